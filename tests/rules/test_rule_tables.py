"""Per-primitive facts keyed by primitive object, and the class rules."""

import dataclasses
import importlib
import pkgutil
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpolicy
from mpolicy._src import dtypes
from mpolicy._src import jax_compat
from mpolicy._src import op_rules
from mpolicy._src import rules as rules_pkg
from mpolicy._src.jax_compat import internals as jax_internals
from mpolicy._src.rules import base
from mpolicy._src.rules import classes
from mpolicy._src.rules import facts
from _helpers import recorded_rows
from _helpers import all_eqns, walk_eqns

HALF = "p=f32,c=bf16,o=f32"


@pytest.fixture
def patched_facts(monkeypatch):
  """Changes one primitive's facts for one test."""
  def patch(prim, **changes):
    monkeypatch.setitem(facts._FACTS, prim,  # pylint: disable=protected-access
                        dataclasses.replace(facts.of(prim), **changes))
  return patch


def test_class_table_has_one_rule_per_class():
  assert set(classes.CLASS_RULES) == {*op_rules.CLASSES, None, base.AS_WRITTEN}


def test_facts_are_keyed_by_primitive_object():
  assert facts.of(jax_compat.convert_element_type_p).special is not None
  assert facts.of(jax_compat.bitcast_convert_type_p).special is not None
  assert all(hasattr(p, "bind")
             for p in facts._FACTS)  # pylint: disable=protected-access
  assert facts.of(jax.lax.exp_p).elementwise
  assert facts.of(jax.lax.add_p).broadcasts
  assert facts.of(jax.lax.reshape_p).keeps_param
  assert facts.of(jax.lax.dot_general_p).lower is not None


def test_default_rules_are_the_registered_classes():
  table = facts.default_table()
  assert op_rules.DEFAULT_RULES == op_rules.OpRules(table)
  assert table["dot_general"][0] == "lower"
  assert table["exp"][0] == "full" and table["concatenate"][0] == "promote"


def test_register_checks_its_input():
  with pytest.raises(TypeError, match="unknown facts.*elementwsie"):
    facts.register(jax.lax.exp_p, elementwsie=True)
  with pytest.raises(ValueError, match="op_class must be one of"):
    facts.register(jax.lax.exp_p, op_class="fp32")
  with pytest.raises(ValueError, match="needs a reason"):
    facts.register(jax.lax.tanh_p, op_class="full")
  assert facts.of(jax.lax.tanh_p).op_class is None  # Nothing was kept.


def _my_exp_primitive():
  """A primitive of the user's: exp, as its own primitive."""
  my_exp_p = jax_compat.new_primitive("my_test_exp")
  my_exp_p.def_impl(jnp.exp)
  my_exp_p.def_abstract_eval(lambda x: x)
  jax_compat.define_lowering(my_exp_p, jnp.exp)
  return my_exp_p


def test_adding_an_elementwise_float32_op_is_one_line():
  my_exp_p = _my_exp_primitive()
  g = lambda x: my_exp_p.bind(x * 2)
  f = mpolicy.amp(g, "p=f32,c=bf16,o=bf16")
  x = jnp.ones(4, jnp.bfloat16)
  (eqn,) = [e for e in all_eqns(f, x) if e.primitive is my_exp_p]
  assert eqn.invars[0].aval.dtype == jnp.bfloat16  # Unknown: runs as given.
  try:
    facts.register(my_exp_p, op_class=facts.FULL, elementwise=True,
                   reason="my exp overflows half")  # The one line.
    assert op_rules.default_rules().class_of("my_test_exp") == "full"
    f = mpolicy.amp(g, "p=f32,c=bf16,o=bf16")  # Takes the rules in force.
    (row,) = [r for r in _rows(f, x) if r.primitive == "my_test_exp"]
    assert row.decided_by.startswith("full: my exp overflows half")
    (eqn,) = [e for e in all_eqns(f, x) if e.primitive is my_exp_p]
    assert eqn.invars[0].aval.dtype == jnp.float32  # Computed in float32,
    assert f(x).dtype == jnp.bfloat16  # stored in bfloat16 (element-wise);
    np.testing.assert_allclose(np.asarray(f(x), np.float32),
                               np.exp(2.0), rtol=1e-2)
  finally:
    facts.unregister(my_exp_p)
  assert op_rules.default_rules() == op_rules.DEFAULT_RULES
  assert "my_test_exp" not in op_rules.DEFAULT_RULES


def _rows(fn, *args):
  with recorded_rows() as rows:
    jax.make_jaxpr(fn)(*args)
  return rows


def test_a_special_rule_registered_for_a_primitive_runs(patched_facts):
  calls = []

  def neg_in_f32(op):
    calls.append(op.prim.name)
    op.rule, op.why = "special", "test rule"
    op.args = [op.env.cast(op.args[0], jnp.float32)]
    return base.bind(op.eqn, op.args)

  patched_facts(jax.lax.neg_p, special=neg_in_f32)
  f = mpolicy.amp(lambda x: -x)
  x = jnp.ones(3, jnp.bfloat16)
  (row,) = [r for r in _rows(f, x) if r.primitive == "neg"]
  (neg,) = [e for e in walk_eqns(jax.make_jaxpr(f)(x))
            if e.primitive.name == "neg"]
  assert neg.invars[0].aval.dtype == jnp.float32  # The rule ran neg in f32;
  assert f(x).dtype == jnp.bfloat16  # the output keeps f's own dtype.
  assert (row.rule, row.decided_by, row.ran_in) == (
      "special", "test rule", "float32")
  assert "neg" in calls


def test_a_special_rule_that_declines_falls_through_to_the_class(
    patched_facts):
  patched_facts(jax.lax.exp_p, special=lambda op: None)
  x = jnp.ones(3, jnp.bfloat16)
  (row,) = [r for r in _rows(mpolicy.amp(jnp.exp), x)
            if r.primitive == "exp"]
  assert (row.rule, row.ran_in) == ("full", "float32")


def test_a_class_rule_replaced_in_the_table_is_used(monkeypatch):
  seen = []

  def promote_spy(op):
    seen.append(op.prim.name)
    return classes.CLASS_RULES[None](op)

  monkeypatch.setitem(classes.CLASS_RULES, op_rules.PROMOTE, promote_spy)
  f = mpolicy.amp(lambda a, b: jnp.concatenate([a, b]))
  out = f(jnp.ones(2, jnp.bfloat16), jnp.ones(2, jnp.float32))
  assert seen == ["concatenate"]
  assert out.shape == (4,)


def test_full_precision_uses_the_as_written_rule():
  def f(x, w):
    with mpolicy.full_precision():
      return jnp.exp(x @ w)

  rows = _rows(mpolicy.amp(f, HALF), jnp.ones((2, 3)), jnp.ones((3, 2)))
  body = [r for r in rows if r.primitive in ("dot_general", "exp")]
  assert [(r.rule, r.ran_in) for r in body] == [
      ("as written", "float32"), ("as written", "float32")]


def test_broadcast_of_a_down_cast_value_declines_inside_full_precision():
  """The wider-source rule is special; inside full_precision it declines."""

  def f(b, x):
    b16 = b.astype(jnp.bfloat16)
    with mpolicy.full_precision():
      return x + jnp.broadcast_to(b16, x.shape)

  rows = _rows(mpolicy.amp(f), jnp.ones(3), jnp.ones((2, 3), jnp.bfloat16))
  (bcast,) = [r for r in rows if r.primitive == "broadcast_in_dim"]
  assert bcast.rule == "as written"
  assert bcast.in_dtypes == ("bfloat16",) and bcast.ran_in == "bfloat16"

  rows = _rows(mpolicy.amp(lambda b, x: x + jnp.broadcast_to(
      b.astype(jnp.bfloat16), x.shape)), jnp.ones(3),
               jnp.ones((2, 3), jnp.bfloat16))
  (bcast,) = [r for r in rows if r.primitive == "broadcast_in_dim"]
  assert "down-cast value" in bcast.decided_by


# --- dtype helpers ------------------------------------------------------------


@pytest.mark.parametrize("a,b,want", [
    (jnp.bfloat16, jnp.float16, jnp.float32),
    (jnp.bfloat16, jnp.float32, jnp.float32),
    (jnp.float16, jnp.float16, jnp.float16),
])
def test_widest_is_jax_promotion(a, b, want):
  assert dtypes.widest([a, b]) == np.dtype(want)
  assert dtypes.widest([a, b]) == jnp.promote_types(a, b)


def test_dtype_predicates():
  assert dtypes.is_half(jnp.bfloat16) and dtypes.is_half(jnp.float8_e4m3fn)
  assert not dtypes.is_half(jnp.float32) and not dtypes.is_half(jnp.int8)
  assert dtypes.is_double(np.float64) and not dtypes.is_double(jnp.float32)
  assert not dtypes.is_float(None) and not dtypes.is_float(jnp.int32)
  assert dtypes.float_value(1.5) and not dtypes.float_value(3)
  key = jax.random.key(0)
  assert not dtypes.float_value(key)  # Typed PRNG keys are not floating.
  assert dtypes.is_traced(jnp.ones(2)) and not dtypes.is_traced(np.ones(2))


def test_ragged_dot_general_accumulates_in_float32():
  gs = jnp.array([3, 5], jnp.int32)
  f = lambda x, w: jax.lax.ragged_dot(x, w, gs)
  x = jax.random.normal(jax.random.PRNGKey(0), (8, 16))
  w = jax.random.normal(jax.random.PRNGKey(1), (2, 16, 4))
  g = mpolicy.amp(f, "p=f32,c=bf16,o=f32")
  (row,) = [r for r in _rows(g, x, w) if r.primitive == "ragged_dot_general"]
  assert row.rule == "lower" and "backward products float32 x half" in (
      row.decided_by)
  (eqn,) = [e for e in all_eqns(g, x, w)
            if e.primitive.name == "ragged_dot_general"]
  assert [v.aval.dtype for v in eqn.invars[:2]] == [jnp.bfloat16] * 2
  assert eqn.outvars[0].aval.dtype == jnp.float32  # Accumulated in float32.
  want = f(x, w)
  np.testing.assert_allclose(g(x, w), want, rtol=0.05, atol=0.05)
  grads = jax.grad(lambda x, w: jnp.sum(g(x, w) ** 2), (0, 1))(x, w)
  want_grads = jax.grad(lambda x, w: jnp.sum(f(x, w) ** 2), (0, 1))(x, w)
  for got, ref in zip(grads, want_grads):
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, ref, rtol=0.05, atol=0.3)


# --- Every primitive name registered exists -------------------------------------


def _installed_jax() -> tuple[int, ...]:
  return tuple(int(p) for p in re.findall(r"\d+", jax.__version__)[:3])


def _defined_here(first, stop) -> bool:
  return ((first is None or _installed_jax() >= first)
          and (stop is None or _installed_jax() < stop))


def test_every_primitive_name_looked_up_exists_in_the_installed_jax():
  for info in pkgutil.iter_modules(rules_pkg.__path__):
    importlib.import_module(f"{rules_pkg.__name__}.{info.name}")
  # Names only some JAX versions define are listed, with those versions;
  # everything else that a registration or lookup names must exist.
  listed = jax_compat.VERSION_SPECIFIC_PRIMITIVES
  expected = {name for name, (first, stop) in listed.items()
              if not _defined_here(first, stop)}
  assert jax_compat.absent_primitive_names() == expected, (
      "registered primitive names this JAX does not define (misspelt, "
      "removed, or missing from VERSION_SPECIFIC_PRIMITIVES): "
      f"{sorted(jax_compat.absent_primitive_names() - expected)}")
  assert "copy" in jax_compat.primitive_names()  # copy_p is named "copy".


def test_a_name_jax_does_not_define_is_recorded_not_skipped(monkeypatch):
  monkeypatch.setattr(jax_internals, "_absent", set())
  monkeypatch.setattr(facts, "_FACTS", dict(facts._FACTS))  # pylint: disable=protected-access
  facts.register(("exp", "expand_dims"), keeps_param=True)
  assert jax_compat.absent_primitive_names() == {"expand_dims"}
