"""Stochastic rounding across 8 simulated devices: shards independent,
replicas identical.

Every array here holds the same values in each of its shards, halfway
between two bfloat16 values (each element rounds up with probability 1/2).
Two shards that draw independent bits agree on about half the elements;
two that draw the same bits agree on all of them. One subprocess computes
every fact; a failure in one case is recorded as that case's error.
"""

from __future__ import annotations

import pytest

from _helpers import fact

# An 8-device script (5-9 s on 2 cores): CI runs it after the default run,
# in both jobs (-m ci).
pytestmark = pytest.mark.ci

EIGHT_DEVICES = r'''
import json
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import mpolicy

from _helpers import record
facts = {}
guard = lambda name, fn: record(facts, name, fn)

N = 2048                      # elements per shard
HALF = 1 + 2.0 ** -8          # halfway between bfloat16 1 and 1 + 2**-7
KEY = jax.random.PRNGKey(0)
mesh = Mesh(np.array(jax.devices()), ("d",))
mesh2 = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
smap = lambda f, m, i, o, cv=True: jax.jit(jax.shard_map(
    f, mesh=m, in_specs=i, out_specs=o, check_vma=cv))
rows = lambda r, axes: jax.lax.pcast(r, axes, to="varying")[None]

def agreement(blocks):
  """Per block after the first, the fraction of elements equal to block 0."""
  b = np.asarray(jnp.asarray(blocks, jnp.float32)).reshape(8, -1)
  return [float(np.mean(b[0] == b[i])) for i in range(1, 8)]

sharded = jnp.full(8 * N, HALF, jnp.float32)   # 8 equal shards along "d"
rnd = lambda x, **kw: mpolicy.stochastic_round(x, jnp.bfloat16, KEY, **kw)

# --- stochastic_round itself --------------------------------------------------
guard("sharded_vma", lambda: agreement(
    smap(rnd, mesh, P("d"), P("d"))(sharded)))
guard("replicated_vma", lambda: agreement(
    smap(lambda x: rows(rnd(x), "d"), mesh, P(), P("d"))(sharded[:N])))
guard("sharded_novma", lambda: agreement(
    smap(rnd, mesh, P("d"), P("d"), False)(sharded)))
guard("sharded_novma_named", lambda: agreement(
    smap(lambda x: rnd(x, vary_over="d"), mesh, P("d"), P("d"), False)(sharded)))
guard("pmap_named", lambda: agreement(jax.pmap(
    lambda x: rnd(x, vary_over="d"), axis_name="d")(sharded.reshape(8, N))))

def two_d():
  # Sharded over "model" (2 shards), replicated over "data" (4 replicas).
  out = smap(lambda x: rows(rnd(x), "data"), mesh2, P("model"),
             P("data", "model"))(sharded[:2 * N])
  out = np.asarray(out.astype(jnp.float32)).reshape(4, 2, N)
  return {"replicas_equal": bool((out == out[0]).all()),
          "model_agreement": float(np.mean(out[0, 0] == out[0, 1]))}
guard("two_d", two_d)

def jit_named_sharding():
  xs = jax.device_put(sharded, NamedSharding(mesh, P("d")))
  out = jax.jit(rnd)(xs)
  one_device = jax.jit(rnd)(sharded)
  return {"agreement": agreement(out),
          "same_as_one_device": bool(jnp.array_equal(out, one_device)),
          "sharded": str(out.sharding.spec)}
guard("jit", jit_named_sharding)

# --- what is built on it: params and optimizer state, FSDP and replicated ------
W = {"w": jnp.ones(8 * N, jnp.bfloat16)}
UP = {"w": -jnp.full(8 * N, 2.0 ** -8, jnp.float32)}  # sgd(1): +half a step

def fsdp_params(cv, **kw):
  tx = mpolicy.stochastic_params(optax.sgd(1.), **kw)
  def body(p, g):
    u, _ = tx.update(g, tx.init(p), p)
    return optax.apply_updates(p, u)
  return agreement(smap(body, mesh, P("d"), P("d"), cv)(W, UP)["w"])
guard("params_fsdp_vma", lambda: fsdp_params(True))
guard("params_fsdp_novma_named", lambda: fsdp_params(False, vary_over="d"))

def fsdp_state():
  tx = mpolicy.with_state_dtypes(optax.trace(0.5), jnp.bfloat16,
                                 rounding="stochastic")
  spec = mpolicy.StateDtypesState(optax.TraceState(trace=P("d")), P())
  def body(g, s):
    return tx.update(g, s)[1]
  s = smap(body, mesh, (P("d"), spec), spec)(
      {"w": jnp.full(8 * N, HALF)}, tx.init({"w": jnp.zeros(8 * N)}))
  return agreement(s.inner_state.trace["w"])
guard("state_fsdp_vma", fsdp_state)

def train_step(fsdp):
  # make_train_step(param_rounding="stochastic"): the loss's gradient is
  # -2**-8 per weight, so sgd(1) moves each weight by half a bfloat16 step.
  def loss(p, x):
    w = jax.lax.all_gather(p["w"], "d", tiled=True) if fsdp else p["w"]
    return -2.0 ** -8 * jnp.sum(w.astype(jnp.float32)) * jnp.mean(x)
  step = mpolicy.make_train_step(loss, optax.sgd(1.), axis_name="d",
                                 param_rounding="stochastic")
  ls = mpolicy.NoOpLossScale()
  p = W if fsdp else {"w": W["w"][:N]}
  s = mpolicy.stochastic_params(optax.sgd(1.)).init(p)
  pspec = P("d") if fsdp else P()
  sspec = mpolicy.StochasticParamsState((optax.EmptyState(), optax.EmptyState()), P())
  if fsdp:
    out = smap(lambda p, s, x: step(p, s, ls, x).params, mesh,
               (pspec, sspec, P("d")), pspec)(p, s, jnp.ones(8))
    return agreement(out["w"])
  # Replicated: out_specs=P() is accepted only if JAX types the new params
  # as the same on every device; the rows show that they are.
  new = smap(lambda p, s, x: step(p, s, ls, x).params, mesh,
             (pspec, sspec, P("d")), pspec)(p, s, jnp.ones(8))
  per_device = smap(lambda p, s, x: rows(step(p, s, ls, x).params["w"], "d"),
                    mesh, (pspec, sspec, P("d")), P("d"))(p, s, jnp.ones(8))
  return {"agreement": agreement(per_device),
          "moved": float(jnp.mean(new["w"].astype(jnp.float32) > 1))}
guard("train_step_fsdp", lambda: train_step(True))
guard("train_step_replicated", lambda: train_step(False))

print("FACTS=" + json.dumps(facts))
'''

INDEPENDENT = (0.44, 0.56)  # 2048 fair coins: 0.5 +- 2.7 standard deviations


def _independent(agreements):
  return all(INDEPENDENT[0] < a < INDEPENDENT[1] for a in agreements)


@pytest.mark.parametrize("case", [
    "sharded_vma", "sharded_novma_named", "pmap_named", "params_fsdp_vma",
    "params_fsdp_novma_named", "state_fsdp_vma", "train_step_fsdp"])
def test_shards_round_independently(eight_devices, case):
  got = fact(eight_devices, case)
  assert _independent(got), got


def test_replicated_values_round_identically_on_every_device(eight_devices):
  assert fact(eight_devices, "replicated_vma") == [1.0] * 7


def test_without_types_or_vary_over_every_shard_draws_the_same_bits(eight_devices):
  # Documented: with check_vma=False, name the sharded axes (vary_over).
  assert fact(eight_devices, "sharded_novma") == [1.0] * 7


def test_two_d_mesh_independent_across_model_identical_across_data(eight_devices):
  got = fact(eight_devices, "two_d")
  assert got["replicas_equal"], got
  assert INDEPENDENT[0] < got["model_agreement"] < INDEPENDENT[1], got


def test_jit_named_sharding_is_independent_per_shard_already(eight_devices):
  got = fact(eight_devices, "jit")
  assert got["same_as_one_device"] and "d" in got["sharded"], got
  assert _independent(got["agreement"]), got


def test_make_train_step_replicated_bf16_params_stay_equal(eight_devices):
  got = fact(eight_devices, "train_step_replicated")
  assert got["agreement"] == [1.0] * 7, got
  assert 0.45 < got["moved"] < 0.55, got  # They did round, half of them up.
