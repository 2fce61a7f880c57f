"""Checkpoints of training state, written and read by orbax-checkpoint.

A checkpoint is an orbax directory with two items: `state`, the leaves of
the pytree in a flat dict keyed by each leaf's `jax.tree_util.keystr` path
(`"[0]['linear']['w']"`), written by orbax's standard pytree handler
(tensorstore: bfloat16, float8, typed PRNG keys and sharded arrays as they
are); and `meta`, JSON naming the format, every leaf's dtype and shape,
which leaves were numpy values or Python numbers, and the settings of
every loss scale in the tree (a `DynamicLossScale`'s `period`, `factor`
and `min_loss_scale`, a `StaticLossScale`'s scale), which pytree
flattening would otherwise drop.

`save_checkpoint` writes into a fresh temporary directory and renames it
into place (`checkpoint_files`). `restore_checkpoint` checks the template
against `meta` first and lists every mismatch in one `ValueError`.

In a run of several processes, every process calls both, and each step
goes through `processes.Processes.step`, so an error on one process is
raised on all of them rather than leaving the others waiting. Saving:
process 0 checks the path and makes the temporary directory; every
process checks that it sees that directory, that all passed the same path
and tree, and that the leaves each holds whole agree; orbax writes each
process's shards, and the metadata once; process 0 renames the directory
into place, and every process returns once it is there. Restoring: each
process reads what its devices hold.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any
import zlib

import jax
import numpy as np

from mpolicy._src import checkpoint_files as files
from mpolicy._src import checkpoint_leaves as leaves_lib
from mpolicy._src import loss_scale as loss_scale_lib
from mpolicy._src import processes as processes_lib

PyTree = Any

_FORMAT = "mpolicy.checkpoint"
_VERSION = 2
_SETTINGS = {
    loss_scale_lib.DynamicLossScale: ("period", "factor", "min_loss_scale"),
    loss_scale_lib.StaticLossScale: ("loss_scale",),
}


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


def _path_arg(path: Any, what: str) -> str:
  if not isinstance(path, (str, os.PathLike)):
    raise TypeError(f"{what}: path must be a directory path (a str or an "
                    f"os.PathLike), got {type(path).__name__} {path!r:.80}.")
  return os.path.abspath(os.fspath(path))


def _agree(shared: list[dict], keys: list[str], what: str) -> None:
  """Every process passed process 0's path and tree, and holds the same
  value of each leaf it holds whole."""
  first = shared[0]
  for i, other in enumerate(shared[1:], 1):
    if other["path"] != first["path"]:
      raise ValueError(f"{what}: process {i} saves to {other['path']}, "
                       f"process 0 to {first['path']}; every process must "
                       "pass the same path.")
    if other["leaves"] != first["leaves"]:
      pairs = zip(other["leaves"], first["leaves"])
      n = next((j for j, (a, b) in enumerate(pairs) if a != b),
               min(len(other["leaves"]), len(first["leaves"])))
      where = (f"from leaf number {n} on (here {keys[n]})" if n < len(keys)
               else f"in its number of leaves ({len(other['leaves'])} "
               f"against {len(first['leaves'])})")
      raise ValueError(
          f"{what}: process {i}'s tree differs from process 0's {where} "
          "(structure, dtype or shape); every process must pass the same "
          "tree, whose global arrays hold each process's part.")
    differ = sorted(k for k in first["whole"]
                    if other["whole"].get(k) != first["whole"][k])
    if differ:
      raise ValueError(
          f"{what}: {', '.join(differ[:5])} differ between process 0 and "
          f"process {i}. Each process holds these leaves whole (numpy "
          "values, Python numbers, arrays on its own devices), and a "
          "checkpoint holds one value per leaf: make them equal on every "
          "process, or, where each process holds a part of one array, make "
          "it a global array (jax.make_array_from_process_local_data).")


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

  With `jax.distributed` (several processes), every process calls it with
  the same `path` and a tree of the same structure, as with orbax: each
  process writes the shards its devices hold, process 0 the metadata, and
  every process returns once the checkpoint is in place. A leaf that each
  process holds whole (a numpy value, a Python number, or a `jnp` array
  made outside `jit`, such as a fresh loss scale) must be equal on every
  process, and is written once. An error on any process is raised on
  every process.

  Args:
    path: the checkpoint directory to create.
    tree: a pytree of arrays and numbers.
    overwrite: replace an existing checkpoint at `path` (it is removed only
      once the new one is complete).

  Raises:
    FileExistsError: `path` exists and `overwrite` is False.
    TypeError: `path` is not a path, or a leaf is neither an array nor a
      number (the message names it).
    ValueError: two leaves share a path; with several processes, the
      processes passed different paths or trees, or hold different values
      of a leaf each holds whole (the message names it).
    OSError: with several processes, they do not share the file system
      that `path` is on.
    TimeoutError: another process did not call `save_checkpoint` (within
      five minutes of this one).

  >>> import os, tempfile, jax.numpy as jnp, mpolicy
  >>> state = {"loss_scale": mpolicy.DynamicLossScale(2. ** 15, period=10),
  ...          "params": {"w": jnp.ones(2, jnp.bfloat16)}}
  >>> path = os.path.join(tempfile.mkdtemp(), "step_100")
  >>> save_checkpoint(path, state)
  >>> restored = restore_checkpoint(path, state)
  >>> float(restored["loss_scale"].loss_scale), restored["params"]["w"].dtype
  (32768.0, dtype(bfloat16))

  See also: `restore_checkpoint`, `CheckpointManager`.
  """
  what = "save_checkpoint"
  group = processes_lib.Processes(what)
  made = []  # The temporary directory, on process 0.

  def prepare():
    dest = _path_arg(path, what)
    flat, described, _ = leaves_lib.flatten(tree, what)
    kinds = {k: leaves_lib.host_kind(v) for k, v in flat.items()}
    meta = {"format": _FORMAT, "version": _VERSION, "leaves": described,
            "host_values": {k: v for k, v in kinds.items() if v},
            "loss_scales": _settings(tree)}
    shared = {"path": dest, "whole": {}, "leaves": []}
    if group.count > 1:  # What the processes compare.
      shared["whole"] = {k: leaves_lib.digest(v) for k, v in flat.items()
                         if leaves_lib.held_whole(v)}
      shared["leaves"] = [zlib.crc32(json.dumps([k, d]).encode())
                          for k, d in described.items()]
    if group.primary:
      made.append(files.make_scratch(dest, overwrite, what))
      shared["scratch"] = made[0]
    return (dest, flat, meta), shared

  def check(flat, shared):
    scratch = shared[0]["scratch"]
    _agree(shared, list(flat), what)
    if not os.path.isdir(scratch):
      raise OSError(f"{what}: process {group.index} does not see {scratch}, "
                    "which process 0 made beside the checkpoint's path: "
                    "every process must save to one directory on a file "
                    "system they all share.")
    if group.count > 1:  # One array on every device, written once.
      flat = {k: leaves_lib.to_global(v) if isinstance(v, jax.Array)
                 and v.is_fully_addressable else v for k, v in flat.items()}
    return flat, None

  try:
    (dest, flat, meta), shared = group.step(prepare)
    scratch = shared[0]["scratch"]
    flat, _ = group.step(lambda: check(flat, shared))
    staged = os.path.join(scratch, "checkpoint")
    files.write(staged, flat, meta, group)
    group.step(lambda: (files.move_into_place(
        staged, dest, scratch, overwrite, what) if group.primary else None,
                        None))
  finally:
    for made_here in made:
      shutil.rmtree(made_here, ignore_errors=True)


def _problems(meta: dict, flat: dict, described: dict,
              settings: dict) -> list[str]:
  saved, kinds = meta["leaves"], meta.get("host_values", {})
  problems = []
  missing = [k for k in described if k not in saved]
  extra = [k for k in saved if k not in described]
  if missing:
    problems.append("missing from the checkpoint: " + ", ".join(missing))
  if extra:
    problems.append("in the checkpoint but not in the template: "
                    + ", ".join(extra))
  for key, (dtype, shape) in described.items():
    if key not in saved or tuple(saved[key]) == (dtype, shape):
      continue
    s_dtype, s_shape = saved[key]
    if (key in kinds and s_shape == shape
        and isinstance(flat[key], jax.ShapeDtypeStruct)
        and not leaves_lib.abstract_mismatch(s_dtype, flat[key])):
      continue  # jax.eval_shape gave a 64-bit host value JAX's own dtype.
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


def _read_meta(path_arg: Any, template: PyTree, group, what: str):
  """Checks `path` and `template`; the template's leaves and the meta."""
  path = _path_arg(path_arg, what)
  if template is None:
    raise TypeError(
        f"{what}: template is None; pass a pytree like the one saved: the "
        "state itself (freshly initialized), or jax.eval_shape of its "
        "initializer (with shardings on its ShapeDtypeStructs to place the "
        "leaves). The restored state takes its structure, dtypes and "
        "shardings from it.")
  if not os.path.lexists(path):
    raise FileNotFoundError(f"{what}: no checkpoint at {path}.")
  if not os.path.isdir(path):
    hint = (" It looks like an .npz file, which numpy.load reads."
            if path.endswith(".npz") else "")
    raise ValueError(f"{what}: {path} is a file, not an mpolicy checkpoint "
                     f"(a directory written by save_checkpoint).{hint}")
  flat, described, treedef = leaves_lib.flatten(template, what)
  meta = files.read_meta(path, group, what)
  if (not isinstance(meta, dict) or meta.get("format") != _FORMAT
      or meta.get("version") != _VERSION):
    raise ValueError(
        f"{what}: {path} is not an mpolicy checkpoint of format "
        f"{_FORMAT!r} version {_VERSION} (its metadata is {meta!r:.300}).")
  problems = _problems(meta, flat, described, _settings(template))
  if problems:
    raise ValueError("The checkpoint does not match the template: "
                     + "; ".join(problems) + ".")
  return (path, flat, treedef, meta), None


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

  The devices may differ from the save's: a checkpoint written by 2
  processes restores into 1, or 4 devices' into 2, given a template
  sharded over the devices there are now. With `jax.distributed`, every
  process calls it, and each reads the shards its devices hold.

  Args:
    path: the directory `save_checkpoint` wrote.
    template: a pytree like the one saved (e.g. freshly initialized state,
      or `jax.eval_shape` of its initializer, with `sharding` set on the
      `ShapeDtypeStruct`s to choose where leaves go); its structure,
      shapes, dtypes and loss-scale settings are checked.

  Returns:
    The restored pytree. Leaves are JAX arrays (typed PRNG keys stay
    typed), except where the template has a numpy value or a Python
    number, which come back as the same kind. A template leaf without a
    sharding (a `ShapeDtypeStruct` with none, as `jax.eval_shape` gives)
    comes back as it was saved: a numpy value or a Python number as such
    (an `np.float64` stays float64), an array with the sharding it was
    saved with, or replicated on every device where those devices are
    gone. An array the template made outside `jit` (a fresh `jnp` array)
    comes back as one, free to join sharded arguments of `jit`.

  Raises:
    TypeError: `path` is not a path, or `template` is None.
    FileNotFoundError: nothing is at `path`.
    ValueError: `path` is not an mpolicy checkpoint or cannot be read (the
      message says which and why), or it does not match the template
      (every mismatch is listed).
    TimeoutError: with several processes, another process did not call
      `restore_checkpoint` (within five minutes of this one).

  >>> import os, tempfile, jax.numpy as jnp, mpolicy
  >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
  >>> save_checkpoint(path, mpolicy.DynamicLossScale(2. ** 15, period=10))
  >>> restore_checkpoint(path, mpolicy.DynamicLossScale(2. ** 15))
  Traceback (most recent call last):
  ...
  ValueError: The checkpoint does not match the template: the root: the checkpoint's DynamicLossScale has period=10, the template's DynamicLossScale has period=2000 (build the template with the saved settings; change them after restoring if you mean to).

  See also: `save_checkpoint`, `CheckpointManager`.
  """
  what = "restore_checkpoint"
  group = processes_lib.Processes(what)
  (src, flat, treedef, meta), _ = group.step(
      lambda: _read_meta(path, template, group, what))
  kinds = meta.get("host_values", {})
  saved = []  # The saved shardings, read once if a leaf needs them.

  def saved_sharding(key):
    if not saved:
      saved.append(files.saved_shardings(src))
    return saved[0].get(key)

  def read():
    target = {k: leaves_lib.restore_target(
        v, kinds.get(k), meta["leaves"][k][0],
        lambda k=k: saved_sharding(k)) for k, v in flat.items()}
    return files.read_state(src, target, group, what), None

  restored, _ = group.step(read)
  out = [leaves_lib.restored_like(flat[k], restored[k], kinds.get(k))
         for k in flat]
  return jax.tree_util.tree_unflatten(treedef, out)
