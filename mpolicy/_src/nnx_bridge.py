"""Flax NNX modules passed to an `amp` function: their state comes back.

An NNX module is a pytree, so `amp` traces its variables like any other
argument, but the module the function sees is rebuilt from tracers: what
the function writes into it in place (BatchNorm's running statistics, RNG
counters) would be lost with the trace. `amp` therefore returns the state
of every NNX module argument after the call and writes it back into the
caller's module with `nnx.update`, as `nnx.jit` does.

Like the linen bridge, only `frameworks` loads this module, once the user
has imported `flax.nnx`.
"""

from __future__ import annotations

from collections.abc import Iterator
import contextlib
from typing import Any

from flax import nnx


# The base of NNX's objects with in-place state: modules, `nnx.Rngs`,
# `nnx.Optimizer` (named `Object` before Flax 0.12).
_STATEFUL = getattr(nnx, "Pytree", None) or nnx.Object


def is_stateful(x: Any) -> bool:
  """Whether ``x`` is an NNX object whose state a call may write in place."""
  return isinstance(x, _STATEFUL)


def state_of(node: Any) -> Any:
  """Every variable of ``node``, as a pytree (`nnx.state`)."""
  return nnx.state(node)


def update(node: Any, state: Any) -> None:
  """Writes ``state`` into ``node`` in place (`nnx.update`)."""
  nnx.update(node, state)


@contextlib.contextmanager
def module_policies() -> Iterator[None]:
  """NNX has no method hook: per-layer policies go through name patterns."""
  yield
