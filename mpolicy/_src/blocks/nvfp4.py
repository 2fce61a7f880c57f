"""NVFP4 blocks: float4_e2m1fn elements under two scales.

Float32 arithmetic throughout, constants multiplied (not divided by), and
float32 subnormals flushed (`float32_ops.flush`):

* tensor scale ``g = amax * float32(1/2688)`` (2688 = 448 * 6; amax over
  the tensor's finite values), ``g = 1`` where that product is 0;
* block scale ``s = float8_e4m3fn((amax_block * float32(1/6)) / g)``,
  nearest-even, saturating at 448; ``d = s * g``;
* elements ``x / d`` on e2m1's grid (nearest-even, saturating at 6);
  values ``element * d``.

A block whose ``s`` or ``d`` is 0 is zeros (of its values' signs); a block
holding a NaN or an infinity gets the NaN scale and zero elements, and
dequantizes to NaN throughout.

>>> import jax.numpy as jnp
>>> x = jnp.array([[1.0, -3.0, 0.2, 12.0]])
>>> g = tensor_scale(x)
>>> el, s = quantize(x, g)
>>> el.astype(jnp.float32), s.astype(jnp.float32)
(Array([[ 0.5, -1.5,  0. ,  6. ]], dtype=float32), Array([448.], dtype=float32))
>>> dequantize(el, s, g)
Array([[ 1., -3.,  0., 12.]], dtype=float32)
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from mpolicy._src.blocks import float32_ops
from mpolicy._src.blocks import rounding
from mpolicy._src.blocks.formats import FORMATS

_FMT = FORMATS["nvfp4"]
_SCALE_DTYPE = np.dtype(jnp.float8_e4m3fn)
INV_2688 = np.float32(1 / 2688)
INV_6 = np.float32(1 / 6)


def tensor_scale(x: jax.Array) -> jax.Array:
  """The float32 scalar ``g`` of flushed float32 ``x``."""
  amax = jnp.max(jnp.where(jnp.isfinite(x), jnp.abs(x), np.float32(0)),
                 initial=np.float32(0))
  g = float32_ops.flush(amax * INV_2688)
  return jnp.where(g == 0, np.float32(1), g)


def _step(s: jax.Array, g: jax.Array) -> jax.Array:
  return float32_ops.flush(s.astype(jnp.float32) * g)


def quantize(blocks: jax.Array, g: jax.Array,
             u: Optional[jax.Array] = None) -> tuple[jax.Array, jax.Array]:
  """Elements (float4_e2m1fn) and block scales (float8_e4m3fn) of flushed
  float32 ``blocks`` shaped ``(..., block)``, under tensor scale ``g``."""
  finite = jnp.all(jnp.isfinite(blocks), axis=-1)
  safe = jnp.where(finite[..., None], blocks, np.float32(0))
  amax = jnp.max(jnp.abs(safe), axis=-1)
  t = float32_ops.divide(float32_ops.flush(amax * INV_6), g)
  s = jnp.minimum(t, np.float32(448)).astype(_SCALE_DTYPE)
  d = _step(s, g)
  zero = d == 0
  y = float32_ops.divide(safe, jnp.where(zero, np.float32(1), d)[..., None])
  y = jnp.where(zero[..., None], safe * np.float32(0), y)
  elements = rounding.round_to_grid(y, _FMT, u)
  elements = jnp.where(finite[..., None], elements,
                       jnp.zeros((), elements.dtype))
  s = jnp.where(finite, s, jnp.array(np.nan, _SCALE_DTYPE))
  return elements, s


def dequantize(elements: jax.Array, s: jax.Array, g: jax.Array) -> jax.Array:
  """float32 ``element * s * g`` per block: NaN for a NaN scale, flushed,
  saturating at float32's largest finite value."""
  d = _step(s, g)
  values = float32_ops.flush(elements.astype(jnp.float32) * d[..., None])
  values = float32_ops.saturate(values)
  return jnp.where(jnp.isnan(d)[..., None], np.float32(np.nan), values)
