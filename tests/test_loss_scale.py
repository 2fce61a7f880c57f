"""Specification of mpolicy loss scales, including jmp's bugs fixed."""

from __future__ import annotations

import pickle
import warnings

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import pytest

import mpolicy
from mpolicy._src import loss_scale as ls_lib

DynamicLossScale = ls_lib.DynamicLossScale
StaticLossScale = ls_lib.StaticLossScale
NoOpLossScale = ls_lib.NoOpLossScale

FINITE, NON_FINITE = jnp.bool_(True), jnp.bool_(False)


def _run(ls, steps):
  for finite in steps:
    ls = ls.adjust(jnp.bool_(finite))
  return ls


# --- NoOp and Static ----------------------------------------------------------


def test_no_op_returns_the_same_tree():
  tree = {"a": jnp.ones(2)}
  ls = NoOpLossScale()
  assert ls.scale(tree) is tree and ls.unscale(tree) is tree
  assert ls.adjust(NON_FINITE) is ls and ls.loss_scale == 1
  assert jax.tree_util.tree_leaves(ls) == []


def test_static_scales_and_unscales_values():
  ls = StaticLossScale(4.0)
  scaled = ls.scale({"a": jnp.array([1., 2.])})
  np.testing.assert_array_equal(scaled["a"], [4., 8.])
  np.testing.assert_array_equal(ls.unscale(scaled)["a"], [1., 2.])
  assert ls.adjust(NON_FINITE) is ls


def test_static_is_an_empty_pytree_that_survives_jit():
  ls = StaticLossScale(jnp.float32(3.))
  assert jax.tree_util.tree_leaves(ls) == []
  out = jax.jit(lambda ls, x: ls.scale(x))(ls, jnp.float32(2.))
  assert float(out) == 6.0


def test_static_with_array_scale_under_jit_uses_each_value():
  # jmp's StaticLossScale fails here: arrays are not valid pytree metadata.
  fn = jax.jit(lambda ls, x: ls.scale(x))
  assert float(fn(StaticLossScale(np.float32(2.)), jnp.float32(1.))) == 2.
  assert float(fn(StaticLossScale(np.float32(5.)), jnp.float32(1.))) == 5.
  # A non-scalar scale would broadcast and change every leaf's shape.
  with pytest.raises(ValueError, match="loss_scale must be a scalar"):
    StaticLossScale(np.array([2., 3.], np.float32))


# --- scale / unscale dtypes ---------------------------------------------------


@pytest.mark.parametrize("make", [
    lambda: StaticLossScale(jnp.float32(1024.)),
    lambda: DynamicLossScale(jnp.float32(1024.)),
])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_unscale_keeps_the_gradient_dtype(make, dtype):
  ls = make()
  grads = {"w": jnp.full(3, 2048., dtype)}
  out = ls.unscale(grads)
  assert out["w"].dtype == dtype
  np.testing.assert_array_equal(np.asarray(out["w"], np.float32), 2.)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_scale_keeps_the_leaf_dtype(dtype):
  out = DynamicLossScale(jnp.float32(8.)).scale(jnp.ones(2, dtype))
  assert out.dtype == dtype
  np.testing.assert_array_equal(np.asarray(out, np.float32), 8.)


def test_scale_overflow_in_f16_gives_inf():
  out = DynamicLossScale(jnp.float32(2. ** 16)).scale(jnp.ones(1, jnp.float16))
  assert out.dtype == jnp.float16 and bool(jnp.isinf(out).all())


F8 = [jnp.float8_e4m3fn, jnp.float8_e5m2]
SCALES = [NoOpLossScale, lambda: StaticLossScale(16.),
          lambda: DynamicLossScale(jnp.float32(16.))]


@pytest.mark.parametrize("make", SCALES)
@pytest.mark.parametrize("dtype", F8)
def test_float8_leaves_scale_and_unscale_in_their_dtype_under_jit(make, dtype):
  ls = make()
  # 0.375 is not a power of two: the float32 product is rounded back.
  grads = {"w": jnp.array([0.375, -2., 0.], dtype), "i": jnp.arange(2)}
  scaled = jax.jit(lambda ls, g: ls.scale(g))(ls, grads)
  out = jax.jit(lambda ls, g: ls.unscale(g))(ls, scaled)
  assert scaled["w"].dtype == out["w"].dtype == dtype
  factor = float(ls.loss_scale)
  np.testing.assert_array_equal(np.asarray(scaled["w"], np.float32),
                                np.array([0.375, -2., 0.]) * factor)
  np.testing.assert_array_equal(np.asarray(out["w"], np.float32),
                                [0.375, -2., 0.])
  assert out["i"].dtype == jnp.int32


@pytest.mark.parametrize("dtype, fits, overflows", [
    (jnp.float8_e4m3fn, 224., 240.),  # Largest finite: 448.
    (jnp.float8_e5m2, 24576., 32768.),  # Largest finite: 57344.
])
def test_float8_overflow_is_not_finite_never_saturated(dtype, fits,
                                                       overflows):
  ls = StaticLossScale(2.)
  out = jax.jit(ls.scale)(jnp.array([fits, overflows, -overflows], dtype))
  assert out.dtype == dtype
  out = np.asarray(out, np.float32)
  assert out[0] == 2 * fits
  assert not np.isfinite(out[1:]).any()  # Not 448 / 57344: a wrong value.
  if dtype == jnp.float8_e5m2:  # It has inf, and keeps the sign.
    np.testing.assert_array_equal(out[1:], [np.inf, -np.inf])
  assert not bool(ls_lib.all_finite(out))


@pytest.mark.parametrize("dtype, rounds_down, rounds_up", [
    # Halfway past the largest finite value rounds to even: down to 448 in
    # e4m3fn (its mantissa ends in 0), up to inf in e5m2.
    (jnp.float8_e4m3fn, [448., 463.9, 464.], [464.1, 1e6, np.inf]),
    (jnp.float8_e5m2, [57344., 61439.], [61440., 1e6, np.inf]),
])
def test_float8_cast_rounds_to_nearest_up_to_the_overflow(dtype, rounds_down,
                                                          rounds_up):
  y = jnp.array(rounds_down + rounds_up, jnp.float32)
  out = jax.jit(lambda y: ls_lib._cast_narrow(y, dtype))(y)
  assert out.dtype == dtype
  out = np.asarray(out, np.float32)
  np.testing.assert_array_equal(out[:len(rounds_down)],
                                float(jnp.finfo(dtype).max))
  assert not np.isfinite(out[len(rounds_down):]).any()


@pytest.mark.parametrize("dtype, start, grown", [
    (jnp.float8_e5m2, 16384., 32768.), (jnp.float8_e4m3fn, 128., 256.)])
def test_float8_scale_adjusts_in_its_dtype_and_never_overflows(dtype, start,
                                                               grown):
  ls = DynamicLossScale(jnp.asarray(start, dtype), period=1)
  up = jax.jit(lambda ls: _run(ls, [True, True, True]))(ls)
  assert up.loss_scale.dtype == dtype and float(up.loss_scale) == grown
  down = jax.jit(lambda ls: ls.adjust(NON_FINITE))(ls)
  assert float(down.loss_scale) == start / 2


def test_scale_and_unscale_leave_non_float_leaves_unchanged():
  tree = {"i": jnp.arange(3), "n": 7, "b": True, "none": None, "s": "x",
          "f": jnp.ones(2)}
  for ls in (StaticLossScale(2.), DynamicLossScale(2.)):
    for out in (ls.scale(tree), ls.unscale(tree)):
      assert out["i"] is tree["i"] and out["n"] == 7 and out["b"] is True
      assert out["none"] is None and out["s"] == "x"
  np.testing.assert_array_equal(StaticLossScale(2.).scale(tree)["f"], 2.)


def test_scale_multiplies_python_float_leaves():
  assert float(DynamicLossScale(4.).scale(1.5)) == 6.0
  assert StaticLossScale(4).scale(1.5) == 6.0


# --- DynamicLossScale: construction and leaves --------------------------------


def test_python_numbers_become_strong_float32_and_int32_arrays():
  ls = DynamicLossScale(2. ** 15)
  assert isinstance(ls.loss_scale, jax.Array)
  assert ls.loss_scale.dtype == jnp.float32 and not ls.loss_scale.weak_type
  assert ls.counter.dtype == jnp.int32 and not ls.counter.weak_type
  assert DynamicLossScale(1024).loss_scale.dtype == jnp.float32


def test_weak_typed_arrays_become_strong():
  ls = DynamicLossScale(jnp.asarray(2.), jnp.asarray(0))
  assert not ls.loss_scale.weak_type and not ls.counter.weak_type


def test_default_construction_does_not_warn():
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    DynamicLossScale(2. ** 15)
    DynamicLossScale(jnp.float16(1024.))


def test_integer_array_scale_warns_like_jmp():
  with pytest.warns(UserWarning, match="Expected floating type for loss_scale"):
    DynamicLossScale(jnp.asarray(8, jnp.int32))


def test_leaves_are_loss_scale_and_counter():
  scale, counter = jnp.float32(4.), jnp.int32(3)
  ls = DynamicLossScale(scale, counter, period=10, factor=3, min_loss_scale=2.)
  leaves = jax.tree_util.tree_leaves(ls)
  assert len(leaves) == 2
  assert float(leaves[0]) == 4. and int(leaves[1]) == 3


@pytest.mark.parametrize("kwargs,match", [
    (dict(period=0), "period"), (dict(factor=0.5), "factor")])
def test_bad_period_or_factor_is_rejected(kwargs, match):
  with pytest.raises(ValueError, match=match):
    DynamicLossScale(1., **kwargs)


def _fields(ls):
  return (float(ls.loss_scale), int(ls.counter), ls.period, ls.factor,
          float(ls.min_loss_scale))


def test_tree_map_preserves_every_field():
  ls = DynamicLossScale(jnp.float32(256.), jnp.int32(5), period=7, factor=4,
                        min_loss_scale=128.)
  out = jax.tree_util.tree_map(lambda x: x, ls)
  assert type(out) is DynamicLossScale
  assert _fields(out) == (256., 5, 7, 4, 128.)


def test_pickle_round_trip_preserves_every_field():
  ls = DynamicLossScale(jnp.float16(512.), jnp.int32(2), period=9, factor=3,
                        min_loss_scale=64.)
  out = pickle.loads(pickle.dumps(ls))
  assert _fields(out) == _fields(ls)
  assert out.loss_scale.dtype == jnp.float16


def test_jit_round_trip_preserves_every_field():
  ls = DynamicLossScale(jnp.float32(256.), jnp.int32(5), period=7, factor=4,
                        min_loss_scale=128.)
  out = jax.jit(lambda x: x)(ls)
  assert _fields(out) == (256., 5, 7, 4, 128.)


def test_min_loss_scale_holds_under_jit():
  # In jmp, min_loss_scale is lost in unflattening and this decays to 1.
  ls = DynamicLossScale(jnp.float32(2. ** 10), min_loss_scale=128.)
  step = jax.jit(lambda ls: ls.adjust(NON_FINITE))
  seen = []
  for _ in range(10):
    ls = step(ls)
    seen.append(float(ls.loss_scale))
  assert seen == [512., 256., 128., 128., 128., 128., 128., 128., 128., 128.]
  assert float(ls.min_loss_scale) == 128.


def test_jitted_step_does_not_retrace_across_adjust():
  traces = []

  @jax.jit
  def step(ls, grads):
    traces.append(1)
    grads = ls.unscale(grads)
    return ls.adjust(ls_lib.all_finite(grads)), grads

  ls = DynamicLossScale(2. ** 15, period=2)
  grads = jnp.ones(3)
  for i in range(8):
    ls, _ = step(ls, grads if i % 3 else grads * jnp.inf)
  ls = ls.adjust(FINITE)  # Eager adjust must keep the dtypes too.
  step(ls, grads)
  assert len(traces) == 1


def test_vmap_over_loss_scales():
  ls = DynamicLossScale(jnp.array([4., 8.]), jnp.zeros(2, jnp.int32), period=1)
  out = jax.vmap(lambda ls, f: ls.adjust(f))(ls, jnp.array([True, False]))
  np.testing.assert_array_equal(out.loss_scale, [8., 4.])
  np.testing.assert_array_equal(out.counter, [0, 0])


def test_pmap_over_loss_scales():
  n = jax.local_device_count()
  ls = DynamicLossScale(jnp.full(n, 4.), jnp.zeros(n, jnp.int32), period=1)
  out = jax.pmap(lambda ls: ls.adjust(FINITE))(ls)
  np.testing.assert_array_equal(out.loss_scale, np.full(n, 8.))


# --- DynamicLossScale.adjust: the schedule ------------------------------------


@pytest.mark.parametrize("period", [1, 2, 5])
def test_grows_exactly_after_period_finite_steps(period):
  ls = DynamicLossScale(jnp.float32(16.), period=period)
  for i in range(1, period):
    ls = ls.adjust(FINITE)
    assert float(ls.loss_scale) == 16. and int(ls.counter) == i
  ls = ls.adjust(FINITE)
  assert float(ls.loss_scale) == 32. and int(ls.counter) == 0
  for _ in range(period):
    ls = ls.adjust(FINITE)
  assert float(ls.loss_scale) == 64.


def test_non_finite_backs_off_and_resets_the_counter():
  ls = _run(DynamicLossScale(jnp.float32(64.), period=3, factor=4),
            [True, True])
  assert int(ls.counter) == 2
  ls = ls.adjust(NON_FINITE)
  assert float(ls.loss_scale) == 16. and int(ls.counter) == 0
  ls = _run(ls, [True, True])
  assert float(ls.loss_scale) == 16.  # Needs 3 fresh finite steps.
  ls = ls.adjust(FINITE)
  assert float(ls.loss_scale) == 64.


def test_back_off_stops_at_min_loss_scale():
  ls = _run(DynamicLossScale(jnp.float32(100.), min_loss_scale=30.),
            [False] * 5)
  assert float(ls.loss_scale) == 30.


def test_back_off_stops_at_default_min_of_one():
  ls = _run(DynamicLossScale(jnp.float32(4.)), [False] * 5)
  assert float(ls.loss_scale) == 1.


def test_growth_never_reaches_inf_in_float16():
  ls = DynamicLossScale(jnp.float16(2. ** 14), period=1)
  ls = ls.adjust(FINITE)
  assert float(ls.loss_scale) == 2. ** 15
  ls = _run(ls, [True] * 3)
  assert float(ls.loss_scale) == 2. ** 15  # 2 ** 16 > 65504.
  assert ls.loss_scale.dtype == jnp.float16 and int(ls.counter) == 0


def test_growth_never_reaches_inf_in_float32():
  big = np.finfo(np.float32).max / 1.5
  ls = _run(DynamicLossScale(jnp.float32(big), period=1), [True] * 3)
  assert float(ls.loss_scale) == float(np.float32(big))
  assert bool(jnp.isfinite(ls.loss_scale))


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_half_precision_scale_adjusts_in_its_dtype(dtype):
  # jmp crashes here: its adjust selects between f16 and f32 branches.
  ls = DynamicLossScale(jnp.asarray(1024., dtype), period=2, min_loss_scale=2.)
  ls = _run(ls, [True, True])
  assert ls.loss_scale.dtype == dtype and float(ls.loss_scale) == 2048.
  ls = _run(ls, [False] * 20)
  assert ls.loss_scale.dtype == dtype and float(ls.loss_scale) == 2.
  jitted = jax.jit(lambda ls: ls.adjust(FINITE))(ls)
  assert jitted.loss_scale.dtype == dtype


def test_integer_scale_adjusts():
  with pytest.warns(UserWarning):
    ls = DynamicLossScale(jnp.asarray(9, jnp.int32), period=1)
  ls = ls.adjust(FINITE)
  assert ls.loss_scale.dtype == jnp.int32 and int(ls.loss_scale) == 18
  ls = _run(ls, [False, False])
  assert int(ls.loss_scale) == 4  # 18 / 2 = 9, 9 / 2 rounds down to 4.
  ls = _run(ls, [False] * 5)
  assert int(ls.loss_scale) == 1


def test_integer_scale_never_overflows():
  with pytest.warns(UserWarning):
    ls = DynamicLossScale(jnp.asarray(2 ** 30, jnp.int32), period=1)
  ls = _run(ls, [True] * 3)
  assert int(ls.loss_scale) == 2 ** 30


def test_counter_and_scale_dtypes_are_kept():
  ls = _run(DynamicLossScale(jnp.float32(8.), period=2), [True, False, True])
  assert ls.loss_scale.dtype == jnp.float32 and ls.counter.dtype == jnp.int32
  assert not ls.loss_scale.weak_type and not ls.counter.weak_type


def test_adjust_returns_a_new_object():
  ls = DynamicLossScale(jnp.float32(8.), period=1)
  out = ls.adjust(FINITE)
  assert out is not ls and float(ls.loss_scale) == 8.


@pytest.mark.parametrize("bad", [jnp.array([True, False]), jnp.float32(1.)])
def test_adjust_requires_a_boolean_scalar(bad):
  with pytest.raises(AssertionError, match="expected boolean scalar"):
    DynamicLossScale(1.).adjust(bad)


def test_adjust_accepts_python_bool():
  assert float(DynamicLossScale(4., period=1).adjust(True).loss_scale) == 8.


# --- all_finite and select_tree -----------------------------------------------


def test_all_finite():
  assert ls_lib.all_finite({}).dtype == jnp.bool_
  assert bool(ls_lib.all_finite({})) and bool(ls_lib.all_finite(None))
  assert bool(ls_lib.all_finite({"a": jnp.ones(3), "i": jnp.arange(2)}))
  for bad in (jnp.inf, -jnp.inf, jnp.nan):
    tree = {"a": jnp.ones(3), "b": jnp.array([1., bad], jnp.bfloat16)}
    assert not bool(ls_lib.all_finite(tree))
  assert ls_lib.all_finite({"a": jnp.ones(3)}).shape == ()


def test_all_finite_under_jit():
  fn = jax.jit(ls_lib.all_finite)
  assert bool(fn([jnp.ones(2)])) and not bool(fn([jnp.array([jnp.nan])]))


def test_select_tree():
  a = {"w": jnp.ones(2), "i": jnp.arange(2)}
  b = {"w": jnp.zeros(2), "i": jnp.arange(2) + 5}
  out = ls_lib.select_tree(FINITE, a, b)
  np.testing.assert_array_equal(out["w"], 1.)
  out = ls_lib.select_tree(NON_FINITE, a, b)
  np.testing.assert_array_equal(out["i"], [5, 6])
  assert ls_lib.select_tree(FINITE, None, None) is None


def test_select_tree_rejects_non_scalar_or_non_bool():
  with pytest.raises(AssertionError, match="expected boolean scalar"):
    ls_lib.select_tree(jnp.ones([1]), None, None)
  with pytest.raises(AssertionError, match="expected boolean scalar"):
    ls_lib.select_tree(jnp.array([True, False]), None, None)


def test_select_tree_rejects_mismatched_structure():
  with pytest.raises(ValueError):
    ls_lib.select_tree(FINITE, {"a": jnp.ones(2)}, {"b": jnp.ones(2)})


def test_unittest_assert_warns_works_with_mpolicy_imported():
  # jmp's own suite checks these warnings with unittest's assertWarnsRegex,
  # which reads `__warningregistry__` on every loaded module; Haiku's flax
  # stand-in module used to raise ImportError there.
  import unittest  # pylint: disable=g-import-not-at-top
  case = unittest.TestCase()
  with case.assertWarnsRegex(Warning, "Expected floating type for loss_scale"):
    DynamicLossScale(jnp.asarray(1, dtype=jnp.int32))



def test_all_finite_answers_false_under_jax_debug_infs():
  # With jax_debug_infs on, a check for infs must answer, not raise.
  x = jnp.array([1., jnp.inf])
  with jax.debug_infs(True):
    assert not bool(mpolicy.all_finite({"a": x, "b": jnp.ones(2)}))
    assert not bool(jax.jit(mpolicy.all_finite)([jnp.arange(2), x]))
    assert not bool(mpolicy.all_finite(float("inf")))
    assert bool(mpolicy.all_finite([jnp.ones(2)]))
