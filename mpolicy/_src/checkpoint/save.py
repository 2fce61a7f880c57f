"""`save_checkpoint`: checks, agreement across processes, checksums, then
orbax's commit and the rename into place."""

import itertools
import os
import shutil
from typing import Any
import zlib

import jax

from mpolicy._src.checkpoint import digests
from mpolicy._src.checkpoint import disk
from mpolicy._src.checkpoint import leaves as leaves_lib
from mpolicy._src.checkpoint import processes


def _agree(shared: list[dict], keys: list[str], what: str) -> None:
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
    differ = sorted(k for k, v in first["whole"].items()
                    if other["whole"].get(k) != v)
    if differ:
      raise ValueError(
          f"{what}: {', '.join(differ[:5])} differ between process 0 and "
          f"process {i}. Each process holds these leaves whole (numpy "
          "values, Python numbers, arrays on its own devices), and a "
          "checkpoint holds one value per leaf: make them equal on every "
          "process, or, where each process holds a part of one array, make "
          "it a global array (jax.make_array_from_process_local_data).")


def save_checkpoint(path: str | os.PathLike[str], tree: Any, *,
                    overwrite: bool = False) -> None:
  """Saves `tree` (params, optimizer state, loss scale, keys...) with orbax.

  Any pytree of concrete arrays (every dtype, typed PRNG keys, sharded:
  each device writes its shards) and numbers; loss scales keep their
  settings, and every leaf its checksum. orbax commits the checkpoint
  beside `path`, and it is renamed into place: saves racing for one path
  leave one whole checkpoint (the others raise), a failed save leaves
  nothing, and a checkpoint being replaced (`overwrite=True`) stays where
  `restore_checkpoint` finds it until the new one is in place. With
  `jax.distributed`, every process calls it alike; a leaf each holds whole
  (numpy, a number, a `jnp` array made outside `jit`) must be equal on all.
  An error on any process is raised on every process.

  Raises `FileExistsError` (`path` exists, `overwrite` False), `TypeError`
  (not a path; a leaf neither array nor number, or traced inside `jit`),
  `ValueError` (a URL such as `gs://...`; processes that disagree: the
  message names the leaf), `OSError` (processes that do not share the file
  system) or `TimeoutError` (a process did not call within five minutes).

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
  what = "save_checkpoint"
  group, made = processes.Processes(what), []

  def prepare():
    dest = disk.local_path(path, what)
    flat, described, _ = leaves_lib.flatten(tree, what)
    shared = {"path": dest, "leaves": [zlib.crc32(repr(d).encode())
                                       for d in described.items()],
              "whole": {k: str(digests.part(v, described[k][0], True))
                        for k, v in flat.items()
                        if group.count > 1 and leaves_lib.held_whole(v)}}
    if group.primary:
      made.append(disk.scratch(dest, overwrite, what))
      shared["scratch"] = made[0]
    return (dest, flat, leaves_lib.build(tree, flat, described)), shared

  def check(flat, shared, meta):
    _agree(shared, list(flat), what)
    if not os.path.isdir(shared[0]["scratch"]):
      raise OSError(f"{what}: process {group.index} does not see "
                    f"{shared[0]['scratch']}, which process 0 made beside the "
                    "checkpoint's path: every process must save to one "
                    "directory on a file system they all share.")
    if group.count > 1:  # One array on every device, written once.
      flat = {k: leaves_lib.to_global(v) if isinstance(v, jax.Array)
                 and v.is_fully_addressable else v for k, v in flat.items()}
    return flat, [str(digests.part(v, meta["leaves"][k][0], group.primary))
                  for k, v in flat.items()]

  try:
    (dest, flat, meta), shared = group.step(prepare)
    flat, parts = group.step(lambda: check(flat, shared, meta))
    meta["digests"] = {k: digests.total(p[i] for p in parts)
                       for i, k in enumerate(flat)}
    staged = os.path.join(shared[0]["scratch"], "checkpoint")
    disk.write(staged, flat, meta, group)
    group.step(lambda: (disk.place(staged, dest, overwrite, what)
                        if group.primary else None, None))
  finally:
    for scratch in made:
      shutil.rmtree(scratch, ignore_errors=True)
