"""A 64-bit checksum of each leaf that no resharding changes: a sum, modulo
2**64, over the elements, each weighted by a hash of its global position.
It adds up over any split of the array (each process sums the shards it
holds, one copy of each), and one flipped bit always changes it."""

from typing import Any, Iterable, Optional

import jax
import numpy as np

from mpolicy._src.checkpoint import leaves as leaves_lib

_U64 = np.uint64


def _block(data: np.ndarray, starts: list[int], shape: tuple) -> int:
  """The sum over `data`, the block at `starts` of an array of `shape`:
  each 64-bit word of an element times an odd weight drawn from its place."""
  if data.itemsize in (1, 2, 4, 8):
    words = data.view(f"<u{data.itemsize}").astype(_U64).reshape(-1, 1)
  else:
    raw = data.reshape(-1).view(np.uint8).reshape(data.size, data.itemsize)
    words = np.pad(raw, ((0, 0), (0, -data.itemsize % 8))).view("<u8")
  grid: tuple = np.indices(data.shape, sparse=True)
  place = np.ravel_multi_index([g + s for g, s in zip(grid, starts)], shape)
  weights = ((place.reshape(-1, 1).astype(_U64) * _U64(words.shape[1])
              + np.arange(words.shape[1], dtype=_U64))
             * _U64(0x9E3779B97F4A7C15))
  weights = (weights ^ (weights >> _U64(29))) | _U64(1)  # Odd, scrambled.
  return int(np.sum(words * weights, dtype=_U64))


def _piece(data: Any, index: tuple, shape: tuple, dtype) -> int:
  """The sum over `data`, the part `index` (slices) of an array of `shape`,
  in blocks of rows that stay small in memory."""
  data = np.asarray(data, dtype, order="C")
  index = tuple(index) + (slice(None),) * (len(shape) - len(index))
  starts = [part.indices(n)[0] for part, n in zip(index, shape)]
  if not data.ndim:
    data, starts, shape = data.reshape(1), [0], (1,)
  rows = max(1, 2 ** 18 // max(1, data[:1].size))
  return sum(_block(data[r:r + rows], [starts[0] + r] + starts[1:], shape)
             for r in range(0, len(data), rows)) % 2 ** 64


def part(leaf: Any, dtype: Optional[str]) -> int:
  """The sum over what this process holds of `leaf` (one copy of each
  shard), its values taken as `dtype` (the saved one)."""
  if leaves_lib.is_key(leaf):
    leaf, dtype = jax.random.key_data(leaf), None
  if not isinstance(leaf, jax.Array):
    return _piece(leaf, (), np.shape(leaf), dtype)
  return sum(_piece(s.data, s.index, leaf.shape, dtype)
             for s in leaf.addressable_shards if s.replica_id == 0) % 2 ** 64


def parts(flat: dict, described: dict) -> dict[str, dict[str, int]]:
  """`part` of each leaf, its dtype `described[key][0]`: under "whole"
  where this process holds the leaf whole, else under "part"."""
  out: dict[str, dict[str, int]] = {"whole": {}, "part": {}}
  for key, leaf in flat.items():
    whole = getattr(leaf, "is_fully_addressable", True)
    out["whole" if whole else "part"][key] = part(leaf, described[key][0])
  return out


def totals(keys: Iterable[str], posts: list[dict]) -> dict[str, str]:
  """Each leaf's checksum from every process's `parts`: one held whole as
  process 0 has it, else the sum of the processes' parts."""
  sums = {k: sum(post["part"][k] for post in posts) for k in posts[0]["part"]}
  sums.update(posts[0]["whole"])
  return {key: f"{sums[key] % 2 ** 64:016x}" for key in keys}
