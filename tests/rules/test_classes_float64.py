"""float64 where it meets float32 under x64: never narrowed, never a crash,
and `explain` says what ran."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpolicy

from _helpers import all_eqns

HALF = "p=f32,c=bf16,o=f32"
SHAPES = [((4, 4), (4, 4)), ((3, 4), (4, 5)), ((2, 3, 4), (4, 1)), ((5,), (5, 2))]


def _operands(lhs_shape, rhs_shape):
  x = np.random.RandomState(0).randn(*lhs_shape).astype(np.float32)
  w = np.random.RandomState(1).randn(*rhs_shape)
  return x, w


def _dot_in_dtypes(fn, *args):
  return [tuple(str(v.aval.dtype) for v in e.invars)
          for e in all_eqns(fn, *args) if "dot_general" in e.primitive.name]


@pytest.mark.parametrize("lhs_shape,rhs_shape", SHAPES)
@pytest.mark.parametrize("policy", [HALF, "p=f32,c=f8,o=bf16"])
def test_x32_matmul_w64_runs_in_float64_for_every_shape(lhs_shape, rhs_shape,
                                                       policy):
  with jax.enable_x64(True):
    x, w = _operands(lhs_shape, rhs_shape)
    x, w = jnp.asarray(x), jnp.asarray(w, jnp.float64)
    f = mpolicy.amp(lambda x, w: x @ w, policy)
    out = jax.jit(f)(x, w)
    want = np.asarray(x, np.float64) @ np.asarray(w)
    # Float64 results stay float64 (the policy's output dtype narrows
    # floating outputs only where they are no wider than float32).
    assert out.dtype == jnp.float64
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)
    assert all(d == ("float64", "float64") for d in _dot_in_dtypes(f, x, w))
    row, = [r for r in mpolicy.explain(f, x, w).rows
            if r.primitive == "dot_general"]
    assert row.ran_in == "float64" and "float64" in row.decided_by


@pytest.mark.parametrize("shapes", [((3, 4), (4, 5)), ((4, 4), (4, 4))])
def test_without_dot_general_rule_half_input_meets_parameter(shapes):
  x, w = (jnp.asarray(a) for a in _operands(*shapes))
  x, w = x.astype(jnp.bfloat16), w.astype(jnp.float32)
  rules = mpolicy.DEFAULT_RULES.without_ops("dot_general")
  # A bfloat16 input meets a float32 parameter: they meet in the compute
  # dtype, and the parameter is not broadcast to the result's shape.
  f = mpolicy.amp(lambda x, w: x @ w, HALF, rules=rules)
  assert _dot_in_dtypes(f, x, w) == [("bfloat16", "bfloat16")]
  out = jax.jit(f)(x, w)
  want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  assert out.dtype == jnp.float32
  np.testing.assert_allclose(out, want, rtol=2e-2, atol=5e-2)


@pytest.mark.parametrize("shapes", SHAPES)
def test_without_dot_general_rule_float64_is_not_narrowed(shapes):
  with jax.enable_x64(True):
    x, w = _operands(*shapes)
    x, w = jnp.asarray(x), jnp.asarray(w, jnp.float64)
    rules = mpolicy.DEFAULT_RULES.without_ops("dot_general")
    f = mpolicy.amp(lambda x, w: x @ w, HALF, rules=rules)
    assert all("bfloat16" not in d for d in _dot_in_dtypes(f, x, w))
    np.testing.assert_allclose(jax.jit(f)(x, w),
                               np.asarray(x, np.float64) @ np.asarray(w),
                               rtol=1e-12, atol=1e-12)


def test_bias_parameter_is_still_broadcast_in_float32_for_elementwise_ops():
  x = jnp.ones((3, 4), jnp.float32)
  w = jnp.ones((4, 4), jnp.float32)
  b = jnp.ones((1, 4), jnp.float32)
  f = mpolicy.amp(lambda x, w, b: jax.lax.add(x @ w, b), HALF)
  bcasts = [e for e in all_eqns(f, x, w, b)
            if e.primitive.name == "broadcast_in_dim"]
  assert [str(e.invars[0].aval.dtype) for e in bcasts] == ["float32"]
  np.testing.assert_array_equal(jax.jit(f)(x, w, b), np.full((3, 4), 5.0))
