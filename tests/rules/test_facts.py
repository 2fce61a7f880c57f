"""What the rules know of a primitive is its `Facts` record, and only that.

Each test changes one fact of one primitive and checks that the rule that
reads it changes its decision: a rule that asked for the primitive object
itself would not notice.
"""

import ast
import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import pytest

import mpolicy
from _helpers import recorded_rows
from mpolicy._src import jax_compat
from mpolicy._src import sub_computations
from mpolicy._src.jax_compat import linearize as linearize_lib
from mpolicy._src.rules import base
from mpolicy._src.rules import facts

HALF = "p=f32,c=bf16,o=f32"
RULES = pathlib.Path(base.__file__).parent


@pytest.fixture(name="patched_facts")
def _patched_facts(monkeypatch):
  """Changes one primitive's facts for one test."""
  def patch(prim, **changes):
    monkeypatch.setitem(facts._FACTS, prim,  # pylint: disable=protected-access
                        dataclasses.replace(facts.of(prim), **changes))
  return patch


def _row(fn, primitive, *args):
  with recorded_rows() as rows:
    jax.make_jaxpr(mpolicy.amp(fn, HALF))(*args)
  (row,) = [r for r in rows if r.primitive == primitive]
  return row


def test_the_facts_rules_ask_for_are_registered():
  assert facts.of(jax.lax.mul_p).commutes
  assert not facts.of(jax.lax.div_p).commutes
  assert not facts.of(jax.lax.sub_p).commutes
  assert facts.of(jax_compat.gather_p).looks_up
  assert not facts.of(jax.lax.dynamic_slice_p).looks_up
  assert facts.of(jax_compat.convert_element_type_p).casts
  assert not facts.of(jax_compat.bitcast_convert_type_p).casts
  assert facts.of(jax.lax.scatter_add_p).combines_scalars
  assert facts.of(jax_compat.pallas_call_p).kernel
  assert facts.of(jax_compat.ref_swap_p).binds_plainly
  exp = facts.of(jax.lax.exp_p)
  assert not (exp.commutes or exp.looks_up or exp.casts or exp.binds_plainly
              or exp.combines_scalars or exp.kernel)


def _scaled_by_sum(x, w):
  h = x @ w  # A bfloat16 activation.
  return jnp.sum(h, axis=1, keepdims=True) * h  # float32 statistic first.


def test_a_product_scales_its_second_operand_because_it_commutes(
    patched_facts):
  x, w = jnp.linspace(1, 2, 8).reshape(2, 4), jnp.ones((4, 4))
  row = _row(_scaled_by_sum, "mul", x, w)
  assert row.in_dtypes == ("float32", "bfloat16")
  assert "scaled by a float32 statistic: in bfloat16, the statistic " \
         "rounded once" in row.decided_by
  patched_facts(jax.lax.mul_p, commutes=False)
  row = _row(_scaled_by_sum, "mul", x, w)
  assert "scaled" not in row.decided_by  # Read like a quotient's divisor.


def test_a_lookup_in_a_float32_table_gives_rows_in_the_compute_dtype(
    patched_facts):
  table, index = jnp.ones((5, 3)), jnp.array([0, 2])
  row = _row(lambda t, i: t[i], "gather", table, index)
  assert row.decided_by.startswith("gather of a float32 parameter")
  assert "rows used in the compute dtype bfloat16" in row.decided_by
  patched_facts(jax_compat.gather_p, looks_up=False)
  row = _row(lambda t, i: t[i], "gather", table, index)
  assert row.decided_by == "no rule: runs in its inputs' dtype"


def test_a_result_only_cast_to_float32_stays_float32(patched_facts):
  x = jnp.linspace(1, 2, 8, dtype=jnp.bfloat16)
  exp_then_cast = lambda x: jnp.exp(x).astype(jnp.float32)
  row = _row(exp_then_cast, "exp", x)
  assert row.decided_by == "full: " + mpolicy.DEFAULT_RULES.reason_of("exp")
  patched_facts(jax_compat.convert_element_type_p, casts=False)
  row = _row(exp_then_cast, "exp", x)
  assert row.decided_by.endswith("; computed in float32, stored in bfloat16")


def _linearizations() -> int:
  return linearize_lib._linearization.cache_info().currsize  # pylint: disable=protected-access


def test_a_primitive_that_binds_plainly_is_not_linearized_once_per_signature(
    patched_facts):
  eqn = jax.make_jaxpr(jnp.sin)(1.0).eqns[0]
  grad = jax.grad(lambda x: base.bind(eqn, [x])[0])
  # Only mpolicy's cache: `jax.clear_caches()` would make every later test
  # in this process compile its programs again.
  linearize_lib._linearization.cache_clear()  # pylint: disable=protected-access
  assert float(grad(0.5)) == pytest.approx(float(jnp.cos(0.5)))
  assert _linearizations() == 1
  patched_facts(jax.lax.sin_p, binds_plainly=True)
  linearize_lib._linearization.cache_clear()  # pylint: disable=protected-access
  assert float(grad(0.5)) == pytest.approx(float(jnp.cos(0.5)))
  assert _linearizations() == 0


def test_kernels_and_scalar_combiners_are_known_by_their_facts(
    patched_facts):
  assert sub_computations.handling(jax.lax.scatter_add_p) == "scalar combiner"
  assert sub_computations.handling(jax_compat.pallas_call_p) == "kernel"
  patched_facts(jax.lax.scatter_add_p, combines_scalars=False)
  patched_facts(jax_compat.pallas_call_p, kernel=False)
  assert sub_computations.handling(jax.lax.scatter_add_p) is None
  assert sub_computations.handling(jax_compat.pallas_call_p) is None
  assert "pallas_call" not in facts.names_with("kernel")
  # The runtime guard refuses what is no longer a scalar combiner.
  scatter = lambda x: x.at[jnp.array([0, 2])].add(x[:2])
  with pytest.raises(mpolicy.UnsupportedPrimitiveError, match="scatter-add"):
    jax.make_jaxpr(mpolicy.amp(scatter, HALF))(jnp.ones(4))


def _table_reads() -> set[str]:
  """The attributes the rules read of the table: ``rules.x``,
  ``op.rules.x`` and ``self.rules.x`` in mpolicy/_src/rules."""
  read = set()
  for path in sorted(RULES.glob("*.py")):
    for node in ast.walk(ast.parse(path.read_text())):
      if not isinstance(node, ast.Attribute):
        continue
      owner = node.value
      if ((isinstance(owner, ast.Name) and owner.id == "rules")
          or (isinstance(owner, ast.Attribute) and owner.attr == "rules")):
        read.add(node.attr)
  return read


def test_the_rule_table_protocol_is_what_the_rules_read():
  members = {name for name in vars(base.RuleTable)
             if not name.startswith("_")}
  assert members == {"class_of", "reason_of", "rule_of", "fp8",
                     "collective_sum_dtype"}
  assert _table_reads() == members
  for name in members:  # OpRules is a RuleTable.
    assert hasattr(mpolicy.DEFAULT_RULES, name), name
  assert base.Op.__annotations__["rules"] == "RuleTable"
