"""marin#7659: under gradient accumulation the last microbatch's loss scale
(or amax) won, so an overflow in an earlier microbatch went unseen.

mpolicy instead: one loss scale serves every microbatch of a step and adjusts
once, from all of them. An overflow in the first microbatch skips the step
and backs the scale off once; a clean step grows it once, not once per
microbatch. (Float8 keeps no amax between microbatches at all: see
test_fp8_microbatch_scales.py.)
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpolicy

K = 4  # Microbatch i holds rows i, i + K, ... (strided).


def loss_fn(params, x):
  return jnp.mean(params["w"] * x)


def step_on(x):
  tx = optax.sgd(0.1)
  params = {"w": jnp.arange(1.0, 4.0)}
  scale = mpolicy.DynamicLossScale(jnp.float32(2.0 ** 10), period=1)
  step = jax.jit(mpolicy.make_train_step(loss_fn, tx, microbatches=K))
  return params, step(params, tx.init(params), scale, x)


@pytest.mark.parametrize("bad_row", [0, K - 1], ids=["first", "last"])
def test_an_overflow_in_any_microbatch_skips_the_step(bad_row):
  x = np.ones((2 * K, 3), np.float32)
  x[bad_row, 1] = np.inf  # Microbatch `bad_row` only.
  params, out = step_on(jnp.asarray(x))
  assert not bool(out.grads_finite)
  np.testing.assert_array_equal(out.params["w"], params["w"])
  assert float(out.loss_scale.loss_scale) == 2.0 ** 9  # Halved once.


def test_a_clean_step_grows_the_scale_once():
  _, out = step_on(jnp.ones((2 * K, 3), jnp.float32))
  assert bool(out.grads_finite)
  # period=1: one growth per step, not one per microbatch (2 ** 14).
  assert float(out.loss_scale.loss_scale) == 2.0 ** 11
  assert int(out.loss_scale.counter) == 0
