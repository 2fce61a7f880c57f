"""`reduce_dtype` of the gradient helpers holds for the sums JAX's AD
places in the backward pass: FSDP's reduce-scatter (the transpose of the
loss's `all_gather`) and the `psum` of a replicated parameter's gradient
over an FSDP axis (the transpose of JAX's `pvary`). Checked in the lowered
StableHLO on 2, 4 and 8 simulated devices (a subprocess; this process has
one device), with the values against a float32 reference.
"""

from __future__ import annotations

import pytest

from _helpers import fact

# An 8-device script (about 20 s on 2 cores): CI runs it after the default
# run (-m ci).
pytestmark = pytest.mark.ci

EIGHT_DEVICES = r'''
import json, re
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, PartitionSpec as P

import mpolicy
from _helpers import poison, record

facts = {}
guard = lambda name, fn: record(facts, name, fn)
POLICY = "p=bf16,c=bf16,o=f32"
LS = mpolicy.DynamicLossScale(jnp.float32(2. ** 15))
TX = optax.sgd(0.5)
SPECS = {"w": P("d"), "b": P()}


def sums(text):
  """The element type of each all_reduce / reduce_scatter of an array
  (scalars are the loss and the finiteness flag) in StableHLO text."""
  found, lines = [], text.splitlines()
  for i, line in enumerate(lines):
    m = re.search(r'"stablehlo\.(all_reduce|reduce_scatter)"', line)
    if m:
      close = next(l for l in lines[i:] if "}) :" in l)
      found += [(m.group(1), t) for t in re.findall(
          r"tensor<[\dx]+x(bf16|f32|f16)>", close.split("->")[-1])]
  return sorted(found)


def inner(p, x):
  h = jnp.tanh(x @ p["w"] + p["b"])
  return jnp.mean(h.astype(jnp.float32) ** 2)


gather = lambda p: {"w": jax.lax.all_gather(p["w"], "d", tiled=True),
                    "b": p["b"]}
LOSSES = {
    # The gather inside the amp-ed loss, and outside it (plain JAX).
    "amp": mpolicy.amp(lambda p, x: inner(gather(p), x), POLICY),
    "outside": lambda p, x: mpolicy.amp(inner, POLICY)(gather(p), x),
}


def scanned(p, x):  # FSDP over scanned layers: the gather inside the scan.
  def layer(h, w):
    return jnp.tanh(h @ jax.lax.all_gather(w, "d", tiled=True)), None
  h, _ = jax.lax.scan(layer, x, p["ws"])
  return jnp.mean(h.astype(jnp.float32) ** 2)


rng = np.random.default_rng(0)
W = jnp.asarray(rng.normal(size=(32, 32)) / 4, jnp.bfloat16)
B = jnp.asarray(rng.normal(size=(32,)), jnp.bfloat16)
X = jnp.asarray(rng.normal(size=(64, 32)) * (1 + np.arange(64)[:, None] % 8),
                jnp.bfloat16)
PARAMS = {"w": W, "b": B}


def step_on(n, loss, reduce_dtype, specs=SPECS, microbatches=1, extra=()):
  mesh = Mesh(np.array(jax.devices()[:n]), ("d",))
  step = mpolicy.make_train_step(loss, TX, axis_name="d",
                                 reduce_dtype=reduce_dtype,
                                 microbatches=microbatches)
  return jax.jit(jax.shard_map(
      lambda p, s, x, *e: step(p, s, LS, x, *e)[:4], mesh=mesh,
      in_specs=(specs, P(), P("d")) + (P("d"),) * len(extra),
      out_specs=(specs, P(), P(), P())))


def lowered(n, loss, reduce_dtype, params=PARAMS, **kw):
  f = step_on(n, loss, reduce_dtype, **kw)
  return sums(f.lower(params, TX.init(params), X).as_text())


for n in (2, 4, 8):
  for name, loss in LOSSES.items():
    for rd in ("float32", None):
      guard(f"{n}/{name}/{rd}", lambda: lowered(n, loss, rd and jnp.float32))
  guard(f"{n}/microbatches", lambda: lowered(
      n, LOSSES["amp"], jnp.float32, microbatches=2))
  # Data parallel: replicated params, the step's own pmean.
  guard(f"{n}/replicated", lambda: lowered(
      n, mpolicy.amp(inner, POLICY), jnp.float32, specs={"w": P(), "b": P()}))
  guard(f"{n}/pmap", lambda: sums(jax.pmap(
      lambda p, s, x: mpolicy.make_train_step(
          mpolicy.amp(inner, POLICY), TX, axis_name="d")(p, s, LS, x).params,
      axis_name="d", in_axes=(None, None, 0)).lower(
          PARAMS, TX.init(PARAMS), X.reshape(n, -1, 32)).as_text()))

WS = {"ws": jnp.stack([W] * 3) / 2}
WS_SPECS = {"ws": P(None, "d")}
guard("scan/amp", lambda: lowered(4, mpolicy.amp(scanned, POLICY), jnp.float32,
                                  params=WS, specs=WS_SPECS))
guard("scan/plain", lambda: lowered(4, scanned, jnp.float32, params=WS,
                                    specs=WS_SPECS))
guard("scan/plain_none", lambda: lowered(4, scanned, None, params=WS,
                                         specs=WS_SPECS))


def summed(reduce_dtype):
  """FSDP gradients that are the sums of the devices' bfloat16 rows of
  x: exact per device, rounded only by the reduce-scatter's sum."""
  mesh = Mesh(np.array(jax.devices()), ("d",))
  loss = mpolicy.amp(lambda w, x: jnp.sum(
      jax.lax.all_gather(w, "d", tiled=True).astype(jnp.float32)
      * x.astype(jnp.float32)), POLICY)
  g = mpolicy.scaled_value_and_grad(loss, axis_name="d",
                                    reduce_dtype=reduce_dtype)
  f = jax.jit(jax.shard_map(lambda w, x: g(LS, w, x)[3], mesh=mesh,
                            in_specs=(P("d"), P("d")), out_specs=P("d")))
  return f(W[:8], X)


def sums_against_float32():
  parts = X.astype(jnp.float32).reshape(8, 8, 32)
  want = (parts.sum(0).astype(jnp.bfloat16) / 8).astype(jnp.float32)
  err = lambda g: float(jnp.max(jnp.abs(g.astype(jnp.float32) - want)))
  f32, bf16 = summed(jnp.float32), summed(jnp.bfloat16)
  return {"dtypes": [str(f32.dtype), str(bf16.dtype)], "f32": err(f32),
          "bf16": err(bf16)}


guard("error", sums_against_float32)


def poisoned(p, x, f):
  return LOSSES["amp"]({"w": poison(p["w"], f[0]), "b": p["b"]}, x)


def skipped():
  f = step_on(8, poisoned, jnp.float32, extra=(0,))
  opt = TX.init(PARAMS)
  bad = jnp.ones(8).at[3].set(jnp.inf)
  p, s, ls, finite = f(PARAMS, opt, X, bad)
  same = all(bool(jnp.array_equal(a, b)) for a, b in
             zip(jax.tree.leaves((p, s)), jax.tree.leaves((PARAMS, opt))))
  return {"finite": bool(finite), "kept": same,
          "loss_scale": float(ls.loss_scale)}


guard("skipped", skipped)
print("FACTS=" + json.dumps(facts))
'''

F32, BF16 = ["reduce_scatter", "f32"], ["reduce_scatter", "bf16"]
# The bias's gradient: JAX's psum over the FSDP axis (all_reduce).
B_F32, B_BF16 = ["all_reduce", "f32"], ["all_reduce", "bf16"]


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("loss", ["amp", "outside"])
def test_fsdp_backward_sums_run_in_reduce_dtype(eight_devices, n, loss):
  assert fact(eight_devices, f"{n}/{loss}/float32") == [B_F32, F32]
  # None: each sum in the gradient's dtype, as JAX writes it.
  assert fact(eight_devices, f"{n}/{loss}/None") == [B_BF16, BF16]


@pytest.mark.parametrize("n", [2, 4, 8])
def test_microbatches_and_the_step_s_own_sums_run_in_reduce_dtype(
    eight_devices, n):
  assert fact(eight_devices, f"{n}/microbatches") == [B_F32, F32]
  assert fact(eight_devices, f"{n}/replicated") == [B_F32, B_F32]
  assert fact(eight_devices, f"{n}/pmap") == [B_F32, B_F32]


def test_a_gather_inside_a_scan_under_amp_is_honoured(eight_devices):
  assert fact(eight_devices, "scan/amp") == [F32]
  assert fact(eight_devices, "scan/plain_none") == [BF16]


def test_a_gather_inside_a_scan_amp_did_not_run_is_refused(eight_devices):
  error = eight_devices["scan/plain"]["error"]
  assert error.startswith("ValueError"), error
  assert ("reduce_dtype=float32 cannot be honoured for a reduce-scatter "
          "(the transpose of an all_gather) of bfloat16 gradients") in error
  assert "inside the loss's 'scan'" in error and "mpolicy.amp" in error
  assert "reduce_dtype=None" in error


def test_float32_sums_equal_the_float32_sum_rounded_once(eight_devices):
  got = fact(eight_devices, "error")
  assert got["dtypes"] == ["bfloat16", "bfloat16"], got
  assert got["f32"] == 0, got
  # XLA:CPU runs a bfloat16 reduce-scatter in float32 too (it promotes
  # bfloat16 reductions when it compiles), so here both agree; on GPU and
  # TPU only the lowered float32 sum (above) is rounded once.
  assert got["bf16"] == got["f32"], got


def test_a_non_finite_step_leaves_params_and_state_unchanged(eight_devices):
  assert fact(eight_devices, "skipped") == {
      "finite": False, "kept": True, "loss_scale": 2. ** 14}
