"""The block-scaled matmul under ``c=mxfp8``, ``c=mxfp4`` and ``c=nvfp4``.

The matmuls the float8 placement admits (`fp8_placement.admit`) run with
both operands fake-quantized in blocks along the contracting dimension
(`blocks.quantize.fake_quantize`: the block format's exact values, held in
float32), multiplied with float32 accumulation, and rounded to the result
dtype (bfloat16). This is the emulation; no backend's native block-scaled
matmul is asked for yet.

The backward matmuls quantize their own operands along their own
contracting dimension, from the unquantized values (the cotangent and the
saved operands), not by transposing the forward's blocks:
``d lhs = q(g, over N) . q(rhs, over N)`` and
``d rhs = q(lhs, over M) . q(g, over M)``. Gradients use the same format
(mxfp8's are e4m3 too). Under nvfp4 a parameter operand is quantized in
16 x 16 tiles, so it and its transpose are quantized alike.

>>> import jax, jax.numpy as jnp
>>> a = jax.random.normal(jax.random.PRNGKey(0), (4, 64))
>>> b = jax.random.normal(jax.random.PRNGKey(1), (64, 8))
>>> config = BlockConfig("mxfp8", False, jnp.bfloat16, jnp.float32, jnp.float32)
>>> y = blocked_mm(a, b, config)
>>> y.dtype, bool(jnp.allclose(y, a @ b, rtol=0.1, atol=0.5))
(dtype(bfloat16), True)
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from mpolicy._src import observe
from mpolicy._src.blocks import formats
from mpolicy._src.blocks import quantize

REASON = {
    "mxfp8": "blocks of 32 float8_e4m3fn along the contracting dimension, "
             "E8M0 scales rounded up",
    "mxfp4": "blocks of 32 float4_e2m1fn along the contracting dimension, "
             "E8M0 scales rounded up",
    "nvfp4": "blocks of 16 float4_e2m1fn along the contracting dimension "
             "(16x16 tiles for parameters), float8_e4m3fn block scales under "
             "a float32 tensor scale",
}


def format_of_op(op) -> Optional[formats.BlockFormat]:
  """The block format of the policy governing ``op``, else ``None``."""
  region = op.region
  if region is None or region.policy is None:
    return None
  compute = region.policy.compute_dtype
  return compute if isinstance(compute, formats.BlockFormat) else None


def reason(fmt: formats.BlockFormat) -> str:
  """`explain`'s reason for a block-scaled matmul."""
  return (f"{REASON[fmt.name]}, float32 accumulation; backward operands "
          f"quantized to {fmt.name} along their own contracting dimension; "
          "emulated")


class BlockConfig(NamedTuple):
  """What `blocked_mm` needs besides its operands (hashable: static)."""
  fmt: str
  batched: bool
  out_dtype: Any
  lhs_dtype: Any
  rhs_dtype: Any
  lhs_tiles: bool = False  # nvfp4: 16 x 16 tiles (the operand is a weight).
  rhs_tiles: bool = False
  label: Optional[str] = None  # `observe.quantization_site`'s.


def _q(x, config: BlockConfig, axis: int, tiles: bool, role=None):
  """``x`` fake-quantized; told to observers as ``role`` (if given)."""
  if role is not None:
    observe.quantized(config.label, observe.Quantization(
        role, config.fmt, x, axis=axis, two_d=tiles))
  return quantize.fake_quantize(x, config.fmt, axis, two_d=tiles)


def _dot(a, b, contract, batched):
  batch = ((0,), (0,)) if batched else ((), ())
  return lax.dot_general(a, b, (contract, batch),
                         precision=lax.Precision.HIGHEST,
                         preferred_element_type=jnp.float32)


def _fwd(a, b, config: BlockConfig):
  nb = 1 if config.batched else 0
  aq = _q(a, config, -1, config.lhs_tiles, "lhs")  # [B,] M, K: along K.
  bq = _q(b, config, -2, config.rhs_tiles, "rhs")  # [B,] K, N: along K.
  out = _dot(aq, bq, ((nb + 1,), (nb,)), config.batched)
  return out.astype(config.out_dtype), (a, b)


def _bwd(config: BlockConfig, residuals, g):
  a, b = residuals
  nb = 1 if config.batched else 0
  g = g.astype(jnp.float32)
  # d lhs [B, M, K] = g [B, M, N] . rhs [B, K, N] over N.
  da = _dot(_q(g, config, -1, False, "cotangent"),
            _q(b, config, -1, config.rhs_tiles),
            ((nb + 1,), (nb + 1,)), config.batched)
  # d rhs [B, K, N] = lhs [B, M, K] . g [B, M, N] over M.
  db = _dot(_q(a, config, -2, config.lhs_tiles),
            _q(g, config, -2, False, "cotangent"),
            ((nb,), (nb,)), config.batched)
  return da.astype(config.lhs_dtype), db.astype(config.rhs_dtype)


blocked_mm = jax.custom_vjp(lambda a, b, config: _fwd(a, b, config)[0],
                            nondiff_argnums=(2,))
blocked_mm.__doc__ = ("``[B,] M, K`` x ``[B,] K, N`` in a block format "
                      "(module doc), differentiable in reverse mode.")
blocked_mm.defvjp(_fwd, _bwd)


def config_for(fmt: formats.BlockFormat, lhs, rhs, batched: bool, out_dtype,
               lhs_param: bool, rhs_param: bool,
               label: Optional[str] = None) -> BlockConfig:
  """The `BlockConfig` of a matmul of ``lhs`` and ``rhs`` (either a
  parameter: nvfp4 tiles it)."""
  tiles = fmt.two_level
  return BlockConfig(fmt.name, batched, np.dtype(out_dtype),
                     np.dtype(lhs.dtype), np.dtype(rhs.dtype),
                     tiles and lhs_param, tiles and rhs_param, label)
