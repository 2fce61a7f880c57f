"""Module hooks of optional frameworks, entered by `amp` while it traces.

A framework's bridge is loaded only when the user has already imported the
framework (it is in `sys.modules`), so mpolicy itself never imports an
optional framework: a program that never imports Flax never loads the Flax
bridge. The Haiku bridge's hook serves a plain ``hk.transform`` traced by
`amp` (``amp(hk.transform(f).apply)``); inside `transform_amp` its own hooks
apply and the `amp` hook stands aside.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
import contextlib
import importlib
import sys
import threading
from typing import Any

# Framework module -> the mpolicy module that bridges it (which has a
# `module_policies()` context manager).
BRIDGES = {
    "haiku": "mpolicy._src.haiku_bridge",
    "flax.linen": "mpolicy._src.flax_bridge",
    "flax.nnx": "mpolicy._src.nnx_bridge",
}


def loaded_bridges() -> list:
  """The bridge modules of the frameworks imported so far.

  >>> import sys
  >>> ("flax.linen" in sys.modules) == any(
  ...     bridge.__name__ == "mpolicy._src.flax_bridge"
  ...     for bridge in loaded_bridges())
  True
  """
  return [importlib.import_module(bridge)
          for framework, bridge in BRIDGES.items()
          if framework in sys.modules]


@contextlib.contextmanager
def module_policies() -> Iterator[None]:
  """Applies the registry's class policies in every imported framework."""
  with contextlib.ExitStack() as stack:
    for bridge in loaded_bridges():
      stack.enter_context(bridge.module_policies())
    yield


class ObjectArguments:
  """How one `amp`-ed function passes framework objects updated in place.

  A Flax NNX argument (a module, `nnx.Rngs`, `nnx.Optimizer`, a bare
  `nnx.Variable`) is split with all the others in one graph before the
  trace, rebuilt inside it and written back after the call, as `nnx.jit`
  does (see `nnx_bridge`). Without Flax NNX imported every step passes its
  value through. `amp` keeps one instance per interpreted function.

  >>> objects = ObjectArguments()
  >>> with objects.outside(((1.0,), {})) as (pure, finish):
  ...   print(finish(objects.inside_done(objects.inside(pure), "out")))
  out
  """

  def __init__(self):
    self._lock = threading.Lock()
    self._calls = None

  def _bridge_calls(self):
    """The NNX bridge's per-function tracker, once Flax NNX is imported."""
    if self._calls is None and "flax.nnx" in sys.modules:
      bridge = importlib.import_module(BRIDGES["flax.nnx"])
      with self._lock:
        if self._calls is None:
          self._calls = bridge.Calls()
    return self._calls

  @contextlib.contextmanager
  def outside(self, tree) -> Iterator[tuple[Any, Callable[[Any], Any]]]:
    """Yields ``(pure, finish)`` for the call's ``(args, kwargs)``.

    ``pure`` is a pytree of arrays and static leaves for `amp` to trace
    (`inside` turns it back into ``(args, kwargs)``); ``finish`` turns
    what `inside_done` returned into the call's output.
    """
    calls = self._bridge_calls()
    if calls is None:
      yield tree, lambda pair: pair[1]
    else:
      with calls.outside(tree) as pair:
        yield pair

  def inside(self, pure):
    """Inside the trace: the objects rebuilt from ``pure``."""
    calls = self._bridge_calls()
    return pure if calls is None else calls.inside(pure)

  def inside_done(self, tree, out) -> tuple[Any, Any]:
    """After the call: ``(the objects' state, out)``, as pure pytrees."""
    calls = self._bridge_calls()
    return (None, out) if calls is None else calls.inside_done(tree, out)

  def is_state(self, x) -> bool:
    """Whether ``x`` in a pure output is an object's state (not cast)."""
    calls = self._bridge_calls()
    return calls is not None and calls.is_state(x)
