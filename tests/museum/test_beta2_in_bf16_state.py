"""Optimisers.jl#215: Adam's beta2 = 0.999 rounded to 1.0 in bfloat16 state
(0.999 is no bfloat16 number), so the second moment never grew.

mpolicy instead: `with_state_dtypes(tx, jnp.bfloat16)` stores Adam's state
in bfloat16 but runs the update in float32 with the optimizer's own float32
constants: after one step the second moment is (1 - 0.999) g**2, rounded
once to bfloat16, and ten steps track float32 Adam's updates.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import mpolicy

BF16 = jnp.bfloat16


def _field(state, name):
  """The first ``name`` field found in the optimizer state."""
  for node in jax.tree_util.tree_leaves(
      state, is_leaf=lambda n: hasattr(n, name)):
    if hasattr(node, name):
      return getattr(node, name)
  raise AssertionError(f"no {name!r} in {state}")


def test_beta2_is_no_bfloat16_number():
  assert float(jnp.asarray(0.999, BF16)) == 1.0  # The failure's cause.


def test_second_moment_after_one_step():
  g = {"w": jnp.array([0.5, -2.0, 3.0], jnp.float32)}
  tx = mpolicy.with_state_dtypes(optax.adam(1e-3), BF16)
  params = {"w": jnp.zeros(3, jnp.float32)}
  _, state = jax.jit(tx.update)(g, tx.init(params), params)
  nu = _field(state, "nu")["w"]
  assert nu.dtype == BF16
  want = np.asarray((1 - 0.999) * g["w"] ** 2, np.float32)
  assert np.all(np.asarray(nu, np.float32) > 0)  # beta2 = 1.0 gives 0.
  np.testing.assert_allclose(np.asarray(nu, np.float32), want, rtol=2 ** -8)


def test_ten_steps_track_float32_adam():
  rng = np.random.default_rng(0)
  grads = [{"w": jnp.asarray(rng.normal(size=4), jnp.float32)}
           for _ in range(10)]
  params = {"w": jnp.zeros(4, jnp.float32)}
  ours, ref = mpolicy.with_state_dtypes(optax.adam(1e-3), BF16), optax.adam(1e-3)
  s_ours, s_ref = ours.init(params), ref.init(params)
  update_ours, update_ref = jax.jit(ours.update), jax.jit(ref.update)
  for g in grads:
    u_ours, s_ours = update_ours(g, s_ours, params)
    u_ref, s_ref = update_ref(g, s_ref, params)
    # Within 1% of the step size (beta2 = 1.0 would give g / eps).
    np.testing.assert_allclose(u_ours["w"], u_ref["w"], atol=1e-5)
