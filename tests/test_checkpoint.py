"""Specification of npz checkpoints: format, validation and bitwise resume."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from mpolicy._src import checkpoint
from mpolicy._src import loss_scale as ls_lib
from mpolicy._src import training

from _helpers import same_bits


def test_round_trip_is_bitwise_for_every_dtype(tmp_path):
  special = [0.1, -0.0, np.inf, -np.inf, np.nan, 1e-8]
  tree = {
      "bf16": jnp.asarray(special, jnp.bfloat16),
      "f16": jnp.asarray(special, jnp.float16),
      "f32": jnp.asarray(special, jnp.float32),
      "f8": jnp.asarray([0.5, -2.], jnp.float8_e4m3fn),
      "i32": jnp.arange(3, dtype=jnp.int32),
      "flag": jnp.array(True),
      "np": np.arange(2.0),
  }
  path = tmp_path / "ckpt.npz"
  checkpoint.save_checkpoint(path, tree)
  restored = checkpoint.restore_checkpoint(path, tree)
  assert same_bits(restored, tree)
  assert isinstance(restored["np"], np.ndarray)
  assert isinstance(restored["bf16"], jax.Array)


def test_the_file_is_plain_npz_keyed_by_keystr(tmp_path):
  tree = ({"linear": {"w": jnp.full(2, 1.5, jnp.bfloat16)}}, jnp.ones(3))
  path = tmp_path / "ckpt.npz"
  checkpoint.save_checkpoint(path, tree)
  with np.load(path, allow_pickle=False) as data:
    assert sorted(data.files) == sorted(
        ["[0]['linear']['w']", "[1]", checkpoint.META_KEY])
    bits = data["[0]['linear']['w']"]
    meta = json.loads(str(data[checkpoint.META_KEY]))
  assert bits.dtype == np.uint16
  assert bits.view(jnp.bfloat16).tolist() == [1.5, 1.5]
  assert meta == {"format": "mpolicy.checkpoint", "version": 1,
                  "dtypes": {"[0]['linear']['w']": "bfloat16",
                             "[1]": "float32"}}


def test_restore_lists_every_mismatch(tmp_path):
  path = tmp_path / "ckpt.npz"
  checkpoint.save_checkpoint(path, {"a": jnp.ones(2), "b": jnp.ones(2),
                                    "c": jnp.ones(2, jnp.bfloat16)})
  template = {"a": jnp.ones(3), "c": jnp.ones(2), "d": jnp.ones(1)}
  with pytest.raises(ValueError) as e:
    checkpoint.restore_checkpoint(path, template)
  msg = str(e.value)
  assert "missing from the checkpoint: ['d']" in msg
  assert "in the checkpoint but not in the template: ['b']" in msg
  assert "['a']: checkpoint has float32[2], template wants float32[3]" in msg
  assert "['c']: checkpoint has bfloat16[2], template wants float32[2]" in msg


def test_restore_rejects_a_foreign_npz(tmp_path):
  path = tmp_path / "other.npz"
  np.savez(path, w=np.ones(2))
  with pytest.raises(ValueError, match="not an mpolicy checkpoint"):
    checkpoint.restore_checkpoint(path, {"w": jnp.ones(2)})


def test_restore_into_an_eval_shape_template(tmp_path):
  tx = training.skip_nonfinite(optax.adam(1e-3))
  init = lambda: (tx.init({"w": jnp.ones(3, jnp.bfloat16)}),
                  ls_lib.DynamicLossScale(2. ** 15, period=7))
  state = init()
  path = tmp_path / "ckpt.npz"
  checkpoint.save_checkpoint(path, state)
  restored = checkpoint.restore_checkpoint(path, jax.eval_shape(init))
  assert same_bits(restored, state)
  assert restored[1].period == 7


def test_weak_scalars_come_back_weak(tmp_path):
  tree = {"lr": jnp.asarray(1e-3), "ls": jnp.float32(2.)}
  path = tmp_path / "ckpt.npz"
  checkpoint.save_checkpoint(path, tree)
  restored = checkpoint.restore_checkpoint(path, tree)
  assert restored["lr"].weak_type and not restored["ls"].weak_type


@jax.custom_vjp
def _poison(x, factor):
  del factor
  return x


_poison.defvjp(lambda x, f: (x, f),
               lambda f, ct: (ct * f.astype(ct.dtype), jnp.zeros_like(f)))


def _loss(params, x, y, factor):
  p = jax.tree_util.tree_map(lambda v: v.astype(jnp.float16), params)
  h = jnp.tanh(x.astype(jnp.float16) @ _poison(p["w1"], factor))
  out = (h @ p["w2"]).astype(jnp.float32)
  return jnp.mean((out - y) ** 2)


def test_resume_is_bitwise_identical_to_an_uninterrupted_run(tmp_path):
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
  params32 = {"w1": jax.random.normal(k1, (4, 16)) * 0.5,
              "w2": jax.random.normal(k2, (16, 1)) * 0.3}
  x = jax.random.normal(k3, (64, 4))
  y = jnp.cos(x[:, :1])
  tx = training.skip_nonfinite(training.master_weights(optax.adam(1e-2)))
  grad_fn = training.scaled_value_and_grad(_loss, grad_dtype=jnp.float32)

  @jax.jit
  def step(params, opt_state, loss_scale, factor):
    loss_scale, finite, _, grads = grad_fn(loss_scale, params, x, y, factor)
    updates, opt_state = tx.update(grads, opt_state, params,
                                   grads_finite=finite)
    return optax.apply_updates(params, updates), opt_state, loss_scale

  bad = {3, 8, 9}  # Steps with an injected inf: the skip state matters too.

  def run(state, steps):
    for i in steps:
      factor = jnp.float32(jnp.inf if i in bad else 1.)
      state = step(*state, factor)
    return state

  def fresh():
    half, opt_state = training.init_master_weights(tx, params32, jnp.float16)
    return half, opt_state, ls_lib.DynamicLossScale(2. ** 15, period=4)

  uninterrupted = run(fresh(), range(16))
  path = tmp_path / "step6.npz"
  checkpoint.save_checkpoint(path, run(fresh(), range(6)))
  template = jax.tree_util.tree_map(jnp.zeros_like, fresh())
  resumed = run(checkpoint.restore_checkpoint(path, template), range(6, 16))
  assert same_bits(resumed, uninterrupted)
  assert int(resumed[1].total_notfinite) >= len(bad)
