"""The `jax.distributed` client, whose key-value store lets the processes
of a run agree on small things without a collective. JAX keeps it as the
``client`` of its private distributed module's ``global_state`` (0.10.2 to
0.12); no public name reaches it."""

from typing import Any, Optional

from jax._src import distributed as _distributed


def distributed_client() -> Optional[Any]:
  """The client `jax.distributed.initialize` made, or None before it."""
  return getattr(_distributed.global_state, "client", None)


__all__ = ["distributed_client"]
