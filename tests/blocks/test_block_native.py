"""The native block-scaled dot: asked for in the CUDA lowering where the
device has one, the same quantized numbers emulated elsewhere."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
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


def _gpt_step(fmt):
  """One `make_train_step` of a one-block GPT-ish model (embedding,
  attention, MLP, unembedding) under ``c=fmt``: five weight matmuls, every
  contraction (forward K, d lhs's N, d rhs's M = 64 tokens) whole blocks."""
  d, vocab, heads = 64, 64, 2
  k = jax.random.split(jax.random.PRNGKey(0), 6)
  init = lambda key, shape: jax.random.normal(key, shape) * 0.1
  params = {"embed": init(k[0], (vocab, d)), "qkv": init(k[1], (d, 3 * d)),
            "out": init(k[2], (d, d)), "up": init(k[3], (d, 4 * d)),
            "down": init(k[4], (4 * d, d)), "unembed": init(k[5], (d, vocab))}

  def loss(p, tokens):
    x = p["embed"][tokens]  # [B, T, D]
    q, k, v = jnp.split(x @ p["qkv"], 3, axis=-1)
    split = lambda t: t.reshape(*t.shape[:2], heads, -1)
    att = jax.nn.softmax(jnp.einsum("bthd,bshd->bhts", split(q), split(k)))
    y = jnp.einsum("bhts,bshd->bthd", att, split(v)).reshape(x.shape)
    x = x + y @ p["out"]
    x = x + jax.nn.gelu(x @ p["up"]) @ p["down"]
    logits = (x @ p["unembed"]).astype(jnp.float32)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits),
                                         tokens[..., None], -1))

  tx = optax.adam(1e-3)
  step = mpolicy.make_train_step(mpolicy.amp(loss, f"p=f32,c={fmt},o=f32"),
                                 tx)
  tokens = jax.random.randint(k[5], (2, 32), 0, vocab)
  return step, (params, tx.init(params), mpolicy.NoOpLossScale(), tokens)


def _count(text, pattern):
  """How many times the program ``text`` runs a line matching ``pattern``:
  a function's lines count once per call of it (the lowering emits one
  function for calls alike)."""
  bodies, name = {}, None
  for line in text.splitlines():
    if m := re.match(r"\s*func.func \w+ @([\w$.]+)", line):
      name = m.group(1)
      bodies[name] = []
    elif name is not None:
      bodies[name].append(line)

  def runs(name):
    total = 0
    for line in bodies[name]:
      callees = re.findall(r"(?<!_)call @([\w$.]+)\(", line)
      total += bool(re.search(pattern, line)) + sum(map(runs, callees))
    return total
  return runs("main")


def _emulation_left(text, fmt):
  """The emulation's traces in a lowered module: float32 x float32 dots
  (but the Hadamard rotations', by a 16 x 16 matrix) and conversions of
  the format's elements to float32 (dequantizations)."""
  element = {"mxfp8": "f8E4M3FN", "nvfp4": "f4E2M1FN"}[fmt]
  dots = _count(text, r"stablehlo.dot_general .*\(tensor<[0-9x]*xf32>, "
                      r"tensor<(?!16x16x)[0-9x]*xf32>")
  converts = _count(text, rf"stablehlo.convert .*\(tensor<[0-9x]*x{element}>\)"
                          r" -> tensor<[0-9x]*xf32>")
  return dots, converts


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_cuda_lowering_of_a_step_holds_native_dots_alone(monkeypatch, fmt):
  step, args = _gpt_step(fmt)
  monkeypatch.setattr(native, "device_supports", lambda: True)
  text = _cuda_text(step, *args)
  # Five weight matmuls, each a forward and two backward products.
  assert _count(text, re.escape(f"custom_call @{NATIVE_CALL}")) == 15, fmt
  assert _emulation_left(text, fmt) == (0, 0), fmt
  # The same step lowered for CPU is the emulation.
  cpu = jax.jit(lambda *a: step(*a)).trace(*args).lower(
      lowering_platforms=("cpu",)).as_text()
  assert NATIVE_CALL not in cpu
  assert _emulation_left(cpu, fmt) == (15, 30), fmt
