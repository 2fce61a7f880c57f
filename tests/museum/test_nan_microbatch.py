"""flaxchat#6: a microbatch with a NaN gradient still changed the optimizer
state (Adam's moments took the NaN, or the skipped step's moments advanced).

mpolicy instead: a non-finite gradient in any microbatch skips the whole
step: params and every leaf of the optimizer state come back bit for bit,
the loss scale backs off, and the next clean step trains as if the bad one
never happened.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import mpolicy

K = 4


def loss_fn(params, x):
  return jnp.mean(jnp.tanh(x @ params["w"]) ** 2)


def _bits(tree):
  return [np.asarray(a).tobytes() for a in jax.tree_util.tree_leaves(tree)]


def test_a_nan_microbatch_leaves_params_and_adam_state_bit_for_bit():
  rng = np.random.default_rng(0)
  tx = optax.adam(1e-2)
  step = jax.jit(mpolicy.make_train_step(loss_fn, tx, microbatches=K))
  params = {"w": jnp.asarray(rng.normal(size=(3, 2)), jnp.float32)}
  x = jnp.asarray(rng.normal(size=(2 * K, 3)), jnp.float32)
  scale = mpolicy.DynamicLossScale(jnp.float32(2.0 ** 15))
  # One clean step first, so that Adam's moments and count are not zeros.
  out = step(params, tx.init(params), scale, x)
  assert bool(out.grads_finite)
  params, opt_state, scale = out.params, out.opt_state, out.loss_scale
  bad = x.at[2, 1].set(jnp.nan)  # Row 2: the third microbatch only.
  skipped = step(params, opt_state, scale, bad)
  assert not bool(skipped.grads_finite)
  assert _bits(skipped.params) == _bits(params)
  assert _bits(skipped.opt_state) == _bits(opt_state)
  assert float(skipped.loss_scale.loss_scale) == 2.0 ** 14
  # The next clean step is the one the bad step would have been.
  after = step(skipped.params, skipped.opt_state, skipped.loss_scale, x)
  direct = step(params, opt_state, scale, x)
  assert _bits(after.params) == _bits(direct.params)
  assert _bits(after.opt_state) == _bits(direct.opt_state)
