"""Tree utilities the training helpers share: floating leaves and casts."""

from __future__ import annotations

from typing import Any

import jax
from jax import lax
import jax.numpy as jnp

PyTree = Any


def is_floating(x: Any) -> bool:
  """Whether `x` is an array of a floating dtype."""
  dtype = getattr(x, "dtype", None)
  return dtype is not None and jnp.issubdtype(dtype, jnp.inexact)


def cast_floating(tree: PyTree, dtype: Any) -> PyTree:
  """The floating leaves of `tree` cast to `dtype`; other leaves as they are."""
  return jax.tree_util.tree_map(
      lambda x: x.astype(dtype) if is_floating(x) else x, tree)


def strong(x: Any) -> Any:
  """`x` without JAX's weak type, so it keeps its dtype when combined."""
  if getattr(x, "weak_type", False):
    return lax.convert_element_type(x, x.dtype)  # Drops the weak type.
  return x


def cast_like(new: Any, old: Any) -> Any:
  """`new` in the dtype of `old` (strongly typed); None leaves pass through."""
  if new is None or old is None:
    return new
  dtype = getattr(old, "dtype", None)
  if dtype is None:
    return new
  new = jnp.asarray(new)
  return strong(new) if new.dtype == dtype else new.astype(dtype)
