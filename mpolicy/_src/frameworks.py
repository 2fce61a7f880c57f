"""Module hooks of optional frameworks, entered by `amp` while it traces.

A framework's bridge is loaded only when the user has already imported the
framework (it is in `sys.modules`), so mpolicy itself never imports an
optional framework: a program that never imports Flax never loads the Flax
bridge. Haiku is not listed: `transform_amp` installs its own hooks.
"""

from __future__ import annotations

from collections.abc import Iterator
import contextlib
import importlib
import sys

# Framework module -> the mpolicy module that bridges it (which has a
# `module_policies()` context manager).
BRIDGES = {
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


def stateful_bridges() -> list:
  """The loaded bridges of frameworks whose objects are updated in place.

  Such an argument (a Flax NNX module, `Rngs` or `Optimizer`) is rebuilt
  from tracers inside `amp`; its bridge's `is_stateful`, `state_of` and
  `update` carry what the function wrote into it back to the caller's
  object.

  >>> all(hasattr(b, "is_stateful") for b in stateful_bridges())
  True
  """
  return [b for b in loaded_bridges() if hasattr(b, "is_stateful")]
