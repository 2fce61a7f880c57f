"""Specification of half params without a float32 copy: the 6-byte mode."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpolicy

BF16 = np.dtype(jnp.bfloat16)
N = 10_000


def _nbytes(tree):
  return sum(np.asarray(x).nbytes for x in jax.tree_util.tree_leaves(tree))


def _six_bytes(learning_rate=1e-3):
  return mpolicy.stochastic_params(mpolicy.with_state_dtypes(
      optax.adam(learning_rate), jnp.bfloat16, rounding="stochastic"))


def test_small_updates_move_bfloat16_params_only_with_stochastic_rounding():
  # 1e-3 is an eighth of a bfloat16 spacing at 1: nearest drops every step.
  grads = {"w": -jnp.ones(N)}
  for tx, expected in [(optax.sgd(1e-3), 1.0),
                       (mpolicy.stochastic_params(optax.sgd(1e-3)), 1.02)]:
    params = {"w": jnp.ones(N, jnp.bfloat16)}
    state = tx.init(params)
    step = jax.jit(lambda p, s: tx.update(grads, s, p))
    for _ in range(20):
      updates, state = step(params, state)
      params = optax.apply_updates(params, updates)
    assert params["w"].dtype == BF16
    mean = float(params["w"].astype(jnp.float32).mean())
    assert mean == pytest.approx(expected, abs=2e-4)


def test_its_updates_applied_by_optax_equal_apply_updates_stochastic():
  tx = mpolicy.stochastic_params(optax.sgd(1.0), seed=3)
  params = {"w": jax.random.normal(jax.random.PRNGKey(0), (N,)).astype(
      jnp.bfloat16), "f": jnp.ones(3)}
  grads = {"w": jax.random.normal(jax.random.PRNGKey(1), (N,)) * 1e-3,
           "f": jnp.full(3, 0.5)}
  state = tx.init(params)
  updates, new_state = tx.update(grads, state, params)
  via_optax = optax.apply_updates(params, updates)
  # The same key the transformation derives for its first update.
  inner_updates, _ = optax.sgd(1.0).update(grads, state.inner_state, params)
  key = jax.random.fold_in(
      jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(3), 0), 0),
      0x5EED)
  direct = mpolicy.apply_updates_stochastic(params, inner_updates, key)
  np.testing.assert_array_equal(np.asarray(via_optax["w"], np.float32),
                                np.asarray(direct["w"], np.float32))
  # Float32 params get the inner updates unchanged.
  np.testing.assert_array_equal(updates["f"], inner_updates["f"])
  assert int(new_state.count) == 1


def test_six_byte_mode_holds_six_bytes_per_parameter():
  params = {"w": jnp.ones((100, 100), jnp.bfloat16),
            "b": jnp.zeros(100, jnp.bfloat16)}
  n = 100 * 100 + 100
  tx = _six_bytes()
  state = tx.init(params)
  _, state = jax.jit(lambda s, p: tx.update(
      jax.tree_util.tree_map(jnp.ones_like, p), s, p))(state, params)
  scalars = sum(np.asarray(x).nbytes for x in jax.tree_util.tree_leaves(state)
                if np.ndim(x) == 0)  # Step counters: 3 int32.
  assert scalars == 12
  assert (_nbytes(params) + _nbytes(state) - scalars) / n == 6.0
  # float32 Adam holds 12; master weights 14 (bfloat16 params 2, float32
  # master, mu and nu 4 each).
  f32 = jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), params)
  adam = optax.adam(1e-3).init(f32)
  assert (_nbytes(f32) + _nbytes(adam) - 4) / n == 12.0
  master = mpolicy.master_weights(optax.adam(1e-3)).init(f32)
  assert (_nbytes(params) + _nbytes(master) - 4) / n == 14.0


def test_six_byte_mode_fits_a_regression_like_float32_adam():
  x = jax.random.normal(jax.random.PRNGKey(0), (256, 16))
  w_true = jax.random.normal(jax.random.PRNGKey(1), (16,))
  y = x @ w_true
  loss = lambda p: jnp.mean((x @ p["w"].astype(jnp.float32) - y) ** 2)

  def train(tx, dtype):
    params = {"w": jnp.zeros(16, dtype)}
    state = tx.init(params)

    @jax.jit
    def step(params, state):
      grads = jax.grad(loss)(params)
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state
    for _ in range(300):
      params, state = step(params, state)
    return float(loss(params))

  reference = train(optax.adam(3e-2), jnp.float32)
  six = train(_six_bytes(3e-2), jnp.bfloat16)
  nearest = train(optax.adam(3e-2), jnp.bfloat16)
  assert reference < 1e-3
  assert six < 2e-3
  assert nearest > 2 * six  # Round-to-nearest bfloat16 stalls higher.


def test_make_train_step_stochastic_mode_moves_tiny_updates():
  loss_fn = lambda p, x: jnp.mean(p["w"].astype(jnp.float32) * x)
  x = -jnp.ones(N)  # Gradient -1/N per weight: sgd(1e-3 * N) adds 1e-3.
  params = {"w": jnp.ones(N, jnp.bfloat16)}
  tx = optax.sgd(1e-3 * N)
  results = {}
  for rounding, init in [("nearest", tx.init),
                         ("stochastic", mpolicy.stochastic_params(tx).init)]:
    step = jax.jit(mpolicy.make_train_step(loss_fn, tx,
                                           param_rounding=rounding))
    p, s, scale = params, init(params), mpolicy.NoOpLossScale()
    for _ in range(10):
      p, s, scale, finite, *_ = step(p, s, scale, x)
      assert bool(finite)
    results[rounding] = float(p["w"].astype(jnp.float32).mean())
  assert results["nearest"] == 1.0
  assert results["stochastic"] == pytest.approx(1.01, abs=3e-4)


def test_make_train_step_stochastic_mode_explains_a_wrong_opt_state():
  tx = optax.sgd(0.1)
  step = mpolicy.make_train_step(lambda p: jnp.sum(p["w"]), tx,
                                 param_rounding="stochastic")
  params = {"w": jnp.ones(2, jnp.bfloat16)}
  with pytest.raises(TypeError, match=r"stochastic_params\(optimizer\)\.init"):
    step(params, tx.init(params), mpolicy.NoOpLossScale())


def test_bad_param_rounding_lists_the_choices():
  with pytest.raises(ValueError, match="'nearest', 'stochastic' or 'low_bits', "
                     "got 'sr'"):
    mpolicy.make_train_step(lambda p: p, optax.sgd(0.1), param_rounding="sr")


def test_update_without_params_says_what_to_pass():
  tx = mpolicy.stochastic_params(optax.sgd(0.1))
  state = tx.init({"w": jnp.ones(2, jnp.bfloat16)})
  with pytest.raises(ValueError, match=r"tx.update\(grads, state, params\)"):
    tx.update({"w": jnp.ones(2)}, state)
