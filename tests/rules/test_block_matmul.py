"""Matmuls under c=mxfp8, c=mxfp4 and c=nvfp4, against NumPy references
built from the independent quantizer reading (`_block_reference`)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import mpolicy
import _block_reference as ref

BF16 = np.dtype(ml_dtypes.bfloat16)
FORMATS = ("mxfp8", "mxfp4", "nvfp4")


def fq(x, fmt, axis, tiles=False):
  """The reference's dequantized values, as float64."""
  return ref.quantize(np.asarray(x, np.float32), fmt, axis,
                      tiles and fmt == "nvfp4")[3].astype(np.float64)


def _assert_bf16_close(got, want):
  """``got`` (bf16) equals ``want`` rounded to bf16, but for a rare entry
  where float32 accumulation lands on the other side of a rounding boundary
  (one bf16 step at most)."""
  got = np.asarray(got).astype(np.float64)
  want = want.astype(np.float32).astype(BF16).astype(np.float64)
  step = np.abs(want) * 2.0**-7 + 1e-30
  assert np.all(np.abs(got - want) <= step), np.abs(got - want).max()
  assert np.mean(got == want) >= 0.98, np.mean(got == want)


def _mlp(params, x):
  h = jax.nn.relu(x @ params["w1"] + params["b1"])
  return h @ params["w2"]


def _params(seed=0):
  k = jax.random.split(jax.random.PRNGKey(seed), 4)
  return {"w1": jax.random.normal(k[0], (96, 48)) * 0.2,
          "b1": jax.random.normal(k[1], (48,)) * 0.1,
          "w2": jax.random.normal(k[2], (48, 24)) * 0.3}, \
      jax.random.normal(k[3], (16, 96)) * jnp.exp2(
          jax.random.randint(k[3], (16, 1), -6, 6).astype(jnp.float32))


@pytest.mark.parametrize("fmt", FORMATS)
def test_mlp_forward_matches_quantize_matmul_bf16(fmt):
  params, x = _params()
  f = mpolicy.amp(_mlp, f"p=f32,c={fmt},o=bf16")
  y = f(params, x)
  assert y.dtype == jnp.bfloat16
  p = {k: np.asarray(v) for k, v in params.items()}
  # x and the weights entered amp as float32 (parameters: nvfp4 tiles
  # them); h is an activation (blocks of the format along the contraction).
  z = fq(x, fmt, 1, True) @ fq(p["w1"], fmt, 0, True)
  z = z.astype(np.float32).astype(BF16)
  h = np.maximum((z + p["b1"].astype(BF16)).astype(BF16), 0)
  want = fq(h.astype(np.float32), fmt, 1) @ fq(p["w2"], fmt, 0, True)
  _assert_bf16_close(y, want)
  # The quantization is visible: bf16 compute gives other numbers.
  plain = mpolicy.amp(_mlp, "p=f32,c=bf16,o=bf16")(params, x)
  assert not np.array_equal(np.asarray(y), np.asarray(plain))


@pytest.mark.parametrize("fmt", FORMATS)
def test_backward_quantizes_along_its_own_contraction(fmt):
  k = jax.random.split(jax.random.PRNGKey(1), 3)
  x = jax.random.normal(k[0], (32, 64))
  # Columns of very different sizes: blocks along K (the forward's) and
  # along N (d x's) then differ, even for mxfp8, whose power-of-two scales
  # change only which values go subnormal or to zero.
  w = jax.random.normal(k[1], (64, 48)) * jnp.exp2(
      jnp.arange(48, dtype=jnp.float32)[None, :] % 16 - 8)
  ct = jax.random.normal(k[2], (32, 48)).astype(jnp.bfloat16)
  # Round to nearest, no rotation: the NVFP4 recipe's parts off (tested in
  # tests/blocks/test_block_recipe.py).
  rules = mpolicy.DEFAULT_RULES.with_fp8(stochastic_rounding=False,
                                         hadamard=False)
  f = mpolicy.amp(lambda x, w: x @ w, f"p=f32,c={fmt},o=bf16", rules=rules)
  _, vjp = jax.vjp(f, x, w)
  dx, dw = vjp(ct)
  assert dx.dtype == jnp.float32 and dw.dtype == jnp.float32
  g = np.asarray(ct.astype(jnp.float32))
  xn, wn = np.asarray(x), np.asarray(w)
  # d x [M, K] = g [M, N] . w [K, N] over N; d w [K, N] = x [M, K] . g over M.
  want_dx = fq(g, fmt, 1) @ fq(wn, fmt, 1, True).T
  want_dw = fq(xn, fmt, 0, True).T @ fq(g, fmt, 0)
  np.testing.assert_allclose(np.asarray(dx), want_dx, rtol=2e-5, atol=1e-4)
  np.testing.assert_allclose(np.asarray(dw), want_dw, rtol=2e-5, atol=1e-4)
  # Not the forward's blocks transposed: those give other numbers.
  wrong = fq(g, fmt, 1) @ fq(wn, fmt, 0, True).T
  if fmt != "nvfp4":  # (nvfp4 tiles w: both ways agree there, by design.)
    assert not np.allclose(np.asarray(dx), wrong, rtol=1e-6, atol=0)


def test_mlp_trains_under_mxfp8_with_grad_and_jit():
  params, _ = _params(2)
  x = jax.random.normal(jax.random.PRNGKey(3), (16, 96))
  target = jnp.sin(x[:, :24])

  def loss(params):
    y = mpolicy.amp(_mlp, "p=f32,c=mxfp8,o=bf16")(params, x)
    return jnp.mean((y.astype(jnp.float32) - target) ** 2)

  step = jax.jit(lambda p: jax.tree_util.tree_map(
      lambda a, g: a - 0.1 * g, p, jax.grad(loss)(p)))
  first = float(loss(params))
  for _ in range(20):
    params = step(params)
  assert all(v.dtype == jnp.float32 for v in params.values())
  assert float(loss(params)) < 0.9 * first


@pytest.mark.parametrize("fmt", FORMATS)
def test_explain_names_the_format_and_the_fallbacks(fmt):
  params, x = _params()

  def f(params, x):
    h = _mlp(params, x)
    return h @ h.T  # Both operands activations: stays in bf16.

  report = mpolicy.explain(mpolicy.amp(f, f"p=f32,c={fmt},o=bf16"), params, x)
  dots = [r for r in report.rows if r.primitive == "dot_general"]
  assert [r.ran_in for r in dots] == [fmt, fmt, "bfloat16"]
  text = str(report)
  assert f"lower in {fmt} (blocks of" in text
  assert f"not {fmt}: both operands are activations" in text


def test_size_threshold_fallback_says_so():
  rules = mpolicy.DEFAULT_RULES.with_fp8(min_size=10**9)
  f = mpolicy.amp(lambda x, w: x @ w, "p=f32,c=mxfp4,o=bf16", rules=rules)
  report = mpolicy.explain(f, jnp.ones((4, 32)), jnp.ones((32, 8)))
  assert "not mxfp4: fp8 skipped: MxKxN = 4x32x8" in str(report)
  assert [r.ran_in for r in report.rows if r.primitive == "dot_general"] == [
      "bfloat16"]


def test_convolutions_fall_back_to_bf16_under_block_formats():
  x = jnp.ones((1, 8, 8, 4))
  k = jnp.ones((3, 3, 4, 8))
  conv = lambda x, k: jax.lax.conv_general_dilated(
      x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
  report = mpolicy.explain(mpolicy.amp(conv, "p=f32,c=nvfp4,o=bf16"), x, k)
  row = [r for r in report.rows if r.primitive == "conv_general_dilated"][0]
  assert row.ran_in != "nvfp4"
  assert "not nvfp4: block formats cover matmuls" in str(report)


def _heads():
  """``x [B, H, D]`` and ``w [H, D, K]`` whose heads differ by 2**12 in
  size (a block spanning heads loses the small ones), D = 8: a part of a
  block."""
  kx, kw = jax.random.split(jax.random.PRNGKey(4))
  scale = jnp.array([2.0**12, 1.0, 1.0, 1.0])
  x = jax.random.normal(kx, (4, 4, 8)) * scale[:, None]
  w = jax.random.normal(kw, (4, 8, 16)) / scale[:, None, None]
  return x, w


@pytest.mark.parametrize("fmt", FORMATS)
def test_several_contracting_dimensions_are_blocked_along_one(fmt):
  x, w = _heads()
  y = mpolicy.amp(lambda x, w: jnp.einsum("bhd,hdk->bk", x, w),
                  f"p=f32,c={fmt},o=bf16")(x, w)
  # Blocks along d in both operands (per head, zero-filled to whole
  # blocks); both operands entered amp (parameters: nvfp4 tiles them, x's
  # tiles over b and d).
  xn, wn = np.asarray(x), np.asarray(w)
  fx = fq(xn.transpose(1, 0, 2), fmt, 2, True).transpose(1, 0, 2)
  want = np.einsum("bhd,hdk->bk", fx, fq(wn, fmt, 1, True))
  _assert_bf16_close(y, want)
  exact = np.einsum("bhd,hdk->bk", xn.astype(np.float64), wn)
  error = np.linalg.norm(np.asarray(y, np.float64) - exact) / np.linalg.norm(
      exact)
  assert error < {"mxfp8": 0.05, "mxfp4": 0.25, "nvfp4": 0.2}[fmt], error


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_order_of_the_contracting_dimensions_does_not_matter(fmt):
  x, w = _heads()
  dot = lambda dims: mpolicy.amp(
      lambda x, w: jax.lax.dot_general(x, w, (dims, ((), ()))),
      f"p=f32,c={fmt},o=f32")(x, w)
  np.testing.assert_array_equal(dot(((1, 2), (0, 1))), dot(((2, 1), (1, 0))))
