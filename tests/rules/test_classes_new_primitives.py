"""The element-wise primitives of newer JAX (0.11.2-0.12.1) each have a rule.

``exp2m1``, ``log2p1``, ``log2``, ``tanpi``, ``acospi`` and ``asinpi`` run
in float32 as ``expm1``, ``log1p``, ``log``, ``tan``, ``acos`` and ``asin``
do (computed in float32, stored in bfloat16 under a bfloat16 policy);
``fma`` runs in float32 wherever an operand is half (its one rounding is
its point, and XLA:CPU has no half fma); ``fmuladd``, ``sinpi`` and
``cospi`` run in their inputs' dtype; ``atan2pi`` promotes as ``atan2``.
"""

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest

import mpolicy

from _helpers import all_eqns

HALF = "p=f32,c=bf16,o=f32"
X = jnp.linspace(-0.9, 0.9, 32, dtype=jnp.float32).reshape(4, 8)
W = jnp.eye(8, dtype=jnp.float32) * 0.5


def _needs(*names):
  missing = [n for n in names if not hasattr(lax, n)]
  return pytest.mark.skipif(
      bool(missing), reason=f"JAX {jax.__version__} has no lax.{missing}")


def _operand_dtypes(fn, name, *args):
  """The operand dtypes of each equation of primitive ``name``."""
  return [tuple(v.aval.dtype for v in e.invars)
          for e in all_eqns(fn, *args) if e.primitive.name == name]


@pytest.mark.parametrize("new,old", [
    ("exp2m1", "expm1"), ("log2p1", "log1p"), ("log2", "log"),
    ("tanpi", "tan"), ("acospi", "acos"), ("asinpi", "asin")])
def test_a_new_fragile_op_runs_in_float32_as_its_classic_twin(new, old):
  if not hasattr(lax, new):
    pytest.skip(f"JAX {jax.__version__} has no lax.{new}")
  run = {}
  for name in (new, old):
    op = getattr(lax, name)
    f = mpolicy.amp(lambda x, w, op=op: op((x @ w) * 0.5), HALF)
    run[name] = _operand_dtypes(f, name, X, W)
    assert run[name] == [(jnp.float32,)], (name, run[name])
    row = [r for r in mpolicy.explain(f, X, W).rows if r.primitive == name]
    assert row[0].rule == "full" and row[0].ran_in == "float32", row
    want = getattr(lax, name)((X @ W) * 0.5)
    np.testing.assert_allclose(f(X, W), want, rtol=2e-2, atol=2e-2)
  assert mpolicy.DEFAULT_RULES.class_of(new) == "full"


@_needs("fma")
def test_fma_fed_by_a_half_matmul_runs_in_float32_on_cpu():
  # Plain XLA:CPU: "Fma is not supported for element type bf16".
  fn = lambda x, w, c: lax.fma(x @ w, x @ w, c)
  f = mpolicy.amp(fn, HALF)
  c = jnp.full((4, 8), 0.25)
  got = jax.jit(f)(X, W, c)
  assert _operand_dtypes(f, "fma", X, W, c) == [(jnp.float32,) * 3]
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(got, fn(X, W, c), rtol=2e-2, atol=2e-2)
  grads = jax.grad(lambda x: f(x, W, c).sum())(X)
  np.testing.assert_allclose(grads, jax.grad(lambda x: fn(x, W, c).sum())(X),
                             rtol=3e-2, atol=3e-2)


@_needs("fmuladd", "sinpi", "cospi")
@pytest.mark.parametrize("name", ["fmuladd", "sinpi", "cospi", "atanpi"])
def test_an_exact_or_bounded_new_op_runs_in_its_inputs_dtype(name):
  op = getattr(lax, name)
  arity = 3 if name == "fmuladd" else 1
  fn = lambda x, w: op(*[x @ w] * arity)
  f = mpolicy.amp(fn, HALF)
  assert _operand_dtypes(f, name, X, W) == [(jnp.bfloat16,) * arity]
  np.testing.assert_allclose(jax.jit(f)(X, W), fn(X, W), rtol=2e-2,
                             atol=2e-2)
  assert mpolicy.DEFAULT_RULES.class_of(name) is None


@_needs("atan2pi")
def test_atan2pi_promotes_as_atan2():
  # A half matmul's result against a float32 value (exp runs in float32).
  for name in ("atan2pi", "atan2"):
    op = getattr(lax, name)
    fn = lambda x, w, op=op: op(x @ w, jnp.exp(x))
    f = mpolicy.amp(fn, HALF)
    assert mpolicy.DEFAULT_RULES.class_of(name) == "promote"
    assert _operand_dtypes(f, name, X, W) == [(jnp.float32,) * 2], name
    np.testing.assert_allclose(f(X, W), fn(X, W), rtol=2e-2, atol=2e-2)
