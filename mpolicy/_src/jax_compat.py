"""The one place where mpolicy touches JAX internals.

JAX's private modules (`jax._src`) and its semi-public `jax.extend` change
every few releases: `jax.core` moved to `jax.extend.core`, `pjit` became
`jit`, and `Primitive.get_bind_params` changed its return type in 0.9.2.
Every import of them lives here, so a JAX upgrade means reading one file.

Nothing in this module knows about policies: it only offers small,
version-independent helpers over name stacks, jaxprs and primitives.
"""

from __future__ import annotations

from collections.abc import Iterator
import contextlib

import jax
from jax.extend import core as jex_core
from jax.extend import source_info_util as _siu

# --- Name stacks ------------------------------------------------------------

# `jax._src.source_info_util` is the only place the Scope/Transform entries of
# a name stack are defined; `jax.extend` re-exports the functions but not them.
from jax._src import source_info_util as _siu_private  # pylint: disable=g-bad-import-order

_Scope = _siu_private.Scope
_Transform = _siu_private.Transform


def scope_names(name_stack) -> tuple[str, ...]:
  """The plain scope names of a name stack, outermost first.

  Transform entries (`jvp(...)`, `transpose(...)`, `vmap(...)`) are dropped:
  they wrap the scopes under AD and batching but are not scopes themselves.
  """
  names = []
  for entry in getattr(name_stack, "stack", ()):
    if isinstance(entry, _Scope):
      names.append(entry.name)
    elif not isinstance(entry, _Transform):  # Unknown kind: read its name.
      name = getattr(entry, "name", None)
      if isinstance(name, str):
        names.append(name)
  return tuple(names)


def current_scope_names() -> tuple[str, ...]:
  """Scope names of the name stack in force at this point of tracing."""
  return scope_names(_siu.current_name_stack())


def eqn_scope_names(eqn) -> tuple[str, ...]:
  """Scope names recorded on a jaxpr equation (relative inside sub-jaxprs)."""
  return scope_names(eqn.source_info.name_stack)


@contextlib.contextmanager
def eqn_context(eqn) -> Iterator[None]:
  """Re-binds under the equation's own traceback and name stack.

  Keeping the name stack means a re-evaluated equation lands in the same
  scope of the new jaxpr, so an outer interpreter (or a profiler) still
  sees where it came from.
  """
  with _siu.user_context(eqn.source_info.traceback,
                         name_stack=eqn.source_info.name_stack):
    yield


@contextlib.contextmanager
def extend_name_stack(names: tuple[str, ...]) -> Iterator[None]:
  """Pushes several scope names at once (used to carry a prefix down)."""
  with contextlib.ExitStack() as stack:
    for name in names:
      stack.enter_context(_siu.extend_name_stack(name))
    yield


# --- Jaxpr types ------------------------------------------------------------

ClosedJaxpr = jex_core.ClosedJaxpr
Jaxpr = jex_core.Jaxpr
JaxprEqn = jex_core.JaxprEqn
Literal = jex_core.Literal
Var = jex_core.Var
Primitive = jex_core.Primitive
DropVar = jex_core.DropVar

__all__ = [
    "ClosedJaxpr",
    "DropVar",
    "Jaxpr",
    "JaxprEqn",
    "Literal",
    "Primitive",
    "Var",
    "current_scope_names",
    "eqn_context",
    "eqn_scope_names",
    "extend_name_stack",
    "scope_names",
]

del jax
