"""float8 scales across devices agree with the one-device run (8 CPU devices).

Under `jax.jit` with sharded operands the amax is a global reduction; inside
`shard_map` the float8 matmul shares its scales with `pmax` (`fp8_mesh`).
Each case compares against the same `amp` function on unsharded arrays.
The operands' magnitudes differ from shard to shard (rows of one half 1000
times smaller, K chunks from 0.01 to 30, cotangent rows 100 times larger
on one half), so a device's own amax differs from the global one and a
scale that is not shared shows in the values. The subprocess prints one
JSON object of facts, which the tests assert on.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

# An 8-device script (10-17 s on 2 cores): CI runs it after the default
# run, in both jobs (-m ci).
pytestmark = pytest.mark.ci


EIGHT_DEVICES = r'''
import json
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import mpolicy
from mpolicy._src.rules import fp8_mesh, fp8_scaling

mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
kx, kw, kt = jax.random.split(jax.random.PRNGKey(0), 3)
x = jax.random.normal(kx, (16, 64))
x = x * jnp.repeat(jnp.array([1., 30., 0.01, 5.]), 16)[None, :]
x = x * jnp.repeat(jnp.array([1., 1e-3]), 8)[:, None]
w = jax.random.normal(kw, (64, 32))
w = w * jnp.repeat(jnp.array([1., 7., 0.1, 2.]), 8)[None, :]
t = jax.random.normal(kt, (16, 32)) * jnp.repeat(jnp.array([1., 100.]), 8)[:, None]
F8 = "p=f32,c=f8,o=f32"
facts = {}


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def run(f, x, w):
  out = jax.jit(f)(x, w)
  grads = jax.jit(jax.grad(lambda a, b: jnp.sum(f(a, b) * t), (0, 1)))(x, w)
  return out, grads


_references = {}


def reference(ref_f, x, w):
  """`run(ref_f, x, w)`, computed once for each reference and operands."""
  key = (id(ref_f), id(x), id(w))
  if key not in _references:  # The value keeps the keys' objects alive.
    _references[key] = (run(ref_f, x, w), ref_f, x, w)
  return _references[key][0]


def compare(f, ref_f, x, w, xs=None, ws=None):
  out, grads = run(f, x if xs is None else xs, w if ws is None else ws)
  ref, ref_grads = reference(ref_f, x, w)
  return {"out": rel(out, ref),
          "grads": max(rel(g, r) for g, r in zip(grads, ref_grads))}


def smap(body, ins, out, **kw):
  return jax.shard_map(body, mesh=mesh, in_specs=ins, out_specs=out, **kw)


LAYOUTS = {
    "data_parallel": (lambda a, b: a @ b, (P("data", None), P()),
                      P("data", None)),
    "column_parallel": (lambda a, b: a @ b, (P("data", None), P(None, "model")),
                        P("data", "model")),
    "row_parallel": (lambda a, b: jax.lax.psum(a @ b, "model"),
                     (P("data", "model"), P("model", None)), P("data", None)),
}

# jit with NamedSharding: scales and values of quantize, and amp's results.
for name, spec in {"rows": P("data", None), "both": P("data", "model")}.items():
  xs = jax.device_put(x, NamedSharding(mesh, spec))
  for axes in (None, -1):
    q, s = jax.jit(lambda v: fp8_scaling.quantize(v, axes=axes))(xs)
    q1, s1 = jax.jit(lambda v: fp8_scaling.quantize(v, axes=axes))(x)
    facts[f"jit_quantize_{name}_{axes}"] = bool(
        np.array_equal(s, s1) and np.array_equal(
            np.asarray(q, np.float32), np.asarray(q1, np.float32)))
for scaling in ("per_row", "per_tensor"):
  rules = mpolicy.DEFAULT_RULES.with_fp8(scaling=scaling)
  ref_f = mpolicy.amp(lambda a, b: a @ b, F8, rules=rules)
  for name, (_, (sx, sw), _) in LAYOUTS.items():
    xs = jax.device_put(x, NamedSharding(mesh, sx))
    ws = jax.device_put(w, NamedSharding(mesh, sw))
    facts[f"jit_{scaling}_{name}"] = compare(ref_f, ref_f, x, w, xs, ws)

# shard_map: shared scales (check_vma) against local ones (no check_vma).
for scaling in ("per_row", "per_tensor"):
  rules = mpolicy.DEFAULT_RULES.with_fp8(scaling=scaling)
  ref_f = mpolicy.amp(lambda a, b: a @ b, F8, rules=rules)
  for name, (body, ins, out) in LAYOUTS.items():
    for vma in (True, False):
      f = mpolicy.amp(smap(body, ins, out, check_vma=vma), F8, rules=rules)
      facts[f"smap_{scaling}_{name}_{vma}"] = compare(f, ref_f, x, w)

# The scales themselves, as the shard_map body shares them.
def scales(a, b):
  rows, whole = fp8_mesh.scale_axes(a, b, per_tensor=False, batched=False)
  return (fp8_scaling.quantize(a, axes=-1, mesh_axes=rows)[1],
          fp8_scaling.quantize(b, mesh_axes=whole)[1])
ref_rows = jax.jit(lambda v: fp8_scaling.quantize(v, axes=-1)[1])(x)
ref_whole = jax.jit(lambda v: fp8_scaling.quantize(v)[1])(w)
for name, (_, ins, _) in LAYOUTS.items():
  sa, sb = jax.jit(smap(scales, ins, (P("data", None), P())))(x, w)
  facts[f"scales_{name}"] = [bool(np.array_equal(sa, ref_rows)),
                             bool(np.array_equal(sb, ref_whole))]

# A batched matmul with its batch split: per-element scales stay local.
a = jax.random.normal(kx, (8, 16, 32)) * jnp.logspace(-6, 2, 8)[:, None, None]
b = jax.random.normal(kw, (8, 32, 8))
t = jax.random.normal(kt, (8, 16, 8))
mm = lambda a, b: jnp.einsum("bmk,bkn->bmn", a, b)
ref_f = mpolicy.amp(mm, F8)
f = mpolicy.amp(smap(mm, (P("data"), P("data")), P("data")), F8)
facts["smap_batched"] = compare(f, ref_f, a, b)

print("FACTS=" + json.dumps(facts))
'''


# The bounds. Where the devices hold the same float8 values and scales as
# one device, the float32 gradients can differ only by the order in which a
# sum split over devices adds: less than one float32 rounding (measured:
# up to 7e-8 inside shard_map; under jit 0, or 4e-9 on jax 0.10.2 with K
# split). A row-parallel forward rounds
# each device's partial product to bfloat16 before the psum (relative error
# up to 2 ** -8 each) and the result once more: at most bfloat16's epsilon
# (measured 2e-3 to 3e-3). Everything else is bit-identical.
F32_EPS = float(np.finfo(np.float32).eps)
BF16_EPS = float(jnp.finfo(jnp.bfloat16).eps)


@pytest.fixture
def facts(eight_devices):
  return eight_devices


def test_jit_sharded_quantize_scales_equal_one_device(facts):
  for name in ("rows", "both"):
    for axes in ("None", "-1"):
      assert facts[f"jit_quantize_{name}_{axes}"], (name, axes)


@pytest.mark.parametrize("scaling", ["per_row", "per_tensor"])
@pytest.mark.parametrize("layout", ["data_parallel", "column_parallel",
                                    "row_parallel"])
def test_jit_sharded_matmul_equals_one_device(facts, scaling, layout):
  got = facts[f"jit_{scaling}_{layout}"]
  # Same scales and float8 values: the results are bit-identical; only the
  # order of the gradients' float32 sums may differ.
  assert got["out"] == 0.0 and got["grads"] < F32_EPS, got


@pytest.mark.parametrize("layout", ["data_parallel", "column_parallel",
                                    "row_parallel"])
def test_shard_map_row_and_tensor_scales_equal_one_device(facts, layout):
  assert facts[f"scales_{layout}"] == [True, True]


@pytest.mark.parametrize("scaling", ["per_row", "per_tensor"])
@pytest.mark.parametrize("layout", ["data_parallel", "column_parallel",
                                    "row_parallel"])
def test_shard_map_matmul_and_gradients_equal_one_device(facts, scaling,
                                                          layout):
  shared = facts[f"smap_{scaling}_{layout}_True"]
  local = facts[f"smap_{scaling}_{layout}_False"]
  # Gradients: the same float8 values as one device, so float32 rounding.
  assert shared["grads"] < F32_EPS, shared
  # Unshared (per-device) scales quantize differently: the check can fail.
  assert local["grads"] > 1e-3, local
  # Row-parallel partial products are bfloat16 before the psum; the other
  # layouts compute each output element on one device, as one device does.
  if layout == "row_parallel":
    assert 0 < shared["out"] < BF16_EPS, shared
  else:
    assert shared["out"] == 0.0, shared


def test_column_parallel_without_shared_scales_differs(facts):
  assert facts["smap_per_row_column_parallel_False"]["out"] > 1e-3


def test_batched_matmul_with_split_batch_equals_one_device(facts):
  got = facts["smap_batched"]
  # Each batch element on one device, with its own scales: bit-identical.
  assert got["out"] == 0.0 and got["grads"] == 0.0, got
