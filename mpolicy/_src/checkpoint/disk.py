"""A checkpoint on disk: orbax's `Checkpointer` writes and commits `state`
(leaves by `keystr`) and `meta` (JSON) in a scratch directory beside the
path; `place` renames it to the path, first moving a replaced checkpoint to
`old_path`, where `locate` finds it if the process dies in between. Across
processes orbax's barriers are the coordination service's, with a timeout;
an array each process holds whole is written once, and each process reads
what its devices hold."""

import contextlib
import functools
import gc
import logging
import os
import re
import shutil
import socket
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Optional
import warnings
import zlib

import jax
import numpy as np

_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]+):/")
# A scratch directory: `.<name>.<pid>@<machine>.<random>.mpolicy-tmp`.
_SCRATCH = re.compile(r"\..+\.(\d{1,9})@([0-9a-f]{8})\.[^.]+\.mpolicy-tmp")
_LOCK = threading.Lock()  # orbax's save shares state between threads.


def local_path(path: Any, what: str, arg: str = "path") -> str:
  """`path` made absolute; an error for what is not a local path."""
  if not isinstance(path, (str, os.PathLike)):
    raise TypeError(f"{what}: {arg} must be a directory path (a str or an "
                    f"os.PathLike), got {type(path).__name__} {path!r:.80}.")
  url = _URL.match(str(os.fspath(path)))
  if url:
    raise ValueError(
        f"{what}: {os.fspath(path)} is a {url.group(1)}:// URL; mpolicy "
        "checkpoints go to a directory on a file system (shared by every "
        "process). Mount the bucket (e.g. with gcsfuse) and pass the "
        "mounted path, or save with orbax directly.")
  return os.path.abspath(os.fspath(path))


def old_path(path: str) -> str:
  parent, name = os.path.split(path)
  return os.path.join(parent, f".{name}.mpolicy-old")


def locate(path: str, what: str) -> str:
  """The checkpoint at `path`, or the one a replacing save left aside; an
  error if there is none."""
  found = [p for p in (path, old_path(path)) if os.path.lexists(p)]
  if not found:
    raise FileNotFoundError(f"{what}: no checkpoint at {path}.")
  if not os.path.isdir(found[0]):
    hint = (" It looks like an .npz file, which numpy.load reads."
            if path.endswith(".npz") else "")
    raise ValueError(f"{what}: {path} is a file, not an mpolicy checkpoint "
                     f"(a directory written by save_checkpoint).{hint}")
  return found[0]


def _machine() -> str:
  """This machine and its pid namespace (where a pid names one process)."""
  space = os.stat("/proc/self/ns/pid").st_ino if os.path.exists(
      "/proc/self/ns/pid") else 0
  return f"{zlib.crc32(f'{socket.gethostname()}/{space}'.encode()):08x}"


def _dead(name: str) -> bool:
  """Whether `name` is the scratch directory of a save that died: made on
  this machine by a process that is gone (of another, nothing is known)."""
  owner = _SCRATCH.fullmatch(name)
  if os.name == "posix" and owner and owner.group(2) == _machine():
    try:
      os.kill(int(owner.group(1)), 0)  # Signal 0 only asks if it is there.
    except ProcessLookupError:
      return True
    except OSError:  # Another user's.
      pass
  return False


def scratch(path: str, overwrite: bool, what: str) -> str:
  """A new directory beside `path`, free unless `overwrite`, named for this
  process; the scratch directories there of saves that died go."""
  if not overwrite and (os.path.lexists(path)
                        or os.path.lexists(old_path(path))):
    raise FileExistsError(f"{what}: {path} already exists; pass "
                          "overwrite=True to replace it, or choose a new path.")
  parent, name = os.path.split(path)
  os.makedirs(parent, exist_ok=True)
  for stale in filter(_dead, os.listdir(parent)):
    shutil.rmtree(os.path.join(parent, stale), ignore_errors=True)
  return tempfile.mkdtemp(prefix=f".{name}.{os.getpid()}@{_machine()}.",
                          suffix=".mpolicy-tmp", dir=parent)


def place(staged: str, path: str, overwrite: bool, what: str) -> None:
  """Renames the committed `staged` to `path` (replacing it if asked)."""
  old = old_path(path)
  if overwrite and os.path.lexists(path):
    shutil.rmtree(old, ignore_errors=True)  # An earlier save's; path is newer.
    os.rename(path, old)
  try:
    os.rename(staged, path)  # Atomic; refuses a non-empty directory.
  except OSError as e:
    if not os.path.lexists(path):
      raise
    raise FileExistsError(f"{what}: {path} was created by another save "
                          "while this one ran; it is left as that one wrote "
                          "it.") from e
  shutil.rmtree(old, ignore_errors=True)


def _checkpointer(group, *, alone: bool):
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  mp = {"multiprocessing_options": ocp.options.MultiprocessingOptions(
      primary_host=0, barrier_sync_key_prefix=group.tag,
      active_processes={group.index} if alone else set(range(group.count)))}
  return ocp, ocp.Checkpointer(ocp.CompositeCheckpointHandler(
      state=ocp.StandardCheckpointHandler(**mp),
      meta=ocp.JsonCheckpointHandler(**mp),
      composite_options=ocp.CompositeOptions(**mp)), **mp)


def write(path: str, flat: dict, meta: dict, group) -> None:
  """Writes `flat`, each array that each process holds whole written once."""
  ocp, checkpointer = _checkpointer(group, alone=False)
  if group.count > 1:
    flat = {k: _global(v) if isinstance(v, jax.Array)
            and v.is_fully_addressable else v for k, v in flat.items()}
  with _LOCK, checkpointer:
    checkpointer.save(path, ocp.args.Composite(
        state=ocp.args.StandardSave(flat), meta=ocp.args.JsonSave(meta)))


def read(path: str, group, what: str, target: Optional[dict] = None) -> Any:
  """The metadata at `path`, or with `target` the arrays, each restored to
  its sharding (`_as_saved` if none); a `ValueError` naming what failed."""
  ocp, checkpointer = _checkpointer(group, alone=True)
  with _LOCK, _quiet(), checkpointer:
    try:  # orbax raises many kinds of errors; one is documented.
      if target is None:
        return checkpointer.restore(path, ocp.args.Composite(
            meta=ocp.args.JsonRestore()))["meta"]
      target = _as_saved(lambda: checkpointer.metadata(path), target)
      return checkpointer.restore(path, ocp.args.Composite(
          state=ocp.args.StandardRestore(target)))["state"]
    except Exception as e:  # pylint: disable=broad-except
      failure = e
    error: Optional[BaseException] = failure  # Drop its frames, then collect what only they held.
    while error is not None:
      error.__traceback__, error = None, error.__cause__ or error.__context__
    for _ in range(4) if target is not None else ():  # Let reads in flight end.
      time.sleep(0.05)
      gc.collect()
  raise ValueError(
      f"{what}: {path} is not a readable mpolicy checkpoint (its metadata "
      f"could not be read: {failure!r:.300})." if target is None else
      f"{what}: the arrays of {path} could not be read ({failure!r:.300}); "
      "the checkpoint is damaged.") from failure


@functools.lru_cache(maxsize=None)
def _replicated() -> jax.sharding.NamedSharding:
  """Every device of the run holds the whole value."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("all",))
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def _global(array: jax.Array) -> jax.Array:
  """An array each process holds whole, made one array on every device."""
  mine = [d for d in _replicated().mesh.devices.flat
          if d.process_index == jax.process_index()]  # In the mesh's order.
  return jax.make_array_from_single_device_arrays(
      array.shape, _replicated(), [jax.device_put(array, d) for d in mine])


def _as_saved(metadata: Callable[[], Any], target: dict) -> dict:
  """`target`, each `ShapeDtypeStruct` without a sharding given the saved
  one where it spans every process there are now, else `_replicated()`
  (`metadata()`, the saved one, read only if a leaf needs it)."""
  bare = [k for k, v in target.items()
          if isinstance(v, jax.ShapeDtypeStruct) and v.sharding is None]
  saved = metadata().item_metadata["state"].tree if bare else {}
  target = dict(target)
  for key in bare:
    leaf = target[key] = target[key].update(sharding=_replicated())
    with contextlib.suppress(Exception):  # None saved, or devices gone.
      sharding = saved[key].sharding.to_jax_sharding()
      processes = {d.process_index for d in sharding.device_set}
      if len(processes) == jax.process_count():  # Raises for another rank.
        target[key] = leaf.update(sharding=sharding)
  return target


@contextlib.contextmanager
def _quiet():
  """Silences what a failed orbax read leaves: reads in flight reporting to
  the event loop it closed, tasks' errors never retrieved and coroutines
  never awaited, each printing a traceback (often at exit)."""
  logger, previous = logging.getLogger("asyncio"), sys.unraisablehook
  unretrieved = lambda r: "exception was never retrieved" not in r.getMessage()
  hook = lambda u: None if "Event loop is closed" in str(u.exc_value) else (
      previous(u))
  logger.addFilter(unretrieved)
  sys.unraisablehook = hook
  try:
    with warnings.catch_warnings():
      warnings.filterwarnings("ignore", message="coroutine .* never awaited",
                              category=RuntimeWarning)
      yield
  finally:
    if sys.unraisablehook is hook:
      sys.unraisablehook = previous
    logger.removeFilter(unretrieved)
