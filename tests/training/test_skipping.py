"""Specification of skip_nonfinite and update_if_finite: bad steps change nothing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

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


def test_a_flag_that_says_finite_does_not_let_a_nan_update_through():
  # E.g. the last mini-batch's flag while the updates are an accumulated sum.
  tx = mpolicy.skip_nonfinite(optax.sgd(1.))
  params = {"w": jnp.ones(2)}
  updates, state = tx.update({"w": jnp.array([jnp.nan, 1.])}, tx.init(params),
                             params, grads_finite=jnp.bool_(True))
  assert same_bits(optax.apply_updates(params, updates), params)
  assert int(state.total_notfinite) == 1 and not bool(state.last_finite)


# --- Gradient accumulation: skip_nonfinite(optax.MultiSteps(tx, k)) -----------

NAN = jnp.array([jnp.nan, 1.])


def _accumulate(tx, grads, flags, params):
  """Feeds mini-batches with their flags; params and state after each."""
  state = tx.init(params)
  seen = []
  for g, finite in zip(grads, flags):
    updates, state = tx.update({"w": g}, state, params,
                               grads_finite=jnp.bool_(finite))
    params = optax.apply_updates(params, updates)
    seen.append((params, state))
  return seen


def test_multisteps_inside_skip_drops_a_bad_mini_batch_and_keeps_state():
  tx = mpolicy.skip_nonfinite(optax.MultiSteps(optax.sgd(0.5), 3))
  p0 = {"w": jnp.array([1., 2.])}
  grads = [jnp.ones(2), NAN, jnp.full(2, 2.), jnp.full(2, 6.)]
  seen = _accumulate(tx, grads, [True, False, True, True], p0)
  (p1, s1), (p2, s2), (p3, _), (p4, s4) = seen
  # The bad mini-batch: MultiSteps' accumulator, mini-step and inner state
  # and the params come back bit for bit; only the skip's counters move.
  assert same_bits(s2.inner_state, s1.inner_state)
  assert int(s2.inner_state.mini_step) == 1
  assert same_bits(p2, p1) and same_bits(p1, p0) and same_bits(p3, p0)
  assert int(s2.total_notfinite) == 1 and int(s4.notfinite_count) == 0
  # The window closes after 3 finite mini-batches: sgd on their mean.
  np.testing.assert_array_equal(p4["w"], p0["w"] - 0.5 * (1. + 2. + 6.) / 3)
  assert int(s4.inner_state.mini_step) == 0
  assert int(s4.inner_state.gradient_step) == 1


def test_multisteps_params_never_nan_whatever_mini_batch_is_bad():
  # k=2, a bad mini-batch at every position of a window, finite values
  # elsewhere; one update per two finite mini-batches, by hand.
  tx = mpolicy.skip_nonfinite(optax.MultiSteps(optax.sgd(1.), 2))
  p0 = {"w": jnp.zeros(2)}
  grads = [NAN, jnp.ones(2), jnp.array([jnp.inf, 0.]), jnp.full(2, 3.),
           jnp.full(2, 5.), NAN, jnp.full(2, 7.)]
  flags = [False, True, False, True, True, False, True]
  want = [0., 0., 0., -2., -2., -2., -8.]
  for (params, _), w in zip(_accumulate(tx, grads, flags, p0), want):
    np.testing.assert_array_equal(params["w"], [w, w])


def test_skip_inside_multisteps_is_refused_with_the_composition_to_use():
  tx = optax.MultiSteps(mpolicy.skip_nonfinite(optax.sgd(1.)), 2)
  params = {"w": jnp.ones(2)}
  with pytest.raises(ValueError, match=r"skip_nonfinite inside optax.MultiSteps"
                     r".*0 \* NaN is NaN.*Put the skip outside: "
                     r"skip_nonfinite\(optax.MultiSteps\(tx, k\)\)"):
    jax.jit(tx.update)({"w": jnp.ones(2)}, tx.init(params), params)


def test_skip_inside_a_multisteps_that_drops_bad_mini_batches_is_allowed():
  tx = optax.MultiSteps(mpolicy.skip_nonfinite(optax.sgd(1.)), 2,
                        should_skip_update_fn=optax.skip_not_finite)
  seen = _accumulate(tx, [jnp.ones(2), NAN, jnp.full(2, 3.)],
                     [True, False, True], {"w": jnp.zeros(2)})
  np.testing.assert_array_equal(seen[-1][0]["w"], [-2., -2.])


def test_the_loss_scale_advances_once_per_mini_batch_in_the_optax_recipe():
  # The documented recipe: one scaled_value_and_grad per mini-batch, so the
  # loss scale's period counts mini-batches and it backs off on the bad one.
  loss_fn = lambda p, x: jnp.sum(p["w"] * x)
  grad_fn = mpolicy.scaled_value_and_grad(loss_fn)
  tx = mpolicy.skip_nonfinite(optax.MultiSteps(optax.sgd(1.), 2))
  params = {"w": jnp.zeros(2)}
  state = tx.init(params)
  loss_scale = DynamicLossScale(jnp.float32(2. ** 10), period=2)
  scales = []
  for x in [jnp.ones(2), jnp.full(2, jnp.inf), jnp.ones(2), jnp.ones(2),
            jnp.ones(2)]:
    loss_scale, finite, _, grads = grad_fn(loss_scale, params, x)
    updates, state = tx.update(grads, state, params, grads_finite=finite)
    params = optax.apply_updates(params, updates)
    scales.append(float(loss_scale.loss_scale))
  assert scales == [2. ** 10, 2. ** 9, 2. ** 9, 2. ** 10, 2. ** 10]
  assert int(state.inner_state.gradient_step) == 2  # Two optimizer steps.
  np.testing.assert_array_equal(params["w"], [-2., -2.])


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
