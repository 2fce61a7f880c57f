"""Specification of the op-rule table."""

from __future__ import annotations

import jax
import pytest

from mpolicy._src import jax_compat
from mpolicy._src import op_rules
from mpolicy._src.op_rules import DEFAULT_RULES, OpRules


def test_matmul_and_conv_are_lower():
  for name in ("dot_general", "conv_general_dilated"):
    assert DEFAULT_RULES.class_of(name) == "lower"


def test_fragile_ops_and_sums_are_full():
  for name in ("exp", "log", "log1p", "pow", "rsqrt", "erf_inv", "reduce_sum",
               "cumsum", "cumlogsumexp"):
    assert DEFAULT_RULES.class_of(name) == "full", name


def test_combining_ops_are_promote():
  for name in ("concatenate", "select_n", "dynamic_update_slice", "scatter-add"):
    assert DEFAULT_RULES.class_of(name) == "promote", name


def test_exact_ops_are_unlisted():
  for name in ("reduce_max", "add", "mul", "max", "convert_element_type"):
    assert DEFAULT_RULES.class_of(name) is None
    assert DEFAULT_RULES.reason_of(name) is None


def test_every_entry_has_a_reason():
  for name in DEFAULT_RULES:
    assert DEFAULT_RULES.reason_of(name), name


def test_default_names_are_real_primitive_names():
  real = {p.name for module in (jax.lax, jax.lax.linalg)
          for p in vars(module).values()
          if isinstance(p, jax.extend.core.Primitive)}
  missing = set(DEFAULT_RULES) - real - {"ragged_dot_general"}
  assert not missing


def test_with_ops_moves_and_returns_new_table():
  rules = DEFAULT_RULES.with_ops(full=["dot_general"], lower="exp")
  assert rules.class_of("dot_general") == "full"
  assert rules.class_of("exp") == "lower"
  assert rules.reason_of("exp") == "user rule"
  assert DEFAULT_RULES.class_of("dot_general") == "lower"
  assert rules != DEFAULT_RULES and hash(rules) != hash(DEFAULT_RULES)


def test_with_ops_rejects_overlap():
  with pytest.raises(ValueError, match="both as 'lower' and as 'full'"):
    DEFAULT_RULES.with_ops(lower=["exp"], full=["exp"])


def test_with_ops_rejects_non_strings_with_hint():
  with pytest.raises(TypeError, match="'exp'"):
    DEFAULT_RULES.with_ops(full=[jax.lax.exp_p])
  with pytest.raises(TypeError, match="iterable"):
    DEFAULT_RULES.with_ops(full=3)


def test_without_ops_lets_primitive_run_as_inputs():
  assert DEFAULT_RULES.without_ops("exp").class_of("exp") is None


def test_names_and_table_is_immutable():
  assert "dot_general" in DEFAULT_RULES.names(op_rules.LOWER)
  with pytest.raises(TypeError):
    DEFAULT_RULES._table["exp"] = ("lower", "x")  # pylint: disable=protected-access
  with pytest.raises(ValueError):
    DEFAULT_RULES.names("half")
  assert OpRules().class_of("exp") is None


def _exp_in_bf16(policy, x, **params):
  del policy, params
  return jax.lax.exp(x.astype("bfloat16"))


def test_op_rules_deep_copy_and_pickle_round_trip():
  import copy
  import pickle
  from mpolicy._src.op_rules import DEFAULT_RULES
  rules = DEFAULT_RULES.with_ops(full="dot_general").with_rule(
      "tanh", _exp_in_bf16)
  for again in (copy.deepcopy(rules), copy.copy(rules),
                pickle.loads(pickle.dumps(rules))):
    assert again == rules and hash(again) == hash(rules)
    assert again.class_of("dot_general") == "full"
    assert again.rule_of("tanh") is _exp_in_bf16
    with pytest.raises(TypeError):
      again._table["exp"] = ("lower", "")  # Still immutable.
  assert pickle.loads(pickle.dumps(DEFAULT_RULES)) == DEFAULT_RULES


def test_every_primitive_of_the_installed_jax_has_an_entry():
  # A class, a reason it runs in its inputs' dtype, or a higher-order rule:
  # a primitive a newer JAX adds is named here, never run silently.
  missing = [p.name for p in jax_compat.public_primitives()
             if op_rules.entry_of(p) is None]
  assert not missing, (
      f"primitives of JAX {jax.__version__} new to mpolicy: {missing}. Give "
      "each a class or a reason it runs in its inputs' dtype "
      "(mpolicy/_src/rules/classes.py), or a higher-order rule; a name "
      "only some JAX versions define goes on "
      "jax_compat.VERSION_SPECIFIC_PRIMITIVES.")


def test_an_entry_says_how_the_primitive_runs():
  assert op_rules.entry_of(jax.lax.exp_p) == (
      "full: " + DEFAULT_RULES.reason_of("exp"))
  assert op_rules.entry_of(jax.lax.add_p).startswith("inputs: ")
  assert op_rules.entry_of(jax.lax.while_p) == "interpreted"
  toy = jax_compat.new_primitive("toy_unknown_to_mpolicy")
  assert op_rules.entry_of(toy) is None
