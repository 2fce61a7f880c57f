"""A 64-bit checksum of each leaf that no resharding changes: the sum,
modulo 2**64, of a hash of each element's global position and bits. It
adds up over any split of the array, so each process sums the shards it
holds (one copy of each) and a restore over other devices finds the same
total; one flipped bit changes it (but for a chance of 2**-64)."""

from typing import Any, Iterable, Optional

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
  raw = data.reshape(-1).view(np.uint8).reshape(data.size, data.itemsize)
  words = np.pad(raw, ((0, 0), (0, -data.itemsize % 8))).view("<u8")
  index = tuple(index) + (slice(None),) * (len(shape) - len(index))
  strides = np.cumprod((tuple(shape[1:]) + (1,))[::-1])[::-1]
  position = np.zeros(data.shape, _U64)
  for axis, (part, n, stride) in enumerate(zip(index, shape, strides)):
    start = part.indices(n)[0]
    grid = np.arange(start, start + data.shape[axis], dtype=_U64)
    position += grid.reshape((-1,) + (1,) * (data.ndim - axis - 1)) * _U64(
        stride)
  slots = position.reshape(-1, 1) * _U64(words.shape[1]) + np.arange(
      words.shape[1], dtype=_U64)
  return int(np.sum(_mix(_mix(slots) ^ words), dtype=_U64))


def part(leaf: Any, dtype: Optional[str], primary: bool) -> int:
  """This process's part of `leaf`'s checksum, its values taken as `dtype`
  (the saved one). A leaf each process holds whole counts on process 0."""
  if leaves_lib.is_key(leaf):
    leaf, dtype = jax.random.key_data(leaf), None
  if not isinstance(leaf, jax.Array):
    return _piece(leaf, (), np.shape(leaf), dtype) if primary else 0
  if leaf.is_fully_addressable and not primary:
    return 0
  return sum(_piece(s.data, s.index, leaf.shape, dtype)
             for s in leaf.addressable_shards if s.replica_id == 0) % 2 ** 64


def total(parts: Iterable[Any]) -> str:
  """The checksum, from every process's part."""
  return f"{sum(int(p) for p in parts) % 2 ** 64:016x}"
