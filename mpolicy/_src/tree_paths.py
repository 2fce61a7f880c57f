"""Pytree key paths as the '/'-joined names users read.

A low module (it needs only the standard library): the debugger names
arguments by it, the training helpers name gradient leaves by it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def _key_name(key: Any) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def path_str(path: Sequence[Any]) -> str:
  """A pytree key path as a '/'-joined string.

  Dict keys, attribute names and sequence indices are joined with '/', so a
  Haiku parameter `params["encoder/~/linear_1"]["w"]` reads
  `encoder/~/linear_1/w`, the same as Haiku's own module names.

  Args:
    path: a key path, as from `jax.tree_util.tree_flatten_with_path`.

  Returns:
    The joined string.

  >>> import jax
  >>> params = {"encoder/~/linear_1": {"w": 0, "b": 0}}
  >>> [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  ['encoder/~/linear_1/b', 'encoder/~/linear_1/w']

  See also: `mpolicy.nonfinite_paths`, `jax.tree_util.keystr` (the
  checkpoint keys).
  """
  return "/".join(_key_name(k) for k in path)
