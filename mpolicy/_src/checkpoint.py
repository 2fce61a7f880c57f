"""Checkpoints of training state, written and read by orbax-checkpoint.

A checkpoint is an orbax directory with two items: `state`, the leaves of
the pytree in a flat dict keyed by each leaf's `jax.tree_util.keystr` path
(`"[0]['linear']['w']"`), written by orbax's standard pytree handler
(tensorstore: bfloat16, float8, typed PRNG keys and sharded arrays as they
are); and `meta`, JSON naming the format, every leaf's dtype and shape, and
the settings of every loss scale in the tree (a `DynamicLossScale`'s
`period`, `factor` and `min_loss_scale`, a `StaticLossScale`'s scale), which
pytree flattening would otherwise drop.

`save_checkpoint` writes into a fresh temporary directory beside `path` and
renames it into place, so concurrent saves to one path never mix and a
failed save leaves nothing behind. `restore_checkpoint` checks the template
against `meta` first and lists every mismatch in one `ValueError`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpolicy._src import loss_scale as loss_scale_lib

PyTree = Any

_FORMAT = "mpolicy.checkpoint"
_VERSION = 2
_SETTINGS = {
    loss_scale_lib.DynamicLossScale: ("period", "factor", "min_loss_scale"),
    loss_scale_lib.StaticLossScale: ("loss_scale",),
}

# orbax's synchronous save shares state between threads of one process (a
# second save started while one runs can fail or damage both); saves and
# restores from threads therefore take turns. Processes need no lock: each
# writes to its own temporary directory.
_ORBAX_LOCK = threading.Lock()


def _orbax():
  # Imported on first use: orbax takes about a second to import.
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  return ocp


def _is_key(x: Any) -> bool:
  dtype = getattr(x, "dtype", None)
  return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _describe_leaf(key: str, leaf: Any, what: str) -> tuple[str, list[int]]:
  if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct, np.ndarray, np.generic,
                       bool, int, float)):
    dtype = getattr(leaf, "dtype", None)
    if dtype is None:  # A Python number: the dtype JAX gives it.
      dtype = jax.dtypes.canonicalize_dtype(np.result_type(type(leaf)))
    return str(dtype), [int(d) for d in np.shape(leaf)]
  raise TypeError(
      f"{what}: leaf {key} is of type {type(leaf).__name__}; a checkpoint "
      "holds arrays (jax or numpy, any dtype, typed PRNG keys included), "
      "jax.ShapeDtypeStruct (in a template) and Python numbers.")


def _number(value: Any) -> Any:
  return np.asarray(value).item()


def _settings(tree: PyTree) -> dict[str, dict[str, Any]]:
  """`{keystr: {"type": name, setting: value}}` for each loss scale."""
  is_ls = lambda x: type(x) in _SETTINGS
  out = {}
  nodes = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_ls)[0]
  for path, node in nodes:
    if is_ls(node):
      names = _SETTINGS[type(node)]
      out[jax.tree_util.keystr(path)] = dict(
          type=type(node).__name__,
          **{name: _number(getattr(node, name)) for name in names})
  return out


def _flatten(tree: PyTree, what: str):
  leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  flat, described = {}, {}
  for path, leaf in leaves:
    key = jax.tree_util.keystr(path)
    if key in flat:
      raise ValueError(f"{what}: two leaves share the path {key!r}; give "
                       "them distinct keys.")
    described[key] = _describe_leaf(key, leaf, what)
    flat[key] = leaf
  return flat, described, treedef


def save_checkpoint(path: str | os.PathLike[str], tree: PyTree, *,
                    overwrite: bool = False) -> None:
  """Saves `tree` (params, optimizer state, loss scale, keys...) with orbax.

  Works for any pytree of arrays and numbers: half-precision params
  (bfloat16, float16, float8_e4m3fn, float8_e5m2), float32 master weights,
  optimizer state, typed PRNG keys, sharded arrays (each device writes its
  shards) and loss scales, whose settings are saved too. The checkpoint is
  written to a new temporary directory beside `path` and renamed into place
  when complete: two saves racing for one path leave one whole checkpoint
  (the other raises), and a failed save leaves nothing.

  Args:
    path: the checkpoint directory to create.
    tree: a pytree of arrays and numbers.
    overwrite: replace an existing checkpoint at `path` (it is removed only
      once the new one is complete).

  Raises:
    FileExistsError: `path` exists and `overwrite` is False.
    TypeError: a leaf is neither an array nor a number (the message names
      it).
    ValueError: two leaves share a path.
    NotImplementedError: JAX runs in several processes; use orbax's
      `CheckpointManager` there, which coordinates the hosts.

  >>> import os, tempfile, jax.numpy as jnp, mpolicy
  >>> state = {"loss_scale": mpolicy.DynamicLossScale(2. ** 15, period=10),
  ...          "params": {"w": jnp.ones(2, jnp.bfloat16)}}
  >>> path = os.path.join(tempfile.mkdtemp(), "step_100")
  >>> save_checkpoint(path, state)
  >>> restored = restore_checkpoint(path, state)
  >>> float(restored["loss_scale"].loss_scale), restored["params"]["w"].dtype
  (32768.0, dtype(bfloat16))

  See also: `restore_checkpoint`.
  """
  what = "save_checkpoint"
  if jax.process_count() > 1:
    raise NotImplementedError(
        f"{what}: JAX runs in {jax.process_count()} processes; save with "
        "orbax.checkpoint.CheckpointManager, which coordinates them.")
  flat, described, _ = _flatten(tree, what)
  meta = {"format": _FORMAT, "version": _VERSION, "leaves": described,
          "loss_scales": _settings(tree)}
  path = os.path.abspath(os.fspath(path))
  if os.path.lexists(path) and not overwrite:
    raise FileExistsError(f"{what}: {path} already exists; pass "
                          "overwrite=True to replace it, or choose a new path.")
  parent, name = os.path.split(path)
  os.makedirs(parent, exist_ok=True)
  ocp = _orbax()
  scratch = tempfile.mkdtemp(prefix=f".{name}.", suffix=".mpolicy-tmp",
                             dir=parent)
  try:
    staged = os.path.join(scratch, "checkpoint")
    with _ORBAX_LOCK, ocp.Checkpointer(
        ocp.CompositeCheckpointHandler()) as checkpointer:
      checkpointer.save(staged, ocp.args.Composite(
          state=ocp.args.StandardSave(flat), meta=ocp.args.JsonSave(meta)))
    if overwrite and os.path.lexists(path):
      os.rename(path, os.path.join(scratch, "replaced"))
    try:
      os.rename(staged, path)  # Atomic; refuses a non-empty directory.
    except OSError as e:
      if not os.path.lexists(path):
        raise
      raise FileExistsError(
          f"{what}: {path} was created by another save while this one ran; "
          "it is left as that save wrote it.") from e
  finally:
    shutil.rmtree(scratch, ignore_errors=True)


def _abstract(leaf: Any) -> Any:
  """What orbax restores `leaf` from: its shape, dtype and sharding."""
  if isinstance(leaf, jax.Array):
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
  return leaf  # ShapeDtypeStruct, numpy arrays and numbers restore as such.


def _like(template: Any, restored: Any) -> Any:
  if isinstance(template, (bool, int, float)):
    return type(template)(np.asarray(restored).item())
  if isinstance(template, np.generic):
    return np.asarray(restored)[()]
  if isinstance(template, np.ndarray):
    return np.asarray(restored)
  sharding = getattr(template, "sharding", None)
  if not isinstance(restored, jax.Array):  # A number saved, an array wanted.
    restored = jax.device_put(jnp.asarray(restored, template.dtype), sharding)
  if (getattr(template, "weak_type", False) and restored.ndim == 0
      and not _is_key(restored)):
    # A weakly typed scalar (`jnp.asarray(1e-3)`) comes back weakly typed,
    # so it promotes as the saved one did.
    weak = jnp.asarray(np.asarray(restored).item())
    if weak.dtype == restored.dtype:
      return jax.device_put(weak, restored.sharding)
  return restored


def _problems(meta: dict, described: dict, settings: dict) -> list[str]:
  saved = meta["leaves"]
  problems = []
  missing = [k for k in described if k not in saved]
  extra = [k for k in saved if k not in described]
  if missing:
    problems.append("missing from the checkpoint: " + ", ".join(missing))
  if extra:
    problems.append("in the checkpoint but not in the template: "
                    + ", ".join(extra))
  for key, (dtype, shape) in described.items():
    if key in saved and tuple(saved[key]) != (dtype, shape):
      s_dtype, s_shape = saved[key]
      problems.append(f"{key}: checkpoint has {s_dtype}{s_shape}, template "
                      f"wants {dtype}{shape}")
  for key, want in settings.items():
    have = meta["loss_scales"].get(key)
    if have is None:
      continue  # Its leaves are reported above, or it has none.
    for name in sorted(set(want) | set(have)):
      if want.get(name) != have.get(name):
        problems.append(
            f"{key or 'the root'}: the checkpoint's {have['type']} has {name}="
            f"{have.get(name)!r}, the template's {want['type']} has {name}="
            f"{want.get(name)!r} (build the template with the saved "
            "settings; change them after restoring if you mean to)")
  return problems


def restore_checkpoint(path: str | os.PathLike[str],
                       template: PyTree) -> PyTree:
  """Loads a `save_checkpoint` checkpoint into the structure of `template`.

  Leaves come back with the template's dtypes and shardings (a template
  sharded over 8 devices gets a state sharded the same way), and
  continuing from the restored state gives bit for bit the steps of a run
  that never stopped. A loss scale's settings are checked, not taken from
  the template silently: restoring into a `DynamicLossScale` whose
  `period`, `factor` or `min_loss_scale` differs from the saved one raises
  an error naming both values.

  Args:
    path: the directory `save_checkpoint` wrote.
    template: a pytree like the one saved (e.g. freshly initialized state,
      or `jax.eval_shape` of its initializer, with `sharding` set on the
      `ShapeDtypeStruct`s to choose where leaves go); its structure,
      shapes, dtypes and loss-scale settings are checked.

  Returns:
    The restored pytree. Leaves are JAX arrays (typed PRNG keys stay typed),
    except where the template has a numpy array or a Python number, which
    come back as the same kind. A template leaf without a sharding (a
    `ShapeDtypeStruct` with none) gets the one it was saved with.

  Raises:
    FileNotFoundError: nothing is at `path`.
    ValueError: `path` is not an mpolicy checkpoint or cannot be read (the
      message says which and why), or it does not match the template
      (every mismatch is listed).

  >>> import os, tempfile, jax.numpy as jnp, mpolicy
  >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
  >>> save_checkpoint(path, mpolicy.DynamicLossScale(2. ** 15, period=10))
  >>> restore_checkpoint(path, mpolicy.DynamicLossScale(2. ** 15))
  Traceback (most recent call last):
  ...
  ValueError: The checkpoint does not match the template: the root: the checkpoint's DynamicLossScale has period=10, the template's DynamicLossScale has period=2000 (build the template with the saved settings; change them after restoring if you mean to).

  See also: `save_checkpoint`.
  """
  what = "restore_checkpoint"
  path = os.path.abspath(os.fspath(path))
  if not os.path.lexists(path):
    raise FileNotFoundError(f"{what}: no checkpoint at {path}.")
  if not os.path.isdir(path):
    hint = (" It looks like an .npz file, which numpy.load reads."
            if path.endswith(".npz") else "")
    raise ValueError(f"{what}: {path} is a file, not an mpolicy checkpoint "
                     f"(a directory written by save_checkpoint).{hint}")
  flat, described, treedef = _flatten(template, what)
  ocp = _orbax()
  with _ORBAX_LOCK, ocp.Checkpointer(
      ocp.CompositeCheckpointHandler()) as checkpointer:
    try:
      meta = checkpointer.restore(
          path, ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
    except Exception as e:  # orbax raises many kinds; one is documented.
      raise ValueError(f"{what}: {path} is not a readable mpolicy checkpoint "
                       f"(its metadata could not be read: {e!r:.300}).") from e
    if (not isinstance(meta, dict) or meta.get("format") != _FORMAT
        or meta.get("version") != _VERSION):
      raise ValueError(
          f"{what}: {path} is not an mpolicy checkpoint of format "
          f"{_FORMAT!r} version {_VERSION} (its metadata is {meta!r:.300}).")
    problems = _problems(meta, described, _settings(template))
    if problems:
      raise ValueError("The checkpoint does not match the template: "
                       + "; ".join(problems) + ".")
    target = {k: _abstract(v) for k, v in flat.items()}
    try:
      restored = checkpointer.restore(path, ocp.args.Composite(
          state=ocp.args.StandardRestore(target))).state
    except Exception as e:  # orbax raises many kinds; one is documented.
      raise ValueError(f"{what}: the arrays of {path} could not be read "
                       f"({e!r:.300}); the checkpoint is damaged.") from e
  leaves = [_like(flat[k], restored[k]) for k in flat]
  return jax.tree_util.tree_unflatten(treedef, leaves)
