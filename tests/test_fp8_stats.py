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


def test_without_a_float8_policy_the_report_is_empty_and_says_why():
  report = mpolicy.fp8_stats(mpolicy.amp(lambda x: x @ x, "p=f32,c=bf16,o=f32"),
                             jnp.ones((2, 2)))
  assert report.rows == ()
  assert "no float8 op ran" in report.note and "no float8 op ran" in str(report)
