"""Lowering per backend: half results on GPU/TPU, float32 accumulation on CPU.

The StableHLO is produced for CUDA (and TPU) on this CPU-only machine with
``jit(f).trace(...).lower(lowering_platforms=...)``; no GPU is needed.
On GPU the matmul and convolution units accumulate half products in float32
themselves, so every amp dot and convolution is asked for its half result:
cuDNN has no half-in, float32-out convolution (asked for one, XLA runs the
whole convolution in float32), and a float32 result would be an activation
written in float32. On CPU the float32 accumulation is asked for explicitly.
"""

import re

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpolicy

HALF = "p=f32,c=bf16,o=f32"
KEY = jax.random.PRNGKey(0)

_TYPES = re.compile(r"\(([^()]*)\)\s*->\s*(tensor<[^>]*>)\s*$")


def _ops(text, op):
  """``(operand element types, result element type)`` of each ``op`` line."""
  found = []
  for line in text.splitlines():
    if f"stablehlo.{op}" not in line:
      continue
    m = _TYPES.search(line.strip())
    assert m, f"unparsed {op} line: {line}"
    ins = re.findall(r"tensor<(?:[0-9?]+x)*(\w+)>", m.group(1))
    out = re.findall(r"tensor<(?:[0-9?]+x)*(\w+)>", m.group(2))[0]
    found.append((tuple(ins), out))
  return found


def _lowered(fn, *args, platform):
  return jax.jit(fn).trace(*args).lower(
      lowering_platforms=(platform,)).as_text()


def _conv_net(x, k1, k2):
  h = jax.lax.conv_general_dilated(x, k1, (1, 1), "SAME",
                                   dimension_numbers=("NHWC", "HWIO", "NHWC"))
  h = jax.nn.relu(h)
  h = jax.lax.conv_general_dilated(h, k2, (2, 2), "SAME",
                                   dimension_numbers=("NHWC", "HWIO", "NHWC"))
  return jnp.mean(jnp.tanh(h))


def _conv_args():
  ks = jax.random.split(KEY, 3)
  return (jax.random.normal(ks[0], (2, 8, 8, 3)),
          jax.random.normal(ks[1], (3, 3, 3, 4)),
          jax.random.normal(ks[2], (3, 3, 4, 4)))


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_convolutions_are_half_in_half_out_forward_and_backward(platform):
  f = jax.grad(mpolicy.amp(_conv_net, HALF), argnums=(0, 1, 2))
  convs = _ops(_lowered(f, *_conv_args(), platform=platform), "convolution")
  # 2 forward, 1 input gradient (the first conv's input gradient is
  # still asked for) x 2, 2 kernel gradients.
  assert len(convs) >= 5
  assert convs and all(c == (("bf16", "bf16"), "bf16") for c in convs), convs


def test_cpu_convolutions_accumulate_in_float32():
  f = jax.grad(mpolicy.amp(_conv_net, HALF), argnums=(0, 1, 2))
  convs = _ops(_lowered(f, *_conv_args(), platform="cpu"), "convolution")
  assert len(convs) >= 5
  assert all(c == (("bf16", "bf16"), "f32") for c in convs), convs


def _mlp(params, x):
  for w, b in params[:-1]:
    x = jax.nn.relu(x @ w + b)
  w, b = params[-1]
  return jnp.mean(jnp.square(x @ w + b))


def _mlp_args():
  ks = jax.random.split(KEY, 4)
  params = [(jax.random.normal(k, (16, 16)) / 4, jnp.zeros(16)) for k in ks[:3]]
  return params, jax.random.normal(ks[3], (8, 16))


def test_forward_dots_give_half_results_on_cuda_and_float32_on_cpu():
  f = mpolicy.amp(_mlp, HALF)
  gpu = _ops(_lowered(f, *_mlp_args(), platform="cuda"), "dot_general")
  cpu = _ops(_lowered(f, *_mlp_args(), platform="cpu"), "dot_general")
  assert gpu == [(("bf16", "bf16"), "bf16")] * 3
  assert cpu == [(("bf16", "bf16"), "f32")] * 3


def test_backward_dots_on_cuda_are_half_x_half():
  # Activation gradients come out half; a float32 parameter's gradient may
  # be a half x half -> float32 gemm (which cuBLAS runs natively).
  f = jax.grad(mpolicy.amp(_mlp, HALF))
  dots = _ops(_lowered(f, *_mlp_args(), platform="cuda"), "dot_general")
  assert len(dots) == 3 + 2 + 3  # forward, input grads, weight grads.
  assert all(ins == ("bf16", "bf16") for ins, _ in dots), dots
  assert sum(out == "bf16" for _, out in dots) == 3 + 2
  assert sum(out == "f32" for _, out in dots) == 3


def test_haiku_conv_net_under_transform_amp_lowers_half_convolutions():
  mpolicy.set_policy(hk.Module, HALF)

  def forward(x):
    x = hk.Conv2D(8, 3)(x)
    x = jax.nn.relu(x)
    x = hk.Conv2D(8, 3, stride=2)(x)
    return jnp.mean(x ** 2)

  f = mpolicy.transform_amp(forward)
  x = jax.random.normal(KEY, (2, 8, 8, 3))
  params = jax.eval_shape(f.init, KEY, x)  # Lowered only: shapes suffice.
  g = jax.grad(lambda p, x: f.apply(p, None, x))
  convs = _ops(_lowered(g, params, x, platform="cuda"), "convolution")
  assert len(convs) >= 5
  assert all(c == (("bf16", "bf16"), "bf16") for c in convs), convs


def test_cuda_lowering_computes_what_the_cpu_one_does():
  # The GPU lowering is another way to the same numbers: the default
  # lowering evaluated here and the accelerator composite agree to bf16.
  from mpolicy._src.rules import conv
  x, k1, _ = _conv_args()
  xh, kh = x.astype(jnp.bfloat16), k1.astype(jnp.bfloat16)
  params = dict(window_strides=(1, 1), padding=((1, 1), (1, 1)),
                lhs_dilation=(1, 1), rhs_dilation=(1, 1),
                dimension_numbers=jax.lax.conv_dimension_numbers(
                    x.shape, k1.shape, ("NHWC", "HWIO", "NHWC")),
                feature_group_count=1, batch_group_count=1, precision=None)
  cpu = conv._conv_composite(xh, kh, out_dtype=jnp.bfloat16, **params)  # pylint: disable=protected-access
  gpu = conv._conv_accelerator(xh, kh, out_dtype=jnp.bfloat16, **params)  # pylint: disable=protected-access
  assert cpu.dtype == gpu.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(cpu, np.float32),
                             np.asarray(gpu, np.float32), rtol=2e-2, atol=2e-2)
