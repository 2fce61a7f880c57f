"""The `jax.distributed` client of a run in several processes.

Its key-value store and barriers are how the processes of one job agree
on small things (a path, a leaf's digest, an outcome) without compiling a
collective. JAX keeps the client in a private module; 0.10.2 and 0.12
both hold it at `jax._src.distributed.global_state.client`, with the same
methods (`key_value_set`, `blocking_key_value_get`, `key_value_delete`).
"""

from __future__ import annotations

from typing import Any, Optional

from jax._src import distributed as _distributed


def distributed_client() -> Optional[Any]:
  """The client `jax.distributed.initialize` made, or None before it."""
  return getattr(_distributed.global_state, "client", None)


__all__ = ["distributed_client"]
