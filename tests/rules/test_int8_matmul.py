"""The int8 matmul rule under ``c=int8``: which matmuls it takes, what they
compute (against a numpy reading of the definition), their gradients (the
bfloat16 matmul's), what explain and fp8_stats say, and the ops it cannot
take (a convolution, a dot with a reduction order): warned, run in
bfloat16."""

import inspect
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import mpolicy
from mpolicy._src.rules import int8_matmul

from _helpers import all_eqns

RULES = mpolicy.DEFAULT_RULES.with_fp8(min_size=0)
INT8 = "p=f32,c=int8,o=f32"
BF16 = "p=f32,c=bf16,o=f32"


def _np_int8(x, w):
  """x [M, K] @ w [K, N] by the definition, in numpy."""
  def q(v, axis):
    v = np.asarray(v, np.float32)
    amax = np.max(np.abs(v), axis=axis, keepdims=True)
    s = np.where(amax == 0, np.float32(1), amax * np.float32(1 / 127))
    return np.clip(np.rint(v / s), -127, 127).astype(np.int64), s
  qx, sx = q(x, 1)
  qw, sw = q(w, 0)
  out = ((qx @ qw).astype(np.float32) * sx) * sw
  return out.astype(ml_dtypes.bfloat16).astype(np.float32)


def _data():
  k = jax.random.split(jax.random.PRNGKey(0), 2)
  # float32 values that bfloat16 would round: the rule must read these.
  x = jax.random.normal(k[0], (8, 48)) * 1.001
  w = jax.random.normal(k[1], (48, 16)) * 0.1 + 1e-4
  return x, w


def test_weight_matmul_runs_in_int8_from_the_float32_operands():
  x, w = _data()
  y = mpolicy.amp(lambda x, w: x @ w, INT8, rules=RULES)(x, w)
  assert y.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(y), _np_int8(x, w))


def test_program_holds_an_int8_dot_summed_in_int32():
  x, w = _data()
  eqns = all_eqns(mpolicy.amp(lambda x, w: x @ w, INT8, rules=RULES), x, w)
  dots = [e for e in eqns if e.primitive.name == "dot_general"]
  assert dots and all(
      [v.aval.dtype for v in e.invars] == [jnp.int8, jnp.int8]
      and e.outvars[0].aval.dtype == jnp.int32 for e in dots)


def test_gradients_are_the_bfloat16_matmuls():
  x, w = _data()
  loss = lambda policy: jax.grad(
      lambda x, w: mpolicy.amp(lambda x, w: x @ w, policy, rules=RULES)(
          x, w).sum(), (0, 1))(x, w)
  for got, want in zip(loss(INT8), loss(BF16)):
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_explain_names_int8_and_its_scales():
  x, w = _data()
  report = mpolicy.explain(mpolicy.amp(lambda x, w: x @ w, INT8, rules=RULES),
                           x, w)
  (row,) = [r for r in report.rows if r.primitive == "dot_general"]
  assert row.ran_in == "int8"
  assert "per output channel" in str(report) and "int32" in str(report)


def test_activation_matmul_stays_in_bfloat16_by_default():
  x, _ = _data()
  f = mpolicy.amp(lambda x: jnp.tanh(x) @ jnp.tanh(x).T, INT8, rules=RULES)
  report = str(mpolicy.explain(f, x))
  assert "not int8: both operands are activations" in report, report


def test_fp8_stats_reports_int8_operands():
  x, w = _data()
  x = x.at[0, :4].set(1e-6)  # Below half a step of row 0's scale.
  xs = np.asarray(x)
  s = np.max(np.abs(xs), 1, keepdims=True) * np.float32(1 / 127)
  zeros = int(np.sum(np.rint(xs / s) == 0))
  assert zeros >= 4
  report = mpolicy.fp8_stats(
      mpolicy.amp(lambda x, w: x @ w, INT8, rules=RULES), x, w)
  (row,) = report.rows
  assert sorted(row.counts) == ["lhs", "rhs"]  # No quantized cotangent.
  assert row.counts["lhs"].format == "int8"
  assert row.counts["lhs"].underflow == zeros
  assert row.saturated("lhs") == 0.0 and row.saturated("rhs") == 0.0


def test_a_convolution_under_int8_warns_and_runs_in_bfloat16():
  x = jnp.ones((1, 8, 8, 3))
  k = jnp.ones((3, 3, 3, 4)) * 0.1
  conv = lambda x, k: jax.lax.conv_general_dilated(
      x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
  with pytest.warns(UserWarning, match="c=int8: the conv_general_dilated is "
                    "a convolution: int8 covers matmuls"):
    got = mpolicy.amp(conv, INT8, rules=RULES)(x, k)
  want = mpolicy.amp(conv, BF16, rules=RULES)(x, k)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    report = str(mpolicy.explain(mpolicy.amp(conv, INT8, rules=RULES), x, k))
  assert "not int8: is a convolution" in report, report


@pytest.mark.skipif(
    "reduction_order" not in inspect.signature(jax.lax.dot_general).parameters,
    reason=f"JAX {jax.__version__}'s dot_general takes no reduction_order")
def test_a_dot_with_a_reduction_order_warns_and_keeps_it_in_bfloat16():
  x, w = _data()
  f = lambda x, w: jax.lax.dot_general(
      x, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32,
      reduction_order="linear")
  with pytest.warns(UserWarning, match="names reduction_order="):
    got = mpolicy.amp(f, INT8, rules=RULES)(x, w)
  want = mpolicy.amp(f, BF16, rules=RULES)(x, w)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_an_unknown_format_lists_the_allowed_ones():
  with pytest.raises(ValueError, match="Unknown dtype 'int4'") as e:
    mpolicy.get_policy("p=f32,c=int4,o=f32")
  for name in ("int8", "mxfp8", "nvfp4", "f8", "bf16"):
    assert name in str(e.value)


def test_int8_round_trips_through_its_string():
  policy = mpolicy.get_policy("p=f32,c=int8,o=f32")
  assert str(policy) == "p=f32,c=int8,o=f32"
  assert mpolicy.get_policy(str(policy)) == policy
  assert policy != mpolicy.get_policy("p=f32,c=mxfp8,o=f32")


def test_weights_say_which_values_only_int8_matmuls_read():
  a, b, c = (jnp.ones(2) * i for i in range(3))
  hook = int8_matmul.Weights()
  hook.read(a)
  hook.record(a, a, (0,))  # a: read once, by an int8 matmul.
  hook.read(b)
  hook.read(b)
  hook.record(b, b, (0,))  # b: read twice, once by an int8 matmul.
  hook.read(c)
  hook.record(a, c, (1,))  # c: read by a cast (a) read only by int8.
  assert hook.only_int8(a) == (0,)
  assert hook.only_int8(b) is None
  assert hook.only_int8(jnp.zeros(2)) is None
