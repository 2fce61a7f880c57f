"""The native block-scaled matmul (`jax.nn.scaled_matmul`), where it runs.

XLA lowers `jax.nn.scaled_matmul` for CUDA to a block-scaled dot
(``__op$block_scaled_dot``, run by cuDNN on Blackwell GPUs, compute
capability 10 and up); JAX 0.10.2 has no CPU lowering for it. The block
matmul (`rules.block_matmul`) therefore asks for it through
`lax.platform_dependent`: the CUDA lowering multiplies the quantized
elements and scales natively, every other backend multiplies their
dequantized (float32) values. Both take the same `quantize_blocks` output,
so the operands are the same numbers; only the float32 accumulation order
may differ.

It is used for mxfp8 and nvfp4 (the formats cuDNN's block-scaled dot
takes, with blocks of 32 and 16) where the contracting dimension is a
multiple of the block size and the default device is such a GPU
(`device_supports`); mxfp4 and other shapes are emulated. `matmul` is the
one place that chooses: the emulation (two dequantizations and a float32
dot) is traced only inside the non-CUDA branch, so a CUDA lowering holds
the native dot alone.
"""

from __future__ import annotations

from typing import Optional

import jax
from jax import lax
import jax.numpy as jnp

from mpolicy._src.blocks import quantize

NATIVE_FORMATS = ("mxfp8", "nvfp4")


def jax_has_it() -> bool:
  """Whether this JAX has `jax.nn.scaled_matmul` (0.10.2 and 0.12 do)."""
  return hasattr(jax.nn, "scaled_matmul")


def device_supports() -> bool:
  """Whether the default device is a GPU with a native block-scaled dot
  (CUDA compute capability 10 or more: Blackwell)."""
  device = jax.devices()[0]
  capability = getattr(device, "compute_capability", None)
  if device.platform != "gpu" or capability is None:
    return False
  return int(str(capability).split(".")[0]) >= 10


def usable(fmt: str, k: int, block_size: int) -> bool:
  """Whether a block matmul of format ``fmt`` contracting over ``k`` asks
  for the native dot (on CUDA; other backends emulate it anyway)."""
  return (fmt in NATIVE_FORMATS and k % block_size == 0 and jax_has_it()
          and device_supports())


def _row_scales(q, k_axis: int, block: int) -> jax.Array:
  """``q``'s scales as ``[..., rows, K / block]`` (rows the free axis),
  nvfp4's 16 x 16 tiles repeated over their rows."""
  scales = q.scales
  if q.two_d:  # Tile grid over the last two axes: repeat the free one.
    free = -1 if k_axis in (-2, q.elements.ndim - 2) else -2
    rows = q.elements.shape[free]
    scales = jnp.repeat(scales, block, axis=free)
    scales = lax.slice_in_dim(scales, 0, rows, axis=free % scales.ndim)
  return jnp.moveaxis(scales, k_axis, -1)


def native_matmul(qa, qb, batched: bool) -> jax.Array:
  """``[B,] M, K`` x ``[B,] K, N`` of two `BlockQuantized` (``qa`` blocked
  along its last axis, ``qb`` along K) with `jax.nn.scaled_matmul`, float32
  result (nvfp4's tensor scales applied after)."""
  block = qa.fmt.block_size
  a = qa.elements if batched else qa.elements[None]
  b = jnp.moveaxis(qb.elements, -2, -1)
  b = b if batched else b[None]
  sa = _row_scales(qa, -1, block)
  sb = _row_scales(qb, -2, block)
  sa, sb = (s if batched else s[None] for s in (sa, sb))
  out = jax.nn.scaled_matmul(a, b, sa, sb, preferred_element_type=jnp.float32)
  out = out if batched else out[0]
  if qa.tensor_scale is not None:
    out = out * (qa.tensor_scale * qb.tensor_scale)
  return out


def emulated_matmul(qa, qb, batched: bool) -> jax.Array:
  """The product of ``qa`` and ``qb``'s dequantized (float32) values, as
  `native_matmul` lays them out, float32 accumulation."""
  nb = 1 if batched else 0
  batch = ((0,), (0,)) if batched else ((), ())
  return lax.dot_general(quantize.dequantize_blocks(qa),
                         quantize.dequantize_blocks(qb),
                         (((nb + 1,), (nb,)), batch),
                         precision=lax.Precision.HIGHEST,
                         preferred_element_type=jnp.float32)


def matmul(qa, qb, batched: bool) -> jax.Array:
  """``qa . qb`` (as `native_matmul` takes them), float32: on CUDA the
  native dot where `usable`, else (and on every other backend) emulated."""
  emulate = lambda qa, qb: emulated_matmul(qa, qb, batched)
  if not usable(qa.fmt.name, qa.elements.shape[-1], qa.fmt.block_size):
    return emulate(qa, qb)
  return lax.platform_dependent(
      qa, qb, cuda=lambda qa, qb: native_matmul(qa, qb, batched),
      default=emulate)
