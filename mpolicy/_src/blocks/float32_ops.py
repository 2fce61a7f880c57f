"""Exact float32 steps the quantizers share: flushing, powers of two, saturation.

XLA's CPU and GPU backends flush float32 subnormals (below 2**-126) to
zero, on input and on output of arithmetic. The quantizers make that
explicit (`flush`), so their results are the same on every backend: a
subnormal float32 input counts as a zero of its sign, and so does a
subnormal result.

Division is correctly rounded (`divide`), which XLA's own rewriting of a
division by a broadcast value is not.

Scaling by ``2**k`` for ``k`` in [-127, 127] is two multiplications by
normal powers of two (``2**-127`` itself is subnormal), exact unless the
result leaves float32's normal range.

>>> import jax.numpy as jnp
>>> mul_pow2(jnp.float32(1.0), jnp.int32(-127)) == 0   # 2**-127 is subnormal
Array(True, dtype=bool)
>>> float(mul_pow2(jnp.float32(3.0), jnp.int32(100))) == 3 * 2.0**100
True
"""

from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

TINY = np.float32(np.finfo(np.float32).tiny)  # 2**-126
F32_MAX = np.float32(np.finfo(np.float32).max)


def flush(v: jax.Array) -> jax.Array:
  """Float32 subnormals become zeros of their sign; the rest is unchanged."""
  return jnp.where(jnp.abs(v) < TINY, v * np.float32(0), v)


def pow2(k: jax.Array) -> jax.Array:
  """``2.0**k`` in float32 from its bits, for int32 ``k`` in [-126, 127]."""
  return lax.bitcast_convert_type((k + 127).astype(jnp.uint32) << 23,
                                  jnp.float32)


def mul_pow2(v: jax.Array, k: jax.Array) -> jax.Array:
  """``v * 2**k`` (int32 ``k`` in [-127, 127]), flushed; exact otherwise."""
  half = k // 2
  return flush(v * pow2(half) * pow2(k - half))


def divide(x: jax.Array, d: jax.Array) -> jax.Array:
  """``x / d`` correctly rounded, ``d`` broadcast to ``x``'s shape, flushed.

  XLA rewrites a division by a broadcast value into a multiplication by its
  reciprocal, which can land one float32 step off (6.65625 / 1.9017857
  gives 3.4999998, not 3.5, and e2m1 then rounds to 3, not 4). The
  divisor goes through an optimization barrier, so XLA sees a full array.
  """
  d = lax.optimization_barrier(jnp.broadcast_to(d, x.shape))
  return flush(x / d)


def saturate(v: jax.Array) -> jax.Array:
  """Clamps to float32's largest finite magnitude (infinities included)."""
  return jnp.clip(v, -F32_MAX, F32_MAX)
