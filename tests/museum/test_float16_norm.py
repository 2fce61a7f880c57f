"""jax#39899: `jnp.linalg.norm` of a float16 array overflowed (its squares
pass 65504 beyond 256) and gave inf, and a zero gradient.

mpolicy instead: under a float16 policy a float16 value multiplied by itself
is a square, classed `full` as ``x ** 2`` is: it runs in float32, so the
norm of a float16 activation is the float32 norm, its gradient finite and
right, and `explain` says why.
"""

import jax
import jax.numpy as jnp
import numpy as np

import mpolicy

F16 = "p=f32,c=f16,o=f32"
X = jnp.full((4, 64), 30.0, jnp.float32)
W = 10.0 * jnp.eye(64, dtype=jnp.float32)  # x @ w: 300, exact in float16.


def norm_of_activation(x, w):
  return jnp.linalg.norm(x @ w)


def test_plain_float16_norm_overflows():
  # The failure, without mpolicy: 300 ** 2 > 65504.
  assert jnp.isinf(jnp.linalg.norm((X @ W).astype(jnp.float16)))


def test_norm_of_a_float16_activation_is_finite_and_right():
  f = mpolicy.amp(norm_of_activation, F16)
  assert float(jax.jit(f)(X, W)) == 4800.0  # sqrt(256) * 300, exactly.
  g = jax.jit(jax.grad(f, argnums=1))(X, W)
  want = jax.jit(jax.grad(norm_of_activation, argnums=1))(X, W)
  assert g.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(g)))
  assert float(jnp.abs(want).max()) > 1
  np.testing.assert_allclose(g, want, rtol=1e-3, atol=1e-6)


def test_float16_params_norm():
  f = mpolicy.amp(jnp.linalg.norm, "p=f16,c=f16,o=f32")
  x = jnp.full((64,), 300.0, jnp.float16)
  assert float(jax.jit(f)(x)) == 2400.0
  assert float(jax.jit(jax.grad(f))(x)[0]) == 0.125


def test_explain_says_the_square_ran_in_float32():
  report = mpolicy.explain(mpolicy.amp(norm_of_activation, F16), X, W)
  rows = [r for r in report.rows
          if r.primitive == "mul"]
  assert len(rows) == 1
  assert rows[0].ran_in == "float32" and rows[0].in_dtypes == ("float16",) * 2
  assert "x**2 overflows float16" in rows[0].decided_by
