"""Specification of skip_nonfinite and update_if_finite: bad steps change nothing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import mpolicy

from _helpers import same_bits

DynamicLossScale = mpolicy.DynamicLossScale


# --- Skipping non-finite steps -------------------------------------------------


def _adam_state_after_steps(tx, params, n=3):
  state = tx.init(params)
  for i in range(n):
    grads = jax.tree_util.tree_map(lambda p: jnp.full_like(p, 0.1 * (i + 1)),
                                   params)
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
  return params, state


def test_skip_nonfinite_keeps_params_and_inner_state_bit_for_bit():
  tx = mpolicy.skip_nonfinite(optax.adam(1e-2))
  params = {"w": jnp.array([1., -0., 0., 3.]), "b": jnp.ones(2)}
  params, state = _adam_state_after_steps(tx, params)
  params = {"w": params["w"].at[1].set(-0.), "b": params["b"]}
  bad = {"w": jnp.array([1., jnp.nan, 0., 1.]), "b": jnp.array([jnp.inf, 1.])}
  updates, new_state = tx.update(bad, state, params)
  new_params = optax.apply_updates(params, updates)
  assert same_bits(new_params, params)  # -0.0 stays -0.0.
  assert same_bits(new_state.inner_state, state.inner_state)
  assert int(new_state.inner_state[0].count) == 3  # Step count did not move.
  assert int(new_state.total_notfinite) == 1
  assert int(new_state.notfinite_count) == 1
  assert not bool(new_state.last_finite)


def test_skip_nonfinite_never_gives_up_unlike_apply_if_finite():
  params = {"w": jnp.ones(2)}
  bad = {"w": jnp.array([jnp.nan, 1.])}
  ours = mpolicy.skip_nonfinite(optax.sgd(0.1))
  theirs = optax.apply_if_finite(optax.sgd(0.1), max_consecutive_errors=3)
  p_ours, s_ours = params, ours.init(params)
  p_theirs, s_theirs = params, theirs.init(params)
  for _ in range(10):
    u, s_ours = ours.update(bad, s_ours, p_ours)
    p_ours = optax.apply_updates(p_ours, u)
    u, s_theirs = theirs.update(bad, s_theirs, p_theirs)
    p_theirs = optax.apply_updates(p_theirs, u)
  assert same_bits(p_ours, params) and int(s_ours.notfinite_count) == 10
  # optax.apply_if_finite applies the NaN update after 3 errors in a row.
  assert np.isnan(np.asarray(p_theirs["w"])).any()


def test_skip_nonfinite_follows_the_external_flag():
  tx = mpolicy.skip_nonfinite(optax.sgd(1.))
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  good = {"w": jnp.ones(2)}
  updates, new_state = tx.update(good, state, params,
                                 grads_finite=jnp.bool_(False))
  assert same_bits(optax.apply_updates(params, updates), params)
  assert int(new_state.total_notfinite) == 1
  updates, _ = tx.update(good, state, params, grads_finite=jnp.bool_(True))
  assert optax.apply_updates(params, updates)["w"].tolist() == [0., 0.]


def test_skip_nonfinite_then_finite_step_resets_the_run_count():
  tx = mpolicy.skip_nonfinite(optax.sgd(1.))
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  _, state = tx.update({"w": jnp.array([jnp.inf, 0.])}, state, params)
  _, state = tx.update({"w": jnp.ones(2)}, state, params)
  assert int(state.notfinite_count) == 0 and int(state.total_notfinite) == 1
  assert bool(state.last_finite)


def test_for_accumulation_optax_multisteps_drops_a_bad_mini_batch():
  # The recommendation in `skip_nonfinite`'s docstring, checked.
  tx = optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2,
                        should_skip_update_fn=optax.skip_not_finite)
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  _, state = tx.update({"w": jnp.ones(2)}, state, params)
  _, bad_state = tx.update({"w": jnp.array([jnp.nan, 1.])}, state, params)
  assert same_bits(bad_state.inner_opt_state, state.inner_opt_state)
  assert same_bits(bad_state.acc_grads, state.acc_grads)
  assert int(bad_state.mini_step) == int(state.mini_step) == 1


def test_update_if_finite_keeps_everything_on_a_bad_step():
  tx = optax.adam(1e-2)
  params, state = _adam_state_after_steps(tx, {"w": jnp.ones(3)})
  bad = {"w": jnp.array([1., jnp.inf, 1.])}
  new_params, new_state = mpolicy.update_if_finite(
      tx, bad, state, params, mpolicy.all_finite(bad))
  assert same_bits(new_params, params) and same_bits(new_state, state)
  good = {"w": jnp.ones(3)}
  new_params, new_state = mpolicy.update_if_finite(
      tx, good, state, params, jnp.bool_(True))
  assert int(new_state[0].count) == 4
  assert not same_bits(new_params, params)
