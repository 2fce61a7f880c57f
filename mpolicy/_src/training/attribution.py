"""Which gradient leaves overflowed: flags on device, paths on the host."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpolicy._src import tree_paths

PyTree = Any


path_str = tree_paths.path_str
"""See `tree_paths.path_str` (kept here for the training helpers)."""


def nonfinite_flags(tree: PyTree) -> PyTree:
  """Per-leaf flags: a boolean scalar array per leaf, True where it has inf/NaN.

  Runs on device (no host sync) and works under `jit`, `pmap` and
  `shard_map`; turn it into names on the host with `nonfinite_paths`.

  Args:
    tree: a pytree of arrays (e.g. gradients).

  Returns:
    A pytree of the same structure with a boolean scalar per leaf. Integer
    and bool leaves are always finite; a complex leaf is not finite where
    either part is inf or NaN.

  >>> import jax.numpy as jnp
  >>> flags = nonfinite_flags({"a": jnp.ones(2), "b": jnp.array([jnp.inf])})
  >>> bool(flags["a"]), bool(flags["b"])
  (False, True)

  See also: `nonfinite_paths`, `scaled_value_and_grad(attribute_overflow=True)`.
  """
  return jax.tree_util.tree_map(lambda x: ~jnp.isfinite(x).all(), tree)


def nonfinite_paths(flags: PyTree) -> list[str]:
  """The '/'-joined paths of the leaves flagged True, on the host.

  This reads the flags back to the host (a device sync): call it only on
  steps you want to report, e.g. when `grads_finite` is False.

  Args:
    flags: the output of `nonfinite_flags`, or any pytree of boolean arrays
      (a leaf counts as flagged if any of its elements is True).

  Returns:
    A list of paths (see `path_str`), in pytree order.

  >>> import jax.numpy as jnp
  >>> grads = {"encoder/~/linear_1": {"w": jnp.array([jnp.nan]),
  ...                                 "b": jnp.zeros(1)}}
  >>> nonfinite_paths(nonfinite_flags(grads))
  ['encoder/~/linear_1/w']

  See also: `nonfinite_flags`, `path_str`.
  """
  leaves = jax.tree_util.tree_flatten_with_path(flags)[0]
  return [path_str(p) for p, flag in leaves if bool(np.any(np.asarray(flag)))]

