"""Specification of stochastic_round: unbiased, exact where it can be, cheap."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpolicy

KEY = jax.random.PRNGKey(0)
DRAWS = 100_000
HALVES = [jnp.bfloat16, jnp.float16]


def _nearest(x, dtype, key):
  del key
  return x.astype(dtype)


def _mean_errors(round_fn, dtype, low):
  """Mean rounding error, in units of the spacing above `low`, for values
  at 1/8, 1/4, ..., 7/8 of the way from `low` to the next `dtype` value."""
  low = jnp.asarray(low, dtype)
  high = jnp.nextafter(low, jnp.asarray(np.inf, dtype))
  low32, high32 = low.astype(jnp.float32), high.astype(jnp.float32)
  spacing = float(high32 - low32)
  errors = []
  for i, frac in enumerate(np.arange(1, 8) / 8):
    x = jnp.full(DRAWS, low32 + np.float32(frac * spacing), jnp.float32)
    y = round_fn(x, dtype, jax.random.fold_in(KEY, i)).astype(jnp.float32)
    assert set(np.unique(np.asarray(y))) <= {float(low32), float(high32)}
    errors.append(float(jnp.mean(y - x)) / spacing)
  return np.array(errors)


# Normal values, a float16 subnormal, a negative value.
@pytest.mark.parametrize("dtype,low", [
    (jnp.bfloat16, 1.0), (jnp.bfloat16, -3.0), (jnp.bfloat16, 1e-30),
    (jnp.float16, 1.0), (jnp.float16, -1000.0), (jnp.float16, 3 * 2.0**-24),
])
def test_mean_error_over_many_draws_is_zero_and_nearest_fails_it(dtype, low):
  bound = 0.01  # In spacings; the sampling error is about 0.0016.
  stochastic = _mean_errors(mpolicy.stochastic_round, dtype, low)
  assert np.all(np.abs(stochastic) < bound), stochastic
  # The same criterion rejects round-to-nearest: its error is up to half a
  # spacing, towards the nearer neighbour.
  nearest = _mean_errors(_nearest, dtype, low)
  assert np.max(np.abs(nearest)) > 0.3, nearest


@pytest.mark.parametrize("dtype", HALVES)
def test_rounds_up_with_probability_proportional_to_the_distance(dtype):
  x = jnp.full(DRAWS, 1 + 0.25 * float(jnp.finfo(dtype).eps), jnp.float32)
  up = mpolicy.stochastic_round(x, dtype, KEY) > 1
  assert abs(float(up.mean()) - 0.25) < 0.01


@pytest.mark.parametrize("dtype", HALVES)
def test_representable_values_come_back_exactly(dtype):
  bits = jax.random.bits(KEY, (50_000,), jnp.uint16)
  values = jax.lax.bitcast_convert_type(bits, dtype)
  values = jnp.where(jnp.isfinite(values), values, 0).astype(dtype)
  if dtype == jnp.float16:  # Every subnormal too, and both zeros.
    subnormals = jax.lax.bitcast_convert_type(
        jnp.arange(0x400, dtype=jnp.uint16), dtype)
    values = jnp.concatenate([values, subnormals, -subnormals])
  out = mpolicy.stochastic_round(values.astype(jnp.float32), dtype, KEY)
  assert out.dtype == dtype
  np.testing.assert_array_equal(
      jax.lax.bitcast_convert_type(out, jnp.uint16),
      jax.lax.bitcast_convert_type(values, jnp.uint16))


@pytest.mark.parametrize("dtype", HALVES)
def test_non_finite_values_stay_non_finite(dtype):
  # 0x7F800001: a NaN whose payload lies only in the low 16 bits.
  nan_low = jax.lax.bitcast_convert_type(jnp.uint32(0x7F800001), jnp.float32)
  x = jnp.array([np.nan, -np.nan, np.inf, -np.inf, nan_low], jnp.float32)
  for i in range(20):
    out = np.asarray(mpolicy.stochastic_round(
        x, dtype, jax.random.PRNGKey(i)).astype(jnp.float32))
    np.testing.assert_array_equal(np.isnan(out), [1, 1, 0, 0, 1])
    assert out[2] == np.inf and out[3] == -np.inf


def test_float16_below_the_smallest_subnormal_rounds_up_in_proportion():
  tiny = 2.0**-24  # The smallest float16 subnormal.
  x = jnp.full(DRAWS, 0.3 * tiny, jnp.float32)
  out = mpolicy.stochastic_round(x, jnp.float16, KEY).astype(jnp.float32)
  assert set(np.unique(np.asarray(out))) == {0.0, tiny}
  assert abs(float(out.mean()) / tiny - 0.3) < 0.01
  negative = mpolicy.stochastic_round(-x, jnp.float16, KEY)
  assert float(negative.astype(jnp.float32).mean()) / tiny == pytest.approx(
      -float(out.mean()) / tiny)


def test_float16_beyond_its_range_rounds_as_nearest_would():
  x = jnp.array([65519.0, 65520.0, 1e5, -1e5, 65504.0], jnp.float32)
  for i in range(20):
    out = mpolicy.stochastic_round(x, jnp.float16, jax.random.PRNGKey(i))
    np.testing.assert_array_equal(
        np.asarray(out.astype(jnp.float32)),
        [65504.0, np.inf, np.inf, -np.inf, 65504.0])


def test_same_key_same_bits_and_new_key_new_bits():
  x = jax.random.uniform(KEY, (1000,))
  a = mpolicy.stochastic_round(x, jnp.bfloat16, jax.random.PRNGKey(1))
  b = mpolicy.stochastic_round(x, jnp.bfloat16, jax.random.PRNGKey(1))
  c = mpolicy.stochastic_round(x, jnp.bfloat16, jax.random.PRNGKey(2))
  np.testing.assert_array_equal(a, b)
  assert np.any(np.asarray(a) != np.asarray(c))


@pytest.mark.parametrize("dtype", HALVES)
def test_holds_no_buffer_of_random_bits_and_no_transcendentals(dtype):
  n = 1 << 20
  f = jax.jit(lambda x, k: mpolicy.stochastic_round(x, dtype, k))
  lowered = f.lower(jax.ShapeDtypeStruct((n,), jnp.float32), KEY)
  assert not re.search(r"stablehlo\.(log|exponential|erf|sqrt)\b",
                       lowered.as_text())
  # The bits are fused into the rounding: XLA's temp is far below the 4
  # bytes per element a materialised uint32 draw would take.
  temp = lowered.compile().memory_analysis().temp_size_in_bytes
  assert temp < 0.01 * n


def test_decisions_under_successive_keys_are_uncorrelated():
  x = jnp.full(DRAWS, 1 + 2.0**-8, jnp.float32)  # Halfway: up with p = 1/2.
  ups = [np.asarray(mpolicy.stochastic_round(
      x, jnp.bfloat16, jax.random.fold_in(KEY, i)) > 1) for i in range(4)]
  for a, b in zip(ups, ups[1:]):
    assert abs(np.corrcoef(a, b)[0, 1]) < 0.02
  # Neighbouring elements under one key neither.
  assert abs(np.corrcoef(ups[0][:-1], ups[0][1:])[0, 1]) < 0.02


def test_bad_dtype_names_the_accepted_ones():
  with pytest.raises(ValueError, match="bfloat16 or float16, got"):
    mpolicy.stochastic_round(jnp.ones(2), jnp.float32, KEY)


def test_integer_input_is_rejected_with_what_is_accepted():
  with pytest.raises(TypeError, match="float32 array .* got int32"):
    mpolicy.stochastic_round(jnp.ones(2, jnp.int32), jnp.bfloat16, KEY)
