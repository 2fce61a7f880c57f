"""The int8 quantizer and matmul (`blocks.int8`) against a numpy reading
of their definition: per-channel and per-row scales over the contracting
dimensions, ``s = amax * float32(1/127)``, round half to even, clip to
+-127, exact int32 sums, ``(acc * s_row) * s_col`` rounded to bfloat16;
NaN for a row or channel with a non-finite value; straight-through
gradients."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from mpolicy._src.blocks import int8


def _np_quantize(x, axes):
  x = np.asarray(x, np.float32)
  amax = np.max(np.abs(x), axis=axes, keepdims=True)
  with np.errstate(invalid="ignore", over="ignore"):
    s = np.where(amax == 0, np.float32(1), amax * np.float32(1 / 127))
    s = np.where(np.isfinite(amax), s, np.float32(np.nan)).astype(np.float32)
    q = np.clip(np.rint(x / s), -127, 127)  # rint: half to even.
  return q, s


def _np_matmul(x, w):
  """``x [M, K] @ w [K, N]``: rows of x, channels of w."""
  qx, sx = _np_quantize(x, (1,))
  qw, sw = _np_quantize(w, (0,))
  acc = qx.astype(np.int64) @ qw.astype(np.int64)
  out = (acc.astype(np.float32) * sx) * sw
  return out.astype(ml_dtypes.bfloat16)


def _data(m=16, k=96, n=24, seed=0):
  r = np.random.default_rng(seed)
  x = r.standard_normal((m, k)).astype(np.float32) * np.exp2(
      r.integers(-6, 6, (m, 1))).astype(np.float32)
  w = r.standard_normal((k, n)).astype(np.float32) * 0.1
  return x, w


def test_quantize_rounds_half_to_even_and_scales_by_amax():
  x = np.array([[127.0, 0.5, 1.5, 2.5, -0.5, -126.5]], np.float32)
  q, s = int8.quantize(jnp.asarray(x), (1,))
  assert q.dtype == jnp.int8 and s.dtype == jnp.float32
  assert s.shape == (1, 1)
  assert float(s[0, 0]) == np.float32(127.0) * np.float32(1 / 127)
  ref_q, ref_s = _np_quantize(x, (1,))
  np.testing.assert_array_equal(np.asarray(q), ref_q)
  np.testing.assert_array_equal(np.asarray(s), ref_s)


def test_zero_row_has_scale_one_and_zero_codes():
  q, s = int8.quantize(jnp.zeros((2, 5)), (1,))
  assert np.asarray(s).ravel().tolist() == [1.0, 1.0]
  assert not np.asarray(q).any()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matmul_matches_numpy_reference_bit_for_bit(seed):
  x, w = _data(seed=seed)
  y = int8.matmul(jnp.asarray(x), jnp.asarray(w), (((1,), (0,)), ((), ())),
                  jnp.bfloat16)
  assert y.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(y).view(np.uint16),
                                _np_matmul(x, w).view(np.uint16))


def test_int32_accumulation_is_exact():
  # 4096 products of 127 * 127 sum to 66 million, above 2**24: float32
  # partial sums would round; int32 ones are exact.
  x = np.full((2, 4096), 1.0, np.float32)
  x[1, ::2] = -1.0
  w = np.full((4096, 3), 1.0, np.float32)
  acc = int8.matmul(jnp.asarray(x), jnp.asarray(w), (((1,), (0,)), ((), ())),
                    jnp.float32)
  s = np.float32(1.0) * np.float32(1 / 127)
  expect = (np.float32(4096 * 127 * 127) * s) * s
  assert float(acc[0, 0]) == expect and float(acc[1, 0]) == 0.0


def test_weight_on_the_left_scales_its_channels_last():
  x, w = _data(seed=3)
  dims = (((0,), (1,)), ((), ()))  # w^T-style: w [K, N] as lhs, x [M, K].
  y = int8.matmul(jnp.asarray(w), jnp.asarray(x), dims, jnp.float32,
                  weight="lhs")
  qw, sw = _np_quantize(w, (0,))
  qx, sx = _np_quantize(x, (1,))
  acc = (qw.astype(np.int64).T @ qx.astype(np.int64).T).astype(np.float32)
  np.testing.assert_array_equal(np.asarray(y), (acc * sx.T) * sw.T)


def test_batched_and_several_contracting_dims_scale_per_free_index():
  r = np.random.default_rng(5)
  a = r.standard_normal((3, 4, 5, 6)).astype(np.float32)  # b, m, h, d
  b = r.standard_normal((3, 5, 6, 7)).astype(np.float32)  # b, h, d, n
  dims = (((2, 3), (1, 2)), ((0,), (0,)))
  y = int8.matmul(jnp.asarray(a), jnp.asarray(b), dims, jnp.float32)
  qa, sa = _np_quantize(a, (2, 3))
  qb, sb = _np_quantize(b, (1, 2))
  acc = np.einsum("bmhd,bhdn->bmn", qa.astype(np.int64), qb.astype(np.int64))
  expect = (acc.astype(np.float32) * sa[:, :, 0]) * sb[:, 0]
  np.testing.assert_array_equal(np.asarray(y), expect)


def test_non_finite_row_or_channel_gives_nan_outputs():
  x, w = _data()
  x[2, 7], x[5, 0] = np.inf, np.nan
  w[3, 4] = -np.inf
  y = np.asarray(int8.matmul(jnp.asarray(x), jnp.asarray(w),
                             (((1,), (0,)), ((), ())), jnp.float32))
  bad = np.zeros_like(y, bool)
  bad[[2, 5], :] = True
  bad[:, 4] = True
  assert np.isnan(y[bad]).all() and np.isfinite(y[~bad]).all()


def test_given_codes_are_used_instead_of_quantizing():
  x, w = _data()
  dims = (((1,), (0,)), ((), ()))
  given = int8.quantize(jnp.asarray(w), (0,))
  a = int8.matmul(jnp.asarray(x), jnp.asarray(w), dims, jnp.bfloat16)
  b = int8.matmul(jnp.asarray(x), None, dims, jnp.bfloat16, rhs_given=given)
  np.testing.assert_array_equal(np.asarray(a).view(np.uint16),
                                np.asarray(b).view(np.uint16))


def test_backward_is_the_given_functions_gradient():
  x, w = _data()
  dims = (((1,), (0,)), ((), ()))

  def bf16(a, b):
    return jax.lax.dot_general(
        a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), dims,
        preferred_element_type=jnp.float32).astype(jnp.bfloat16)

  g = jnp.asarray(np.random.default_rng(1).standard_normal((16, 24)),
                  jnp.bfloat16)
  _, vjp = jax.vjp(lambda a, b: int8.dot_general(a, b, dims, backward=bf16),
                   jnp.asarray(x), jnp.asarray(w))
  _, ref = jax.vjp(bf16, jnp.asarray(x), jnp.asarray(w))
  for got, want in zip(vjp(g), ref(g)):
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_bad_weight_role_is_refused():
  with pytest.raises(ValueError, match="must be 'lhs' or 'rhs'"):
    int8.dot_general(jnp.ones((2, 2)), jnp.ones((2, 2)),
                     (((1,), (0,)), ((), ())), weight="left")
