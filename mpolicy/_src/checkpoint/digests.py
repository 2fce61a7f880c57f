"""A 64-bit checksum of each leaf that no resharding changes.

It is a sum, modulo 2**64, of a hash of every element's global position
and bits, so it adds up over any split of the array: each process sums the
shards it holds (one copy of each, `replica_id` 0), the processes add their
parts, and a restore over other devices or processes finds the same total.
One flipped bit changes it (but for a chance of 2**-64).
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import numpy as np

from mpolicy._src.checkpoint import leaves as leaves_lib

_U64 = np.uint64


def _mix(x: np.ndarray) -> np.ndarray:
  """splitmix64's finalizer, elementwise."""
  x = (x ^ (x >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
  x = (x ^ (x >> _U64(27))) * _U64(0x94D049BB133111EB)
  return x ^ (x >> _U64(31))


def _piece(data: Any, index: tuple, shape: tuple, dtype) -> int:
  """The sum over `data`, the part `index` (slices) of an array of `shape`."""
  data = np.ascontiguousarray(np.asarray(data, dtype))
  size, width = data.size, data.dtype.itemsize
  raw = data.reshape(-1).view(np.uint8).reshape(size, width)
  words = np.pad(raw, ((0, 0), (0, -width % 8))).view("<u8")
  index = tuple(index) + (slice(None),) * (len(shape) - len(index))
  strides = np.cumprod((tuple(shape[1:]) + (1,))[::-1])[::-1]
  position = np.zeros(data.shape, _U64)
  for axis, (part, n, stride) in enumerate(zip(index, shape, strides)):
    start = part.indices(n)[0] if isinstance(part, slice) else 0
    grid = np.arange(start, start + data.shape[axis], dtype=_U64)
    position = position + grid.reshape(
        (-1,) + (1,) * (len(shape) - axis - 1)) * _U64(stride)
  slots = position.reshape(-1, 1) * _U64(words.shape[1]) + np.arange(
      words.shape[1], dtype=_U64)
  return int(np.sum(_mix(_mix(slots) ^ words), dtype=_U64))


def part(leaf: Any, dtype: Optional[str], primary: bool) -> int:
  """This process's part of `leaf`'s checksum, its values as `dtype` (the
  saved one; None for keys). A leaf each process holds whole counts on
  process 0 only."""
  if leaves_lib.is_key(leaf):
    leaf, dtype = jax.random.key_data(leaf), None
  if not isinstance(leaf, jax.Array):
    value = np.asarray(leaf)
    return _piece(value, (), value.shape, dtype) if primary else 0
  if leaf.is_fully_addressable and not primary:
    return 0
  return sum(_piece(s.data, s.index, leaf.shape, dtype)
             for s in leaf.addressable_shards if s.replica_id == 0) % 2 ** 64


def whole(leaf: Any) -> str:
  """A digest of a leaf that this process holds whole: its dtype, shape
  (a key's impl) and bits."""
  extra = str(jax.random.key_impl(leaf)) if leaves_lib.is_key(leaf) else ""
  return f"{getattr(leaf, 'dtype', type(leaf).__name__)}{extra}" + (
      f"{np.shape(leaf)}:{part(leaf, None, True):x}")
