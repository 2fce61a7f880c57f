"""Specification of master_weights(storage="low_bits"): an exact float32
master kept as bfloat16 params (its top 16 bits) plus 16 low bits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpolicy
from mpolicy._src.training import low_bits

from _helpers import same_bits

from mpolicy import checkpoint


def _params32():
  k1, k2 = jax.random.split(jax.random.PRNGKey(0))
  return {"a": jax.random.normal(k1, (64, 32)) * 0.05,
          "b": jnp.zeros(32),
          "c": jax.random.normal(k2, (7,))}


def _grads(i, like):
  key = jax.random.PRNGKey(100 + i)
  return jax.tree_util.tree_map(
      lambda p: jax.random.normal(key, p.shape).astype(jnp.bfloat16), like)


def _master(state, half):
  return mpolicy.params_from_master(
      state, jax.tree_util.tree_map(lambda p: p.astype(jnp.float32), half))


def _adam(state_dtype):
  if state_dtype is None:
    return optax.adam(3e-3)
  return mpolicy.with_state_dtypes(optax.adam(3e-3), state_dtype,
                                   rounding="stochastic")


@pytest.mark.parametrize("state_dtype", [None, jnp.bfloat16])
def test_the_master_follows_full_storage_bit_for_bit(state_dtype):
  full_tx = mpolicy.master_weights(_adam(state_dtype))
  low_tx = mpolicy.master_weights(_adam(state_dtype), storage="low_bits")
  full_half, full = mpolicy.init_master_weights(full_tx, _params32(),
                                                jnp.bfloat16)
  half, low = mpolicy.init_master_weights(low_tx, _params32(), jnp.bfloat16)
  assert same_bits(_master(low, half), full.master)
  for i in range(12):
    grads = _grads(i, half)
    updates, low = low_tx.update(grads, low, half)
    half = optax.apply_updates(half, updates)
    full_updates, full = full_tx.update(grads, full, full_half)
    full_half = optax.apply_updates(full_half, full_updates)
    assert same_bits(_master(low, half), full.master), i
    # The params are the master's top 16 bits, truncated toward zero.
    assert same_bits(half, jax.tree_util.tree_map(
        lambda m: low_bits.split(m)[0], full.master))
  assert jax.tree_util.tree_map(lambda x: x.dtype, low.low_bits) == {
      "a": jnp.uint16, "b": jnp.uint16, "c": jnp.uint16}


def test_params_truncate_toward_zero_where_nearest_would_round_up():
  x = jnp.array([1.0 + 2. ** -8 + 2. ** -12, -(1.0 + 2. ** -8 + 2. ** -12)])
  tx = mpolicy.master_weights(optax.sgd(0.), storage="low_bits")
  half, state = mpolicy.init_master_weights(tx, {"w": x}, jnp.bfloat16)
  assert half["w"].tolist() == [1.0, -1.0]  # Nearest gives +-1.0078125.
  assert x.astype(jnp.bfloat16).tolist() == [1.0078125, -1.0078125]
  assert same_bits(_master(state, half), {"w": x})


def test_eight_bytes_per_parameter_with_bfloat16_moments():
  tx = mpolicy.master_weights(_adam(jnp.bfloat16), storage="low_bits")
  params = {"w": jnp.zeros((256, 256))}
  half, state = mpolicy.init_master_weights(tx, params, jnp.bfloat16)
  nbytes = lambda t: sum(x.nbytes for x in jax.tree_util.tree_leaves(t))
  count = 256 * 256
  counters = nbytes(state) + nbytes(half) - 8 * count
  assert 0 <= counters <= 16  # Adam's count and the rounding's counter.
  full_tx = mpolicy.master_weights(_adam(jnp.bfloat16))
  full_half, full = mpolicy.init_master_weights(full_tx, params, jnp.bfloat16)
  assert nbytes(full) + nbytes(full_half) - counters == 10 * count


def test_a_float32_param_is_its_own_master():
  tx = mpolicy.master_weights(optax.adam(1e-2), storage="low_bits")
  params = {"h": jnp.array([0.3, -1.7]), "f": jnp.array([0.3, -1.7])}
  state = tx.init(params)
  half = {"h": params["h"].astype(jnp.bfloat16), "f": params["f"]}
  plain_tx = optax.adam(1e-2)
  plain = plain_tx.init(params["f"])
  for i in range(5):
    g = jnp.array([1., -2.]) * (i + 1)
    updates, state = tx.update({"h": g, "f": g}, state, half)
    half = optax.apply_updates(half, updates)
    u, plain = plain_tx.update(g, plain, params["f"])
    params = {"f": optax.apply_updates(params["f"], u)}
  assert half["f"].dtype == jnp.float32
  assert same_bits(half["f"], params["f"])
  assert same_bits(_master(state, half)["f"], params["f"])


def test_a_weight_shrinking_past_float32s_reach_keeps_the_nearest_master():
  # 1.0 -> 1.5 * 2**-30 in one step: 1.5 * 2**-30 - 1 is no float32, so
  # `apply_updates` cannot write the new top bits; the kept master is then
  # the nearest one the written weight's 16 low bits give.
  p = jnp.array([1.0], jnp.bfloat16)
  master = jnp.array([1.0078125 * 2. ** -30], jnp.float32)
  update, low = low_bits.written(p, master)
  w = optax.apply_updates(p, update)
  kept = low_bits.join(w, low)
  assert float(w[0]) != float(low_bits.split(master)[0][0])
  assert abs(float(kept[0]) - float(master[0])) <= 2. ** -24
  # The usual case: the top bits are written and the master kept exactly.
  update, low = low_bits.written(p, jnp.array([0.75 + 2. ** -20]))
  w = optax.apply_updates(p, update)
  assert float(low_bits.join(w, low)[0]) == 0.75 + 2. ** -20


def test_skipped_steps_and_the_train_step_keep_everything():
  def loss_fn(params, x):
    return jnp.mean((x.astype(jnp.bfloat16) @ params["w"]).astype(
        jnp.float32) ** 2)

  tx = mpolicy.master_weights(optax.adam(1e-2), storage="low_bits")
  params, state = mpolicy.init_master_weights(
      tx, {"w": jax.random.normal(jax.random.PRNGKey(1), (8, 4))},
      jnp.bfloat16)
  step = jax.jit(mpolicy.make_train_step(loss_fn, optax.adam(1e-2),
                                         param_rounding="low_bits"))
  x = jax.random.normal(jax.random.PRNGKey(2), (16, 8))
  out = step(params, state, mpolicy.NoOpLossScale(), x)
  assert bool(out.grads_finite)
  assert not same_bits(out.params, params)
  assert isinstance(out.opt_state, mpolicy.LowBitsMasterState)
  bad = step(out.params, out.opt_state, mpolicy.NoOpLossScale(), x * jnp.inf)
  assert not bool(bad.grads_finite)
  assert same_bits(bad.params, out.params)
  assert same_bits(bad.opt_state, out.opt_state)


def test_checkpoints_save_and_restore_the_low_bits(tmp_path):
  tx = mpolicy.master_weights(optax.adam(3e-3), storage="low_bits")
  half, state = mpolicy.init_master_weights(tx, _params32(), jnp.bfloat16)

  def run(half, state, steps):
    for i in steps:
      updates, state = tx.update(_grads(i, half), state, half)
      half = optax.apply_updates(half, updates)
    return half, state

  straight = run(half, state, range(6))
  checkpoint.save_checkpoint(tmp_path / "ckpt", run(half, state, range(3)))
  restored = checkpoint.restore_checkpoint(tmp_path / "ckpt", (half, state))
  assert restored[1].low_bits["a"].dtype == jnp.uint16
  assert same_bits(run(*restored, range(3, 6)), straight)


def test_bad_storage_and_dtypes_are_named():
  with pytest.raises(ValueError, match=r"storage must be one of \('full', "
                     r"'low_bits'\).*got 'low'"):
    mpolicy.master_weights(optax.sgd(1.), storage="low")
  with pytest.raises(ValueError, match="master_dtype must be float32; got "
                     "float64"):
    mpolicy.master_weights(optax.sgd(1.), jnp.float64, storage="low_bits")
  tx = mpolicy.master_weights(optax.sgd(1.), storage="low_bits")
  with pytest.raises(ValueError, match="needs bfloat16 .* got a float16 "
                     "param.*storage='full'"):
    tx.init({"w": jnp.ones(2, jnp.float16)})
  with pytest.raises(ValueError, match="param_dtype float16 is not"):
    mpolicy.init_master_weights(tx, {"w": jnp.ones(2)}, jnp.float16)
  state = tx.init({"w": jnp.ones(2)})
  with pytest.raises(ValueError, match="got a float16 param"):
    tx.update({"w": jnp.ones(2)}, state, {"w": jnp.ones(2, jnp.float16)})
  with pytest.raises(ValueError, match="param_rounding must be 'nearest', "
                     "'stochastic' or 'low_bits', got 'exact'"):
    mpolicy.make_train_step(lambda p: 0., optax.sgd(1.),
                            param_rounding="exact")
