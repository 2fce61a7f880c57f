"""Loss scales never silently lose gradients, and reject values that would."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mpolicy._src import loss_scale as ls_lib

DynamicLossScale = ls_lib.DynamicLossScale
StaticLossScale = ls_lib.StaticLossScale

FINITE, NON_FINITE = jnp.bool_(True), jnp.bool_(False)


def _quiet(fn):
  """Calls `fn` with warnings silenced (integer scales warn, as in jmp)."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    return fn()


# Every way of writing a scale that float16 itself cannot hold.
_BIG_SCALES = {
    "static_python_float": lambda: StaticLossScale(2. ** 17),
    "static_python_int": lambda: StaticLossScale(2 ** 17),
    "static_numpy_f32": lambda: StaticLossScale(np.float32(2. ** 17)),
    "static_int32": lambda: StaticLossScale(jnp.int32(2 ** 20)),
    "dynamic_python_float": lambda: DynamicLossScale(2. ** 17),
    "dynamic_f32": lambda: DynamicLossScale(jnp.float32(2. ** 20)),
    "dynamic_int32": lambda: _quiet(
        lambda: DynamicLossScale(jnp.int32(2 ** 20))),
}


def _value(ls):
  return float(np.asarray(ls.loss_scale))


# --- A: scale arithmetic that cannot overflow ---------------------------------


@pytest.mark.parametrize("make", _BIG_SCALES.values(), ids=_BIG_SCALES.keys())
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_unscale_by_a_scale_beyond_float16_keeps_the_gradient(make, dtype):
  ls = make()
  grads = {"w": jnp.full(3, 1024., dtype), "i": jnp.arange(3)}
  out = ls.unscale(grads)
  assert out["w"].dtype == dtype
  # Powers of two: the exact quotient is representable in every dtype here.
  np.testing.assert_array_equal(np.asarray(out["w"], np.float32),
                                1024. / _value(ls))
  assert out["i"] is grads["i"]


@pytest.mark.parametrize("make", _BIG_SCALES.values(), ids=_BIG_SCALES.keys())
def test_scale_beyond_float16_is_inf_only_on_a_true_overflow(make):
  ls = make()
  small = jnp.float16(1e-3)
  out = ls.scale(small)
  assert out.dtype == jnp.float16
  expected = np.float16(np.float32(small) * np.float32(_value(ls)))
  assert np.isfinite(expected)
  assert np.asarray(out).tobytes() == expected.tobytes()
  # 1 * 2 ** 17 really does not fit float16.
  assert bool(jnp.isinf(ls.scale(jnp.ones(2, jnp.float16))).all())


@pytest.mark.parametrize("make", _BIG_SCALES.values(), ids=_BIG_SCALES.keys())
def test_big_scales_round_trip_under_jit_tree_map_and_vmap(make):
  ls = make()
  g = jnp.full((4,), 1024., jnp.float16)
  expected = np.float16(1024. / _value(ls))
  jitted = jax.jit(lambda ls, g: ls.unscale(g))(ls, g)
  assert jitted.dtype == jnp.float16
  np.testing.assert_array_equal(jitted, expected)
  mapped = jax.tree_util.tree_map(lambda x: x, ls)
  np.testing.assert_array_equal(mapped.unscale(g), expected)
  vmapped = jax.vmap(ls.unscale)(jnp.stack([g, g]))
  assert vmapped.dtype == jnp.float16 and vmapped.shape == (2, 4)
  np.testing.assert_array_equal(vmapped, expected)


def test_a_float16_scale_value_unscales_float16_exactly():
  ls = DynamicLossScale(jnp.float16(2. ** 15))
  out = ls.unscale(jnp.float16(3.))
  assert out.dtype == jnp.float16 and float(out) == 3. / 2 ** 15


def test_python_float_leaves_are_scaled_in_float32_or_exactly():
  assert StaticLossScale(2 ** 17).scale(0.5) == 2. ** 16
  out = DynamicLossScale(jnp.float16(2. ** 15)).scale(4.0)
  assert float(out) == 2. ** 17  # Would be inf if computed in float16.


def test_scaled_float16_grads_recover_under_jit_with_a_huge_scale():
  # The whole loss-scaling round trip, with the scale held as int32.
  ls = _quiet(lambda: DynamicLossScale(jnp.int32(2 ** 20)))

  @jax.jit
  def grads(ls, w):
    return ls.unscale(jax.grad(
        lambda w: ls.scale(jnp.sum(w * jnp.float16(1e-3))))(w))

  out = grads(ls, jnp.ones(3, jnp.float32))
  np.testing.assert_allclose(out, 1e-3, rtol=1e-3)


# --- B: values are validated at construction ----------------------------------


@pytest.mark.parametrize("bad", [jnp.inf, -jnp.inf, jnp.nan, 0., -1., 0,
                                 np.float16(np.inf), jnp.float32(jnp.nan)])
def test_non_positive_or_non_finite_dynamic_scales_are_rejected(bad):
  with pytest.raises(ValueError,
                     match=r"loss_scale must be a positive, finite real"):
    DynamicLossScale(bad)


@pytest.mark.parametrize("bad", [jnp.inf, -jnp.inf, jnp.nan, -1.,
                                 np.float16(np.inf), jnp.float32(jnp.nan)])
def test_negative_or_non_finite_static_scales_are_rejected(bad):
  with pytest.raises(ValueError,
                     match=r"loss_scale must be a non-negative, finite real"):
    StaticLossScale(bad)


@pytest.mark.parametrize("zero", [0, 0., jnp.float32(0.)])
def test_a_zero_static_scale_is_accepted_with_a_warning(zero):
  # jmp accepts it (its own tests build StaticLossScale(0)); it erases every
  # gradient, which the warning says.
  with pytest.warns(UserWarning, match=r"StaticLossScale\(0\) scales every "
                    r"gradient to zero.*NoOpLossScale"):
    ls = StaticLossScale(zero)
  assert jax.tree_util.tree_leaves(ls) == []


@pytest.mark.parametrize("bad", [jnp.inf, jnp.nan, -2.])
def test_negative_or_non_finite_floors_are_rejected(bad):
  with pytest.raises(ValueError,
                     match=r"min_loss_scale must be a non-negative, finite"):
    DynamicLossScale(2. ** 15, min_loss_scale=bad)


def test_a_zero_floor_backs_off_without_another_floor():
  # jmp's semantics: min_loss_scale=0 is no floor (10 / 2 ** 100 in float32).
  ls = DynamicLossScale(jnp.float32(10.), min_loss_scale=0.)
  for _ in range(100):
    ls = ls.adjust(NON_FINITE)
  np.testing.assert_allclose(_value(ls), 10. / 2. ** 100, rtol=1e-6)


@pytest.mark.parametrize("dtype,floor", [(jnp.float16, 1e-9),
                                         (jnp.float32, 1e-40),
                                         (jnp.bfloat16, 0.),
                                         (jnp.float16, 0.)])
def test_the_scale_never_backs_off_to_zero_or_an_infinite_reciprocal(dtype,
                                                                     floor):
  ls = DynamicLossScale(jnp.asarray(2. ** 10, dtype), min_loss_scale=floor)
  step = jax.jit(lambda ls: ls.adjust(NON_FINITE))
  for _ in range(300):
    ls = step(ls)
  tiny = float(jnp.finfo(dtype).tiny)
  assert ls.loss_scale.dtype == dtype
  assert _value(ls) == tiny, (_value(ls), tiny)
  grads = ls.unscale({"g": jnp.asarray(1e-3, dtype)})
  assert bool(jnp.isfinite(grads["g"])), grads


def test_a_period_the_counter_cannot_hold_is_rejected_at_construction():
  with pytest.raises(ValueError, match=r"period \(1099511627776\) must fit "
                     r"the counter's dtype \(int32, at most 2147483647\)"):
    DynamicLossScale(2. ** 15, period=2 ** 40)
  ls = DynamicLossScale(2. ** 15, period=2 ** 31 - 1)
  assert int(ls.adjust(FINITE).counter) == 1


@pytest.mark.parametrize("period,expected", [(5., 5), (np.float32(3.), 3)])
def test_a_whole_number_float_period_is_an_int(period, expected):
  ls = DynamicLossScale(2. ** 15, period=period)
  assert ls.period == expected and isinstance(ls.period, int)


@pytest.mark.parametrize("bad", [5.5, float("inf"), float("nan")])
def test_a_fractional_period_is_rejected(bad):
  with pytest.raises(TypeError, match=r"period must be a positive int"):
    DynamicLossScale(2. ** 15, period=bad)


@pytest.mark.parametrize("bad", ["4", True, None, object(), 1j])
@pytest.mark.parametrize("cls", [StaticLossScale, DynamicLossScale])
def test_non_numeric_scales_are_rejected_by_name(cls, bad):
  with pytest.raises(TypeError, match=r"loss_scale must be a positive"):
    cls(bad)


def test_floor_above_the_scale_is_rejected():
  with pytest.raises(ValueError,
                     match=r"min_loss_scale \(100.0\) must not exceed "
                     r"loss_scale \(4.0\)"):
    DynamicLossScale(4., min_loss_scale=100.)
  # Equal is fine: the scale just cannot back off.
  ls = DynamicLossScale(4., min_loss_scale=4.)
  assert _value(ls.adjust(NON_FINITE)) == 4.


def test_adjust_never_raises_the_scale_on_overflow():
  # A scale below its floor can still arrive unchecked (unflattened from a
  # checkpoint, or made by tree_map): backing off must not lift it.
  ls = DynamicLossScale(2. ** 10, min_loss_scale=2. ** 8)
  low = jax.tree_util.tree_map(
      lambda x: x / 64 if x.dtype == jnp.float32 else x, ls)
  assert _value(low) == 16.
  for adjust in (lambda l: l.adjust(NON_FINITE),
                 jax.jit(lambda l: l.adjust(NON_FINITE))):
    out = adjust(low)
    assert _value(out) == 16. and int(out.counter) == 0
  stacked = jax.tree_util.tree_map(lambda x: jnp.stack([x, x]), ls)
  stacked = jax.tree_util.tree_map(
      lambda x: x.at[0].divide(64) if x.dtype == jnp.float32 else x, stacked)
  out = jax.vmap(lambda l: l.adjust(NON_FINITE))(stacked)
  np.testing.assert_array_equal(out.loss_scale, [16., 512.])


def test_backing_off_forever_never_reaches_zero():
  ls = DynamicLossScale(2. ** 15)
  step = jax.jit(lambda l: l.adjust(NON_FINITE))
  for _ in range(200):
    ls = step(ls)
  assert _value(ls) == 1.
  assert bool(jnp.isfinite(ls.unscale(jnp.ones(2, jnp.float16))).all())


def test_integer_scale_needs_a_floor_of_at_least_one():
  with pytest.raises(ValueError, match=r"min_loss_scale must be >= 1"):
    _quiet(lambda: DynamicLossScale(jnp.int32(8), min_loss_scale=0.5))
  ls = _quiet(lambda: DynamicLossScale(jnp.int32(8)))
  for _ in range(10):
    ls = ls.adjust(NON_FINITE)
  assert int(ls.loss_scale) == 1


def test_non_scalar_static_scale_is_rejected():
  with pytest.raises(ValueError, match=r"loss_scale must be a scalar, got "
                     r"shape \(2,\)"):
    StaticLossScale(np.array([2., 4.], np.float32))


def test_non_scalar_dynamic_scale_cannot_scale_but_can_be_mapped():
  # A stack of scales is how one keeps a scale per device or per model.
  stacked = DynamicLossScale(jnp.array([2., 4.]), jnp.zeros(2, jnp.int32))
  for method in (stacked.scale, stacked.unscale):
    with pytest.raises(ValueError, match=r"loss_scale must be a scalar, got "
                       r"shape \(2,\).*jax.vmap"):
      method({"w": jnp.ones(3)})
  out = jax.vmap(lambda l, g: l.unscale(g))(stacked, jnp.ones((2, 3)))
  assert out.shape == (2, 3)
  np.testing.assert_array_equal(out, [[.5] * 3, [.25] * 3])


@pytest.mark.parametrize("period", [1.5, True, np.bool_(True), "2000",
                                    None, jnp.float32(2.)])
def test_period_of_the_wrong_type_is_rejected_by_name(period):
  with pytest.raises(TypeError, match=r"period must be a positive int .*got "):
    DynamicLossScale(2. ** 15, period=period)


@pytest.mark.parametrize("period", [0, -3])
def test_period_below_one_is_rejected(period):
  with pytest.raises(ValueError, match=r"period must be a positive int"):
    DynamicLossScale(2. ** 15, period=period)


@pytest.mark.parametrize("factor", ["2", True, None, [2]])
def test_factor_of_the_wrong_type_is_rejected_by_name(factor):
  with pytest.raises(TypeError, match=r"factor must be a finite real number "
                     r"> 1"):
    DynamicLossScale(2. ** 15, factor=factor)


@pytest.mark.parametrize("factor", [jnp.inf, jnp.nan, 1, 0.5, 0, -2])
def test_factor_that_cannot_back_off_is_rejected(factor):
  with pytest.raises(ValueError, match=r"factor must be a finite real number "
                     r"> 1"):
    DynamicLossScale(2. ** 15, factor=factor)


@pytest.mark.parametrize("counter,error", [(-1, ValueError), (1.5, TypeError),
                                           (True, TypeError)])
def test_bad_counter_is_rejected(counter, error):
  with pytest.raises(error, match=r"counter must be a non-negative int"):
    DynamicLossScale(2. ** 15, counter=counter)


def test_numpy_numbers_are_accepted_as_plain_metadata():
  ls = DynamicLossScale(np.float32(8.), np.int32(1), period=np.int64(3),
                        factor=np.float32(4.), min_loss_scale=np.float32(2.))
  assert ls.period == 3 and type(ls.period) is int
  assert ls.factor == 4. and type(ls.factor) is float
  assert hash(jax.tree_util.tree_structure(ls))  # Metadata stays hashable.
  ls = ls.adjust(FINITE).adjust(FINITE)
  assert _value(ls) == 32.


# --- Validation leaves JAX's own machinery alone ------------------------------


def test_construction_from_tracers_under_jit_is_not_validated():
  @jax.jit
  def make(scale, counter):
    return (DynamicLossScale(scale, counter).adjust(NON_FINITE),
            StaticLossScale(scale).unscale(jnp.float16(1024.)))

  ls, g = make(jnp.float32(2. ** 17), jnp.int32(0))
  assert _value(ls) == 2. ** 16 and float(g) == 1024. / 2 ** 17
  # Values the constructor would reject are the caller's business in a trace.
  ls, _ = make(jnp.float32(0.), jnp.int32(0))
  assert _value(ls) == 0.


@pytest.mark.parametrize("placeholder", [None, object()])
def test_unflattening_with_arbitrary_leaves_is_not_validated(placeholder):
  dynamic = DynamicLossScale(2. ** 15, period=7, min_loss_scale=4.)
  out = jax.tree_util.tree_unflatten(
      jax.tree_util.tree_structure(dynamic), [placeholder] * 2)
  assert out.loss_scale is placeholder and out.counter is placeholder
  assert (out.period, out.factor, out.min_loss_scale) == (7, 2, 4.)
  static = StaticLossScale(2. ** 17)
  out = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(static), [])
  assert type(out) is StaticLossScale and out.loss_scale == 2. ** 17


def test_vmap_and_tree_map_build_loss_scales_without_validating():
  ls = DynamicLossScale(2. ** 15, min_loss_scale=2.)
  # tree_map may produce values the constructor would refuse; that is allowed.
  zeros = jax.tree_util.tree_map(jnp.zeros_like, ls)
  assert _value(zeros) == 0. and zeros.min_loss_scale == 2.
  n = 3
  stacked = jax.tree_util.tree_map(lambda x: jnp.stack([x] * n), ls)
  out = jax.vmap(lambda l: l.adjust(NON_FINITE))(stacked)
  np.testing.assert_array_equal(out.loss_scale, [2. ** 14] * n)
