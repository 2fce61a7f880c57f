"""Primus PR #1046: an accumulation loop kept one microbatch's gradient of 32
instead of their sum.

mpolicy instead: `make_train_step(microbatches=32)` applies the optimizer to
the mean of all 32 microbatches' gradients, which for a mean loss is the
whole batch's gradient up to float32 rounding, and unlike any one
microbatch's.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import mpolicy

K = 32


def loss_fn(params, x, y):
  return jnp.mean((x @ params["w"] - y) ** 2)


def test_the_update_is_the_mean_of_all_32_gradients():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(4 * K, 5)), jnp.float32)
  y = jnp.asarray(rng.normal(size=(4 * K, 2)), jnp.float32)
  params = {"w": jnp.zeros((5, 2), jnp.float32)}
  tx = optax.sgd(1.0)  # From zero: the new params are minus the gradient.
  step = jax.jit(mpolicy.make_train_step(loss_fn, tx, microbatches=K))
  out = step(params, tx.init(params), mpolicy.NoOpLossScale(), x, y)
  got = -np.asarray(out.params["w"], np.float64)
  want = np.asarray(jax.jit(jax.grad(loss_fn))(params, x, y)["w"],
                    np.float64)
  assert np.abs(want).max() > 0.1
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(float(out.value),
                             float(jax.jit(loss_fn)(params, x, y)), rtol=1e-6)
  # Each microbatch's own gradient (rows i, i + K, ...) is far from it.
  split = lambda a: a.reshape(-1, K, a.shape[-1]).swapaxes(0, 1)
  ones = jax.jit(jax.vmap(jax.grad(loss_fn), in_axes=(None, 0, 0)))(
      params, split(x), split(y))["w"]
  assert ones.shape == (K, 5, 2)
  np.testing.assert_allclose(np.mean(ones, 0), want, rtol=1e-5, atol=1e-6)
  assert np.abs(np.asarray(ones) - want).max(axis=(1, 2)).min() > 0.05
