"""Reading and writing a checkpoint's two items with orbax.

`state` holds the leaves keyed by their `keystr` path (orbax's standard
pytree handler: tensorstore, every dtype and sharding), `meta` the JSON
the rest of the package reads. orbax's `Checkpointer` commits atomically.
In several processes its barriers go through `jax.distributed`'s
coordination service with a timeout (not a collective over every device,
which waits forever for a failed process), and a read waits for no other
process: each reads what its devices hold.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import pathlib
import sys
import threading
import time
from typing import Any
import warnings

import jax

# orbax's synchronous save shares state between the threads of a process:
# saves and restores from threads take turns.
LOCK = threading.Lock()


def _orbax():
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  return ocp  # Imported on first use: it takes about a second.


def _checkpointer(group, *, alone: bool):
  """A `Checkpointer` of both items; `alone` (reading) waits for no one."""
  ocp = _orbax()
  if group.count == 1:
    return ocp.Checkpointer(ocp.CompositeCheckpointHandler())
  options = ocp.options.MultiprocessingOptions(
      primary_host=0, barrier_sync_key_prefix=group.tag,
      active_processes={group.index} if alone else set(range(group.count)))
  return ocp.Checkpointer(ocp.CompositeCheckpointHandler(
      state=ocp.StandardCheckpointHandler(multiprocessing_options=options),
      meta=ocp.JsonCheckpointHandler(multiprocessing_options=options),
      composite_options=ocp.CompositeOptions(multiprocessing_options=options)),
                          multiprocessing_options=options)


def write(path: str, flat: dict, meta: dict, group) -> None:
  ocp = _orbax()
  with LOCK, _checkpointer(group, alone=False) as c:
    c.save(path, ocp.args.Composite(state=ocp.args.StandardSave(flat),
                                    meta=ocp.args.JsonSave(meta)))


def read_meta(path: str, group, what: str) -> Any:
  ocp = _orbax()
  with LOCK, _checkpointer(group, alone=True) as c:
    try:
      return c.restore(path, ocp.args.Composite(
          meta=ocp.args.JsonRestore())).meta
    except Exception as e:  # orbax raises many kinds; one is documented.
      raise ValueError(f"{what}: {path} is not a readable mpolicy checkpoint "
                       f"(its metadata could not be read: {e!r:.300}).") from e


def saved_shardings(path: str) -> dict[str, Any]:
  """Each array's sharding as saved, where its devices exist now (else
  None); in several processes, only a sharding over every process."""
  handler = _orbax().StandardCheckpointHandler()
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
    if sharding is not None and len({d.process_index for d in
                                     sharding.device_set}) < jax.process_count():
      sharding = None  # On some processes' devices only.
    out[key] = sharding
  return out


def read_state(path: str, target: dict, group, what: str) -> dict:
  """The arrays of `target`, each restored to its sharding."""
  ocp = _orbax()
  args = ocp.args.Composite(state=ocp.args.StandardRestore(target))
  with LOCK, _quiet(), _checkpointer(group, alone=True) as c:
    try:
      return c.restore(path, args).state
    except Exception as e:  # orbax raises many kinds; one is documented.
      failure = e
    message = (f"{what}: the arrays of {path} could not be read "
               f"({failure!r:.300}); the checkpoint is damaged.")
    error = failure  # Drop its frames, then collect what only they held.
    while error is not None:
      error.__traceback__, error = None, error.__cause__ or error.__context__
    for _ in range(4):  # Let the reads in flight finish.
      time.sleep(0.05)
      gc.collect()
  raise ValueError(message) from failure


@contextlib.contextmanager
def _quiet():
  """Silences what a failed orbax read leaves: it reads in tasks of an
  event loop that it closes at the first failure, so the reads in flight
  report to a closed loop, other tasks' errors go unretrieved and some
  coroutines are never awaited, each printing a traceback (often at exit).
  """
  logger, previous = logging.getLogger("asyncio"), sys.unraisablehook
  unretrieved = lambda r: "exception was never retrieved" not in r.getMessage()

  def hook(unraisable):
    if "Event loop is closed" not in str(unraisable.exc_value):
      previous(unraisable)

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
