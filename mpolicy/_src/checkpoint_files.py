"""A checkpoint on disk: orbax's directory, written atomically, read back.

A save writes into a fresh temporary directory beside its path
(`make_scratch`) and renames the finished checkpoint into place
(`move_into_place`): saves racing for one path leave one whole checkpoint,
and a failed save leaves nothing. orbax does the writing and reading. In a
run of several processes its barriers go through `jax.distributed`'s
coordination service with a timeout (not orbax's default, a collective
over every device, which waits forever for a process that failed), and a
read needs no barrier at all: each process reads what its devices hold.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import pathlib
import sys
import tempfile
import threading
import time
from typing import Any
import warnings

import jax

from mpolicy._src import processes as processes_lib

# orbax's synchronous save shares state between threads of one process (a
# second save started while one runs can fail or damage both); saves and
# restores from threads therefore take turns. Processes need no lock: each
# writes to its own temporary directory.
ORBAX_LOCK = threading.Lock()

# After a failed read: how many times to wait 50 ms for the reads still in
# flight, and collect what they leave.
_SETTLE_ROUNDS = 4


def orbax():
  # Imported on first use: orbax takes about a second to import.
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  return ocp


def checkpointer(group: processes_lib.Processes, *, alone: bool):
  """An orbax `Checkpointer` for the `state` and `meta` items.

  In several processes, its barriers are coordination-service barriers
  named for this call; `alone=True` (reading) waits for no other process.
  """
  ocp = orbax()
  if group.count == 1:
    return ocp.Checkpointer(ocp.CompositeCheckpointHandler())
  options = ocp.options.MultiprocessingOptions(
      primary_host=0, barrier_sync_key_prefix=group.tag,
      active_processes={group.index} if alone else set(range(group.count)))
  return ocp.Checkpointer(
      ocp.CompositeCheckpointHandler(
          state=ocp.StandardCheckpointHandler(multiprocessing_options=options),
          meta=ocp.JsonCheckpointHandler(multiprocessing_options=options),
          composite_options=ocp.CompositeOptions(
              multiprocessing_options=options)),
      multiprocessing_options=options)


def make_scratch(path: str, overwrite: bool, what: str) -> str:
  """A new temporary directory beside `path` (which must be free unless
  `overwrite`)."""
  if os.path.lexists(path) and not overwrite:
    raise FileExistsError(f"{what}: {path} already exists; pass "
                          "overwrite=True to replace it, or choose a new path.")
  parent, name = os.path.split(path)
  os.makedirs(parent, exist_ok=True)
  return tempfile.mkdtemp(prefix=f".{name}.", suffix=".mpolicy-tmp",
                          dir=parent)


def move_into_place(staged: str, path: str, scratch: str, overwrite: bool,
                    what: str) -> None:
  """Renames the finished checkpoint `staged` to `path`; what it replaces
  goes into `scratch`, which the caller removes."""
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


def write(staged: str, flat: dict, meta: dict,
          group: processes_lib.Processes) -> None:
  ocp = orbax()
  with ORBAX_LOCK, checkpointer(group, alone=False) as c:
    c.save(staged, ocp.args.Composite(
        state=ocp.args.StandardSave(flat), meta=ocp.args.JsonSave(meta)))


def read_meta(path: str, group: processes_lib.Processes, what: str) -> Any:
  ocp = orbax()
  with ORBAX_LOCK, checkpointer(group, alone=True) as c:
    try:
      return c.restore(path, ocp.args.Composite(
          meta=ocp.args.JsonRestore())).meta
    except Exception as e:  # orbax raises many kinds; one is documented.
      raise ValueError(f"{what}: {path} is not a readable mpolicy checkpoint "
                       f"(its metadata could not be read: {e!r:.300}).") from e


def saved_shardings(path: str) -> dict[str, Any]:
  """Each array's sharding as saved, where its devices exist now (else
  None); in several processes, only a sharding over every process."""
  ocp = orbax()
  handler = ocp.StandardCheckpointHandler()
  try:
    tree = handler.metadata(pathlib.Path(path) / "state").tree
  finally:
    handler.close()
  out = {}
  for key, leaf in tree.items():
    try:
      sharding = leaf.sharding.to_jax_sharding()
    except Exception:  # pylint: disable=broad-except
      sharding = None  # None saved, or its devices are gone.
    if sharding is not None and jax.process_count() > 1 and len(
        {d.process_index for d in sharding.device_set}) < jax.process_count():
      sharding = None  # On some processes' devices only.
    out[key] = sharding
  return out


def read_state(path: str, target: dict, group: processes_lib.Processes,
               what: str) -> dict:
  """The arrays of `target`, each restored to its sharding."""
  ocp = orbax()
  args = ocp.args.Composite(state=ocp.args.StandardRestore(target))
  with ORBAX_LOCK, _quiet_leftovers(), checkpointer(group, alone=True) as c:
    try:
      return c.restore(path, args).state
    except Exception as e:  # orbax raises many kinds; one is documented.
      failure = e
    message = (f"{what}: the arrays of {path} could not be read "
               f"({failure!r:.300}); the checkpoint is damaged.")
    _settle(failure)
  raise ValueError(message) from failure


def _unretrieved(record: logging.LogRecord) -> bool:
  return "exception was never retrieved" not in record.getMessage()


@contextlib.contextmanager
def _quiet_leftovers():
  """Silences what a failed orbax read leaves behind.

  orbax reads the arrays in concurrent tasks of an event loop that it
  closes as soon as one read fails. The reads still in flight then fail
  to report to the closed loop, the other tasks' errors are never
  retrieved and some coroutines never awaited: each prints a traceback,
  when the reads finish or when the garbage collector finds them (often
  at interpreter exit). The read runs in this context; a failed one
  drops the error's traceback frames (the error keeps its message), gives
  the reads in flight a moment to finish, and collects the leftovers
  before the context ends.
  """
  logger = logging.getLogger("asyncio")
  previous = sys.unraisablehook

  def hook(unraisable):
    if not (isinstance(unraisable.exc_value, RuntimeError)
            and "Event loop is closed" in str(unraisable.exc_value)):
      previous(unraisable)

  logger.addFilter(_unretrieved)
  sys.unraisablehook = hook
  try:
    with warnings.catch_warnings():
      warnings.filterwarnings("ignore", message="coroutine .* never awaited",
                              category=RuntimeWarning)
      yield
  finally:
    if sys.unraisablehook is hook:
      sys.unraisablehook = previous
    logger.removeFilter(_unretrieved)


def _settle(error: BaseException) -> None:
  """Drops `error`'s traceback frames and what only they held."""
  _drop_tracebacks(error)
  for _ in range(_SETTLE_ROUNDS):
    time.sleep(0.05)
    gc.collect()


def _drop_tracebacks(error: BaseException) -> None:
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    error.__traceback__ = None
    error = error.__cause__ or error.__context__
