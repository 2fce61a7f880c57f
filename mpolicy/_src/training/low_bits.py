"""An exact float32 master in 16 bits per bfloat16 parameter.

A bfloat16 value is the top 16 bits of a float32 one. Keeping the other 16
bits of the master (its "low bits") beside bfloat16 params that are the
master's top 16 bits, truncated toward zero, stores the float32 master
exactly in 2 bytes more than the params: `join(params, low_bits)` rebuilds
it. (Round-to-nearest-even params could not: 2**16 + 1 float32 values round
to each even bfloat16 value, one more than 16 bits tell apart.)

`master_weights(inner, storage="low_bits")` uses these; this module holds
the bit arithmetic and the state.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from mpolicy._src.training import _trees

PyTree = Any
_TOP = np.uint32(0xFFFF0000)
_LOW = np.uint32(0x0000FFFF)


class LowBitsMasterState(NamedTuple):
  """State of `master_weights(inner, storage="low_bits")`.

  Attributes:
    low_bits: per parameter, a uint16 array of its shape: the 16 bits a
      float32 master has beyond the parameter's bfloat16 value (for a
      float32 parameter, its own low 16 bits); a uint16 scalar 0 for a
      leaf that is not real floating (it is its own master).
    inner_state: the wrapped optimizer's state, built from the master.
  """
  low_bits: Any
  inner_state: Any


def join(top: jax.Array, low: jax.Array) -> jax.Array:
  """The float32 whose top 16 bits are those of `top` (bfloat16, or float32
  whose low bits are ignored) and whose low 16 bits are `low` (uint16)."""
  high = lax.bitcast_convert_type(top.astype(jnp.float32), jnp.uint32) & _TOP
  return lax.bitcast_convert_type(high | low.astype(jnp.uint32), jnp.float32)


def split(master: jax.Array) -> tuple[jax.Array, jax.Array]:
  """`(top, low)`: `master`'s top 16 bits as bfloat16 (truncated toward
  zero) and its low 16 bits as uint16; `join(top, low)` is `master`."""
  bits = lax.bitcast_convert_type(master.astype(jnp.float32), jnp.uint32)
  top = lax.bitcast_convert_type((bits >> 16).astype(jnp.uint16),
                                 jnp.bfloat16)
  return top, (bits & _LOW).astype(jnp.uint16)


def check_leaf(x: Any, who: str) -> None:
  """Refuses a real floating leaf that is neither bfloat16 nor float32."""
  dtype = getattr(x, "dtype", None)
  if _trees.is_floating(x) and np.dtype(dtype) not in (
      np.dtype(jnp.bfloat16), np.dtype(jnp.float32)):
    raise ValueError(
        f"{who}: storage='low_bits' keeps a float32 master as bfloat16 "
        "params (its top 16 bits) plus 16 low bits, so it needs bfloat16 "
        f"(or float32) params; got a {np.dtype(dtype).name} param. Cast the "
        "params to bfloat16, or use storage='full' (a float32 copy) for "
        f"{np.dtype(dtype).name} params.")


def init_low_bits(params: PyTree, who: str) -> PyTree:
  """The low bits of `params`: a float32 leaf's own, zeros for bfloat16."""

  def low(x):
    check_leaf(x, who)
    if not _trees.is_floating(x):
      return jnp.zeros([], jnp.uint16)
    if x.dtype == jnp.float32:
      return split(x)[1]
    return jnp.zeros(x.shape, jnp.uint16)

  return jax.tree_util.tree_map(low, params)


def masters(params: PyTree, low_bits: PyTree) -> PyTree:
  """The float32 master of each real floating leaf; other leaves as they
  are (their own master)."""
  return jax.tree_util.tree_map(
      lambda p, low: join(p, low) if _trees.is_floating(p) else p,
      params, low_bits)


def written(p: jax.Array, master: jax.Array) -> tuple[jax.Array, jax.Array]:
  """`(update, low)` for half param `p` and its new float32 `master`.

  `update` is what `optax.apply_updates` adds to `p` to write the master's
  top 16 bits, `low` the bits to keep. `p + update` is computed in float32;
  it lands on the top bits unless the weight shrinks by a factor over
  2**15 in one step without reaching zero (float32 cannot hold that
  difference). There the written value `w` differs, and `low` is the one
  making `join(w, low)` nearest to `master`.
  """
  top, low = split(master)
  update = top.astype(jnp.float32) - p.astype(jnp.float32)
  lands = (p.astype(jnp.float32) + update).astype(p.dtype)
  same_sign = jnp.signbit(lands) == jnp.signbit(master)
  beyond = jnp.abs(master) > jnp.abs(lands.astype(jnp.float32))
  nearest = jnp.where(same_sign & beyond, np.uint16(0xFFFF), np.uint16(0))
  same = lax.bitcast_convert_type(lands, jnp.uint16) == lax.bitcast_convert_type(
      top, jnp.uint16)
  return update, jnp.where(same, low, nearest)
