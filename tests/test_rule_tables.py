"""The interpreter dispatches first-order primitives through two tables."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpolicy
from mpolicy._src import dtypes
from mpolicy._src import first_order
from mpolicy._src import jax_compat
from mpolicy._src import op_rules
from mpolicy._src import recording
from _helpers import walk_eqns

HALF = "p=f32,c=bf16,o=f32"


def test_class_table_has_one_rule_per_class():
  assert set(first_order.CLASS_RULES) == {
      *op_rules.CLASSES, None, first_order.AS_WRITTEN}


def test_special_table_is_keyed_by_primitive_object():
  assert jax_compat.convert_element_type_p in first_order.SPECIAL_RULES
  assert jax_compat.bitcast_convert_type_p in first_order.SPECIAL_RULES
  assert all(hasattr(p, "bind") for p in first_order.SPECIAL_RULES)


def _rows(fn, *args):
  with recording.recording() as rows:
    jax.make_jaxpr(fn)(*args)
  return rows


def test_a_special_rule_registered_for_a_primitive_runs(monkeypatch):
  calls = []

  def neg_in_f32(op):
    calls.append(op.prim.name)
    op.rule, op.why = "special", "test rule"
    op.args = [op.env.cast(op.args[0], jnp.float32)]
    return first_order.bind(op.eqn, op.args)

  monkeypatch.setitem(first_order.SPECIAL_RULES, jax.lax.neg_p, neg_in_f32)
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


def test_a_special_rule_that_declines_falls_through_to_the_class(monkeypatch):
  monkeypatch.setitem(first_order.SPECIAL_RULES, jax.lax.exp_p,
                      lambda op: None)
  x = jnp.ones(3, jnp.bfloat16)
  (row,) = [r for r in _rows(mpolicy.amp(jnp.exp), x)
            if r.primitive == "exp"]
  assert (row.rule, row.ran_in) == ("full", "float32")


def test_a_class_rule_replaced_in_the_table_is_used(monkeypatch):
  seen = []

  def promote_spy(op):
    seen.append(op.prim.name)
    return first_order.CLASS_RULES[None](op)

  monkeypatch.setitem(first_order.CLASS_RULES, op_rules.PROMOTE, promote_spy)
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
