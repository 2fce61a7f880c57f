"""Per-row (default) against per-tensor float8 scaling: values and graphs."""

from __future__ import annotations

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpolicy
from mpolicy._src.rules import matmul

F8 = "p=f32,c=f8,o=f32"


def _rules(scaling):
  return mpolicy.DEFAULT_RULES.with_fp8(scaling=scaling)


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _rows_far_apart():
  kx, kw = jax.random.split(jax.random.PRNGKey(0))
  x = jax.random.normal(kx, (8, 64)).at[3].multiply(1e-6)
  return x, jax.random.normal(kw, (64, 16))


def test_per_row_keeps_a_small_row_per_tensor_does_not():
  x, w = _rows_far_apart()
  exact = x @ w
  f = lambda s: mpolicy.amp(lambda x, w: x @ w, F8, rules=_rules(s))(x, w)
  per_row, per_tensor = f("per_row"), f("per_tensor")
  assert _rel(per_row[3], exact[3]) < 0.1
  # 1e-6 * 448 is below float8_e4m3fn's smallest subnormal (2**-9):
  # under one scale for the tensor the small row becomes zeros.
  assert not np.any(np.asarray(per_tensor[3]))
  for out in (per_row, per_tensor):
    assert _rel(np.delete(out, 3, 0), np.delete(exact, 3, 0)) < 0.05


def test_per_tensor_gradients_match_float32_within_float8():
  x, w = _rows_far_apart()
  x = x.at[3].multiply(1e6)  # One magnitude for the whole tensor.
  t = jax.random.normal(jax.random.PRNGKey(3), (8, 16))
  f = mpolicy.amp(lambda x, w: x @ w, F8, rules=_rules("per_tensor"))
  grads = jax.grad(lambda x, w: jnp.sum(f(x, w) * t), (0, 1))(x, w)
  refs = jax.grad(lambda x, w: jnp.sum((x @ w) * t), (0, 1))(x, w)
  for g, r in zip(grads, refs):
    assert g.dtype == jnp.float32 and 0.005 < _rel(g, r) < 0.10


def test_fp8_dot_general_rejects_unknown_scaling():
  with pytest.raises(ValueError, match="scaling='rowwise'.*per_row"):
    matmul.fp8_dot_general(jnp.ones((2, 3)), jnp.ones((3, 2)),
                           (((1,), (0,)), ((), ())), scaling="rowwise")


def _cuda_ops(fn, *args):
  text = jax.jit(fn).trace(*args).lower(
      lowering_platforms=("cuda",)).as_text()
  return text, collections.Counter(re.findall(r"= (stablehlo\.[a-z_]+)", text))


@pytest.mark.parametrize("scaling, reduces, row_scales", [
    ("per_row", 4, True), ("per_tensor", 3, False)])
def test_cuda_lowering_of_a_linear(scaling, reduces, row_scales):
  x, w = jnp.ones((256, 512)), jnp.ones((512, 1024))
  f = mpolicy.amp(lambda x, w: x @ w, "p=f32,c=f8,o=bf16",
                  rules=_rules(scaling))
  loss = lambda x, w: jnp.sum(f(x, w).astype(jnp.float32) ** 2)
  text, ops = _cuda_ops(jax.grad(loss, (0, 1)), x, w)
  dots = [l for l in text.splitlines() if "stablehlo.dot_general" in l]
  # The forward and both backward products take float8 operands.
  assert len(dots) == 3 and all("f8E4M3FN" in d for d in dots)
  assert sum("f8E5M2" in d for d in dots) == 2
  # One amax per quantized tensor: x (per row or whole), w, the cotangent,
  # and, per row, the cotangent times the rows' scales for the weight
  # gradient.
  assert ops["stablehlo.reduce"] == reduces
  forward, _ = _cuda_ops(f, x, w)
  # The scales multiply the float32 product after the gemm: one per row
  # of x (256 of them), or one for all.
  assert re.search(r"stablehlo\.multiply %\S+, %\S+ : tensor<256x1024xf32>",
                   forward)
  assert ("tensor<256x1xf32>" in forward) == row_scales
