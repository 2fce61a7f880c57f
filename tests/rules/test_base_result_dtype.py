"""An explicit ``preferred_element_type`` in float32-traced code is kept:
the matmul runs on half inputs and returns float32, as the code asked."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import mpolicy

from _helpers import all_eqns

HALF = "p=f32,c=bf16,o=f32"
X = jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float32).reshape(3, 4)
W = jnp.linspace(-0.5, 0.5, 20, dtype=jnp.float32).reshape(4, 5)
DN = (((1,), (0,)), ((), ()))


def _dot_out_dtypes(fn, *args):
  return [str(e.outvars[0].aval.dtype) for e in all_eqns(fn, *args)
          if "dot_general" in e.primitive.name]


def _exp_in_dtypes(fn, *args):
  return [str(e.invars[0].aval.dtype) for e in all_eqns(fn, *args)
          if e.primitive.name == "tanh"]


def test_explicit_float32_result_is_kept_for_lax_and_jnp_calls():
  calls = {
      "lax": lambda x, w: jnp.tanh(jax.lax.dot_general(
          x, w, DN, preferred_element_type=jnp.float32)),
      "jnp": lambda x, w: jnp.tanh(jnp.dot(
          x, w, preferred_element_type=jnp.float32)),
      "einsum": lambda x, w: jnp.tanh(jnp.einsum(
          "ij,jk->ik", x, w,
          preferred_element_type=jnp.float32)),
  }
  for name, fn in calls.items():
    f = mpolicy.amp(fn, HALF)
    # The tanh reads the matmul's float32 result, not a bfloat16 one.
    assert _exp_in_dtypes(f, X, W) == ["float32"], name
    report = mpolicy.explain(f, X, W)
    dot, = [r for r in report.rows if r.primitive == "dot_general"]
    assert dot.ran_in == "bfloat16", name  # Still half inputs.
    want = jnp.tanh(jnp.dot(X.astype(jnp.bfloat16), W.astype(jnp.bfloat16),
                            preferred_element_type=jnp.float32))
    np.testing.assert_allclose(jax.jit(f)(X, W), want, rtol=1e-6, atol=1e-6)


def test_jnp_matmul_without_the_keyword_still_returns_half():
  for fn in (lambda x, w: jnp.tanh(x @ w),
             lambda x, w: jnp.tanh(jnp.einsum("ij,jk->ik", x, w)),
             lambda x, w: jnp.tanh(jax.lax.dot_general(x, w, DN))):
    assert _exp_in_dtypes(mpolicy.amp(fn, HALF), X, W) == ["bfloat16"]
