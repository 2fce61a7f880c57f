"""Where the blocks are: cutting an array into blocks and putting it back.

A one-dimensional layout takes ``size`` consecutive values along ``axis``;
the last block of an axis whose length is not a multiple of ``size`` is
filled up with zeros. A two-dimensional layout takes ``size x size`` tiles
of the last two axes (zero-filled the same way), so an array and its
transpose are cut into the same tiles.

`Layout.split` gives ``(..., grid..., values)`` with one row per block;
`Layout.join` undoes it and drops the filling. Scales are stored with the
array's axes: the blocked axis shortened to its number of blocks (for
tiles, both of the last two axes).

>>> import jax.numpy as jnp
>>> layout = Layout.of((2, 5), axis=-1, size=4, two_d=False)
>>> layout.split(jnp.ones((2, 5))).shape, layout.scale_shape
((2, 2, 4), (2, 2))
>>> tiles = Layout.of((5, 6), axis=0, size=4, two_d=True)
>>> tiles.split(jnp.ones((5, 6))).shape, tiles.scale_shape
((2, 2, 16), (2, 2))
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp


def normalize_axis(shape: tuple[int, ...], axis: int, two_d: bool) -> int:
  """``axis`` as a non-negative index into ``shape``, or a `ValueError`."""
  ndim = len(shape)
  if two_d and ndim < 2:
    raise ValueError(
        f"two-dimensional blocks need an array of rank 2 or more (tiles of "
        f"its last two axes), got shape {shape}.")
  if not isinstance(axis, int) or not -ndim <= axis < ndim:
    raise ValueError(
        f"axis={axis!r} is not an axis of an array of shape {shape}: expected "
        f"an int in [{-ndim}, {ndim - 1}].")
  axis %= ndim
  if two_d and axis < ndim - 2:
    raise ValueError(
        f"axis={axis} with two-dimensional blocks: the tiles cover the last "
        f"two axes, so axis must be one of them ({ndim - 2}, {ndim - 1}, "
        "-2 or -1).")
  return axis


@dataclasses.dataclass(frozen=True)
class Layout:
  """How an array of ``shape`` is cut into blocks (see the module doc)."""
  shape: tuple[int, ...]
  axis: int
  size: int
  two_d: bool

  @classmethod
  def of(cls, shape, axis: int, size: int, two_d: bool) -> "Layout":
    shape = tuple(shape)
    if not shape:
      raise ValueError("block quantization needs an array with at least one "
                       "axis, got a scalar (shape ()).")
    return cls(shape, normalize_axis(shape, axis, two_d), size, two_d)

  def _blocks(self, n: int) -> int:
    return math.ceil(n / self.size)

  @property
  def scale_shape(self) -> tuple[int, ...]:
    shape = list(self.shape)
    axes = (-2, -1) if self.two_d else (self.axis,)
    for a in axes:
      shape[a] = self._blocks(shape[a])
    return tuple(shape)

  def _pad(self, x: jax.Array, axes) -> jax.Array:
    widths = [(0, 0)] * x.ndim
    for a in axes:
      widths[a] = (0, self._blocks(x.shape[a]) * self.size - x.shape[a])
    return jnp.pad(x, widths)

  def split(self, x: jax.Array) -> jax.Array:
    """``x`` as ``(..., grid..., values)``, one row per block."""
    b = self.size
    if not self.two_d:
      x = self._pad(jnp.moveaxis(x, self.axis, -1), (-1,))
      return x.reshape(x.shape[:-1] + (x.shape[-1] // b, b))
    x = self._pad(x, (-2, -1))
    *lead, m, n = x.shape
    x = x.reshape(tuple(lead) + (m // b, b, n // b, b))
    x = jnp.swapaxes(x, -3, -2)
    return x.reshape(tuple(lead) + (m // b, n // b, b * b))

  def join(self, blocks: jax.Array) -> jax.Array:
    """The inverse of `split`, without the zero filling."""
    b = self.size
    if not self.two_d:
      x = blocks.reshape(blocks.shape[:-2] + (-1,))
      x = x[..., :self.shape[self.axis]]
      return jnp.moveaxis(x, -1, self.axis)
    *lead, gm, gn, _ = blocks.shape
    x = blocks.reshape(tuple(lead) + (gm, gn, b, b))
    x = jnp.swapaxes(x, -3, -2).reshape(tuple(lead) + (gm * b, gn * b))
    return x[..., :self.shape[-2], :self.shape[-1]]

  def grid_to_scales(self, grid: jax.Array) -> jax.Array:
    """Per-block values in `split`'s order to the stored scale layout."""
    return grid if self.two_d else jnp.moveaxis(grid, -1, self.axis)

  def scales_to_grid(self, scales: jax.Array) -> jax.Array:
    """The inverse of `grid_to_scales`."""
    return scales if self.two_d else jnp.moveaxis(scales, self.axis, -1)
