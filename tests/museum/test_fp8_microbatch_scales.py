"""MaxText PR #5021: float8 scales were overwritten across microbatches, so
one microbatch was quantized with another's scale (a small one flushed to
zero by a large one's).

mpolicy instead: float8 scaling is current (scale = amax / 448 of each
operand, computed in the same step), so there is no scale to carry or
overwrite: under `make_train_step(microbatches=2)` each microbatch is
quantized with its own amax, and the accumulated gradient is the mean of
the gradients each microbatch gives alone, even where their magnitudes
differ by 10 ** 6.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import mpolicy

K = 2
RULES = mpolicy.DEFAULT_RULES.with_fp8(min_size=0, scaling="per_tensor")
FP8 = mpolicy.amp(lambda x, w: x @ w, "p=f32,c=f8,o=bf16", rules=RULES)


def loss_fn(params, x):
  return jnp.mean(jnp.sum(FP8(x, params["w"]).astype(jnp.float32), -1))


# An optimizer that keeps the gradient it was given as its state.
RECORD = optax.GradientTransformation(
    lambda params: params, lambda grads, state, params=None: (grads, grads))


def _batch():
  rng = np.random.default_rng(0)
  x = np.zeros((4 * K, 8), np.float32)
  x[0::K, :4] = 1e-3 * rng.uniform(0.5, 1.0, size=(4, 4))  # Microbatch 0.
  x[1::K, 4:] = 1e3 * rng.uniform(0.5, 1.0, size=(4, 4))  # Microbatch 1.
  return jnp.asarray(x)


def test_float8_runs_here():
  report = mpolicy.explain(FP8, jnp.ones((4, 8)), jnp.ones((8, 3)))
  assert [r.ran_in for r in report.rows] == ["float8_e4m3fn"]


def test_each_microbatch_is_quantized_with_its_own_scale():
  x = _batch()
  params = {"w": jnp.asarray(
      np.random.default_rng(1).uniform(0.5, 1.0, size=(8, 3)), jnp.float32)}
  step = jax.jit(mpolicy.make_train_step(loss_fn, RECORD, microbatches=K))
  out = step(params, RECORD.init(params), mpolicy.NoOpLossScale(), x)
  got = np.asarray(out.opt_state["w"])  # The step's gradient.
  grad = jax.jit(jax.grad(loss_fn))
  alone = [np.asarray(grad(params, x[i::K])["w"]) for i in range(K)]
  np.testing.assert_allclose(got, sum(alone) / K, rtol=1e-5)
  # Microbatch 0's rows of the gradient (its columns of x) are its own,
  # within float8's precision of float32: with microbatch 1's scale they
  # would be zeros.
  # d loss / d w[j, :] is the mean of x[:, j] (halved: one microbatch of 2).
  exact = np.repeat(np.asarray(x[0::K]).mean(0)[:, None], 3, 1) / K
  assert np.abs(exact[:4]).max() > 1e-4
  np.testing.assert_allclose(got[:4], exact[:4], rtol=0.1)
