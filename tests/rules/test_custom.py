"""Custom rule functions (`OpRules.with_rule`) and strict primitive names."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpolicy
from mpolicy._src import op_rules
from mpolicy._src.op_rules import DEFAULT_RULES

from _helpers import all_eqns, multiplies_in

HALF = "p=f32,c=bf16,o=f32"
X = jnp.linspace(-2.0, 2.0, 12, dtype=jnp.float32).reshape(3, 4)
W = jnp.linspace(-1.0, 1.0, 20, dtype=jnp.float32).reshape(4, 5)


def exp_in_bf16(policy, x, **params):
  del policy, params
  return jax.lax.exp(x.astype(jnp.bfloat16))


def dot_in_f32(policy, lhs, rhs, *, dimension_numbers, precision,
               preferred_element_type, **params):
  del policy, precision, preferred_element_type, params
  return jax.lax.dot_general(lhs.astype(jnp.float32), rhs.astype(jnp.float32),
                             dimension_numbers,
                             precision=jax.lax.Precision.HIGHEST)


# --- exp in bf16 --------------------------------------------------------------


def test_rule_runs_exp_in_bf16_even_under_full_policy():
  rules = DEFAULT_RULES.with_rule("exp", exp_in_bf16)
  f = mpolicy.amp(lambda x: jnp.exp(x) * 2, "full", rules=rules)
  exps = [e for e in all_eqns(f, X) if e.primitive.name == "exp"]
  assert [str(e.invars[0].aval.dtype) for e in exps] == ["bfloat16"]
  out = f(X)
  # Output cast to the policy's float32, values those of a bf16 exp.
  assert out.dtype == jnp.float32
  want = (jnp.exp(X.astype(jnp.bfloat16)) * 2).astype(jnp.float32)
  np.testing.assert_array_equal(out, want)
  # And not the float32 exp: the rule really ran.
  assert not np.array_equal(out, jnp.exp(X) * 2)


def test_rule_holds_under_jit_and_grad():
  rules = DEFAULT_RULES.with_rule("exp", exp_in_bf16)
  f = mpolicy.amp(lambda x: jnp.sum(jnp.exp(x)), HALF, rules=rules)
  g = jax.jit(jax.grad(f))
  grad = g(X)
  assert grad.dtype == jnp.float32
  np.testing.assert_allclose(grad, jnp.exp(X), rtol=2e-2)
  exps = [e for e in all_eqns(jax.grad(f), X) if e.primitive.name == "exp"]
  assert exps and all(e.invars[0].aval.dtype == jnp.bfloat16 for e in exps)


def test_rule_holds_under_vmap_and_inside_nested_jit_and_cond():
  rules = DEFAULT_RULES.with_rule("exp", exp_in_bf16)

  def fn(x):
    inner = jax.jit(lambda c: jnp.exp(c) * 0.1)
    return jax.lax.cond(jnp.sum(x) > -100.0, inner, jnp.sin, x)

  f = mpolicy.amp(fn, "full", rules=rules)
  xs = jnp.stack([X, -X])
  got = jax.jit(jax.vmap(f))(xs)
  want = jax.vmap(lambda x: fn(x.astype(jnp.bfloat16)))(xs).astype(jnp.float32)
  np.testing.assert_allclose(got, want, rtol=1e-2)
  exps = [e for e in all_eqns(jax.vmap(f), xs) if e.primitive.name == "exp"]
  assert exps and all(e.invars[0].aval.dtype == jnp.bfloat16 for e in exps)


# --- dot_general in float32 regardless of policy ------------------------------


def test_rule_runs_dot_general_in_float32_under_half_policy():
  rules = DEFAULT_RULES.with_rule("dot_general", dot_in_f32)
  f = mpolicy.amp(lambda x, w: x @ w, HALF, rules=rules)
  dots = [e for e in all_eqns(f, X, W) if "dot_general" in e.primitive.name]
  assert [multiplies_in(e) for e in dots] == [(np.float32, np.float32)]
  np.testing.assert_array_equal(
      jax.jit(f)(X, W), jnp.dot(X, W, precision=jax.lax.Precision.HIGHEST))
  # The default rules would have run it in bf16.
  plain = mpolicy.amp(lambda x, w: x @ w, HALF)
  assert [multiplies_in(e) for e in all_eqns(plain, X, W)
          if "dot_general" in e.primitive.name] == [(jnp.bfloat16,) * 2]


def test_dot_rule_gives_float32_grads_and_sees_the_policy():
  seen = []

  def spy(policy, *args, **params):
    seen.append(policy)
    return dot_in_f32(policy, *args, **params)

  rules = DEFAULT_RULES.with_rule("dot_general", spy)
  loss = mpolicy.amp(lambda x, w: jnp.sum(jnp.tanh(x @ w)), HALF, rules=rules)
  gx, gw = jax.jit(jax.grad(loss, argnums=(0, 1)))(X, W)
  want = jax.grad(lambda x, w: jnp.sum(jnp.tanh(
      jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST))), argnums=(0, 1))(X, W)
  np.testing.assert_allclose(gx, want[0], rtol=1e-5)
  np.testing.assert_allclose(gw, want[1], rtol=1e-5)
  grad_dots = [e for e in all_eqns(jax.grad(loss), X, W)
               if "dot_general" in e.primitive.name]
  assert grad_dots and all(multiplies_in(e) == (np.float32, np.float32)
                           for e in grad_dots)
  assert seen and str(seen[0]) == "p=f32,c=bf16,o=f32"


def test_policy_is_none_where_none_governs():
  seen = []

  def spy(policy, x, **params):
    seen.append(policy)
    return jax.lax.exp_p.bind(x, **params)

  mpolicy.amp(jnp.exp, rules=DEFAULT_RULES.with_rule("exp", spy))(X)
  assert seen == [None]


def test_rule_does_not_run_inside_full_precision():
  calls = []

  def spy(policy, x, **params):
    calls.append(1)
    return exp_in_bf16(policy, x, **params)

  def fn(x):
    with mpolicy.full_precision():
      return jnp.exp(x)

  f = mpolicy.amp(fn, HALF, rules=DEFAULT_RULES.with_rule("exp", spy))
  np.testing.assert_array_equal(f(X), jnp.exp(X))
  assert not calls


def test_rule_on_a_multiple_results_primitive():
  def split_in_half(policy, x, *, sizes, axis):
    del policy
    return [p.astype(jnp.bfloat16) for p in jnp.split(x, [sizes[0]], axis)]

  rules = DEFAULT_RULES.with_rule("split", split_in_half)

  def fn(x):
    a, b = jax.lax.split(x, (1, 3), axis=1)
    return jnp.concatenate([b, a], axis=1)

  f = mpolicy.amp(fn, rules=rules)
  (cat,) = [e for e in all_eqns(f, X) if e.primitive.name == "concatenate"]
  assert [(v.aval.dtype, v.aval.shape) for v in cat.invars] == [
      (jnp.bfloat16, (3, 3)), (jnp.bfloat16, (3, 1))]
  np.testing.assert_array_equal(
      f(X), fn(X.astype(jnp.bfloat16)).astype(jnp.float32))


# --- explain names it ----------------------------------------------------------


def test_explain_names_the_rule_function():
  rules = DEFAULT_RULES.with_rule("exp", exp_in_bf16)
  report = mpolicy.explain(mpolicy.amp(lambda x: jnp.exp(x @ W), HALF,
                                       rules=rules), X)
  (row,) = [r for r in report.rows if r.primitive == "exp"]
  assert row.rule == "custom" and row.ran_in == "bfloat16"
  assert "test_custom.exp_in_bf16" in row.decided_by
  assert "amp(policy=p=f32,c=bf16,o=f32)" in row.decided_by
  assert report.custom_rules == {"exp": "test_custom.exp_in_bf16"}
  assert "test_custom.exp_in_bf16" in str(report)
  assert rules.reason_of("exp") == "custom rule test_custom.exp_in_bf16"


def test_explain_names_partials_and_methods():
  class Rules:

    def exp(self, policy, x, **params):
      return exp_in_bf16(policy, x, **params)

  assert op_rules.rule_name(Rules().exp).endswith(
      "test_explain_names_partials_and_methods.<locals>.Rules.exp")
  part = functools.partial(dot_in_f32)
  assert op_rules.rule_name(part) == "partial(test_custom.dot_in_f32)"


# --- precedence ---------------------------------------------------------------


def test_with_ops_after_with_rule_wins():
  rules = DEFAULT_RULES.with_rule("exp", exp_in_bf16).with_ops(full="exp")
  assert rules.rule_of("exp") is None and rules.class_of("exp") == "full"
  f = mpolicy.amp(jnp.exp, HALF, rules=rules)
  assert [str(e.invars[0].aval.dtype) for e in all_eqns(f, X)
          if e.primitive.name == "exp"] == ["float32"]


def test_with_rule_after_with_ops_wins():
  rules = DEFAULT_RULES.with_ops(lower="exp").with_rule("exp", exp_in_bf16)
  assert rules.rule_of("exp") is exp_in_bf16 and rules.class_of("exp") is None
  assert "exp" in rules and "exp" in rules.custom
  f = mpolicy.amp(jnp.exp, "full", rules=rules)
  assert [str(e.invars[0].aval.dtype) for e in all_eqns(f, X)
          if e.primitive.name == "exp"] == ["bfloat16"]


def test_without_ops_drops_a_rule_and_tables_compare():
  rules = DEFAULT_RULES.with_rule("exp", exp_in_bf16)
  assert rules.without_ops("exp").rule_of("exp") is None
  assert rules == DEFAULT_RULES.with_rule("exp", exp_in_bf16)
  assert rules != DEFAULT_RULES and hash(rules) == hash(
      DEFAULT_RULES.with_rule("exp", exp_in_bf16))
  assert "custom={'exp': test_custom.exp_in_bf16}" in repr(rules)
  assert DEFAULT_RULES.rule_of("exp") is None


# --- errors -------------------------------------------------------------------


def test_non_callable_rule_is_an_error():
  with pytest.raises(TypeError, match=r"fn must be callable.*got 3"):
    DEFAULT_RULES.with_rule("exp", 3)


def test_with_rule_rejects_bad_names():
  with pytest.raises(ValueError, match=r"unknown primitive name 'exq'.*'exp'"):
    DEFAULT_RULES.with_rule("exq", exp_in_bf16)
  with pytest.raises(TypeError, match=r"use 'exp'"):
    DEFAULT_RULES.with_rule(jax.lax.exp_p, exp_in_bf16)
  with pytest.raises(ValueError, match="higher-order primitive"):
    DEFAULT_RULES.with_rule("scan", exp_in_bf16)
  assert DEFAULT_RULES.with_rule("my_op", exp_in_bf16,
                                 strict=False).rule_of("my_op") is exp_in_bf16


def test_with_ops_rejects_typos_with_close_matches():
  with pytest.raises(ValueError) as info:
    DEFAULT_RULES.with_ops(full=["reduce_summ"])
  msg = str(info.value)
  assert "with_ops(full=...)" in msg and "'reduce_summ'" in msg
  assert "'reduce_sum'" in msg and "strict=False" in msg
  with pytest.raises(ValueError, match="no primitive has a similar name"):
    DEFAULT_RULES.with_ops(lower="zzzzqqq")
  with pytest.raises(ValueError, match="'dot_general'"):
    DEFAULT_RULES.without_ops("dot_generl")
  assert DEFAULT_RULES.with_ops(lower="mine", strict=False).class_of(
      "mine") == "lower"


def test_known_names_cover_jax_lax_and_amp_primitives():
  known = op_rules.known_primitive_names()
  lax_prims = {p.name for module in (jax.lax, jax.lax.linalg)
               for p in vars(module).values()
               if isinstance(p, jax.extend.core.Primitive)}
  assert lax_prims <= known
  assert {"psum", "amp_dot_general", "amp_conv_general_dilated",
          "random_bits", "custom_jvp_call"} <= known
  assert set(DEFAULT_RULES) <= known
  # Every with_ops keyword of every known name is accepted.
  DEFAULT_RULES.with_ops(promote=sorted(known - set(DEFAULT_RULES)))


def _amp_exp(rule):
  return mpolicy.amp(jnp.exp, HALF, rules=DEFAULT_RULES.with_rule("exp", rule))


def test_rule_outputs_are_validated():
  with pytest.raises(TypeError, match=r"one result, so the rule must return "
                     r"one array"):
    _amp_exp(lambda p, x, **k: (jnp.exp(x),))(X)
  with pytest.raises(ValueError, match=r"output 0 has shape \(4, 3\), the "
                     r"primitive's has \(3, 4\)"):
    _amp_exp(lambda p, x, **k: jnp.exp(x).T)(X)
  with pytest.raises(TypeError, match="output 0 is float, not an array"):
    _amp_exp(lambda p, x, **k: 1.0)(X)
  split = mpolicy.amp(lambda x: jax.lax.split(x, (1, 3), axis=1),
                      rules=DEFAULT_RULES.with_rule(
                          "split", lambda p, x, **k: x, strict=False))
  with pytest.raises(TypeError, match="has 2 results"):
    split(X)
  split = mpolicy.amp(lambda x: jax.lax.split(x, (1, 3), axis=1),
                      rules=DEFAULT_RULES.with_rule(
                          "split", lambda p, x, **k: [x], strict=False))
  with pytest.raises(ValueError, match="returned 1 outputs; the primitive has 2"):
    split(X)
