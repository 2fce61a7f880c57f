"""Tree utilities the training helpers share: floating leaves and casts.

Floating means real floating here as everywhere in mpolicy (the answer of
`dtypes.is_float`). Complex leaves are not floating: no helper casts them,
but they are differentiated, unscaled, averaged and checked for inf/NaN
like real ones (`split_complex` lets a loss scale unscale them).
"""

from __future__ import annotations

from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from mpolicy._src import dtypes

PyTree = Any


def is_floating(x: Any) -> bool:
  """Whether `x` is an array of a real floating dtype."""
  return dtypes.is_float(getattr(x, "dtype", None))


def is_complex(x: Any) -> bool:
  """Whether `x` is an array of a complex dtype."""
  dtype = getattr(x, "dtype", None)
  return dtype is not None and jnp.issubdtype(dtype, jnp.complexfloating)


def split_complex(tree: PyTree) -> PyTree:
  """`tree` with each complex leaf replaced by its `(real, imag)` pair."""
  return jax.tree_util.tree_map(
      lambda x: (jnp.real(x), jnp.imag(x)) if is_complex(x) else x, tree)


def join_complex(split: PyTree, like: PyTree) -> PyTree:
  """Undoes `split_complex(like)`: each pair in `split` made one complex
  leaf again, in the dtype of its leaf in `like`."""
  leaves, treedef = jax.tree_util.tree_flatten(like)
  parts = treedef.flatten_up_to(split)  # type: ignore[attr-defined]  # jaxlib: no stubs.
  return treedef.unflatten([  # type: ignore[attr-defined]  # jaxlib: no stubs.
      lax.complex(*part).astype(leaf.dtype) if is_complex(leaf) else part
      for part, leaf in zip(parts, leaves)])


def signed_zeros(shape_dtype: Any) -> jax.Array:
  """`-0.0` in every component of a floating or complex array (zeros for
  other dtypes): `x + signed_zeros` is `x` bit for bit, -0.0 and NaN
  included, while `x + 0.0` turns -0.0 into +0.0."""
  shape, dtype = shape_dtype.shape, np.dtype(shape_dtype.dtype)
  if dtypes.is_float(dtype):
    return jnp.full(shape, -0.0, dtype)
  if jnp.issubdtype(dtype, jnp.complexfloating):
    part = jnp.full(shape, -0.0, np.finfo(dtype).dtype)
    return lax.complex(part, part).astype(dtype)
  return jnp.zeros(shape, dtype)


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
