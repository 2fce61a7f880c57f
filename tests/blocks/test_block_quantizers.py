"""The block quantizers against an independent NumPy + ml_dtypes reading.

Every comparison is bit for bit (arrays viewed as unsigned integers), with
NaNs compared by position: elements, scales, nvfp4's tensor scale and the
dequantized float32 values.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import mpolicy
from mpolicy._src.blocks import formats
import _block_reference as ref

FORMATS = ("mxfp8", "mxfp4", "nvfp4")


def _bits(a):
  a = np.asarray(a)
  return a.view({1: np.uint8, 4: np.uint32}[a.dtype.itemsize])


def _same(got, want, what):
  got, want = np.asarray(got), np.asarray(want)
  assert got.shape == want.shape, (what, got.shape, want.shape)
  assert got.dtype == want.dtype, (what, got.dtype, want.dtype)
  nan_g = np.isnan(got.astype(np.float32))
  nan_w = np.isnan(want.astype(np.float32))
  np.testing.assert_array_equal(nan_g, nan_w, err_msg=f"{what}: NaN places")
  bad = (_bits(got) != _bits(want)) & ~nan_w
  assert not bad.any(), (
      f"{what}: {bad.sum()} of {bad.size} differ; first at "
      f"{np.argwhere(bad)[:3].tolist()}: got {got[bad][:5]}, want "
      f"{want[bad][:5]}")


def check(x, fmt, axis=-1, two_d=False, key=None, jit=False):
  x = np.asarray(x, np.float32)
  u = None if key is None else np.asarray(
      jax.random.uniform(key, x.shape, jnp.float32))
  fn = lambda v: mpolicy.quantize_blocks(v, fmt, axis, two_d=two_d, key=key)
  q = (jax.jit(fn) if jit else fn)(x)
  elements, scales, g, values = ref.quantize(x, fmt, axis, two_d, u)
  _same(q.elements, elements, "elements")
  _same(q.scales, scales, "scales")
  if g is None:
    assert q.tensor_scale is None
  else:
    _same(np.asarray(q.tensor_scale).reshape(()), np.float32(g),
          "tensor scale")
  _same(mpolicy.dequantize_blocks(q), values, "values")
  _same(mpolicy.fake_quantize(x, fmt, axis, two_d=two_d, key=key), values,
        "fake_quantize")
  return q, values


def _magnitudes(rng, shape, lo=-40, hi=40):
  return (np.exp2(rng.uniform(lo, hi, shape))
          * rng.choice([-1.0, 1.0], shape)).astype(np.float32)


@pytest.mark.parametrize("fmt", FORMATS)
def test_random_over_many_magnitudes(fmt):
  rng = np.random.default_rng(0)
  x = _magnitudes(rng, (6, 96))
  # Blocks of very different scales, and blocks spanning 2**-30..2**30.
  x *= np.exp2(rng.integers(-60, 60, (6, 1))).astype(np.float32)
  check(x, fmt)
  check(rng.standard_normal((8, 64)).astype(np.float32), fmt, jit=True)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape,axis", [((3, 37, 5), 1), ((37, 4), 0),
                                        ((2, 3, 45), -1), ((70,), 0)])
def test_axes_and_partial_blocks(fmt, shape, axis):
  rng = np.random.default_rng(1)
  q, _ = check(_magnitudes(rng, shape, -8, 8), fmt, axis)
  size = formats.get_format(fmt).block_size
  want = list(shape)
  want[axis] = -(-shape[axis] // size)
  assert q.elements.shape == shape and q.scales.shape == tuple(want)


@pytest.mark.parametrize("fmt", FORMATS)
def test_zeros_signed_zeros_and_subnormal_elements(fmt):
  top = formats.get_format(fmt).max_elem
  x = np.zeros((4, 32), np.float32)
  x[1] = -0.0
  # Row 2: the block's top at max_elem, the rest down into the element
  # grid's subnormals and below them (to zero).
  x[2] = top * np.exp2(-np.arange(32, dtype=np.float32) * 0.75)
  x[3, :5] = [1e-3, -2e-3, 0.0, -0.0, 3e-40]
  check(x, fmt)
  q = mpolicy.quantize_blocks(x, fmt)
  values = np.asarray(mpolicy.dequantize_blocks(q))
  assert np.all(values[:2] == 0)
  assert np.all(np.signbit(values[1])), "-0 stays -0"
  row = np.abs(np.asarray(q.elements[2]).astype(np.float32))
  smallest_normal = 2.0**-6 if fmt == "mxfp8" else 1.0
  assert np.any((row > 0) & (row < smallest_normal)), "subnormal elements"
  assert np.any(row == 0), "values below the grid round to zero"


@pytest.mark.parametrize("fmt", FORMATS)
def test_huge_finite_values_never_give_infinity(fmt):
  big = np.finfo(np.float32).max
  x = np.array([[big, -big, big / 3] + [1.0] * 29,
                [np.nextafter(big, 0, dtype=np.float32)] * 32], np.float32)
  q, values = check(x, fmt)
  assert np.all(np.isfinite(values))
  assert np.asarray(mpolicy.dequantize_blocks(q))[0, 0] == big


@pytest.mark.parametrize("fmt", FORMATS)
def test_nan_and_infinity_blocks(fmt):
  size = formats.get_format(fmt).block_size
  x = np.random.default_rng(2).standard_normal((3, 2 * size)).astype(
      np.float32)
  x[0, 1], x[1, size], x[2, 0], x[2, 1] = np.nan, np.inf, -np.inf, 5e30
  q, values = check(x, fmt)
  assert np.all(np.isnan(values[0, :size])) and np.all(np.isnan(values[1, size:]))
  assert np.all(np.isfinite(values[0, size:])) and np.all(np.isfinite(values[1, :size]))
  assert np.all(np.isnan(values[2, :size])) and np.all(np.isfinite(values[2, size:]))
  if fmt == "nvfp4":  # The tensor scale ignores the infinities.
    assert float(q.tensor_scale) == np.float32(np.float32(np.abs(
        x[np.isfinite(x)]).max()) * np.float32(1 / 2688))


def test_float32_subnormal_inputs_count_as_zeros():
  x = np.full((1, 32), 1e-39, np.float32)  # Subnormal in float32.
  x[0, 0] = -1e-40
  for fmt in FORMATS:
    q, values = check(x, fmt)
    assert np.all(values == 0) and np.signbit(values[0, 0])


def test_tiny_blocks_near_the_bottom_of_float32():
  rng = np.random.default_rng(3)
  x = _magnitudes(rng, (4, 64), -127, -110)
  for fmt in FORMATS:
    check(x, fmt)


def test_mx_scale_rounds_up():
  # amax = 449 needs 2**1 with e4m3 (448 * 2**0 < 449); 448 needs 2**0.
  for amax, want in ((448.0, 0), (449.0, 1), (224.0, -1), (256.0, 0)):
    q = mpolicy.quantize_blocks(np.full(32, amax, np.float32), "mxfp8")
    assert np.asarray(q.scales).astype(np.float32)[0] == 2.0 ** want, amax


def test_nvfp4_two_dimensional_tiles():
  rng = np.random.default_rng(4)
  w = _magnitudes(rng, (40, 24), -6, 6)
  q, _ = check(w, "nvfp4", 0, two_d=True)
  assert q.scales.shape == (3, 2)
  check(w, "nvfp4", -1, two_d=True)
  check(_magnitudes(rng, (2, 17, 33), -6, 6), "nvfp4", -2, two_d=True)
  tq = mpolicy.fake_quantize(w.T, "nvfp4", 0, two_d=True)
  _same(tq, np.asarray(mpolicy.fake_quantize(w, "nvfp4", 1, two_d=True)).T,
        "a weight and its transpose are quantized alike")


@pytest.mark.parametrize("fmt", FORMATS)
def test_stochastic_rounding(fmt):
  rng = np.random.default_rng(5)
  x = _magnitudes(rng, (4, 64), -4, 4)
  key = jax.random.PRNGKey(7)
  check(x, fmt, key=key)
  check(x, fmt, key=key, jit=True)
  if fmt == "nvfp4":
    check(x[:, :48], fmt, 0, two_d=True, key=key)
  # Unbiased: the mean of many draws is the value (scales are fixed).
  y = np.full((1, 32), 0.3, np.float32)
  y[0, 0] = 6.0  # Fixes the scale at 1 for e2m1, 2**-6 for e4m3.
  draws = jax.vmap(lambda k: mpolicy.fake_quantize(y, fmt, key=k))(
      jax.random.split(jax.random.PRNGKey(0), 1000))
  mean = float(jnp.mean(draws[:, 0, 1:]))
  assert abs(mean - 0.3) < 0.005, mean
  nearest = float(mpolicy.fake_quantize(y, fmt)[0, 1])
  assert fmt == "mxfp8" or abs(nearest - 0.3) > 0.04  # SR is not nearest.


def test_errors_say_what_is_allowed():
  x = jnp.ones((4, 32))
  with pytest.raises(ValueError, match="'mxfp8', 'mxfp4', 'nvfp4'"):
    mpolicy.quantize_blocks(x, "fp4")
  with pytest.raises(ValueError, match=r"axis=2 is not an axis .* \[-2, 1\]"):
    mpolicy.quantize_blocks(x, "mxfp8", axis=2)
  with pytest.raises(ValueError, match="two_d=True is for nvfp4"):
    mpolicy.quantize_blocks(x, "mxfp4", two_d=True)
  with pytest.raises(ValueError, match="must be one of them"):
    mpolicy.quantize_blocks(jnp.ones((2, 3, 4)), "nvfp4", axis=0, two_d=True)
  with pytest.raises(TypeError, match="floating array, got dtype int32"):
    mpolicy.quantize_blocks(jnp.ones(4, jnp.int32), "mxfp8")
  with pytest.raises(ValueError, match="scalar"):
    mpolicy.quantize_blocks(jnp.float32(1), "mxfp8")
  with pytest.raises(TypeError, match="expects what quantize_blocks returns"):
    mpolicy.dequantize_blocks(x)


@pytest.mark.parametrize("key, got", [
    (0, r"got 0 \(int\)\. An int is a seed: pass jax\.random\.key\(0\)\."),
    (jnp.ones(2), r"got a float32\[2\] array"),
    (jax.random.split(jax.random.key(0)), r"got a key<fry>\[2\] array")])
def test_a_key_that_is_not_one_prng_key_is_named(key, got):
  x = jnp.ones((2, 32))
  for fn in (mpolicy.fake_quantize, mpolicy.quantize_blocks):
    with pytest.raises(TypeError, match=rf"{fn.__name__}: key must be one JAX "
                       r"PRNG key, jax\.random\.key\(seed\) or "
                       rf"jax\.random\.PRNGKey\(seed\), {got}"):
      fn(x, "mxfp8", key=key)
  typed = mpolicy.fake_quantize(x, "mxfp8", key=jax.random.key(3))
  raw = mpolicy.fake_quantize(x, "mxfp8", key=jax.random.PRNGKey(3))
  assert typed.dtype == raw.dtype == jnp.float32
  np.testing.assert_array_equal(typed, raw)  # The same draws.


def test_missing_float4_dtype_is_a_clear_error(monkeypatch):
  monkeypatch.delattr(jnp, "float4_e2m1fn")
  with pytest.raises(ImportError, match="no jnp.float4_e2m1fn.*use mxfp8"):
    mpolicy.quantize_blocks(jnp.ones(32), "nvfp4")
  q = mpolicy.quantize_blocks(jnp.ones(32), "mxfp8")  # mxfp8 still works.
  assert q.elements.dtype == jnp.float8_e4m3fn


def test_bfloat16_input_and_pytree():
  x = jnp.linspace(-3, 3, 64, dtype=jnp.bfloat16).reshape(2, 32)
  q = mpolicy.quantize_blocks(x, "mxfp4")
  check(np.asarray(x.astype(jnp.float32)), "mxfp4")
  leaves, tree = jax.tree_util.tree_flatten(q)
  assert len(leaves) == 2  # elements, scales (no tensor scale for MX)
  back = jax.tree_util.tree_unflatten(tree, leaves)
  _same(mpolicy.dequantize_blocks(back), mpolicy.dequantize_blocks(q), "pytree")
  assert q.elements.dtype == np.dtype(ml_dtypes.float4_e2m1fn)


def test_nvfp4_near_ties_divide_correctly_rounded():
  # Values at simple ratios to their block's amax put x / d within a float32
  # step of a tie of e2m1's grid (6.65625 / 1.9017857 is 3.5 correctly
  # rounded); XLA's rewrite of a division by a broadcast value into a
  # product with its reciprocal gives 3.4999998 there, and e2m1 then 3.
  rng = np.random.default_rng(6)
  ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
  amax = rng.uniform(0.5, 200, (512, 1)).astype(ml_dtypes.bfloat16)
  sel = ties[rng.integers(0, 8, (512, 16))]
  sel[:, 0] = 6.0
  x = (amax.astype(np.float32) * sel / 6).astype(ml_dtypes.bfloat16)
  x = x.astype(np.float32)
  x[0, 0] = 250.0
  check(x, "nvfp4")
  check(x, "nvfp4", jit=True)
