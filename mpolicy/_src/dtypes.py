"""Dtype questions the interpreter and its rules ask, answered once.

Every "is this floating?", "is this half?" and "which dtype wins?" in the
interpreter layer goes through these helpers, so the answers agree. Where
floating dtypes meet, the widest is JAX's own promotion: bfloat16 with
float16 gives float32.

>>> import jax.numpy as jnp
>>> widest([jnp.bfloat16, jnp.float16])
dtype('float32')
>>> is_half(jnp.bfloat16), is_half(jnp.float32), is_float(jnp.int32)
(True, False, False)
"""

from __future__ import annotations

from collections.abc import Iterable
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpolicy._src import jax_compat


def dtype_of(x: Any) -> np.dtype:
  """The dtype of an array, tracer, numpy value or Python scalar."""
  dtype = getattr(x, "dtype", None)
  if dtype is None and isinstance(x, jax_compat.Tracer):
    return NO_DTYPE  # A traced value of a type with no dtype (a hijax type).
  return np.asarray(x).dtype if dtype is None else dtype


NO_DTYPE = np.dtype(object)
"""The "dtype" of a value of a type that has none (a hijax type such as a
Flax hijax Variable): neither floating nor integer, never cast."""


def aval_dtype(aval: Any) -> np.dtype:
  """``aval``'s dtype; `NO_DTYPE` for a type that has none."""
  return getattr(aval, "dtype", NO_DTYPE)


def is_float(dtype: Any) -> bool:
  """Whether ``dtype`` is a real floating dtype (``None`` is not)."""
  return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


def is_half(dtype: Any) -> bool:
  """A floating dtype narrower than float32 (bfloat16, float16, float8)."""
  return is_float(dtype) and np.dtype(dtype).itemsize < 4


def is_double(dtype: Any) -> bool:
  """float64 (under x64): never narrowed, and not eligible for ``lower``."""
  return is_float(dtype) and np.dtype(dtype).itemsize > 4


def float_value(x: Any) -> bool:
  """Whether ``x`` holds floating values."""
  return is_float(dtype_of(x))


def widest(dtypes: Iterable[Any]) -> np.dtype:
  """The dtype JAX promotes ``dtypes`` to (bfloat16 with float16: float32)."""
  return np.dtype(functools.reduce(jnp.promote_types, dtypes))


def is_traced(x: Any) -> bool:
  """A JAX array or tracer (not a literal or numpy constant)."""
  return isinstance(x, (jax.Array, jax_compat.Tracer))
