"""The block-scaled matmul under ``c=mxfp8``, ``c=mxfp4`` and ``c=nvfp4``.

The matmuls the float8 placement admits (`fp8_placement.admit`) run with
both operands fake-quantized in blocks along the contracting dimension
(`blocks.quantize.fake_quantize`: the block format's exact values, held in
float32), multiplied with float32 accumulation, and rounded to the result
dtype (bfloat16). On CUDA, where the device has one, the native
block-scaled dot multiplies the same quantized operands (`blocks.native`).

The backward matmuls quantize their own operands along their own
contracting dimension, from the unquantized values (the cotangent and the
saved operands), not by transposing the forward's blocks:
``d lhs = q(g, over N) . q(rhs, over N)`` and
``d rhs = q(lhs, over M) . q(g, over M)``. Gradients use the same format
(mxfp8's are e4m3 too). Under nvfp4 a parameter operand is quantized in
16 x 16 tiles, so it and its transpose are quantized alike. The NVFP4
recipe (mxfp4 and nvfp4, each part an option): the cotangent is rounded
stochastically in both backward matmuls (``sr``), and the weight-gradient
matmul's operands are rotated along M by a random 16 x 16 Hadamard
transform before they are quantized (``hadamard``), its randomness from
the ``key`` operand (`blocks.recipe`).

>>> import jax, jax.numpy as jnp
>>> a = jax.random.normal(jax.random.PRNGKey(0), (4, 64))
>>> b = jax.random.normal(jax.random.PRNGKey(1), (64, 8))
>>> config = BlockConfig("mxfp8", False, jnp.bfloat16, jnp.float32, jnp.float32)
>>> y = blocked_mm(a, b, jax.random.PRNGKey(0), config)
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
from mpolicy._src.blocks import native
from mpolicy._src.blocks import quantize
from mpolicy._src.blocks import recipe

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
  """The block format the policy governing ``op`` names, else ``None``."""
  return formats.FORMATS.get(op.matmul_format)


def reason(fmt: formats.BlockFormat, options=None) -> str:
  """`explain`'s reason for a block-scaled matmul."""
  text = (f"{REASON[fmt.name]}, float32 accumulation; backward operands "
          f"quantized to {fmt.name} along their own contracting dimension")
  if fmt.name in RECIPE_FORMATS and options is not None:
    parts = [name for name, on in (
        ("stochastic rounding of gradients", options.stochastic_rounding),
        ("16x16 Hadamard on the weight gradient", options.hadamard)) if on]
    if parts:
      text += f" ({', '.join(parts)}; seed {options.seed})"
  if native.usable(fmt.name, 0, fmt.block_size):
    return text + ("; the native block-scaled dot (jax.nn.scaled_matmul) on "
                   "CUDA where the contraction is whole blocks, else emulated")
  return text + "; emulated"


class BlockConfig(NamedTuple):
  """What `blocked_mm` needs besides its operands (hashable: static)."""
  fmt: str
  batched: bool
  out_dtype: Any
  lhs_dtype: Any
  rhs_dtype: Any
  lhs_tiles: bool = False  # nvfp4: 16 x 16 tiles (the operand is a weight).
  rhs_tiles: bool = False
  sr: bool = False  # Stochastic rounding of the cotangent.
  hadamard: bool = False  # Random Hadamard rotation of the wgrad operands.
  label: Optional[str] = None  # `observe.quantization_site`'s.


def _mm(x, y, config: BlockConfig, x_tiles: bool = False,
        y_tiles: bool = False, x_key=None, y_key=None, roles=(None, None)):
  """``[B,] M, K`` x ``[B,] K, N`` of the operands quantized along K
  (``x_key``/``y_key``: stochastic rounding), float32: emulated, or on CUDA
  the native block-scaled dot of the same quantized operands. ``roles``:
  what each operand is told to observers as (``None``: not told)."""
  for role, v, axis, tiles in ((roles[0], x, -1, x_tiles),
                               (roles[1], y, -2, y_tiles)):
    if role is not None:
      observe.quantized(config.label, observe.Quantization(
          role, config.fmt, v, axis=axis, two_d=tiles))
  qx = quantize.quantize_blocks(x, config.fmt, -1, two_d=x_tiles, key=x_key)
  qy = quantize.quantize_blocks(y, config.fmt, -2, two_d=y_tiles, key=y_key)
  return native.matmul(qx, qy, config.batched)


def _t(x):
  return jnp.swapaxes(x, -1, -2)


def _fwd(a, b, key, config: BlockConfig):
  out = _mm(a, b, config, config.lhs_tiles, config.rhs_tiles,
            roles=("lhs", "rhs"))
  return out.astype(config.out_dtype), (a, b, key)


def _bwd(config: BlockConfig, residuals, g):
  a, b, key = residuals
  g = g.astype(jnp.float32)
  k_dgrad, k_wgrad, k_rotate = jax.random.split(key, 3)
  sr = (lambda k: k) if config.sr else (lambda k: None)
  # d lhs [B, M, K] = g [B, M, N] . rhs^T [B, N, K] over N.
  da = _mm(g, _t(b), config, False, config.rhs_tiles, x_key=sr(k_dgrad),
           roles=("cotangent", None))
  # d rhs [B, K, N] = lhs^T [B, K, M] . g [B, M, N] over M.
  if config.hadamard:
    a = recipe.hadamard_rotate(a, -2, k_rotate)
    g = recipe.hadamard_rotate(g, -2, k_rotate)
  db = _mm(_t(a), g, config, config.lhs_tiles, False, y_key=sr(k_wgrad),
           roles=(None, "cotangent"))
  return da.astype(config.lhs_dtype), db.astype(config.rhs_dtype), None


blocked_mm = jax.custom_vjp(lambda a, b, key, config: _fwd(a, b, key,
                                                           config)[0],
                            nondiff_argnums=(3,))
blocked_mm.__doc__ = ("``[B,] M, K`` x ``[B,] K, N`` in a block format "
                      "(module doc), differentiable in reverse mode; ``key`` "
                      "(a raw ``uint32[2]`` key) drives the recipe's "
                      "randomness.")
blocked_mm.defvjp(_fwd, _bwd)


def along_one_dimension(lhs, rhs, dimension_numbers, size: int):
  """The operands and dimension numbers of a matmul whose blocks of
  ``size`` run along one contracting dimension: the left operand's
  minor-most (highest axis) one, and its partner in the right operand.

  It is listed last, so merging the contracting dimensions row-major puts
  it innermost, and with several contracting dimensions it is padded with
  zeros to whole blocks (in both operands): a block never spans two
  indices of another contracting dimension (``"bhd,hdk->bk"`` is blocked
  along ``d``, per head).
  """
  (lc, rc), batch = dimension_numbers
  if len(lc) < 2:
    return lhs, rhs, dimension_numbers
  order = sorted(range(len(lc)), key=lambda i: lc[i])
  lc, rc = tuple(lc[i] for i in order), tuple(rc[i] for i in order)
  pad = -lhs.shape[lc[-1]] % size
  if pad:
    lhs = _pad_axis(lhs, lc[-1], pad)
    rhs = _pad_axis(rhs, rc[-1], pad)
  return lhs, rhs, ((lc, rc), batch)


def _pad_axis(x, axis: int, pad: int):
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths)


def config_for(fmt: formats.BlockFormat, lhs, rhs, batched: bool, out_dtype,
               lhs_param: bool, rhs_param: bool, options=None,
               label: Optional[str] = None) -> BlockConfig:
  """The `BlockConfig` of a matmul of ``lhs`` and ``rhs`` (either a
  parameter: nvfp4 tiles it unless ``options.weight_tiles`` is off).
  ``options`` (an `Fp8Options`; ``None``: the defaults) turns the recipe's
  parts on and off; they apply to the 4-bit formats only."""
  sr, hadamard, tiles = True, True, True
  if options is not None:
    sr, hadamard = options.stochastic_rounding, options.hadamard
    tiles = options.weight_tiles
  recipe_fmt = fmt.name in RECIPE_FORMATS
  tiles = tiles and fmt.two_level
  return BlockConfig(fmt.name, batched, np.dtype(out_dtype),
                     np.dtype(lhs.dtype), np.dtype(rhs.dtype),
                     tiles and lhs_param, tiles and rhs_param,
                     sr and recipe_fmt, hadamard and recipe_fmt, label=label)


RECIPE_FORMATS = ("mxfp4", "nvfp4")
"""The formats the NVFP4 recipe's stochastic rounding and Hadamard
rotation apply to (mxfp8 rounds to nearest and rotates nothing)."""


def draws(fmt: formats.BlockFormat, options) -> bool:
  """Whether a ``fmt`` matmul under ``options`` draws random numbers
  (stochastic rounding or the Hadamard signs), so that its key matters."""
  return fmt.name in RECIPE_FORMATS and (
      options.stochastic_rounding or options.hadamard)
