"""Automodel PR #3530: the gradient accumulator was wiped in the middle of a
step, so the microbatches before the wipe were lost.

mpolicy instead: the microbatches' gradients are summed in a float32 carry
of one `lax.scan` that nothing resets within a step: a step whose signal is
in its first microbatch only updates by that microbatch's gradient divided
by their number, as one whose signal is in its last. A retried attempt
(`max_retries`) restarts from zero, neither losing microbatches nor adding
the overflowed attempt's.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpolicy

K = 4


def loss_fn(params, x):
  return jnp.mean(x @ params["w"])


def _run(x, scale, **options):
  params = {"w": jnp.zeros((3,), jnp.float32)}
  tx = optax.sgd(1.0)  # From zero: the new params are minus the gradient.
  step = jax.jit(mpolicy.make_train_step(loss_fn, tx, microbatches=K,
                                         **options))
  return step(params, tx.init(params), scale, x)


@pytest.mark.parametrize("microbatch", [0, 1, K - 1])
def test_only_one_microbatch_has_signal_and_it_arrives(microbatch):
  x = np.zeros((2 * K, 3), np.float32)
  x[microbatch::K] = [[1.0, 2.0, 3.0], [5.0, 6.0, 7.0]]  # Its two rows.
  out = _run(jnp.asarray(x), mpolicy.NoOpLossScale())
  # The batch mean's gradient: the sum of the signal rows over 2 K rows.
  np.testing.assert_allclose(-np.asarray(out.params["w"]),
                             np.array([6.0, 8.0, 10.0]) / (2 * K), rtol=1e-6)


def test_a_retried_step_restarts_its_accumulator():
  x = np.zeros((2 * K, 3), np.float32)
  x[0::K] = [2.0, 3.0, 3.5]
  x[K - 1::K] = [3.0, 2.0, 2.0]
  # Each microbatch's gradient is in [2, 4): 2 ** 127 times it overflows
  # float32, 2 ** 126 times it does not.
  scale = mpolicy.DynamicLossScale(jnp.float32(2.0 ** 127))
  out = _run(jnp.asarray(x), scale, max_retries=1)
  assert bool(out.grads_finite)
  assert float(out.loss_scale.loss_scale) == 2.0 ** 126
  np.testing.assert_allclose(-np.asarray(out.params["w"]),
                             np.array([5.0, 5.0, 5.5]) / K, rtol=1e-6)
