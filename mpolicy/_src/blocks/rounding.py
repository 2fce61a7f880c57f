"""Rounding scaled values onto an element grid: nearest-even or stochastic.

Values are clamped to the grid's largest finite value first (the formats
saturate: float8_e4m3fn would turn 464 into NaN). Round-to-nearest-even is
XLA's own conversion. Stochastic rounding picks, for ``|y|`` between grid
neighbours ``lo < hi``, ``hi`` when ``u * (hi - lo) < |y| - lo`` for a
uniform ``u`` in [0, 1), so the expected result is ``y``; values on the
grid stay. Both sides of that comparison are exact in float32 (grid gaps
are powers of two, and ``|y| - lo`` is exact by Sterbenz's lemma), so the
choice is the exact one.

>>> import jax.numpy as jnp
>>> from mpolicy._src.blocks.formats import get_format
>>> fmt = get_format("mxfp4")
>>> y = jnp.array([0.25, 0.75, 5.0, 7.0, -0.2])
>>> round_to_grid(y, fmt).astype(jnp.float32)
Array([ 0.,  1.,  4.,  6., -0.], dtype=float32)
>>> u = jnp.array([0.4, 0.6, 0.0, 0.9, 0.1])
>>> round_to_grid(y, fmt, u).astype(jnp.float32)
Array([ 0.5,  0.5,  6. ,  6. , -0.5], dtype=float32)
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from mpolicy._src.blocks.formats import BlockFormat


@functools.lru_cache(maxsize=None)
def grid(element_name: str) -> np.ndarray:
  """The element dtype's finite non-negative values, ascending, float32."""
  dtype = np.dtype(getattr(jnp, element_name))
  bits = np.arange(256, dtype=np.uint8)
  if dtype.itemsize != 1:
    raise ValueError(f"{element_name} is not a one-byte element dtype.")
  values = bits.view(dtype).astype(np.float32)
  values = values[np.isfinite(values) & (values >= 0)]
  return np.unique(values)  # Also drops the duplicates of 4-bit dtypes.


def round_to_grid(y: jax.Array, fmt: BlockFormat,
                  u: Optional[jax.Array] = None) -> jax.Array:
  """``y`` (finite float32) on ``fmt``'s element grid, in its element dtype.

  ``u``: uniform draws in [0, 1) of ``y``'s shape for stochastic rounding;
  ``None`` rounds to nearest, ties to even.
  """
  top = np.float32(fmt.max_elem)
  y = jnp.clip(y, -top, top)
  if u is None:
    return y.astype(fmt.element_dtype)
  g = jnp.asarray(grid(fmt.element_name))
  a = jnp.abs(y)
  i = jnp.clip(jnp.searchsorted(g, a, side="right") - 1, 0, g.size - 1)
  lo, hi = g[i], g[jnp.minimum(i + 1, g.size - 1)]
  up = u.astype(jnp.float32) * (hi - lo) < a - lo
  magnitude = jnp.where(up, hi, lo)
  # copysign, not where(signbit(y), -m, m): XLA on CPU gave zeros the
  # opposite sign for the latter (jax 0.12).
  return jnp.copysign(magnitude, y).astype(fmt.element_dtype)
