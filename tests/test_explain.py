"""Specification of `explain` and `Report`."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest

import mpolicy
from _helpers import all_eqns
from mpolicy._src import jax_compat
from mpolicy._src.explain import explain
from mpolicy._src.explain import Report
from mpolicy._src.amp import amp
from mpolicy._src.amp import full_precision

HALF = "p=f32,c=bf16,o=f32"
X, W = jnp.ones((2, 3)), jnp.ones((3, 4))


def _fn(x, w, *, scale=1.0):
  with jax.named_scope("block"):
    h = x @ w
  with full_precision():
    g = x @ w
  return jnp.exp(h * scale).sum() + g.sum()


def _rows(report, primitive):
  return [r for r in report.rows if r.primitive == primitive]


def test_rows_say_dtype_and_who_decided():
  report = explain(amp(_fn, HALF), X, W, scale=2.0)
  assert isinstance(report, Report)
  lowered, as_written = _rows(report, "dot_general")
  assert lowered.ran_in == "bfloat16" and lowered.rule == "lower"
  assert lowered.scope == "block" and lowered.in_dtypes == ("float32", "float32")
  assert "amp(policy=p=f32,c=bf16,o=f32)" in lowered.decided_by
  assert lowered.casts == 2
  assert as_written.ran_in == "float32" and as_written.rule == "as written"
  assert "full_precision()" in as_written.decided_by
  (exp,) = _rows(report, "exp")
  assert exp.rule == "full" and exp.ran_in == "float32"
  assert exp.in_dtypes == ("bfloat16",)


def test_totals():
  report = explain(amp(_fn, HALF), X, W)
  assert report.casts_inserted == sum(r.casts for r in report.rows) >= 3
  assert report.casts_in_code == 0  # _fn writes no astype.
  per = report.ops_per_dtype
  assert per["bfloat16"] >= 2 and per["float32"] >= 3
  assert sum(per.values()) == len(report.rows)
  assert list(per.values()) == sorted(per.values(), reverse=True)  # Most first.


def test_str_is_a_readable_table():
  text = str(explain(amp(_fn, HALF), X, W))
  first = text.splitlines()[0]
  for col in ("scope", "primitive", "inputs", "ran in", "decided by"):
    assert col in first
  assert "dot_general" in text and "by op rules" in text


# --- summary(): one line, the same in str(report) and the examples -----------


def test_summary_of_amp_exp_on_bfloat16():
  report = explain(amp(jnp.exp), jnp.ones(3, jnp.bfloat16))
  assert report.summary() == (
      "1 op: 1 float32; casts: 1 by op rules, 0 by module policies, 0 in the code")


def test_summary_of_matmul_then_exp():
  f = amp(lambda x, w: jnp.exp(x @ w), HALF)
  assert explain(f, X, W).summary() == (
      "2 ops: 1 bfloat16, 1 float32; "
      "casts: 2 by op rules, 0 by module policies, 0 in the code")


def test_summary_counts_casts_in_the_code_apart():
  f = amp(lambda x, w: jnp.exp(x.astype(jnp.bfloat16) @ w), HALF)
  report = explain(f, X, W)
  # The astype is a row (an op, in bfloat16) and a cast in the code, not
  # one the op rules inserted (they cast only w, for the matmul).
  (astype,) = _rows(report, "convert_element_type")
  assert astype.rule == "explicit cast" and astype.casts == 0
  assert report.casts_in_code == 1 and report.casts_inserted == 1
  assert report.summary() == (
      "3 ops: 2 bfloat16, 1 float32; "
      "casts: 1 by op rules, 0 by module policies, 1 in the code")


def test_summary_of_nothing():
  assert Report(rows=()).summary() == (
      "0 ops; casts: 0 by op rules, 0 by module policies, 0 in the code")


def test_str_ends_with_the_summary_line():
  report = explain(amp(_fn, HALF), X, W)
  assert str(report).splitlines()[-1] == report.summary()
  plain = explain(lambda x: jnp.exp(x.astype(jnp.bfloat16)), X)
  assert plain.note and str(plain).splitlines()[-1] == plain.summary()
  assert plain.note in str(plain)


def test_to_dict_totals_are_the_summary_numbers():
  f = amp(lambda x, w: jnp.exp(x.astype(jnp.bfloat16) @ w), HALF)
  for report in (explain(amp(_fn, HALF), X, W), explain(f, X, W)):
    totals = report.to_dict()["totals"]
    assert totals == {"ops": len(report.rows),
                      "ops_per_dtype": report.ops_per_dtype,
                      "casts_inserted": report.casts_inserted,
                      "casts_by_policies": report.casts_by_policies,
                      "casts_in_code": report.casts_in_code}
    assert sum(totals["ops_per_dtype"].values()) == totals["ops"]
    per = ", ".join(f"{n} {d}" for d, n in totals["ops_per_dtype"].items())
    assert report.summary() == (
        f"{totals['ops']} ops: {per}; casts: {totals['casts_inserted']} "
        f"by op rules, {totals['casts_by_policies']} by module policies, "
        f"{totals['casts_in_code']} in the code")


def test_to_dict_is_plain_data():
  data = explain(amp(_fn, HALF), X, W).to_dict()
  json.dumps(data)
  assert data["totals"]["ops"] == len(data["rows"])
  assert {"scope", "primitive", "in_dtypes", "ran_in", "decided_by"} <= set(
      data["rows"][0])


def test_rows_inside_higher_order_primitives():
  f = amp(lambda x, w: jax.lax.scan(lambda c, _: (jnp.tanh(c @ w @ w.T), None),
                                    x, None, length=2)[0], HALF)
  report = explain(f, X, W)
  assert {r.ran_in for r in _rows(report, "dot_general")} == {"bfloat16"}


def _as_it_runs(fn, *args):
  """(primitive, dtype) of each first-order equation ``fn`` really runs."""
  return [(e.primitive.name, str(e.outvars[0].aval.dtype))
          for e in all_eqns(fn, *args)
          if not jax_compat.jaxprs_in_params(e.params)]


def _plain(x, w):
  return jnp.exp(x.astype(jnp.bfloat16)) @ w.astype(jnp.bfloat16)


def test_a_plain_function_is_reported_as_it_runs():
  report = explain(_plain, X, W)
  assert report.note == "not amp-ed: runs as written"
  assert [(r.primitive, r.ran_in) for r in report.rows] == _as_it_runs(
      _plain, X, W)
  assert _rows(report, "exp")[0].ran_in == "bfloat16"  # No float32 net.
  assert _rows(report, "dot_general")[0].decided_by == report.note
  assert str(report).splitlines()[0].startswith(report.note + ":")
  assert report.summary().startswith(report.note + "; 4 ops: 4 bfloat16;")
  # The same code under amp: the op rules act, and there is no note.
  amped = explain(amp(_plain, HALF), X, W)
  assert _rows(amped, "exp")[0].ran_in == "float32" and amped.note == ""
  assert not str(amped).startswith("not amp-ed")


def test_a_linen_apply_that_is_not_amped_reports_float32():
  nn = pytest.importorskip("flax.linen")
  mpolicy.set_policy(nn.Module, HALF)  # Honoured under amp only.

  model, x = nn.Dense(4), jnp.ones((2, 8))
  variables = model.init(jax.random.PRNGKey(0), x)
  report = explain(model.apply, variables, x)
  assert report.note == "not amp-ed: runs as written"
  assert report.ops_per_dtype == {"float32": 3}  # dot, reshape, add.
  assert report.casts_by_policies == 0
  assert [(r.primitive, r.ran_in) for r in report.rows] == _as_it_runs(
      model.apply, variables, x)
  assert model.apply(variables, x).dtype == jnp.float32
  amped = explain(amp(model.apply), variables, x)
  assert [r.ran_in for r in _rows(amped, "dot_general")] == ["bfloat16"]


def test_haiku_model_with_full_batchnorm_inside_bf16_model():
  import haiku as hk  # pylint: disable=g-import-not-at-top
  import mpolicy  # pylint: disable=g-import-not-at-top
  mpolicy.set_policy(hk.Module, HALF)
  mpolicy.set_policy(hk.BatchNorm, "full")

  def forward(x, is_training):
    x = hk.Linear(8)(x)
    x = hk.BatchNorm(True, True, 0.9)(x, is_training)
    return hk.Linear(2)(jax.nn.relu(x))

  model = mpolicy.transform_amp_with_state(forward)
  x = jnp.ones((4, 3))
  params, state = model.init(jax.random.PRNGKey(0), x, True)
  report = mpolicy.explain(model.apply, params, state, None, x, True)
  assert report.note == ""  # transform_amp's apply is interpreted already.
  dots = _rows(report, "dot_general")
  assert [(r.scope, r.module_class, r.ran_in) for r in dots] == [
      ("linear", "hk.Linear", "bfloat16"), ("linear_1", "hk.Linear", "bfloat16")]
  assert all("default hk.Module" in r.decided_by for r in dots)
  bn = [r for r in report.rows if r.module_class == "hk.BatchNorm"]
  assert bn and {r.ran_in for r in bn} <= {"float32", "int32"}
  (rsqrt,) = _rows(report, "rsqrt")
  assert rsqrt.scope == "batch_norm" and rsqrt.ran_in == "float32"
  ema = [r for r in report.rows if r.module_class == "hk.ExponentialMovingAverage"]
  assert ema and all(r.ran_in in ("float32", "int32") for r in ema)
  text = str(report)
  assert "hk.BatchNorm" in text and "bfloat16" in text
  assert report.to_dict()["totals"]["casts_inserted"] == report.casts_inserted


def test_transform_amp_policy_casts_are_labelled_apart_from_code_casts():
  import haiku as hk
  mpolicy.set_policy(hk.Linear, "p=f32,c=bf16,o=f32")

  def forward(x):
    return jnp.exp(hk.Linear(4)(x)).astype(jnp.bfloat16)

  f = mpolicy.transform_amp(forward)
  x = jnp.ones([2, 3])
  params = f.init(jax.random.PRNGKey(0), x)
  report = explain(f.apply, params, None, x)
  casts = [(r.rule, r.decided_by) for r in report.rows
           if r.primitive == "convert_element_type"]
  assert casts == [
      ("policy cast", "the module's policy casts its inputs"),
      ("policy cast", "the module's policy casts its parameters"),
      ("policy cast", "the module's policy casts its parameters"),
      ("policy cast", "the module's policy casts its outputs"),
      ("explicit cast", "convert_element_type in the traced code")]
  assert (report.casts_by_policies, report.casts_in_code) == (4, 1)
  assert report.summary().endswith(
      "by module policies, 1 in the code")
  assert ", 4 by module policies," in report.summary()


def test_summary_leads_with_the_note_of_a_function_not_run_under_amp():
  plain = explain(lambda x: jnp.exp(x.astype(jnp.bfloat16)), X)
  assert plain.summary() == (
      "not amp-ed: runs as written; 2 ops: 2 bfloat16; casts: 0 by op "
      "rules, 0 by module policies, 1 in the code")
  assert "not amp-ed" not in explain(amp(_fn, HALF), X, W).summary()


def test_a_plain_haiku_apply_that_is_not_amped_reports_float32():
  import haiku as hk
  mpolicy.set_policy(hk.Module, HALF)
  plain = hk.transform(lambda x: hk.Linear(4)(x))
  params = plain.init(jax.random.PRNGKey(0), X)
  report = explain(plain.apply, params, None, X)
  assert report.note == "not amp-ed: runs as written"
  assert set(report.ops_per_dtype) == {"float32"}
  assert explain(amp(plain.apply), params, None, X).ops_per_dtype[
      "bfloat16"] > 0


def _transformer_block(x, wq, wk, wv, wo, w1, w2, scale, n_pos):
  """A pre-norm transformer block; the code writes no cast."""
  def norm(h):
    mean = jnp.mean(h, axis=-1, keepdims=True)
    var = jnp.var(h, axis=-1, keepdims=True)
    return (h - mean) * jax.lax.rsqrt(var + 1e-5) * scale
  h = norm(x)
  q, k, v = h @ wq, h @ wk, h @ wv
  scores = jnp.einsum("td,sd->ts", q, k) / jnp.sqrt(q.shape[-1])
  mask = jnp.tril(jnp.ones((x.shape[0], x.shape[0]), bool))
  scores = jnp.where(mask, scores, -1e9) + jnp.arange(n_pos)[:, None] / n_pos
  x = x + jax.nn.softmax(scores, axis=-1) @ v @ wo
  h = jax.nn.gelu(norm(x) @ w1)
  return jnp.mean(jnp.square(x + h @ w2)) + jnp.std(x)


def _block_args():
  keys = jax.random.split(jax.random.PRNGKey(0), 7)
  d = 8
  x = jax.random.normal(keys[0], (6, d))
  ws = [jax.random.normal(k, (d, d)) / 3 for k in keys[1:5]]
  w1 = jax.random.normal(keys[5], (d, 4 * d)) / 3
  w2 = jax.random.normal(keys[6], (4 * d, d)) / 6
  return (x, *ws, w1, w2, jnp.ones(d))


def test_casts_in_the_code_counts_only_casts_the_code_wrote():
  args = _block_args()
  for policy in (None, HALF):
    for fn in (_transformer_block, jax.grad(_transformer_block)):
      report = explain(amp(fn, policy), *args, 6)
      jax_casts = [r for r in report.rows if r.rule == "jax cast"]
      assert report.casts_in_code == 0, [
          r for r in report.rows if r.rule == "explicit cast"]
      assert jax_casts and all(r.casts == 0 for r in jax_casts)
      assert "in the code" not in jax_casts[0].decided_by

  def with_one_cast(x, *rest):
    return _transformer_block(x.astype(jnp.bfloat16).astype(jnp.float32),
                              *rest)
  report = explain(amp(with_one_cast, HALF), *args, 6)
  assert report.casts_in_code == 2


@pytest.mark.parametrize("name", ["explain", "fp8_stats"])
def test_a_function_that_is_not_callable_is_refused_by_name(name):
  """``explain(3)`` names the argument and what it must be, rather than
  failing inside the trace with "'int' object is not callable"."""
  with pytest.raises(TypeError, match=rf"{name}: fn must be a callable \("
                     r".*amp-ed.*\), got 3 \(int\)"):
    getattr(mpolicy, name)(3)


def test_a_jitted_amp_function_that_already_ran_is_explained_as_amped():
  f = jax.jit(amp(lambda x, w: jnp.exp(x @ w), HALF))
  f(X, W)  # jit's cache now holds the interpreted program.
  report = explain(f, X, W)
  assert report.note == ""
  assert [(r.primitive, r.ran_in) for r in report.rows] == [
      ("dot_general", "bfloat16"), ("exp", "float32")]
  assert f(X, W).dtype == jnp.float32  # Later calls run as before.
