"""`save_checkpoint`, `restore_checkpoint` and `CheckpointManager`:
mpolicy's checks, agreement across processes and checksums around orbax's
write and read, and the last few steps of a training loop."""

import itertools
import os
import re
import shutil
from typing import Any, Optional
import zlib

import jax

from mpolicy._src import arguments
from mpolicy._src.checkpoint import digests
from mpolicy._src.checkpoint import disk
from mpolicy._src.checkpoint import leaves as leaves_lib
from mpolicy._src.checkpoint import processes


def _agree(shared: list[dict], keys: list[str], what: str) -> dict[str, str]:
  """Each leaf's checksum from every process's `shared`; a `ValueError`,
  the same on every process, unless they pass one path and one tree."""
  first = shared[0]
  for i, other in enumerate(shared[1:], 1):
    if other["path"] != first["path"]:
      raise ValueError(f"{what}: process {i} saves to {other['path']}, "
                       f"process 0 to {first['path']}; every process must "
                       "pass the same path.")
    pairs = itertools.zip_longest(other["leaves"], first["leaves"])
    n = next((j for j, (a, b) in enumerate(pairs) if a != b), None)
    if n is not None:
      where = f"at leaf {keys[n]}" if n < len(keys) else "in its length"
      raise ValueError(
          f"{what}: process {i}'s tree differs from process 0's {where} "
          "(structure, dtype or shape); every process must pass the same "
          "tree, whose global arrays hold each process's part.")
    differ = sorted(k for k, v in first["sums"]["whole"].items()
                    if other["sums"]["whole"].get(k) != v)
    if differ:
      raise ValueError(
          f"{what}: {', '.join(differ[:5])} differ between process 0 and "
          f"process {i}. Each process holds these leaves whole (numpy "
          "values, Python numbers, arrays on its own devices), and a "
          "checkpoint holds one value per leaf: make them equal on every "
          "process, or, where each process holds a part of one array, make "
          "it a global array (jax.make_array_from_process_local_data).")
  return digests.totals(keys, [other["sums"] for other in shared])


def save_checkpoint(path: str | os.PathLike[str], tree: Any, *,
                    overwrite: bool = False) -> None:
  """Saves `tree` (params, optimizer state, loss scale, keys...) with orbax.

  Any pytree of concrete arrays (any dtype, typed PRNG keys, sharded ones
  shard by shard) and numbers; loss scales keep their settings, each leaf
  gets a checksum. The checkpoint is committed beside `path`, then renamed
  into place: of racing saves one wins, a failed save leaves nothing, and
  a replaced checkpoint (`overwrite=True`) is found until the new one is
  in. With `jax.distributed` every process calls it alike (leaves each
  holds whole must be equal on all); an error on one is raised on all.

  Raises `FileExistsError` (`path` exists, `overwrite` False), `TypeError`
  (not a path; a leaf neither array nor number, or traced inside `jit`),
  `ValueError` (a URL such as `gs://...`; processes that disagree),
  `OSError` (processes that do not share the file system) or
  `TimeoutError` (a process did not call within five minutes).

  >>> import os, tempfile, jax.numpy as jnp, mpolicy
  >>> state = {"loss_scale": mpolicy.DynamicLossScale(2. ** 15, period=10),
  ...          "params": {"w": jnp.ones(2, jnp.bfloat16)}}
  >>> path = os.path.join(tempfile.mkdtemp(), "step_100")
  >>> mpolicy.save_checkpoint(path, state)
  >>> restored = mpolicy.restore_checkpoint(path, state)
  >>> float(restored["loss_scale"].loss_scale), restored["params"]["w"].dtype
  (32768.0, dtype(bfloat16))

  See also: `restore_checkpoint`, `CheckpointManager`.
  """
  what, made = "save_checkpoint", []
  group = processes.Processes(what)

  def prepare():
    dest = disk.local_path(path, what)
    flat, described, _ = leaves_lib.flatten(tree, what)
    if group.primary:
      made.append(disk.scratch(dest, overwrite, what))
    shared = {"path": dest, "scratch": made[0] if made else None,
              "leaves": [zlib.crc32(repr(d).encode())
                         for d in described.items()],
              "sums": digests.parts(flat, described)}
    return (dest, flat, leaves_lib.build(tree, flat, described)), shared

  def see(scratch):
    if not os.path.isdir(scratch):
      raise OSError(f"{what}: process {group.index} does not see {scratch}, "
                    "which process 0 made beside the checkpoint's path: "
                    "every process must save to one directory on a file "
                    "system they all share.")
    return None, None

  try:
    (dest, flat, meta), shared = group.step(prepare)
    meta["digests"] = _agree(shared, list(flat), what)
    group.step(lambda: see(shared[0]["scratch"]))
    staged = os.path.join(shared[0]["scratch"], "checkpoint")
    disk.write(staged, flat, meta, group)
    group.step(lambda: (disk.place(staged, dest, overwrite, what)  # type: ignore[func-returns-value]
                        if group.primary else None, None))
  finally:
    for scratch in made:
      shutil.rmtree(scratch, ignore_errors=True)


def restore_checkpoint(path: str | os.PathLike[str], template: Any) -> Any:
  """Loads a `save_checkpoint` checkpoint into the structure of `template`.

  `template` is a pytree like the one saved (fresh state, or
  `jax.eval_shape` of its initializer with `sharding` set where leaves
  should go); leaves come back with its dtypes and shardings (the devices
  may differ from the save's), so resuming is bit for bit. Structure,
  shapes, dtypes, loss-scale settings and checksums are checked. A leaf
  without a sharding comes back as saved (numpy values and numbers as
  such, arrays with their saved sharding, or replicated where those
  devices are gone). With `jax.distributed`, every process calls it.

  Raises `TypeError` (not a path; `template` None), `FileNotFoundError`,
  `ValueError` (a URL; not an mpolicy checkpoint; damaged, naming a leaf
  whose checksum differs; any mismatch with the template), `TimeoutError`.

  >>> import os, tempfile, mpolicy
  >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
  >>> mpolicy.save_checkpoint(path, mpolicy.DynamicLossScale(1., period=10))
  >>> mpolicy.restore_checkpoint(path, mpolicy.DynamicLossScale(2. ** 15))
  Traceback (most recent call last):
  ...
  ValueError: The checkpoint does not match the template: the root: the checkpoint's DynamicLossScale has period=10, the template's DynamicLossScale has period=2000 (build the template with the saved settings; change them after restoring if you mean to).

  See also: `save_checkpoint`, `CheckpointManager`.
  """
  what = "restore_checkpoint"
  group = processes.Processes(what)

  def read():
    dest = disk.local_path(path, what)
    if template is None:
      raise TypeError(
          f"{what}: template is None; pass a pytree like the one saved: the "
          "state itself (freshly initialized), or jax.eval_shape of its "
          "initializer (with shardings on its ShapeDtypeStructs to place the "
          "leaves). The restored state takes its structure, dtypes and "
          "shardings from it.")
    src = disk.locate(dest, what)
    flat, described, treedef = leaves_lib.flatten(template, what)
    meta = disk.read(src, group, what)
    leaves_lib.check(meta, dest, template, flat, described, what)
    kinds, saved = meta.get("host_values", {}), meta["leaves"]
    plans = {k: leaves_lib.restore_plan(v, kinds.get(k), saved[k][0])
             for k, v in flat.items()}
    out = disk.read(src, group, what, {k: p[0] for k, p in plans.items()})
    out = {k: out[k] for k in flat}  # Checked as read, then made leaves.
    leaves = [plans[k][1](v) for k, v in out.items()]
    return (src, treedef, meta, leaves), digests.parts(out, saved)

  (src, treedef, meta, leaves), parts = group.step(read)
  sums = meta.get("digests", {})  # None before version 3.
  bad = [k for k, v in digests.totals(sums, parts).items() if v != sums[k]]
  if bad:  # The same on every process.
    raise ValueError(
        f"{what}: leaf {', '.join(bad[:5])} of {src} does not match the "
        "checksum saved with it: the checkpoint is damaged (its data "
        "changed after it was written). Restore an earlier checkpoint.")
  return jax.tree_util.tree_unflatten(treedef, leaves)


class CheckpointManager:
  """Saves a training loop's state every few steps and keeps the last ones.

  `save(step, state)` writes `<directory>/step_<step>` with
  `save_checkpoint` and removes the oldest beyond `max_to_keep` (None: keep
  all), renamed to a hidden name first so that no listing shows a step half
  deleted; `restore(template)` loads the latest (or `step=`). With
  `jax.distributed`, every process makes the same calls.

  >>> import tempfile, jax.numpy as jnp, mpolicy
  >>> manager = mpolicy.CheckpointManager(tempfile.mkdtemp(), max_to_keep=2)
  >>> for step in (100, 200, 300):
  ...   manager.save(step, {"w": jnp.full(2, step, jnp.bfloat16)})
  >>> manager.all_steps()
  [200, 300]
  >>> manager.restore({"w": jnp.zeros(2, jnp.bfloat16)})["w"].tolist()
  [300.0, 300.0]

  See also: `save_checkpoint`, `restore_checkpoint`.
  """
  _STEP = re.compile(r"step_(\d+)|\.step_(\d+)\.mpolicy-old")

  def __init__(self, directory: str | os.PathLike[str],
               max_to_keep: Optional[int] = 3) -> None:
    self.directory = disk.local_path(directory, "CheckpointManager",
                                     "directory")
    self.max_to_keep = max_to_keep if max_to_keep is None else (
        arguments.require_whole(max_to_keep, 1, "CheckpointManager: "
                                "max_to_keep", ", or None to keep every step"))

  def path(self, step: int) -> str:
    """The directory of `step`'s checkpoint."""
    step = arguments.require_whole(step, 0, "CheckpointManager: step")
    return os.path.join(self.directory, f"step_{step}")

  def all_steps(self) -> list[int]:
    """The steps with a complete checkpoint, oldest first."""
    names = os.listdir(self.directory) if os.path.isdir(self.directory) else ()
    found = (self._STEP.fullmatch(name) for name in names)
    return sorted({int(m.group(1) or m.group(2)) for m in found if m})

  def latest_step(self) -> Optional[int]:
    """The newest step with a checkpoint, or None."""
    return max(self.all_steps(), default=None)  # all_steps is sorted.

  def save(self, step: int, tree: Any, *, overwrite: bool = False) -> None:
    """Saves `tree` as `step`'s checkpoint (see `save_checkpoint`; a step
    saved before needs `overwrite=True`); keeps the newest `max_to_keep`."""
    save_checkpoint(self.path(step), tree, overwrite=overwrite)
    group = processes.Processes("CheckpointManager.save")
    group.step(lambda: (self._prune() if group.primary else None, None))  # type: ignore[func-returns-value]

  def _prune(self) -> None:
    if self.max_to_keep is None:
      return
    for old in self.all_steps()[:-self.max_to_keep]:
      for where in (self.path(old), disk.old_path(self.path(old))):
        if os.path.lexists(where):
          os.rename(where, os.path.join(
              self.directory, f".{os.path.basename(where)}.deleting"))
    for name in os.listdir(self.directory):  # Also a crashed prune's.
      if name.endswith(".deleting"):
        shutil.rmtree(os.path.join(self.directory, name))

  def restore(self, template: Any, step: Optional[int] = None) -> Any:
    """Loads `step`'s checkpoint (the latest by default) into `template`
    (see `restore_checkpoint`); `FileNotFoundError` if there is none."""
    steps = self.all_steps()
    step = steps[-1] if step is None and steps else step
    path = None if step is None else self.path(step)  # A bad step named.
    if path is None or step not in steps:  # Or none saved yet.
      of = "" if step is None else f" of step {step}"
      raise FileNotFoundError(
          f"CheckpointManager.restore: no checkpoint{of} in {self.directory};"
          f" saved steps: {steps or 'none yet (start from a fresh state)'}.")
    return restore_checkpoint(path, template)
