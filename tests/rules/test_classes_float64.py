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


def test_bias_parameter_is_still_broadcast_with_a_float32_gradient():
  x = jnp.ones((3, 4), jnp.float32)
  w = jnp.ones((4, 4), jnp.float32)
  b = jnp.ones((1, 4), jnp.float32)
  f = mpolicy.amp(lambda x, w, b: jax.lax.add(x @ w, b), HALF)
  bcasts = [e for e in all_eqns(f, x, w, b)
            if e.primitive.name == "broadcast_in_dim"]
  # Cast, then broadcast: the forward pass converts the (1, 4) bias only.
  assert [(e.invars[0].aval.shape, str(e.invars[0].aval.dtype))
          for e in bcasts] == [((1, 4), "bfloat16")]
  np.testing.assert_array_equal(jax.jit(f)(x, w, b), np.full((3, 4), 5.0))
  # The bias gradient sums the (3, 4) cotangent in float32.
  g = jax.grad(lambda b: f(x, w, b).astype(jnp.float32).sum())
  sums = [e for e in all_eqns(g, b) if e.primitive.name == "reduce_sum"
          and e.invars[0].aval.shape == (3, 4)]
  assert sums and all(str(e.invars[0].aval.dtype) == "float32" for e in sums)
  np.testing.assert_array_equal(g(b), np.full((1, 4), 3.0))


# --- A float64 compute policy ---------------------------------------------------


def _mlp(x, w):
  return jnp.tanh(x @ w).sum() + jnp.exp(x * 0.1).mean()


def test_a_float64_policy_computes_float32_inputs_in_float64():
  """``c=f64`` on float32 inputs: every op runs in float64 (as
  `transform_amp` casts inputs to the compute dtype), so the result is the
  float64 one, and `explain` says each row ran in float64."""
  with jax.enable_x64(True):
    x = jax.random.normal(jax.random.PRNGKey(0), (8, 8), jnp.float32)
    w = jax.random.normal(jax.random.PRNGKey(1), (8, 8), jnp.float32)
    f = mpolicy.amp(_mlp, "c=f64")
    got = jax.jit(f)(x, w)
    want = _mlp(x.astype(jnp.float64), w.astype(jnp.float64))
    in32 = _mlp(x, w)
    assert got.dtype == jnp.float64
    assert abs(float(got - want)) <= 1e-14 * abs(float(want))
    assert abs(float(in32 - want)) > 1e-9 * abs(float(want))  # f32 would fail.
    rows = mpolicy.explain(f, x, w).rows
    computes = [r for r in rows if r.primitive in ("dot_general", "tanh",
                                                   "exp", "reduce_sum")]
    assert computes and all(r.ran_in == "float64" for r in computes), rows
    for r in rows:  # What a row says ran is what it says it computes in.
      if "computes in float64" in r.decided_by:
        assert r.ran_in != "float32", r
    # The float32 policy still runs the code as written.
    same = jax.jit(mpolicy.amp(_mlp, "full"))(x, w)
    assert same.dtype == jnp.float32
    np.testing.assert_array_equal(same, jax.jit(_mlp)(x, w))
