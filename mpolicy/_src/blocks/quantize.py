"""`quantize_blocks`, `dequantize_blocks` and `fake_quantize`: the public door.

>>> import jax.numpy as jnp, mpolicy
>>> x = jnp.linspace(-1.0, 1.0, 40).reshape(2, 20)
>>> q = mpolicy.quantize_blocks(x, "mxfp8", axis=-1)
>>> q.elements.dtype, q.elements.shape, q.scales.dtype, q.scales.shape
(dtype(float8_e4m3fn), (2, 20), dtype(float8_e8m0fnu), (2, 1))
>>> bool(jnp.all(mpolicy.dequantize_blocks(q) == mpolicy.fake_quantize(x, "mxfp8")))
True
>>> q4 = mpolicy.quantize_blocks(jnp.ones((32, 32)), "nvfp4", two_d=True)
>>> q4.elements.dtype, q4.scales.shape, q4.tensor_scale.dtype
(dtype(float4_e2m1fn), (2, 2), dtype('float32'))
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from mpolicy._src import arguments
from mpolicy._src.blocks import float32_ops
from mpolicy._src.blocks import mx
from mpolicy._src.blocks import nvfp4
from mpolicy._src.blocks.formats import BlockFormat, get_format
from mpolicy._src.blocks.layout import Layout

_E8M0 = np.dtype(jnp.float8_e8m0fnu)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class BlockQuantized:
  """A block-quantized array (a pytree: arrays are leaves).

  Attributes:
    elements: the quantized values, the input's shape, in the format's
      element dtype (float8_e4m3fn or float4_e2m1fn).
    scales: one per block, with the input's axes (the blocked axis, or for
      two-dimensional blocks the last two, shortened to their block
      counts): float8_e8m0fnu (``2**e``; NaN for a non-finite block) for MX,
      float8_e4m3fn for nvfp4.
    tensor_scale: nvfp4's float32 scalar ``g``; ``None`` for MX.
    fmt: the `BlockFormat`.
    axis: the blocked axis, non-negative.
    two_d: whether the blocks are 16 x 16 tiles of the last two axes.
  """
  elements: jax.Array
  scales: jax.Array
  tensor_scale: Optional[jax.Array]
  fmt: BlockFormat
  axis: int
  two_d: bool = False

  def tree_flatten(self) -> tuple[tuple, tuple]:
    return ((self.elements, self.scales, self.tensor_scale),
            (self.fmt, self.axis, self.two_d))

  @classmethod
  def tree_unflatten(cls, aux: tuple, children: tuple) -> BlockQuantized:
    return cls(*children, *aux)

  @property
  def layout(self) -> Layout:
    return Layout.of(self.elements.shape, self.axis, self.fmt.block_size,
                     self.two_d)


def _as_float32(x: Any) -> jax.Array:
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"block quantization needs a floating array, got dtype "
                    f"{x.dtype.name}: cast it to float32 (or bfloat16) first.")
  return x.astype(jnp.float32)


def quantize_blocks(x: Any, fmt: Any, axis: int = -1, *,
                    two_d: bool = False,
                    key: Optional[jax.Array] = None) -> BlockQuantized:
  """Quantizes ``x`` to block-scaled format ``fmt`` in blocks along ``axis``.

  Args:
    x: a floating array (quantized from its float32 values; float32
      subnormals count as zeros, as XLA's backends treat them).
    fmt: ``"mxfp8"``, ``"mxfp4"`` or ``"nvfp4"`` (or a `BlockFormat`).
    axis: the axis whose consecutive values share a scale.
    two_d: nvfp4 only: 16 x 16 tiles of the last two axes (``axis`` must be
      one of them), so ``x`` and its transpose are quantized alike.
    key: a JAX PRNG key (``jax.random.key(seed)`` or
      ``jax.random.PRNGKey(seed)``, not an int seed) for stochastic rounding
      of the elements (the scales do not change); its draws are
      ``jax.random.uniform(key, x.shape)``. ``None``: round to nearest, ties
      to even.

  Returns:
    A `BlockQuantized`.

  Raises:
    ValueError: an unknown format, an axis ``x`` lacks, or ``two_d`` with
      an MX format.
    TypeError: ``x`` is not floating; ``key`` is not one PRNG key.

  See also: `dequantize_blocks`, `fake_quantize`.
  """
  fmt = get_format(fmt)
  if key is not None:
    arguments.require_key(key, "quantize_blocks")
  if two_d and not fmt.two_level:
    raise ValueError(f"two_d=True is for nvfp4's 16 x 16 weight tiles; "
                     f"{fmt.name} uses blocks of {fmt.block_size} along axis.")
  x = _as_float32(x)
  layout = Layout.of(x.shape, axis, fmt.block_size, two_d)
  return _quantize(x, key, fmt, layout)


@functools.partial(jax.jit, static_argnums=(2, 3))
def _quantize(x: jax.Array, key: Optional[jax.Array], fmt: BlockFormat,
              layout: Layout) -> BlockQuantized:
  """`quantize_blocks` after its checks, compiled once per shape."""
  two_d = layout.two_d
  x = float32_ops.flush(x)
  blocks = layout.split(x)
  u = None
  if key is not None:
    u = layout.split(jax.random.uniform(key, x.shape, jnp.float32))
  if fmt.two_level:
    g = nvfp4.tensor_scale(x)
    elements, grid = nvfp4.quantize(blocks, g, u)
  else:
    g = None
    elements, e_bits = mx.quantize(blocks, fmt, u)
    grid = lax.bitcast_convert_type(e_bits, _E8M0)
  return BlockQuantized(layout.join(elements), layout.grid_to_scales(grid), g,
                        fmt, layout.axis, two_d)


def dequantize_blocks(q: BlockQuantized) -> jax.Array:
  """The float32 values of a `BlockQuantized` (see `quantize_blocks`).

  Non-finite blocks give NaN throughout; finite ones never give an
  infinity (values saturate at float32's largest finite value).
  """
  if not isinstance(q, BlockQuantized):
    raise TypeError("dequantize_blocks expects what quantize_blocks returns, "
                    f"got {type(q).__name__}.")
  return _dequantize(q)


@jax.jit
def _dequantize(q: BlockQuantized) -> jax.Array:
  layout = q.layout
  elements = layout.split(q.elements)
  grid = layout.scales_to_grid(q.scales)
  if q.fmt.two_level:
    values = nvfp4.dequantize(elements, grid, q.tensor_scale)  # type: ignore[arg-type]  # Two-level: set.
  else:
    values = mx.dequantize(elements,
                           lax.bitcast_convert_type(grid, jnp.uint8))
  return layout.join(values)


def fake_quantize(x: Any, fmt: Any, axis: int = -1, *, two_d: bool = False,
                  key: Optional[jax.Array] = None) -> jax.Array:
  """``dequantize_blocks(quantize_blocks(x, fmt, axis, ...))``, float32.

  >>> import jax.numpy as jnp
  >>> fake_quantize(jnp.array([1.0, 0.3, -5.0, 7.0]), "mxfp4")
  Array([ 1.,  0., -4.,  8.], dtype=float32)
  """
  if key is not None:
    arguments.require_key(key, "fake_quantize")
  return dequantize_blocks(quantize_blocks(x, fmt, axis, two_d=two_d, key=key))
