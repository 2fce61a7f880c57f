"""Host callbacks are code as written: their operands arrive in the dtypes
the traced code had, whatever the op rules made of them."""

from __future__ import annotations

import jax
from jax.experimental import io_callback
import jax.numpy as jnp
import numpy as np

import mpolicy

HALF = "p=f32,c=bf16,o=f32"
H = jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float32).reshape(3, 4)
W = jnp.linspace(-0.5, 0.5, 20, dtype=jnp.float32).reshape(4, 5)
SHAPE = jax.ShapeDtypeStruct((3, 5), jnp.float32)


def _seen_dtypes():
  seen = []

  def host(x):
    seen.append(np.asarray(x).dtype)
    return np.tanh(np.asarray(x, np.float32))
  return seen, host


def test_pure_callback_gets_its_traced_dtype_under_a_half_policy():
  seen, host = _seen_dtypes()
  f = mpolicy.amp(lambda h, w: jax.pure_callback(host, SHAPE, h @ w), HALF)
  out = jax.jit(f)(H, W)
  assert seen and all(d == np.float32 for d in seen)
  assert out.dtype == jnp.float32
  # The matmul still ran in bfloat16: its result is the bfloat16 product.
  want = np.tanh(np.asarray((H.astype(jnp.bfloat16) @ W.astype(jnp.bfloat16))
                            .astype(jnp.float32)))
  np.testing.assert_allclose(out, want, rtol=1e-2, atol=1e-2)
  report = mpolicy.explain(f, H, W)
  row = [r for r in report.rows if r.primitive == "pure_callback"][0]
  assert row.ran_in == "float32" and row.rule == "as written"


def test_pure_callback_under_grad_and_vmap():
  seen, host = _seen_dtypes()

  def fn(h, w):
    y = h @ w
    return jnp.sum(jax.pure_callback(host, SHAPE, jax.lax.stop_gradient(y),
                                     vmap_method="sequential") * y)
  g = jax.jit(jax.grad(mpolicy.amp(fn, HALF)))(H, W)
  assert g.dtype == jnp.float32 and np.all(np.isfinite(g))
  out = jax.jit(jax.vmap(mpolicy.amp(fn, HALF), in_axes=(0, None)))(
      jnp.stack([H, -H]), W)
  assert out.shape == (2,) and np.all(np.isfinite(out))
  assert seen and all(d == np.float32 for d in seen)


def test_io_callback_and_debug_callback_get_their_traced_dtypes():
  seen_io, host = _seen_dtypes()
  seen_debug = []

  def fn(h, w):
    y = h @ w
    jax.debug.callback(lambda v: seen_debug.append(np.asarray(v).dtype), y)
    return io_callback(host, SHAPE, y)
  out = jax.jit(mpolicy.amp(fn, HALF))(H, W)
  jax.effects_barrier()
  assert out.dtype == jnp.float32
  assert seen_io == [np.float32] and seen_debug == [np.float32]
