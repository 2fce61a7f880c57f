"""MX (OCP Microscaling) blocks: a power-of-two scale per block of 32.

A block's scale is ``2**e``, ``e`` the smallest integer with
``amax <= max_elem * 2**e`` (rounding the scale up, as the MXFP8 training
recipes do), clamped to [-127, 127], stored as E8M0 (``float8_e8m0fnu``,
bits ``e + 127``). ``e`` comes from amax's bits, with no division: for
``amax = 1.f * 2**E`` and ``max_elem = 1.m * 2**K``, ``e = E - K`` if
``f <= m``, else ``E - K + 1``. Elements are ``x / 2**e`` rounded onto the
grid. A block whose amax is 0 is zeros (scale ``2**-127``); a block holding
a NaN or an infinity gets the NaN scale (bits 0xFF) and zero elements, and
dequantizes to NaN throughout.

>>> import jax.numpy as jnp
>>> from mpolicy._src.blocks.formats import get_format
>>> el, e_bits = quantize(jnp.array([[1.0, 300.0, -700.0]]), get_format("mxfp8"))
>>> el.astype(jnp.float32), e_bits
(Array([[   0.5,  144. , -352. ]], dtype=float32), Array([128], dtype=uint8))
>>> dequantize(el, e_bits)
Array([[   1.,  288., -704.]], dtype=float32)
"""

from __future__ import annotations

from typing import Optional

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from mpolicy._src.blocks import float32_ops
from mpolicy._src.blocks import rounding
from mpolicy._src.blocks.formats import BlockFormat

NAN_BITS = 0xFF


def scale_exponent(amax: jax.Array, max_elem: float) -> jax.Array:
  """The smallest int32 ``e`` in [-127, 127] with ``amax <= max_elem * 2**e``.

  ``amax``: non-negative float32, normal or zero.
  """
  mantissa, exponent = np.frexp(np.float32(max_elem))  # 0.875 * 2**9 for 448.
  top_frac = np.uint32(int((mantissa * 2 - 1) * 2**23))
  bits = lax.bitcast_convert_type(amax, jnp.uint32)
  amax_exp = (bits >> 23).astype(jnp.int32) - 127
  e = amax_exp - (int(exponent) - 1) + ((bits & 0x7FFFFF) > top_frac)
  return jnp.clip(e, -127, 127)


def quantize(blocks: jax.Array, fmt: BlockFormat,
             u: Optional[jax.Array] = None) -> tuple[jax.Array, jax.Array]:
  """Elements (``fmt``'s dtype) and E8M0 bits (uint8) of flushed float32
  ``blocks`` shaped ``(..., block)``; ``u`` as for `rounding.round_to_grid`."""
  finite = jnp.all(jnp.isfinite(blocks), axis=-1)
  safe = jnp.where(finite[..., None], blocks, np.float32(0))
  e = scale_exponent(jnp.max(jnp.abs(safe), axis=-1), fmt.max_elem)
  y = float32_ops.mul_pow2(safe, -e[..., None])
  elements = rounding.round_to_grid(y, fmt, u)
  elements = jnp.where(finite[..., None], elements,
                       jnp.zeros((), elements.dtype))
  e_bits = jnp.where(finite, e + 127, NAN_BITS).astype(jnp.uint8)
  return elements, e_bits


def dequantize(elements: jax.Array, e_bits: jax.Array) -> jax.Array:
  """float32 ``elements * 2**e`` per block (rows of ``elements``): NaN for
  the NaN scale, flushed, saturating at float32's largest finite value."""
  e = e_bits.astype(jnp.int32) - 127
  values = float32_ops.mul_pow2(elements.astype(jnp.float32), e[..., None])
  values = float32_ops.saturate(values)
  return jnp.where((e_bits == NAN_BITS)[..., None], np.float32(np.nan), values)
