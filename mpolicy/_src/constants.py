"""Scalar constants that meet half arrays: they follow the arrays.

Code traced in float32 writes its constants in float32: the fill of an
attention mask (``jnp.where(mask, logits, jnp.finfo(jnp.float32).min)``),
a ``nan`` for an empty variance. Under a half policy such a constant is
no reason to run the op in float32: like a literal, it follows the
arrays it meets, and is narrowed to their dtype. A finite constant beyond
the narrower dtype's range becomes its largest finite value of the same
sign (float32's lowest becomes bfloat16's lowest, as code traced in
bfloat16 would have written it), not an infinity: a masked row of logits
then stays finite.

>>> import jax.numpy as jnp, numpy as np
>>> bool(saturate(np.finfo(np.float32).min, jnp.bfloat16)
...      == jnp.finfo(jnp.bfloat16).min)
True
>>> float(saturate(np.float32(np.inf), jnp.float16))
inf
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def saturate(value: Any, dtype: Any) -> np.ndarray:
  """The scalar ``value`` as ``dtype``, finite values clipped to its range.

  Args:
    value: a scalar (Python or numpy).
    dtype: the dtype to convert to.

  Returns:
    A numpy scalar of ``dtype``; infinities and NaNs stay as they are.

  >>> float(saturate(1e6, jnp.float16))
  65504.0
  """
  dtype = np.dtype(dtype)
  value = np.asarray(value)
  if (jnp.issubdtype(dtype, jnp.floating)
      and jnp.issubdtype(value.dtype, jnp.floating)
      and np.isfinite(value)):
    info = jnp.finfo(dtype)
    value = np.clip(value.astype(np.float64), float(info.min), float(info.max))
  return np.asarray(value).astype(dtype)[()]


def filled(shape: tuple[int, ...], value: Any, dtype: Any) -> jax.Array:
  """An array of ``shape`` holding `saturate`\\ (``value``, ``dtype``).

  >>> filled((2,), -1e9, jnp.float16).tolist()
  [-65504.0, -65504.0]
  """
  return jax.lax.broadcast(np.asarray(saturate(value, dtype)), tuple(shape))
