"""The steps that the processes of a `jax.distributed` run take together.

Every process calls the checkpoint functions, as with orbax. Each of their
steps runs through `Processes.step`: every process does its part, posts to
`jax.distributed`'s key-value store whether it failed and what the others
need to see, and reads what they posted. If any process failed, every
process raises, so none goes on alone into a write or a barrier the others
never reach; a process that does not post within `TIMEOUT_S` makes the
others raise `TimeoutError`. Calls are matched by their order (the same
calls on every process, from one thread). In one process a step just runs.
"""

from __future__ import annotations

import itertools
import json
from typing import Any, Callable

import jax

from mpolicy._src import jax_compat

TIMEOUT_S = 300

# Errors rebuilt with their own type where they did not happen (any other
# type as RuntimeError).
_REBUILT = {e.__name__: e for e in (
    TypeError, ValueError, FileExistsError, FileNotFoundError,
    NotADirectoryError, IsADirectoryError, PermissionError, OSError,
    TimeoutError, RuntimeError)}

_calls = itertools.count()


class Processes:
  """The processes of this run, for one call of `what` (a function name).

  `count`, `index`, `primary` (process 0 writes what is written once), and
  `tag`, a name unique to this call and the same on every process.
  """

  def __init__(self, what: str):
    self.what, self.count = what, jax.process_count()
    self.index = jax.process_index()
    self.primary = self.index == 0
    self._round, self._client, self.tag = 0, None, "mpolicy"
    if self.count == 1:
      return
    self._client = jax_compat.distributed_client()
    if self._client is None:
      raise RuntimeError(
          f"{what}: JAX runs in {self.count} processes, but jax.distributed "
          "is not initialized; call jax.distributed.initialize() at the "
          "start of every process.")
    self._call = next(_calls)
    self.tag = f"mpolicy_{self._call}"
    if self._call >= 2:  # Every process has left call - 2: its keys can go.
      try:
        self._client.key_value_delete(f"mpolicy/{self._call - 2}")
      except Exception:  # pylint: disable=broad-except
        pass  # Another process deleted them first.

  def step(self, work: Callable[[], tuple[Any, Any]]) -> tuple[Any, list]:
    """Runs `work` (returning `(result, shared)`, `shared` a JSON value)
    here and agrees on the outcome: `(result, [each process's shared])`.

    Raises what `work` raised here or, with its type and message, on
    another process; `TimeoutError` if another process did not come.
    """
    try:
      (result, shared), error = work(), None
    except Exception as e:  # pylint: disable=broad-except
      if self._client is None:
        raise
      result, shared, error = None, None, e
    if self._client is None:
      return result, [shared]
    posts = self._exchange({"error": None if error is None else
                            [type(error).__name__, str(error)],
                            "shared": shared})
    if error is not None:
      raise error
    for i, post in enumerate(posts):
      if post["error"] is not None:
        name, message = post["error"]
        raise _REBUILT.get(name, RuntimeError)(
            f"{message} [raised on process {i} of {self.count}; every "
            "process stopped]")
    return result, [post["shared"] for post in posts]

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
