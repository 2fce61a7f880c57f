"""Specification of master_weights: a float32 master of half params."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpolicy

from _helpers import same_bits

DynamicLossScale = mpolicy.DynamicLossScale


def _dtypes(tree):
  return jax.tree_util.tree_map(lambda x: jnp.asarray(x).dtype, tree)


# --- Master weights --------------------------------------------------------------


def test_master_moves_under_updates_a_bfloat16_weight_cannot_see():
  tx = mpolicy.master_weights(optax.sgd(1e-4))
  half, state = mpolicy.init_master_weights(tx, {"w": jnp.ones(4)},
                                             jnp.bfloat16)
  grads = {"w": -jnp.ones(4, jnp.bfloat16)}
  assert float(jnp.bfloat16(1.) + jnp.bfloat16(1e-4)) == 1.  # Invisible.
  first_change = None
  for i in range(100):
    updates, state = tx.update(grads, state, half)
    half = optax.apply_updates(half, updates)
    if first_change is None and float(half["w"][0]) != 1.:
      first_change = i + 1
  np.testing.assert_allclose(np.asarray(state.master["w"]), 1.01, rtol=1e-5)
  assert half["w"].dtype == jnp.bfloat16
  assert float(half["w"][0]) == float(jnp.bfloat16(1.01))  # 1.0078125
  # 1 + 2**-7 is bf16's next weight; it rounds in halfway, after ~40 steps.
  assert first_change is not None and 30 <= first_change <= 50


def test_applied_updates_equal_the_rounded_master_bit_for_bit():
  params32 = {"a": jax.random.normal(jax.random.PRNGKey(0), (64, 32)) * 0.05,
              "b": jnp.zeros(32)}
  for half_dtype in (jnp.bfloat16, jnp.float16):
    tx = mpolicy.master_weights(optax.adam(3e-3))
    half, state = mpolicy.init_master_weights(tx, params32, half_dtype)
    for i in range(20):
      key = jax.random.PRNGKey(100 + i)
      grads = jax.tree_util.tree_map(
          lambda p: jax.random.normal(key, p.shape).astype(half_dtype), half)
      updates, state = tx.update(grads, state, half)
      assert _dtypes(updates) == {"a": jnp.float32, "b": jnp.float32}
      half = optax.apply_updates(half, updates)
      assert same_bits(half, mpolicy.params_from_master(state, half))
    assert _dtypes(half) == {"a": half_dtype, "b": half_dtype}
    assert _dtypes(state.inner_state[0].mu) == {"a": jnp.float32,
                                                "b": jnp.float32}


def test_master_weights_start_from_half_params_and_a_float32_copy():
  copy32 = {"w": jnp.array([1.001, 2.002, -3.003])}
  half = {"w": copy32["w"].astype(jnp.bfloat16)}
  tx = mpolicy.master_weights(optax.sgd(1.))
  state = tx.init(copy32)
  assert same_bits(state.master, copy32)  # The copy is the master, exactly.
  updates, state = tx.update({"w": jnp.zeros(3, jnp.bfloat16)}, state, half)
  assert same_bits(state.master, copy32)
  assert same_bits(optax.apply_updates(half, updates), half)


def test_master_weights_start_from_half_params_only():
  half = {"w": jnp.array([1.5, -2.], jnp.bfloat16)}
  state = mpolicy.master_weights(optax.sgd(1.)).init(half)
  assert state.master["w"].dtype == jnp.float32
  assert state.master["w"].tolist() == [1.5, -2.]


def test_master_weights_needs_params():
  tx = mpolicy.master_weights(optax.sgd(1.))
  state = tx.init({"w": jnp.ones(2)})
  with pytest.raises(ValueError, match="needs `params`"):
    tx.update({"w": jnp.ones(2)}, state)


def test_skip_nonfinite_around_master_weights_keeps_the_master():
  tx = mpolicy.skip_nonfinite(mpolicy.master_weights(optax.adam(1e-2)))
  half, state = mpolicy.init_master_weights(
      tx, {"w": jnp.array([0.3, -0., 2.])}, jnp.bfloat16)
  updates, new_state = tx.update({"w": jnp.array([1., jnp.nan, 1.],
                                                 jnp.bfloat16)}, state, half)
  assert same_bits(optax.apply_updates(half, updates), half)
  assert same_bits(new_state.inner_state, state.inner_state)
