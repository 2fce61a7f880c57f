"""Widening a half value so that every consumer reads the same numbers.

XLA may keep excess precision (``--xla_allow_excess_precision``, on by
default): inside a fusion it drops the pair ``convert(convert(y, bf16), f32)``
and reads ``y`` unrounded. A half value read by several consumers can then
be rounded for some of them and not for others. Under `mpolicy.amp` this
is what a float32 loss sees when the logits are bfloat16: the log-sum-exp,
fused with the op that made the logits, reads them unrounded, while the
picked logit and the maximum read the stored bfloat16 values, and the
cross-entropy comes out negative.

`widen` makes the rounding explicit: the up-cast is followed by
``reduce_precision`` to the half format's precision, which XLA keeps. On a
value that is already half it changes nothing; on a value XLA kept in
float32 it gives the rounded number every other consumer reads.

>>> import jax.numpy as jnp, numpy as np
>>> x = jnp.array([1 / 3, 1e-40, np.inf], jnp.bfloat16)
>>> y = widen(x, jnp.float32)
>>> y.dtype, bool(jnp.array_equal(y, x.astype(jnp.float32)))
(dtype('float32'), True)
"""

from __future__ import annotations

from collections.abc import Callable
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# (exponent bits, mantissa bits) of the ``reduce_precision`` after an
# up-cast from each half format. float16 keeps float32's exponent range: XLA
# flushes values below the target's smallest normal to zero, and float16's
# subnormals must come through unchanged (they have at most 10 significant
# bits, so 10 mantissa bits hold them exactly).
_ROUNDING = {
    np.dtype(jnp.bfloat16): (8, 7),
    np.dtype(jnp.float16): (8, 10),
}


def widen(x: Any, dtype: Any) -> jax.Array:
  """``x`` (bfloat16 or float16) as the wider float ``dtype``, rounding pinned.

  Other dtypes (float8, integers, narrowing casts) are converted plainly.

  Args:
    x: the array to cast.
    dtype: the dtype to cast to.

  Returns:
    ``x.astype(dtype)``, followed by a ``reduce_precision`` to ``x``'s own
    precision when ``x`` is bfloat16 or float16 and ``dtype`` is wider.

  >>> import jax, jax.numpy as jnp
  >>> jax.make_jaxpr(lambda h: widen(h, jnp.float32))(
  ...     jnp.ones(2, jnp.bfloat16)).eqns[-1].primitive.name
  'reduce_precision'
  """
  dtype = np.dtype(dtype)
  src = np.dtype(x.dtype)
  y = jax.lax.convert_element_type(x, dtype)
  bits = _ROUNDING.get(src)
  if bits is None or not jnp.issubdtype(dtype, jnp.floating):
    return y
  if dtype.itemsize <= src.itemsize:
    return y
  exponent_bits, mantissa_bits = bits
  return jax.lax.reduce_precision(y, exponent_bits=exponent_bits,
                                  mantissa_bits=mantissa_bits)


@functools.lru_cache(maxsize=None)
def widener(dtype: Any) -> Callable[[Any], jax.Array]:
  """``lambda x: widen(x, dtype)``, one function per dtype (a cache key).

  >>> import jax.numpy as jnp
  >>> widener(jnp.float32) is widener(jnp.float32)
  True
  """
  return functools.partial(widen, dtype=np.dtype(dtype))


@functools.lru_cache(maxsize=None)
def rounder(dtype: Any) -> Callable[[Any], jax.Array]:
  """``x`` (float32) rounded to the precision of ``dtype`` (bfloat16 or
  float16), kept in float32: the values ``x.astype(dtype)`` holds, without
  a convert.

  >>> import jax.numpy as jnp
  >>> x = jnp.array([1 / 3, 1e-40], jnp.float32)
  >>> bool(jnp.array_equal(rounder(jnp.bfloat16)(x),
  ...                      x.astype(jnp.bfloat16).astype(jnp.float32)))
  True
  """
  exponent_bits, mantissa_bits = _ROUNDING[np.dtype(dtype)]
  return functools.partial(jax.lax.reduce_precision,
                           exponent_bits=exponent_bits,
                           mantissa_bits=mantissa_bits)
