"""Multi-device consistency of loss scaling and skipping, on 8 CPU devices.

The checks run in a subprocess started with
`XLA_FLAGS=--xla_force_host_platform_device_count=8`, so this pytest process
keeps its single device. The subprocess prints one JSON object of facts,
which the tests below assert on.
"""

from __future__ import annotations


import pytest


EIGHT_DEVICES = r'''
import json
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, PartitionSpec as P

from mpolicy._src import loss_scale as ls_lib
import mpolicy

N = jax.device_count()
assert N == 8, N
facts = {"device_count": N}


from _helpers import poison


def loss_fn(params, x, y, factor):
  # The poisoned cotangent reaches w's gradient only (b is added after).
  h = x.astype(jnp.bfloat16) @ params["w"].astype(jnp.bfloat16)
  out = poison(h, factor).astype(jnp.float32) + params["b"]
  return jnp.mean((out - y) ** 2)


key = jax.random.PRNGKey(0)
params = {"w": jax.random.normal(key, (4, 1)), "b": jnp.zeros(1)}
x = jax.random.normal(jax.random.PRNGKey(1), (N, 16, 4))
y = x.sum(-1, keepdims=True)
tx = mpolicy.skip_nonfinite(optax.adam(1e-2))
grad_fn = mpolicy.scaled_value_and_grad(loss_fn, axis_name="d",
                                         attribute_overflow=True)


def step(params, opt_state, ls, x, y, factor):
  ls, finite, loss, grads, flags = grad_fn(ls, params, x, y, factor)
  updates, opt_state = tx.update(grads, opt_state, params, grads_finite=finite)
  params = optax.apply_updates(params, updates)
  return params, opt_state, ls, finite, loss, flags


def bad_factors(bad_device):
  f = np.ones(N, np.float32)
  if bad_device is not None:
    f[bad_device] = np.inf
  return jnp.asarray(f)


def rows_equal(tree):
  """Whether every device's copy of every leaf is bit-for-bit the same."""
  return all(all(np.asarray(l)[i].tobytes() == np.asarray(l)[0].tobytes()
                 for i in range(N)) for l in jax.tree_util.tree_leaves(tree))


def same_bits(a, b):
  return all(np.asarray(u).tobytes() == np.asarray(v).tobytes()
             for u, v in zip(jax.tree_util.tree_leaves(a),
                             jax.tree_util.tree_leaves(b)))


def record(prefix, before, after):
  params0, state0, ls0 = before
  params1, state1, ls1, finite, loss, flags = after
  facts[prefix + "finite"] = np.asarray(finite).reshape(-1).tolist()
  facts[prefix + "loss_scale"] = np.asarray(ls1.loss_scale).reshape(-1).tolist()
  facts[prefix + "params_same_on_all"] = rows_equal(params1)
  facts[prefix + "state_same_on_all"] = rows_equal(state1)
  facts[prefix + "loss_same_on_all"] = rows_equal(loss)
  facts[prefix + "params_unchanged"] = same_bits(params1, params0)
  facts[prefix + "inner_state_unchanged"] = same_bits(
      state1.inner_state, state0.inner_state)
  facts[prefix + "flagged"] = sorted(set(
      mpolicy.nonfinite_paths(jax.tree_util.tree_map(lambda f: f[0], flags))))
  facts[prefix + "flags_same_on_all"] = rows_equal(flags)


# --- pmap ----------------------------------------------------------------------
replicate = lambda t: jax.tree_util.tree_map(
    lambda a: jnp.broadcast_to(a, (N,) + jnp.shape(a)), t)
p_step = jax.pmap(step, axis_name="d")
before = (replicate(params), replicate(tx.init(params)),
          replicate(ls_lib.DynamicLossScale(2. ** 15)))
for name, bad in (("pmap_bad_", 3), ("pmap_good_", None)):
  after = p_step(*before, x, y, bad_factors(bad))
  record(name, before, after)

# --- jit + shard_map over a mesh -----------------------------------------------
mesh = Mesh(np.array(jax.devices()), ("d",))


def per_device(params, opt_state, ls, x, y, factor):
  out = step(params, opt_state, ls, x[0], y[0], factor[0])
  return jax.tree_util.tree_map(lambda a: jnp.asarray(a)[None], out)


s_step = jax.jit(jax.shard_map(
    per_device, mesh=mesh,
    in_specs=(P(), P(), P(), P("d"), P("d"), P("d")),
    out_specs=P("d")))
start = (params, tx.init(params), ls_lib.DynamicLossScale(2. ** 15))
for name, bad in (("shmap_bad_", 5), ("shmap_good_", None)):
  after = s_step(*start, x, y, bad_factors(bad))
  record(name, replicate(start), after)

print("FACTS=" + json.dumps(facts))
'''




@pytest.mark.ci  # 5 s subprocess: once, in CI's newest job (with the other 8-device checks).
def test_the_subprocess_sees_eight_devices(eight_devices):
  assert eight_devices["device_count"] == 8


@pytest.mark.parametrize("mode", ["pmap", "shmap"])
def test_one_bad_device_makes_every_device_skip(mode, eight_devices):
  facts = eight_devices
  p = mode + "_bad_"
  assert facts[p + "finite"] == [False] * 8
  assert facts[p + "loss_scale"] == [2. ** 14] * 8
  assert facts[p + "params_unchanged"] and facts[p + "inner_state_unchanged"]
  assert facts[p + "params_same_on_all"] and facts[p + "state_same_on_all"]
  assert facts[p + "flagged"] == ["w"]
  assert facts[p + "flags_same_on_all"]


@pytest.mark.parametrize("mode", ["pmap", "shmap"])
def test_a_good_step_is_applied_identically_everywhere(mode, eight_devices):
  facts = eight_devices
  p = mode + "_good_"
  assert facts[p + "finite"] == [True] * 8
  assert facts[p + "loss_scale"] == [2. ** 15] * 8
  assert not facts[p + "params_unchanged"]
  assert facts[p + "params_same_on_all"] and facts[p + "state_same_on_all"]
  assert facts[p + "loss_same_on_all"]
  assert facts[p + "flagged"] == []
