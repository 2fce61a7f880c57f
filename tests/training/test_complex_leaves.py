"""Complex leaves in the training helpers: trained, checked, never cast.

Floating means real floating everywhere in mpolicy. A complex parameter is
differentiated, unscaled, averaged and checked for finiteness like any
gradient, but no helper casts it: not `grad_dtype`, not `master_weights`
(it has no half copy and no master in another dtype), not a skipped step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import mpolicy

from _helpers import same_bits

C = jnp.array([1 + 2j, -0.5 + 0.25j], jnp.complex64)
R = jnp.array([1.0, -2.0], jnp.float32)


def _loss(p):
  return jnp.sum(jnp.abs(p["c"]) ** 2) + jnp.sum(p["r"] ** 2)


def _params():
  return {"c": C, "r": R}


def test_complex_grads_are_unscaled_like_real_ones():
  ls = mpolicy.DynamicLossScale(jnp.float32(2. ** 15))
  _, finite, _, grads = mpolicy.scaled_value_and_grad(_loss)(ls, _params())
  want = jax.grad(_loss)(_params())
  assert bool(finite)
  assert grads["c"].dtype == jnp.complex64
  np.testing.assert_array_equal(grads["c"], want["c"])
  np.testing.assert_array_equal(grads["r"], want["r"])


def test_grad_dtype_leaves_complex_grads_in_their_own_dtype():
  ls = mpolicy.StaticLossScale(jnp.float32(4.))
  _, _, _, grads = mpolicy.scaled_value_and_grad(
      _loss, grad_dtype=jnp.bfloat16)(ls, _params())
  assert grads["r"].dtype == jnp.bfloat16
  assert grads["c"].dtype == jnp.complex64
  np.testing.assert_array_equal(grads["c"], jax.grad(_loss)(_params())["c"])


def test_a_nonfinite_imaginary_part_is_flagged_and_named():
  def loss(p):
    return _loss(p) + jnp.sum(jnp.imag(p["c"]) * jnp.array([0., jnp.inf]))

  ls = mpolicy.DynamicLossScale(jnp.float32(2. ** 15))
  new_ls, finite, _, grads, flags = mpolicy.scaled_value_and_grad(
      loss, attribute_overflow=True)(ls, _params())
  assert not bool(finite)
  assert float(new_ls.loss_scale) == 2. ** 14
  assert np.isfinite(np.real(grads["c"])).all()
  assert mpolicy.nonfinite_paths(flags) == ["c"]


def test_master_weights_leave_complex_params_alone():
  tx = mpolicy.master_weights(optax.sgd(0.5))
  half, state = mpolicy.init_master_weights(tx, _params(), jnp.bfloat16)
  assert half["r"].dtype == jnp.bfloat16
  assert half["c"].dtype == jnp.complex64
  np.testing.assert_array_equal(half["c"], C)
  assert state.master["c"].dtype == jnp.complex64
  np.testing.assert_array_equal(state.master["c"], C)

  grads = {"c": jnp.array([2 - 4j, 1j], jnp.complex64),
           "r": jnp.ones(2, jnp.bfloat16)}
  updates, state = tx.update(grads, state, half)
  assert updates["c"].dtype == jnp.complex64
  new = optax.apply_updates(half, updates)
  want = C - 0.5 * grads["c"]
  np.testing.assert_array_equal(new["c"], want)
  np.testing.assert_array_equal(state.master["c"], want)
  back = mpolicy.params_from_master(state, half)
  assert back["c"].dtype == jnp.complex64
  np.testing.assert_array_equal(back["c"], want)


def test_a_skipped_step_keeps_complex_params_bit_for_bit():
  zeros = jnp.array([complex(-0.0, -0.0), complex(0.0, -0.0),
                     complex(-0.0, 0.0)], jnp.complex64)
  params = {"c": zeros}
  tx = mpolicy.skip_nonfinite(optax.sgd(0.1))
  state = tx.init(params)
  bad = {"c": jnp.full(3, complex(np.nan, 0.0), jnp.complex64)}
  updates, state = tx.update(bad, state, params)
  new = optax.apply_updates(params, updates)
  assert int(state.total_notfinite) == 1
  assert same_bits(new, params)


def test_complex_grads_are_averaged_over_devices_in_their_own_dtype():
  # reduce_dtype is a real dtype: it applies to the real floating leaves.
  grad_fn = jax.pmap(mpolicy.scaled_value_and_grad(_loss, axis_name="d"),
                     axis_name="d")
  one = lambda x: jax.tree_util.tree_map(lambda a: a[None], x)
  ls = mpolicy.DynamicLossScale(jnp.float32(2. ** 15))
  _, finite, _, grads = grad_fn(one(ls), one(_params()))
  want = jax.grad(_loss)(_params())
  assert bool(finite[0])
  assert grads["c"].dtype == jnp.complex64
  np.testing.assert_array_equal(grads["c"][0], want["c"])
