"""The steps that the processes of a multi-process JAX run take together.

`save_checkpoint`, `restore_checkpoint` and `CheckpointManager` are called
by every process, as orbax's functions are. Each of their steps runs
through `Processes.step`: every process does its part, then posts to
`jax.distributed`'s key-value store whether it failed and what the others
need to see (a path, digests, a temporary directory), and reads what the
others posted. If any process failed, every process raises (its own error,
or the first failing process's, with its type and message), so no process
goes on alone into a write or a barrier that the others never reach. A
process that does not post (it crashed, or skipped the call) makes the
others raise `TimeoutError` after `TIMEOUT_S` seconds instead of waiting
forever.

Calls are matched by their order: every process must make the same calls
in the same order, from one thread. In one process a step just runs.
"""

from __future__ import annotations

import itertools
import json
from typing import Any, Callable

import jax

from mpolicy._src import jax_compat

TIMEOUT_S = 300

# Errors rebuilt with their own type on the processes where they did not
# happen; any other type is rebuilt as RuntimeError.
_REBUILT = {e.__name__: e for e in (
    TypeError, ValueError, FileExistsError, FileNotFoundError,
    NotADirectoryError, IsADirectoryError, PermissionError, OSError,
    TimeoutError, RuntimeError)}

_calls = itertools.count()


class Processes:
  """The processes of this run, for one call of `what` (a function name).

  Attributes:
    count: `jax.process_count()`.
    index: `jax.process_index()`.
    primary: whether this process writes what is written once (process 0).
    tag: a name unique to this call, the same on every process.
  """

  def __init__(self, what: str):
    self.what = what
    self.count = jax.process_count()
    self.index = jax.process_index()
    self.primary = self.index == 0
    self._round = 0
    self._client = None
    self._call = None
    self.tag = "mpolicy"
    if self.count == 1:
      return
    self._client = jax_compat.distributed_client()
    if self._client is None:
      raise RuntimeError(
          f"{what}: JAX runs in {self.count} processes, but "
          "jax.distributed is not initialized; call "
          "jax.distributed.initialize() at the start of every process.")
    call = self._call = next(_calls)
    self.tag = f"mpolicy_{call}"
    if call >= 2:
      # Every process has finished call - 2: each posted in call - 1, which
      # it enters only after finishing call - 2. Its keys can go.
      try:
        self._client.key_value_delete(f"mpolicy/{call - 2}")
      except Exception:  # pylint: disable=broad-except
        pass  # Already gone (another process deleted them first).

  def step(self, work: Callable[[], tuple[Any, Any]]) -> tuple[Any, list]:
    """Runs `work` here and agrees with the other processes on the outcome.

    Args:
      work: returns `(result, shared)`; `shared` is a JSON value the other
        processes see.

    Returns:
      `(result, [shared of process 0, shared of process 1, ...])`.

    Raises:
      What `work` raised here, or, where it raised on another process, the
      same type of error with that process's message.
      TimeoutError: another process did not take this step in time.
    """
    try:
      (result, shared), error = work(), None
    except Exception as e:  # pylint: disable=broad-except
      if self._client is None:
        raise
      result, shared, error = None, None, e
    if self._client is None:
      return result, [shared]
    post = {"error": None if error is None else
                     [type(error).__name__, str(error)],
            "shared": shared}
    posts = self._exchange(post)
    if error is not None:
      raise error
    for i, p in enumerate(posts):
      if p["error"] is not None:
        name, message = p["error"]
        raise _REBUILT.get(name, RuntimeError)(
            f"{message} [raised on process {i} of {self.count}; every "
            "process stopped]")
    return result, [p["shared"] for p in posts]

  def _exchange(self, post: dict) -> list[dict]:
    key = f"mpolicy/{self._call}/{self._round}"
    self._round += 1
    self._client.key_value_set(f"{key}/{self.index}", json.dumps(post))
    posts = []
    for i in range(self.count):
      if i == self.index:
        posts.append(post)
        continue
      try:
        text = self._client.blocking_key_value_get(f"{key}/{i}",
                                                   TIMEOUT_S * 1000)
      except Exception as e:  # pylint: disable=broad-except
        raise TimeoutError(
            f"{self.what}: process {i} of {self.count} did not reach this "
            f"step within {TIMEOUT_S} s ({e}). Every process must make the "
            "same calls, in the same order.") from e
      posts.append(json.loads(text))
    return posts
