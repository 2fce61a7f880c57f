"""jax#27496: gradients were all-reduced across devices in bfloat16, each
partial sum rounded to 8 significant bits, so small contributions vanished.

mpolicy instead: `scaled_value_and_grad(axis_name=...)` (and
`make_train_step`) average half gradients across devices in float32
(`reduce_dtype`'s default) and round once, to the gradient's dtype: the
collective's operands are float32, and a gradient of 256 on one device and
1 on seven others averages to 263 / 8, not to the bfloat16 sum's 256 / 8.
"""

import jax
import jax.numpy as jnp
import numpy as np

import mpolicy

BF16 = jnp.bfloat16
DEVICES = 8


def loss_fn(params, x):
  return jnp.sum(params["w"].astype(jnp.float32) * x)  # Gradient: x.


def _grads():
  g = mpolicy.scaled_value_and_grad(loss_fn, axis_name="data")
  params = {"w": jnp.ones((2,), BF16)}
  x = jnp.ones((DEVICES, 2), jnp.float32).at[0].set(256.0)

  def one_device(x):
    return g(mpolicy.NoOpLossScale(), params, x)[3]["w"]

  # vmap with an axis name stands for 8 devices: psum is its all-reduce.
  fn = jax.jit(jax.vmap(one_device, axis_name="data"))
  return fn, x


def test_the_all_reduce_runs_on_float32_operands():
  fn, x = _grads()
  text = str(jax.make_jaxpr(fn)(x))
  psums = [line for line in text.splitlines() if "psum" in line]
  assert psums, text
  for line in psums:
    assert "bf16" not in line.split("=")[0] and "f32" in line, line


def test_small_contributions_survive():
  fn, x = _grads()
  got = fn(x)
  assert got.dtype == BF16
  want = jnp.asarray(263.0 / 8, BF16)  # Rounded once: 32.75.
  np.testing.assert_array_equal(np.asarray(got, np.float32),
                                np.full((DEVICES, 2), float(want)))
  # What a bfloat16 all-reduce gives: 256 + 1 rounds back to 256.
  acc = np.zeros((), BF16)
  for v in np.asarray(x[:, 0]).astype(BF16):
    acc = (acc + v).astype(BF16)
  assert float(acc) / 8 == 32.0 != float(want)
