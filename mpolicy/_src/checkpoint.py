"""Checkpoints of training state as plain numpy `.npz` files.

The format, version 1: one `.npz` entry per pytree leaf, keyed by the
leaf's `jax.tree_util.keystr` path (e.g. `"[0]['linear']['w']"`), holding
the leaf as a numpy array. Dtypes numpy cannot store natively (bfloat16,
the float8 types) are stored as their raw bits, an unsigned integer array
of the same item size, and named in the metadata. One extra entry,
`"__mpolicy_checkpoint__"`, is a JSON string:
`{"format": "mpolicy.checkpoint", "version": 1, "dtypes": {key: name}}`,
where `dtypes` names the true dtype of every leaf.

Anything `np.load` reads can read it back; `restore_checkpoint` also checks
it against a template pytree.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any

META_KEY = "__mpolicy_checkpoint__"
_FORMAT = "mpolicy.checkpoint"
_VERSION = 1
# Dtypes whose numpy descriptor `np.save` writes and `np.load` reads back.
_NATIVE_KINDS = frozenset("biufc")


def _leaf_array(leaf: Any) -> np.ndarray:
  return np.asarray(jax.device_get(leaf))


def _is_native(dtype: np.dtype) -> bool:
  return dtype.kind in _NATIVE_KINDS  # bfloat16 and float8 are kind "V".


def tree_to_arrays(tree: PyTree) -> dict[str, np.ndarray]:
  """The `.npz` entries for `tree`: `{keystr(path): array}` plus metadata.

  Non-native dtypes (bfloat16, float8) are stored as unsigned integer bit
  patterns; the metadata entry names every leaf's real dtype. Fetches
  the leaves to the host.

  Args:
    tree: a pytree of arrays and numbers.

  Returns:
    A dict of numpy arrays, ready for `np.savez`.

  Raises:
    ValueError: two leaves share a key.
    TypeError: a leaf is not an array or a number.

  >>> import jax.numpy as jnp
  >>> arrays = tree_to_arrays({"w": jnp.ones(2, jnp.bfloat16)})
  >>> arrays["['w']"].dtype, sorted(arrays)
  (dtype('uint16'), ["['w']", '__mpolicy_checkpoint__'])

  See also: `arrays_to_tree`, `save_checkpoint`.
  """
  out, dtypes = {}, {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    key = jax.tree_util.keystr(path)
    if key in out or key == META_KEY:
      raise ValueError(f"tree_to_arrays: two leaves share the key {key!r}.")
    array = _leaf_array(leaf)
    if array.dtype == object:
      raise TypeError(f"tree_to_arrays: leaf {key} is a "
                      f"{type(leaf).__name__}, not an array or number.")
    dtypes[key] = array.dtype.name
    if not _is_native(array.dtype):
      array = array.view(np.dtype(f"u{array.dtype.itemsize}"))
    out[key] = array
  out[META_KEY] = np.asarray(json.dumps(
      {"format": _FORMAT, "version": _VERSION, "dtypes": dtypes}))
  return out


def _restore_leaf(template: Any, array: np.ndarray) -> Any:
  if isinstance(template, (np.ndarray, np.generic)):
    return array if isinstance(template, np.ndarray) else array[()]
  if isinstance(template, (bool, int, float, complex)):
    return type(template)(array.item())
  if getattr(template, "weak_type", False) and array.ndim == 0:
    # A weakly typed scalar (e.g. `jnp.asarray(2.0)`) comes back weakly
    # typed where JAX can make one, so it promotes as the original did.
    weak = jnp.asarray(array.item())
    if weak.dtype == array.dtype:
      return weak
  return jnp.asarray(array)


def arrays_to_tree(arrays: Any, template: PyTree) -> PyTree:
  """Rebuilds a pytree shaped like `template` from `tree_to_arrays` entries.

  Args:
    arrays: a mapping of entries, e.g. from `tree_to_arrays` or `np.load`.
    template: gives the structure, shapes and dtypes; its leaves may be
      arrays, numbers or `jax.ShapeDtypeStruct`s (e.g. from `jax.eval_shape`).

  Returns:
    The pytree. Leaves come back as JAX arrays, except where the template
    has a numpy array or a Python number, which come back as the same kind.

  Raises:
    ValueError: the entries are not an mpolicy checkpoint, a key is missing
      or extra, or a leaf's shape or dtype differs from the template; the
      message lists every mismatch.

  >>> import jax.numpy as jnp
  >>> tree = {"w": jnp.full(2, 1.5, jnp.bfloat16)}
  >>> arrays_to_tree(tree_to_arrays(tree), tree)["w"]
  Array([1.5, 1.5], dtype=bfloat16)

  See also: `tree_to_arrays`, `restore_checkpoint`.
  """
  if META_KEY not in arrays:
    raise ValueError("arrays_to_tree: not an mpolicy checkpoint (no "
                     f"{META_KEY!r} entry).")
  meta = json.loads(str(np.asarray(arrays[META_KEY])))
  if meta.get("format") != _FORMAT or meta.get("version") != _VERSION:
    raise ValueError(f"arrays_to_tree: unsupported checkpoint format {meta!r}; "
                     f"this version reads {_FORMAT!r} version {_VERSION}.")
  dtypes = meta["dtypes"]
  leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
  keys = [jax.tree_util.keystr(p) for p, _ in leaves]
  stored = set(arrays) - {META_KEY}
  problems = []
  missing = [k for k in keys if k not in stored]
  extra = sorted(stored - set(keys))
  if missing:
    problems.append("missing from the checkpoint: " + ", ".join(missing))
  if extra:
    problems.append("in the checkpoint but not in the template: "
                    + ", ".join(extra))
  restored = []
  for key, (_, leaf) in zip(keys, leaves):
    if key not in stored:
      continue
    array = np.asarray(arrays[key])
    dtype = np.dtype(dtypes.get(key, array.dtype.name))
    if array.dtype != dtype:
      array = array.view(dtype)
    want_shape = tuple(np.shape(leaf))
    want_dtype = getattr(leaf, "dtype", None)
    want_dtype = np.dtype(np.asarray(leaf).dtype if want_dtype is None
                          else want_dtype)
    if array.shape != want_shape or array.dtype != want_dtype:
      problems.append(f"{key}: checkpoint has {array.dtype.name}"
                      f"{list(array.shape)}, template wants "
                      f"{want_dtype.name}{list(want_shape)}")
      continue
    restored.append(_restore_leaf(leaf, array))
  if problems:
    raise ValueError("The checkpoint does not match the template: "
                     + "; ".join(problems) + ".")
  return jax.tree_util.tree_unflatten(treedef, restored)


def save_checkpoint(path: str | os.PathLike[str], tree: PyTree) -> None:
  """Saves `tree` (loss scale, params, optimizer state, ...) to an `.npz` file.

  Writes to a temporary file and renames it, so an interrupted save never
  leaves a half-written checkpoint at `path`. See the module docstring for
  the format.

  Args:
    path: the file to write.
    tree: a pytree of arrays and numbers.

  >>> import os, tempfile, jax.numpy as jnp, mpolicy
  >>> state = {"loss_scale": mpolicy.DynamicLossScale(2. ** 15),
  ...          "params": {"w": jnp.ones(2, jnp.bfloat16)}}
  >>> path = os.path.join(tempfile.mkdtemp(), "ckpt.npz")
  >>> save_checkpoint(path, state)
  >>> restored = restore_checkpoint(path, state)
  >>> float(restored["loss_scale"].loss_scale), restored["params"]["w"].dtype
  (32768.0, dtype(bfloat16))

  See also: `restore_checkpoint`, `tree_to_arrays`.
  """
  path = os.fspath(path)
  tmp = path + ".tmp"
  with open(tmp, "wb") as f:
    np.savez(f, **tree_to_arrays(tree))
  os.replace(tmp, path)


def restore_checkpoint(path: str | os.PathLike[str], template: PyTree) -> PyTree:
  """Loads a `save_checkpoint` file into the structure of `template`.

  Restoring and continuing gives bit-for-bit the same steps as never
  stopping.

  Args:
    path: the file `save_checkpoint` wrote.
    template: a pytree like the one saved (e.g. freshly initialized state,
      or `jax.eval_shape` of its initializer); its structure, shapes and
      dtypes are checked, and the static parts of custom pytrees (a
      `DynamicLossScale`'s period and factor) come from it.

  Returns:
    The restored pytree (see `arrays_to_tree` for the kinds of leaves).

  Raises:
    ValueError: if the file does not match the template (every mismatch is
      listed) or is not an mpolicy checkpoint.

  >>> import os, tempfile, jax.numpy as jnp
  >>> path = os.path.join(tempfile.mkdtemp(), "ckpt.npz")
  >>> save_checkpoint(path, {"w": jnp.ones(2)})
  >>> restore_checkpoint(path, {"w": jnp.zeros(3)})
  Traceback (most recent call last):
  ...
  ValueError: The checkpoint does not match the template: ['w']: checkpoint has float32[2], template wants float32[3].

  See also: `save_checkpoint`, `arrays_to_tree`.
  """
  with np.load(os.fspath(path), allow_pickle=False) as data:
    arrays = {k: data[k] for k in data.files}
  return arrays_to_tree(arrays, template)
