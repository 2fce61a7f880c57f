"""Stochastic rounding from float32 to bfloat16 or float16.

Round-to-nearest loses every update smaller than half a unit in the last
place (ulp) of the value it is added to: a bfloat16 weight near 1 ignores
any step below 2**-9. Stochastic rounding (SR) rounds up or down at random,
with the probability of each neighbour proportional to how close `x` is to
it, so the expected result is `x` and small updates add up on average.

Both roundings here are bit arithmetic on one uint32 of random bits per
element, not sampling. The bits are a hash of the element's index and two
words drawn from the key (a counter-based generator, like threefry, but
elementwise), so XLA fuses them into the rounding and holds no buffer of
random bits: a bfloat16 write costs no temporary memory beyond its input.

* bfloat16 shares float32's exponent: add 16 random bits below the bfloat16
  mantissa of the float32 bit pattern, then drop those 16 bits.
* float16 has a narrower exponent range: take the two float16 neighbours of
  `x` (rounded toward zero, and one ulp further), and pick the far one when
  a uniform draw is below the distance fraction. Subnormals work the same
  way, since their spacing is even too.

Across devices the hash sees each device's own indices: inside `shard_map`
the key is folded with the device's index along the mesh axes the value
varies over (read from its type with `check_vma=True`, or named with
`vary_over`), so shards round independently and replicas identically.
Under `jax.jit` with sharded arrays the indices are global already.
"""

from __future__ import annotations

from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from mpolicy._src import arguments
from mpolicy._src import distributed
from mpolicy._src import jax_compat

TARGETS = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
_SOURCES = (np.dtype(jnp.float32), *TARGETS)


def _check(x: jax.Array, dtype: Any) -> np.dtype:
  try:
    dtype = np.dtype(dtype)
  except TypeError:
    dtype = None
  if dtype not in TARGETS:
    raise ValueError(
        f"stochastic_round: dtype must be bfloat16 or float16, got {dtype!r}"
        " (to keep float32, do not round).")
  if x.dtype not in _SOURCES:
    raise TypeError(
        f"stochastic_round: x must be a float32 array (or a bfloat16 or "
        f"float16 one, read as float32), got {x.dtype}.")
  return dtype


def _mix(h: jax.Array) -> jax.Array:
  """A 32-bit integer hash with full avalanche (xor-shift-multiply)."""
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x7FEB352D)
  h = h ^ (h >> 15)
  h = h * jnp.uint32(0x846CA68B)
  return h ^ (h >> 16)


def _random_bits(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """uint32 random bits of `shape`: a hash of each index and of `key`."""
  seeds = jax.random.bits(key, (2,), jnp.uint32)
  index = lax.iota(jnp.uint32, int(np.prod(shape, dtype=np.int64)))
  index = index.reshape(shape)
  return _mix(_mix(index * jnp.uint32(0x9E3779B9) + seeds[0]) ^ seeds[1])


_BF16_MAX_BITS = 0x7F7F0000  # The largest finite bfloat16, as float32 bits.
_INF_BITS = 0x7F800000


def _to_bfloat16(x: jax.Array, key: jax.Array) -> jax.Array:
  bits = lax.bitcast_convert_type(x, jnp.uint32)
  sign = bits & jnp.uint32(0x80000000)
  magnitude = bits & jnp.uint32(0x7FFFFFFF)
  noise = _random_bits(key, x.shape) & jnp.uint32(0xFFFF)
  rounded = (magnitude + noise) & jnp.uint32(0xFFFF0000)
  # A finite x never rounds up to inf: above the largest finite bfloat16
  # (within one spacing of float32's largest) it saturates there.
  rounded = jnp.where(magnitude < jnp.uint32(_INF_BITS),
                      jnp.minimum(rounded, jnp.uint32(_BF16_MAX_BITS)), rounded)
  out = lax.bitcast_convert_type(sign | rounded, jnp.float32).astype(
      jnp.bfloat16)
  # A NaN whose payload lies only in the dropped bits would become inf.
  return jnp.where(jnp.isnan(x), jnp.array(jnp.nan, jnp.bfloat16), out)


def _to_float16(x: jax.Array, key: jax.Array) -> jax.Array:
  nearest = x.astype(jnp.float16)
  sign = lax.bitcast_convert_type(x, jnp.uint32) >> 31  # 1 for negative x.
  magnitude = lax.bitcast_convert_type(nearest, jnp.uint16) & jnp.uint16(0x7FFF)
  # Round toward zero: one float16 step back if nearest rounded away.
  overshot = jnp.abs(nearest.astype(jnp.float32)) > jnp.abs(x)
  low_mag = magnitude - overshot.astype(jnp.uint16)
  sign16 = sign.astype(jnp.uint16) << 15
  low = lax.bitcast_convert_type(sign16 | low_mag, jnp.float16)
  high = lax.bitcast_convert_type(sign16 | (low_mag + 1), jnp.float16)
  # Both differences are exact in float32: the float16 spacing is a power of
  # two, and x - low keeps only bits x already has.
  low32 = low.astype(jnp.float32)
  fraction = (jnp.abs(x) - jnp.abs(low32)) / (
      jnp.abs(high.astype(jnp.float32)) - jnp.abs(low32))
  draw = (_random_bits(key, x.shape) >> 8).astype(
      jnp.float32) * np.float32(2.0**-24)
  out = jnp.where(draw < fraction, high, low)
  # A finite x beyond float16's range saturates at its largest finite value
  # (with its sign); inf and NaN round to nearest, that is stay as they are.
  largest = np.float32(jnp.finfo(jnp.float16).max)
  out = jnp.where(jnp.abs(x) > largest,
                  jnp.copysign(largest, x).astype(jnp.float16), out)
  return jnp.where(jnp.isfinite(x), out, nearest)


def check_vary_over(vary_over: Any, where: str) -> tuple:
  """`vary_over` (None, one mesh axis name or a sequence of them) as a
  tuple; raises a `TypeError` naming `where` for anything else."""
  if vary_over is None:
    return ()
  axes = (tuple(vary_over) if isinstance(vary_over, (tuple, list))
          else (vary_over,))
  for a in axes:
    try:
      hash(a)
    except TypeError:
      raise TypeError(
          f"{where}: vary_over must be a mesh axis name or a tuple of them "
          f"(the axes the value is sharded over), got {vary_over!r}.") from None
  return axes


def device_key(key: jax.Array, x: jax.Array, vary_over: Any = None,
               where: str = "stochastic_round") -> jax.Array:
  """`key` folded with this device's index along the axes `x` differs
  across: those its type says it varies over (inside `shard_map` with
  `check_vma=True`) and those named by `vary_over`. Unchanged where there
  are none, so replicated values round alike on every device."""
  named = check_vary_over(vary_over, where)
  missing, bound = distributed.unbound_axes(named)
  if missing:
    raise ValueError(
        f"{where}: vary_over names {missing!r}, which no enclosing shard_map "
        f"or pmap binds (bound here: {bound}). Name the "
        "mesh axes the value is sharded over, inside the shard_map; under "
        "jax.jit with sharded arrays pass nothing (the rounding sees global "
        "indices there).")
  axes = sorted(set(named) | jax_compat.varying_axes(x), key=str)
  if not axes:
    return key
  return jax.random.fold_in(key, lax.axis_index(tuple(axes)))


def stochastic_round(x: Any, dtype: Any, key: jax.Array, *,
                     vary_over: Any = None) -> jax.Array:
  """Rounds a float32 array to bfloat16 or float16, stochastically.

  Each element rounds to one of its two neighbours in `dtype`, the upper
  with probability equal to its distance from the lower over the spacing,
  so the expected value of the result is `x`. Values that `dtype` can
  represent come back exactly; NaN stays NaN and infinities stay infinite.
  Float16's subnormals are rounded the same way (their spacing is 2**-24).

  The top of the range: a finite value never rounds to an infinity. A
  finite float32 value beyond the largest finite value of `dtype` rounds
  to that value, with its sign: for bfloat16 (largest 3.3895e38) that is
  only the float32 values within one bfloat16 spacing of float32's largest
  (3.4028e38); for float16, every value beyond 65504, however large. There
  the result is not unbiased (its upper neighbour would be inf).
  Round-to-nearest (`astype`) gives inf from 65520 in float16 and from
  3.3962e38 in bfloat16.

  The same `key` gives the same result; use a new key for every write (see
  `with_state_dtypes` and `stochastic_params`, which derive them from a
  counter in their state). Across devices: inside `shard_map` with
  `check_vma=True`, `key` is folded with the device's index along the mesh
  axes `x` varies over, so the shards of a sharded array round
  independently while a replicated array rounds identically on every
  device (its replicas stay equal). With `check_vma=False` (or under
  `pmap`) JAX does not know which values differ: name the axes `x` is
  sharded over with `vary_over`, or every shard draws the same bits.
  Under `jax.jit` with sharded arrays nothing is needed: the bits hash
  each element's global index, so each shard rounds independently and the
  result is the one-device result, bit for bit.

  Args:
    x: a float32 array (a bfloat16 or float16 one is read as float32; one
      already in `dtype` comes back unchanged).
    dtype: `jnp.bfloat16` or `jnp.float16`.
    key: a JAX PRNG key (``jax.random.key(seed)`` or
      ``jax.random.PRNGKey(seed)``; an int seed is refused).
    vary_over: the mesh axes (a name or a tuple of names) `x` holds
      different values over, inside `shard_map` or `pmap`; added to those
      `x`'s type names with `check_vma=True`. None: only those.

  Returns:
    An array of `dtype`, shaped like `x`.

  Raises:
    ValueError: `dtype` is not bfloat16 or float16, or `vary_over` names
      an axis no enclosing `shard_map` / `pmap` binds.
    TypeError: `x` is not a float32, bfloat16 or float16 array, `key` is
      not one PRNG key, or `vary_over` is not an axis name or a tuple of
      them.

  >>> import jax, jax.numpy as jnp
  >>> x = jnp.full(10_000, 1 + 2.0**-10)  # A quarter of a bfloat16 step.
  >>> y = stochastic_round(x, jnp.bfloat16, jax.random.PRNGKey(0))
  >>> sorted(set(y.tolist())), round(float(y.astype(jnp.float32).mean()), 4)
  ([1.0, 1.0078125], 1.001)
  >>> x.astype(jnp.bfloat16).astype(jnp.float32).mean()  # Nearest: all lost.
  Array(1., dtype=float32)

  See also: `with_state_dtypes`, `stochastic_params`,
  `apply_updates_stochastic`.
  """
  x = jnp.asarray(x)
  dtype = _check(x, dtype)
  arguments.require_key(key, "stochastic_round")
  key = device_key(key, x, vary_over)
  if x.dtype == dtype:
    return x
  x = x.astype(jnp.float32)
  if dtype == jnp.bfloat16:
    return _to_bfloat16(x, key)
  return _to_float16(x, key)


def leaf_keys(seed: int, count: jax.Array, n: int) -> list[jax.Array]:
  """`n` PRNG keys for one write: from `seed` and a step counter.

  The same `(seed, count)` gives the same keys, so a run resumed from a
  checkpoint (which holds the counter) draws the same bits.
  """
  key = jax.random.fold_in(jax.random.PRNGKey(seed), count)
  return [jax.random.fold_in(key, i) for i in range(n)]
