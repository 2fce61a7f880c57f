"""The native block-scaled dot: asked for in the CUDA lowering where the
device has one, the same quantized numbers emulated elsewhere."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpolicy
from mpolicy._src.blocks import native
from mpolicy._src.rules import matmul

DN = (((1,), (0,)), ((), ()))
NATIVE_CALL = "__op$block_scaled_dot"
JAX = tuple(int(p) for p in re.findall(r"\d+", jax.__version__)[:2])


def _loss(fmt):
  def loss(x, w):
    y = matmul.block_dot_general(x, w, DN, fmt, out_dtype=jnp.float32,
                                 rhs_param=True)
    return jnp.sum(y ** 2)
  return loss


def _operands():
  x = jax.random.normal(jax.random.PRNGKey(0), (32, 64))
  w = jax.random.normal(jax.random.PRNGKey(1), (64, 32))
  return x, w


def _cuda_text(fn, *args):
  # A new function each time: jit caches traces by the function.
  fresh = lambda *a: fn(*a)
  return jax.jit(fresh).trace(*args).lower(
      lowering_platforms=("cuda",)).as_text()


def test_this_jax_has_scaled_matmul():
  # jax 0.10.2 and 0.12.0.1, the supported ends, both have it.
  assert native.jax_has_it() == hasattr(jax.nn, "scaled_matmul")
  assert native.jax_has_it()


def test_cpu_is_not_a_native_device():
  assert not native.device_supports()
  assert not native.usable("mxfp8", 64, 32)


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_cuda_lowering_asks_for_the_native_dot(monkeypatch, fmt):
  x, w = _operands()
  grad = jax.value_and_grad(_loss(fmt), argnums=(0, 1))
  # Not a Blackwell device: the emulation only, on every platform.
  assert NATIVE_CALL not in _cuda_text(grad, x, w)
  expected = jax.jit(lambda x, w: grad(x, w))(x, w)
  monkeypatch.setattr(native, "device_supports", lambda: True)
  text = _cuda_text(grad, x, w)
  # The forward, d lhs (over N = 32) and d rhs (over M = 32): three.
  assert text.count(f"custom_call @{NATIVE_CALL}") == 3, fmt
  # On CPU the same program multiplies the same quantized numbers.
  got = jax.jit(lambda x, w: grad(x, w))(x, w)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
    np.testing.assert_array_equal(a, b)


def test_mxfp4_and_partial_blocks_stay_emulated(monkeypatch):
  monkeypatch.setattr(native, "device_supports", lambda: True)
  x, w = _operands()
  assert NATIVE_CALL not in _cuda_text(_loss("mxfp4"), x, w)
  # K = 40: not whole blocks of 32, emulated.
  text = _cuda_text(_loss("mxfp8"), x[:, :40], w[:40])
  assert NATIVE_CALL not in text


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_native_product_on_cpu_by_jax_version(fmt):
  x, w = _operands()
  qx = mpolicy.quantize_blocks(x, fmt, -1)
  qw = mpolicy.quantize_blocks(w, fmt, -2, two_d=fmt == "nvfp4")
  emulated = jnp.matmul(mpolicy.dequantize_blocks(qx),
                        mpolicy.dequantize_blocks(qw), precision="highest")
  if JAX >= (0, 12):  # JAX's own CPU lowering of scaled_matmul.
    np.testing.assert_allclose(native.native_matmul(qx, qw, False), emulated,
                               rtol=1e-5, atol=1e-4)
  else:  # 0.10.2 lowers it for CUDA only.
    with pytest.raises(NotImplementedError, match="scaled_matmul"):
      jax.jit(lambda: native.native_matmul(qx, qw, False))()
