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
>>> from mpolicy._src.rules import quantized_matmul as qm
>>> a = jax.random.normal(jax.random.PRNGKey(0), (4, 64))
>>> b = jax.random.normal(jax.random.PRNGKey(1), (64, 8))
>>> spec = qm.Spec(qm.lookup("mxfp8"), jnp.bfloat16, jnp.float32, jnp.float32)
>>> y = qm.matmul(a, b, jax.random.PRNGKey(0), spec)
>>> y.dtype, bool(jnp.allclose(y, a @ b, rtol=0.1, atol=0.5))
(dtype(bfloat16), True)
"""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp

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


def reason(fmt: formats.BlockFormat, options=None) -> str:
  """`explain`'s reason for a block-scaled matmul."""
  text = (f"{REASON[fmt.name]}, float32 accumulation; backward operands "
          f"quantized to {fmt.name} along their own contracting dimension")
  if fmt.recipe and options is not None:
    parts = [name for name, on in (
        ("stochastic rounding of gradients", options.stochastic_rounding),
        ("16x16 Hadamard on the weight gradient", options.hadamard)) if on]
    if parts:
      text += f" ({', '.join(parts)}; seed {options.seed})"
  if native.usable(fmt, 0, fmt.block_size):
    return text + ("; the native block-scaled dot (jax.nn.scaled_matmul) on "
                   "CUDA where the contraction is whole blocks, else emulated")
  return text + "; emulated"


def _mm(x, y, spec, x_tiles: bool = False, y_tiles: bool = False,
        x_key=None, y_key=None, roles=(None, None)):
  """``[B,] M, K`` x ``[B,] K, N`` of the operands quantized along K
  (``x_key``/``y_key``: stochastic rounding), float32: emulated, or on CUDA
  the native block-scaled dot of the same quantized operands. ``roles``:
  what each operand is told to observers as (``None``: not told)."""
  fmt = spec.fmt.block
  for role, v, axis, tiles in ((roles[0], x, -1, x_tiles),
                               (roles[1], y, -2, y_tiles)):
    if role is not None:
      observe.quantized(spec.label, observe.Quantization(
          role, fmt.name, v, axis=axis, two_d=tiles))
  qx = quantize.quantize_blocks(x, fmt, -1, two_d=x_tiles, key=x_key)
  qy = quantize.quantize_blocks(y, fmt, -2, two_d=y_tiles, key=y_key)
  return native.matmul(qx, qy, spec.batched)


def _t(x):
  return jnp.swapaxes(x, -1, -2)


def forward(a, b, key, spec):
  """The forward product of a `quantized_matmul.Spec` of a block format,
  and what the backward pass keeps: the unquantized operands and key."""
  out = _mm(a, b, spec, spec.lhs_tiles, spec.rhs_tiles, roles=("lhs", "rhs"))
  return out.astype(spec.out_dtype), (a, b, key)


def backward(spec, residuals, g):
  """The operands' cotangents (module doc)."""
  a, b, key = residuals
  g = g.astype(jnp.float32)
  k_dgrad, k_wgrad, k_rotate = jax.random.split(key, 3)
  sr = (lambda k: k) if spec.sr else (lambda k: None)
  # d lhs [B, M, K] = g [B, M, N] . rhs^T [B, N, K] over N.
  da = _mm(g, _t(b), spec, False, spec.rhs_tiles, x_key=sr(k_dgrad),
           roles=("cotangent", None))
  # d rhs [B, K, N] = lhs^T [B, K, M] . g [B, M, N] over M.
  if spec.hadamard:
    a = recipe.hadamard_rotate(a, -2, k_rotate)
    g = recipe.hadamard_rotate(g, -2, k_rotate)
  db = _mm(_t(a), g, spec, spec.lhs_tiles, False, y_key=sr(k_wgrad),
           roles=(None, "cotangent"))
  return da.astype(spec.lhs_dtype), db.astype(spec.rhs_dtype)


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


def recipe_parts(fmt: formats.BlockFormat, lhs_param: bool,
                 rhs_param: bool, options=None) -> dict:
  """``lhs_tiles``, ``rhs_tiles``, ``sr`` and ``hadamard`` of a ``fmt``
  matmul (either operand a parameter: nvfp4 tiles it unless
  ``options.weight_tiles`` is off). ``options`` (an `Fp8Options`;
  ``None``: the defaults) turns the recipe's parts on and off; they apply
  to the formats that take the recipe only."""
  sr, hadamard, tiles = True, True, True
  if options is not None:
    sr, hadamard = options.stochastic_rounding, options.hadamard
    tiles = options.weight_tiles
  tiles = tiles and fmt.two_level
  return dict(lhs_tiles=tiles and lhs_param, rhs_tiles=tiles and rhs_param,
              sr=sr and fmt.recipe, hadamard=hadamard and fmt.recipe)


def draws(fmt: formats.BlockFormat, options) -> bool:
  """Whether a ``fmt`` matmul under ``options`` draws random numbers
  (stochastic rounding or the Hadamard signs), so that its key matters."""
  return fmt.recipe and (options.stochastic_rounding or options.hadamard)
