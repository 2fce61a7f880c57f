"""Specification of keep_dtypes: state and updates keep their dtypes; one compile."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

import mpolicy

from _training_mlp import BF16, clean, data, init_mlp, mlp_loss

DynamicLossScale = mpolicy.DynamicLossScale


def _dtypes(tree):
  return jax.tree_util.tree_map(lambda x: jnp.asarray(x).dtype, tree)


# --- Stable dtypes and compile counts -----------------------------------------


def test_keep_dtypes_fixes_state_and_update_dtypes():
  tx = mpolicy.keep_dtypes(optax.adam(1e-3))
  params = {"w": jnp.ones(3, jnp.bfloat16), "f": jnp.ones(2)}
  state = tx.init(params)
  init_dtypes = _dtypes(state)
  for _ in range(3):
    grads = {"w": jnp.ones(3, jnp.float32), "f": jnp.ones(2, jnp.bfloat16)}
    updates, state = tx.update(grads, state, params)
    assert _dtypes(updates) == _dtypes(params)
    assert _dtypes(state) == init_dtypes
    params = optax.apply_updates(params, updates)
  assert _dtypes(params) == {"w": jnp.bfloat16, "f": jnp.float32}


def _count_traces(tx, params, steps=5):
  """Runs a jitted bf16-params step `steps` times; returns the trace count."""
  traces = []
  x, y = data()
  loss_fn = lambda p, x, y: mlp_loss(p, x, y, clean(), BF16)
  grad_fn = mpolicy.scaled_value_and_grad(loss_fn, grad_dtype=jnp.float32)

  @jax.jit
  def step(params, state, ls, x, y):
    traces.append(1)
    ls, finite, loss, grads = grad_fn(ls, params, x, y)
    updates, state = tx.update(grads, state, params, grads_finite=finite)
    return optax.apply_updates(params, updates), state, ls, loss

  state, ls = tx.init(params), DynamicLossScale(2. ** 15)
  for _ in range(steps):
    params, state, ls, _ = step(params, state, ls, x, y)
  return len(traces)


def test_jitted_step_compiles_once_with_keep_dtypes():
  half = mpolicy.cast_to_half(init_mlp())
  half = jax.tree_util.tree_map(lambda p: p.astype(jnp.bfloat16), half)
  # The control: plain Adam on bf16 params fed f32 grads drifts, and retraces.
  assert _count_traces(optax.adam(1e-3), half) == 2
  assert _count_traces(mpolicy.keep_dtypes(optax.adam(1e-3)), half) == 1
  assert _count_traces(mpolicy.skip_nonfinite(
      mpolicy.keep_dtypes(optax.adam(1e-3))), half) == 1


def test_jitted_master_weights_step_compiles_once():
  tx = mpolicy.skip_nonfinite(mpolicy.master_weights(optax.adam(1e-3)))
  half, _ = mpolicy.init_master_weights(tx, init_mlp(), jnp.bfloat16)
  # `_count_traces` inits from the half params (the third way to start).
  assert _count_traces(tx, half) == 1
