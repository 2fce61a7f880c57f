"""`restore_checkpoint`: the template checked against the metadata, the
arrays read, every leaf's checksum checked."""

import os
from typing import Any

import jax

from mpolicy._src.checkpoint import digests
from mpolicy._src.checkpoint import disk
from mpolicy._src.checkpoint import leaves as leaves_lib
from mpolicy._src.checkpoint import processes


def _open(path_arg: Any, template: Any, group, what: str):
  """The checkpoint's directory, the template's leaves, and the meta."""
  path = disk.local_path(path_arg, what)
  if template is None:
    raise TypeError(
        f"{what}: template is None; pass a pytree like the one saved: the "
        "state itself (freshly initialized), or jax.eval_shape of its "
        "initializer (with shardings on its ShapeDtypeStructs to place the "
        "leaves). The restored state takes its structure, dtypes and "
        "shardings from it.")
  src = disk.locate(path)
  if src is None:
    raise FileNotFoundError(f"{what}: no checkpoint at {path}.")
  if not os.path.isdir(src):
    hint = (" It looks like an .npz file, which numpy.load reads."
            if path.endswith(".npz") else "")
    raise ValueError(f"{what}: {path} is a file, not an mpolicy checkpoint "
                     f"(a directory written by save_checkpoint).{hint}")
  flat, described, treedef = leaves_lib.flatten(template, what)
  meta = disk.read_meta(src, group, what)
  leaves_lib.check(meta, path, template, flat, described, what)
  return (src, flat, treedef, meta), None


def restore_checkpoint(path: str | os.PathLike[str], template: Any) -> Any:
  """Loads a `save_checkpoint` checkpoint into the structure of `template`.

  `template` is a pytree like the one saved (fresh state, or
  `jax.eval_shape` of its initializer with `sharding` set where leaves
  should go); leaves come back with its dtypes and shardings, so resuming
  repeats a run that never stopped bit for bit. Structure, shapes, dtypes,
  loss-scale settings and every leaf's checksum are checked. The devices
  may differ from the save's. A template leaf without a sharding comes
  back as saved (a numpy value or number as such, an array with its saved
  sharding, or replicated where those devices are gone). If a save
  replacing `path` stopped before the new checkpoint was in place, the old
  one is read. With `jax.distributed`, every process calls it.

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
  """
  what = "restore_checkpoint"
  group = processes.Processes(what)
  (src, flat, treedef, meta), _ = group.step(
      lambda: _open(path, template, group, what))
  kinds, saved, shardings = meta.get("host_values", {}), meta["leaves"], []

  def saved_sharding(key):  # Read once, if a leaf needs them.
    shardings[:] = shardings or [disk.saved_shardings(src)]
    return shardings[0].get(key)

  def read():
    target = {k: leaves_lib.restore_target(
        v, kinds.get(k), saved[k][0], lambda k=k: saved_sharding(k))
              for k, v in flat.items()}
    out = disk.read_state(src, target, group, what)
    return out, [str(digests.part(out[k], saved[k][0], group.primary))
                 for k in flat]

  restored, parts = group.step(read)
  sums = meta.get("digests", {})  # None before version 3.
  bad = [k for i, k in enumerate(flat)
         if k in sums and digests.total(p[i] for p in parts) != sums[k]]
  if bad:  # The same on every process.
    raise ValueError(
        f"{what}: leaf {', '.join(bad[:5])} of {src} does not match the "
        "checksum saved with it: the checkpoint is damaged (its data "
        "changed after it was written). Restore an earlier checkpoint.")
  return jax.tree_util.tree_unflatten(treedef, [
      leaves_lib.restored_like(flat[k], restored[k], kinds.get(k))
      for k in flat])
