"""`save_checkpoint`: the training state, as one orbax directory.

Every step goes through `Processes.step`, so in several processes an error
on one is raised on all. Process 0 checks the path and makes a scratch
directory beside it; every process checks that it sees that directory,
that all passed the same path and tree and hold equal values of the leaves
each holds whole, and sums the checksums of its own shards; orbax writes
each process's shards and the metadata once and commits; process 0 puts
the checkpoint in place.
"""

from __future__ import annotations

import os
import shutil
from typing import Any
import zlib

import jax

from mpolicy._src.checkpoint import digests
from mpolicy._src.checkpoint import layout
from mpolicy._src.checkpoint import leaves as leaves_lib
from mpolicy._src.checkpoint import meta as meta_lib
from mpolicy._src.checkpoint import processes
from mpolicy._src.checkpoint import storage


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
      n = next((j for j, (a, b) in enumerate(zip(other["leaves"],
                                                  first["leaves"])) if a != b),
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


def save_checkpoint(path: str | os.PathLike[str], tree: Any, *,
                    overwrite: bool = False) -> None:
  """Saves `tree` (params, optimizer state, loss scale, keys...) with orbax.

  Any pytree of arrays and numbers: half params (bfloat16, float16,
  float8), float32 master weights, optimizer state, typed PRNG keys,
  sharded arrays (each device writes its shards) and loss scales, whose
  settings are saved too, with a checksum of every leaf. orbax commits the
  checkpoint beside `path` and it is renamed into place: saves racing for
  one path leave one whole checkpoint (the others raise), a failed save
  leaves nothing, and a replaced checkpoint stays where `restore_checkpoint`
  finds it until the new one is in place.

  With `jax.distributed`, every process calls it with the same `path` and
  a tree of the same structure; a leaf each process holds whole (a numpy
  value, a number, a `jnp` array made outside `jit`) must be equal on all
  and is written once. An error on any process is raised on every process.

  Args:
    path: the directory to create, on a local (or mounted) file system.
    tree: a pytree of concrete arrays and numbers (not inside `jit`).
    overwrite: replace a checkpoint at `path`.

  Raises:
    FileExistsError: `path` exists and `overwrite` is False.
    TypeError: `path` is not a path, a leaf is neither an array nor a
      number, or it is traced (inside `jit`); the message names it.
    ValueError: `path` is a URL (`gs://...`); two leaves share a path; the
      processes passed different paths or trees, or differ on a leaf each
      holds whole (named).
    OSError: the processes do not share the file system `path` is on.
    TimeoutError: another process did not call it within five minutes.

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
    dest = layout.local_path(path, what)
    flat, described, _ = leaves_lib.flatten(tree, what)
    shared = {"path": dest, "whole": {}, "leaves": []}
    if group.count > 1:  # What the processes compare.
      shared["whole"] = {k: digests.whole(v) for k, v in flat.items()
                         if leaves_lib.held_whole(v)}
      shared["leaves"] = [zlib.crc32(repr([k, d]).encode())
                          for k, d in described.items()]
    if group.primary:
      made.append(layout.scratch(dest, overwrite, what))
      shared["scratch"] = made[0]
    return (dest, flat, meta_lib.build(tree, flat, described)), shared

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
    meta["digests"] = {k: f"{sum(int(p[i]) for p in parts) % 2 ** 64:016x}"
                       for i, k in enumerate(flat)}
    staged = os.path.join(shared[0]["scratch"], "checkpoint")
    storage.write(staged, flat, meta, group)
    group.step(lambda: (layout.place(staged, dest, overwrite, what)
                        if group.primary else None, None))
  finally:
    for scratch in made:
      shutil.rmtree(scratch, ignore_errors=True)
