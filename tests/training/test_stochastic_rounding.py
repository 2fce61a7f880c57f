"""Specification of stochastic_round: unbiased, exact where it can be, cheap."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
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


def _f32(bits):
  return float(jax.lax.bitcast_convert_type(jnp.uint32(bits), jnp.float32))


BF16_MAX = float(jnp.finfo(jnp.bfloat16).max)  # 0x7F7F0000 as float32.
TOP = {  # Finite float32 values beyond each dtype's largest finite value.
    jnp.bfloat16: [_f32(0x7F7F0001), _f32(0x7F7F8000), _f32(0x7F7FFFFF),
                   -_f32(0x7F7FC000)],
    jnp.float16: [65505.0, 65519.0, 65520.0, 1e5, -1e5, 3e38],
}


@pytest.mark.parametrize("dtype", HALVES)
def test_finite_values_beyond_the_range_saturate_never_inf(dtype):
  largest = float(jnp.finfo(dtype).max)
  x = jnp.repeat(jnp.array(TOP[dtype], jnp.float32), 1000)
  want = np.repeat(np.sign(TOP[dtype]) * largest, 1000)
  for i in range(5):
    out = mpolicy.stochastic_round(x, dtype, jax.random.PRNGKey(i))
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), want)
  # Round-to-nearest overflows there (from 65520, from 0x7F7F8000).
  assert np.isinf(np.asarray(x.astype(dtype).astype(jnp.float32))).any()


@pytest.mark.parametrize("dtype", HALVES)
def test_just_below_the_largest_value_still_rounds_both_ways(dtype):
  largest = jnp.asarray(jnp.finfo(dtype).max, dtype)
  below = jnp.nextafter(largest, jnp.asarray(0, dtype)).astype(jnp.float32)
  x = jnp.full(DRAWS, below + (largest.astype(jnp.float32) - below) / 2)
  out = mpolicy.stochastic_round(x, dtype, KEY).astype(jnp.float32)
  assert set(np.unique(np.asarray(out))) == {float(below), float(largest)}
  assert abs(float(jnp.mean(out == largest.astype(jnp.float32))) - 0.5) < 0.01


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


def test_an_int_seed_for_key_is_named():
  with pytest.raises(TypeError, match=r"stochastic_round: key must be one JAX "
                     r"PRNG key, .* got 7 \(int\)\. An int is a seed: pass "
                     r"jax\.random\.key\(7\)\."):
    mpolicy.stochastic_round(jnp.ones(2), jnp.bfloat16, 7)


def test_vary_over_an_unbound_axis_says_where_to_call_it():
  with pytest.raises(ValueError, match=r"vary_over names \['d'\], which no "
                     r"enclosing shard_map or pmap binds"):
    mpolicy.stochastic_round(jnp.ones(2), jnp.bfloat16, KEY, vary_over="d")


def test_vary_over_must_be_axis_names():
  with pytest.raises(TypeError, match="stochastic_params: vary_over must be "
                     "a mesh axis name or a tuple of them"):
    mpolicy.stochastic_params(optax.sgd(1.), vary_over=[["d"]])


def test_vary_over_with_nearest_rounding_says_what_to_pass():
  with pytest.raises(ValueError, match="applies to stochastic rounding only, "
                     "but rounding='nearest'; pass rounding='stochastic'"):
    mpolicy.with_state_dtypes(optax.adam(1.), jnp.bfloat16, vary_over="d")
