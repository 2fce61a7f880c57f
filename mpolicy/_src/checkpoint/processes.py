"""The steps that the processes of a `jax.distributed` run take together:
in `Processes.step` each does its part and posts to the key-value store of
`jax.distributed` whether it failed and what the others need to see. If
one failed, all raise (none goes on alone into a write or a barrier); one
that does not post within `TIMEOUT_S` makes the others raise
`TimeoutError`. Calls are matched by their order."""

import contextlib
import itertools
import json
from typing import Any, Callable

import jax

from mpolicy._src import jax_compat

TIMEOUT_S = 300
# Errors rebuilt with their type where they did not happen (else RuntimeError).
_REBUILT = {e.__name__: e for e in (
    TypeError, ValueError, FileExistsError, FileNotFoundError, OSError,
    PermissionError, TimeoutError, RuntimeError)}
_calls = itertools.count()


class Processes:
  """This run's processes, for one call of `what`: `count`, `index`,
  `primary` (process 0, which writes what is written once) and `tag` (the
  same on every process, unique to the call)."""

  def __init__(self, what: str):
    self.what, self.count = what, jax.process_count()
    self.index = jax.process_index()
    self.primary, self.tag, self._round = self.index == 0, "mpolicy", 0
    self._client = None if self.count == 1 else jax_compat.distributed_client()
    if self.count > 1 and self._client is None:
      raise RuntimeError(
          f"{what}: JAX runs in {self.count} processes, but jax.distributed "
          "is not initialized; call jax.distributed.initialize() at the "
          "start of every process.")
    if self._client is not None:
      self._call = next(_calls)
      self.tag = f"mpolicy_{self._call}"
      # Every process has left call - 2: its keys can go (if still there).
      with contextlib.suppress(Exception):
        self._client.key_value_delete(f"mpolicy/{self._call - 2}")

  def step(self, work: Callable[[], tuple[Any, Any]]) -> tuple[Any, list]:
    """Runs `work` (giving `(result, shared)`, `shared` JSON) and returns
    `(result, [each process's shared])`; raises what `work` raised here
    or, with its type and message, on another process."""
    if self._client is None:
      result, shared = work()
      return result, [shared]
    try:
      (result, shared), error = work(), None
    except Exception as e:  # pylint: disable=broad-except
      result, shared, error = None, None, e
    key, self._round = f"mpolicy/{self._call}/{self._round}", self._round + 1
    text = json.dumps({"error": error and [type(error).__name__, str(error)],
                       "shared": shared})
    self._client.key_value_set(f"{key}/{self.index}", text)
    # Its own post too read back from JSON, as the others'.
    posts = [json.loads(text if i == self.index else self._get(f"{key}/{i}"))
             for i in range(self.count)]
    if error is not None:
      raise error
    for i, post in enumerate(posts):
      if post["error"]:
        name, message = post["error"]
        raise _REBUILT.get(name, RuntimeError)(
            f"{message} [raised on process {i} of {self.count}; every "
            "process stopped]")
    return result, [post["shared"] for post in posts]

  def _get(self, key: str) -> str:
    try:
      return self._client.blocking_key_value_get(key, TIMEOUT_S * 1000)  # type: ignore[union-attr]
    except Exception as e:  # pylint: disable=broad-except
      raise TimeoutError(
          f"{self.what}: process {key.rsplit('/', 1)[1]} of {self.count} did "
          f"not reach this step within {TIMEOUT_S} s ({e}). Every process "
          "must make the same calls, in the same order.") from e
