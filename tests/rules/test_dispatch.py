"""The order in which one primitive's rules are looked up, through any table
that is a `RuleTable` (here a small one of the test's own, not an
`OpRules`): a custom rule, then the primitive's special rule, then its
class; inside `full_precision()` only the code as written."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpolicy
from _helpers import recorded_rows
from mpolicy._src import interpreter
from mpolicy._src import observe
from mpolicy._src import regions
from mpolicy._src.rules import dispatch
from mpolicy._src.rules import fp8_placement

F16 = regions.Region(policy=mpolicy.get_policy("p=f32,c=f16,o=f32"),
                     decided_by="the test")


@dataclasses.dataclass
class Table:
  """A `RuleTable`: classes, reasons and custom rules by primitive name."""
  classes: dict = dataclasses.field(default_factory=dict)
  rules: dict = dataclasses.field(default_factory=dict)
  fp8: fp8_placement.Fp8Options = fp8_placement.Fp8Options()

  def class_of(self, name):
    return self.classes.get(name, (None,))[0]

  def reason_of(self, name):
    return self.classes.get(name, (None, None))[1]

  def rule_of(self, name):
    return self.rules.get(name)


def _run_exp(table, region=F16):
  """``exp`` of a float16 array run by `dispatch.run`: (output, row)."""
  x = jnp.linspace(0, 1, 4, dtype=jnp.float16)
  (eqn,) = jax.make_jaxpr(jnp.exp)(x).jaxpr.eqns
  eq = observe.Equation(eqn, ())
  with recorded_rows() as rows:
    observe.before(eq, [x])
    (out,) = dispatch.run(interpreter.Env(), eqn, [x], table, region, ())
    observe.after(eq, [x], [out])
  (row,) = rows
  return out, row


def test_the_class_the_table_gives_decides():
  out, row = _run_exp(Table(classes={"exp": ("full", "a reason")}))
  assert out.dtype == jnp.float32
  assert (row.rule, row.decided_by) == ("full", "full: a reason")
  out, row = _run_exp(Table())
  assert out.dtype == jnp.float16
  assert row.rule == "inputs"


def test_a_custom_rule_of_the_table_comes_before_the_class():
  def exp_plus_one(policy, x, **params):
    del params
    assert str(policy) == "p=f32,c=f16,o=f32"
    return jnp.exp(x.astype(jnp.float32)) + 1

  table = Table(classes={"exp": ("full", "a reason")},
                rules={"exp": exp_plus_one})
  out, row = _run_exp(table)
  np.testing.assert_allclose(out, np.exp(np.linspace(0, 1, 4)) + 1,
                             rtol=1e-3)
  assert row.rule == "custom"


def test_inside_full_precision_the_code_runs_as_written():
  table = Table(classes={"exp": ("full", "a reason")},
                rules={"exp": lambda policy, x, **params: x})
  out, row = _run_exp(table, regions.FULL_PRECISION)
  assert out.dtype == jnp.float16
  np.testing.assert_allclose(out, np.exp(np.linspace(0, 1, 4)), rtol=1e-3)
  assert row.rule == "as written"


# --- jax_debug_infs -------------------------------------------------------------


def _overflows_in_f16(x):
  return (x @ x).sum()


def _overflows_in_f32(x):
  return jnp.exp(x).sum()


def test_debug_infs_names_the_op_that_overflowed_in_half():
  """Without amp nothing overflows; with it JAX would blame the cast or
  half matmul mpolicy made: the error names the code's op, its line, the
  dtype it ran in and the policy."""
  x = jnp.full((4, 4), 300.0)
  with jax.debug_infs(True):
    jax.block_until_ready(_overflows_in_f16(x))  # float32: finite.
    for f in (mpolicy.amp(_overflows_in_f16, "p=f32,c=f16,o=f32"),
              jax.grad(mpolicy.amp(_overflows_in_f16, "p=f32,c=f16,o=f32"))):
      with pytest.raises(FloatingPointError) as info:
        jax.block_until_ready(f(x))
      message = str(info.value)
      assert message.startswith("mpolicy: dot_general gave inf or NaN")
      assert "test_dispatch.py:" in message and "run in float16" in message
      assert "p=f32,c=f16,o=f32" in message and "full_precision()" in message
      assert "JAX reported: invalid value (inf)" in message


def test_debug_infs_on_an_overflow_without_amp_says_what_jax_says():
  x = jnp.full((4,), 100.0)
  with jax.debug_infs(True):
    with pytest.raises(FloatingPointError, match="encountered in exp") as plain:
      _overflows_in_f32(x)
    with pytest.raises(FloatingPointError) as info:
      mpolicy.amp(_overflows_in_f32, "p=f32,c=f16,o=f32")(x)
  message = str(info.value)
  assert str(plain.value) in message and "mpolicy: exp gave inf" in message
  assert "run in float32" in message and "without amp it gives" in message
