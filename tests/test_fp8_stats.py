"""`fp8_stats`: what float8 quantization loses, per op and role."""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpolicy
from _helpers import all_eqns

F8 = "p=f32,c=f8,o=f32"


def test_counts_underflow_saturation_and_scales_by_role():
  f = mpolicy.amp(lambda x, w: jnp.sum(x @ w), F8)
  x = jnp.array([[1.0, 1e-9, 0.0, 0.5], [4.0, 2.0, 1e-7, 3.0]])
  w = jnp.full((4, 3), 0.25).at[0, 0].set(2.0)
  (row,) = mpolicy.fp8_stats(f, x, w).rows
  lhs, rhs, ct = (row.counts[r] for r in ("lhs", "rhs", "cotangent"))
  assert (row.primitive, row.shapes) == ("dot_general", "2x4, 4x3")
  # lhs: per-row scales amax/448: 1/448 and 4/448; 1e-9 and 1e-7 vanish.
  assert (lhs.values, lhs.nonzero, lhs.underflow, lhs.saturated) == (8, 7, 2, 0)
  np.testing.assert_allclose([lhs.scale_min, lhs.scale_max],
                             [1 / 448, 4 / 448], rtol=1e-6)
  assert row.underflow("lhs") == pytest.approx(2 / 7)
  # rhs: one scale 2/448, no value lost.
  assert (rhs.values, rhs.underflow, rhs.saturated) == (12, 0, 0)
  np.testing.assert_allclose([rhs.scale_min, rhs.scale_max], [2 / 448] * 2,
                             rtol=1e-6)
  # The cotangent of sum(x @ w) is all ones: e5m2's scale 1/57344.
  assert (ct.values, ct.nonzero, ct.underflow, ct.calls) == (6, 6, 0, 1)
  np.testing.assert_allclose(ct.scale_max, 1 / 57344, rtol=1e-6)


def test_non_finite_values_count_as_saturated():
  f = mpolicy.amp(lambda x, w: x @ w, F8)
  x = jnp.array([[1.0, jnp.inf], [1.0, 2.0]])
  (row,) = mpolicy.fp8_stats(f, x, jnp.ones((2, 2))).rows
  assert row.counts["lhs"].saturated == 1  # The inf.


@pytest.mark.ci  # A transformer's fp8 statistics, 7 s on 2 cores.
def test_a_haiku_model_reports_each_linear_with_its_scope():
  mpolicy.set_policy(hk.Module, F8)

  def forward(x):
    return jnp.sum(hk.nets.MLP([16, 4], name="mlp")(x))

  model = mpolicy.transform_amp(forward)
  x = jax.random.normal(jax.random.PRNGKey(0), (8, 12))
  params = model.init(jax.random.PRNGKey(1), x)
  report = mpolicy.fp8_stats(model.apply, params, None, x)
  assert [(r.scope, r.shapes) for r in report.rows] == [
      ("mlp/linear_0", "8x12, 12x16"), ("mlp/linear_1", "8x16, 16x4")]
  # Gradients reach both layers' cotangents.
  assert all(r.counts["cotangent"].values > 0 for r in report.rows)
  text = str(report)
  assert "mlp/linear_0" in text and "cotangent" in text
  assert text.endswith("2 float8 ops")
  assert report.to_dict()["rows"][0]["counts"]["lhs"]["values"] == 8 * 12


def test_counts_add_up_over_the_calls_of_an_op_in_a_loop():
  def f(x, w):
    def body(c, _):
      return jnp.tanh(c @ w), None
    return jnp.sum(jax.lax.scan(body, x, None, length=3)[0])

  (row,) = mpolicy.fp8_stats(mpolicy.amp(f, F8), jnp.ones((2, 4)),
                             jnp.eye(4)).rows
  assert row.counts["lhs"].calls == 3 and row.counts["lhs"].values == 24
  assert row.counts["cotangent"].calls == 3


def test_the_probe_leaves_later_calls_without_callbacks():
  f = jax.jit(mpolicy.amp(lambda x, w: x @ w, F8))
  x, w = jnp.ones((2, 4)), jnp.ones((4, 3))
  before = f(x, w)  # Compiled without the probe.
  report = mpolicy.fp8_stats(f, x, w)
  assert len(report.rows) == 1  # The cached program was not reused.
  after = f(x, w)
  np.testing.assert_array_equal(np.asarray(before), np.asarray(after))
  assert not any("callback" in e.primitive.name for e in all_eqns(f, x, w))
  again = mpolicy.fp8_stats(f, x, w)  # Counted anew, not into the first.
  assert again.rows[0].counts["lhs"].calls == 1
  assert report.rows[0].counts["lhs"].calls == 1


def test_without_a_float8_policy_the_report_is_empty_and_says_why():
  report = mpolicy.fp8_stats(mpolicy.amp(lambda x: x @ x, "p=f32,c=bf16,o=f32"),
                             jnp.ones((2, 2)))
  assert report.rows == ()
  assert "no float8 op ran" in report.note and "no float8 op ran" in str(report)


def test_float8_counts_by_format():
  f = mpolicy.amp(lambda x, w: jnp.sum(x @ w), F8)
  x = jnp.array([[1.0, 1e-9], [2.0, 3.0]])
  report = mpolicy.fp8_stats(f, x, jnp.ones((2, 3)))
  formats = report.by_format()
  assert list(formats) == ["float8_e4m3fn", "float8_e5m2"]
  forward, backward = formats.values()
  assert (forward.values, forward.underflow, forward.calls) == (10, 1, 2)
  assert (backward.values, backward.underflow, backward.calls) == (6, 0, 1)
  assert [report.rows[0].counts[r].format for r in ("lhs", "cotangent")] == [
      "float8_e4m3fn", "float8_e5m2"]
  assert "float8_e5m2" in str(report) and str(report).endswith("1 float8 op")


_NO_RECIPE = mpolicy.DEFAULT_RULES.with_fp8(stochastic_rounding=False,
                                            hadamard=False)


def _block_counts(fmt, x, rules=_NO_RECIPE):
  """`(values, nonzero, underflow, saturated, calls, scale range)` by role
  of ``sum(x @ ones)`` under ``c=fmt`` (the NVFP4 recipe's rounding and
  rotation off unless ``rules`` says), and the report."""
  f = mpolicy.amp(lambda x, w: jnp.sum(x @ w), f"p=f32,c={fmt},o=f32",
                  rules=rules)
  report = mpolicy.fp8_stats(f, x, jnp.ones((32, 1)))
  (row,) = report.rows
  return {role: (c.values, c.nonzero, c.underflow, c.saturated, c.calls,
                 (c.scale_min, c.scale_max))
          for role, c in row.counts.items()}, report


def test_mxfp4_counts_what_its_block_scale_pushes_below_its_smallest_value():
  # One block of 32: amax 64, scale 2**ceil(log2(64 / 6)) = 16. Each 1
  # becomes 1/16, below float4_e2m1's smallest step (0.5): 31 underflow.
  counts, report = _block_counts("mxfp4", jnp.ones((1, 32)).at[0, 0].set(64.))
  assert counts["lhs"] == (32, 32, 31, 0, 1, (16.0, 16.0))
  assert counts["rhs"] == (32, 32, 0, 0, 1, (0.25, 0.25))  # Ones: 2**-2.
  # The cotangent (1 x 1) is quantized once per backward matmul.
  assert counts["cotangent"] == (2, 2, 0, 0, 2, (0.25, 0.25))
  # With the recipe's Hadamard rotation the weight gradient's cotangent is
  # quantized rotated: its one row spread over 16 (M padded to 16).
  recipe, _ = _block_counts("mxfp4", jnp.ones((1, 32)).at[0, 0].set(64.),
                            mpolicy.DEFAULT_RULES)
  assert recipe["cotangent"][:2] == (1 + 16, 1 + 16)
  assert list(report.by_format()) == ["mxfp4"]
  assert report.by_format()["mxfp4"].underflow == 31
  assert str(report).endswith("1 quantized op")


def test_nvfp4_counts_a_value_clamped_by_its_rounded_down_block_scale():
  # Tensor scale 2688 / (448 * 6) = 1. Block 0 (amax 2688): scale 448,
  # exact; its fifteen 1s become 1/448: underflow. Block 1 (amax 299):
  # 299 / 6 = 49.8 rounds to 48 in float8_e4m3fn, so 299 / 48 = 6.23 is
  # clamped to 6: saturated; its fifteen 1s (1/48) underflow.
  x = jnp.ones((1, 32)).at[0, 0].set(2688.).at[0, 16].set(299.)
  counts, _ = _block_counts("nvfp4", x)
  assert counts["lhs"] == (32, 32, 30, 1, 1, (48.0, 448.0))


def test_mxfp8_counts_a_non_finite_value_as_saturated():
  # The inf's block goes non-finite: its other values are lost with it
  # (underflow, as float8 counts them); the zero is not counted.
  x = jnp.ones((1, 32)).at[0, 0].set(jnp.inf).at[0, 3].set(0.)
  counts, _ = _block_counts("mxfp8", x)
  assert counts["lhs"][:5] == (32, 31, 30, 1, 1)
  assert counts["rhs"] == (32, 32, 0, 0, 1, (2. ** -8, 2. ** -8))
