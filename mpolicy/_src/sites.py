"""Sites: each first-order equation named, while the precision debugger traces.

While a `tagging()` block is open on this thread, an observer of the
interpreter (`observe`) traces every equation of the code it runs under a
scope named for a new `Site` (``mpolicy:op-<index>``): the equation's primitive, its scope
names, the region that governs it, where it was written, and the dtype it
ran in. JAX keeps the scope on every equation made from it: the casts and
amp primitives its rule binds, and, under `jax.grad`, its derivative's
equations in the forward and backward passes. So the debugger reads, for
any equation of the final program, the equation of the user's code it
comes from (`site_of`). Sites asked for in ``in_float32`` run in float32:
their half operands are cast up and nothing rounds them (the op-level
island of a value outside any module).

Outside a block nothing is added. The block is part of JAX's jit cache key
(each block its own value), so a jitted function traced without sites, or
in another block, is traced again rather than reused.

>>> import jax, jax.numpy as jnp
>>> from mpolicy._src.amp import amp
>>> with tagging() as found:
...   _ = jax.make_jaxpr(amp(jnp.exp))(jnp.ones(3, jnp.bfloat16))
>>> [(s.primitive, s.ran_in) for s in found]
[('exp', 'float32')]
"""

from __future__ import annotations

from collections.abc import Iterator
import contextlib
import dataclasses
import itertools
import os
import sys
from typing import Any, Optional

import jax

from mpolicy._src import jax_compat
from mpolicy._src import observe
from mpolicy._src import regions

PREFIX = regions.MARKER_PREFIX + "op-"
"""The scope a site's equations are traced under: ``PREFIX`` + its index."""


@dataclasses.dataclass
class Site:
  """One first-order equation of the traced code, as the interpreter ran it.

  Attributes:
    primitive: the primitive's name.
    names: its scope names, mpolicy's markers included.
    region: what governs it (``None``: nothing).
    source: the user's ``file:line`` that made it (``""`` if unknown).
    ran_in: the dtype(s) it ran in, as `explain` says (``""`` until run).
    producers: per operand, the site that made it (``None``: an argument,
      a constant, or a value made outside every site).
    higher_order: whether the equation holds sub-jaxprs (``scan``,
      ``cond``, ``jit``, ...): its own equations are the interpreter's
      casts at its boundary, its sub-jaxprs' are sites of their own.
  """
  primitive: str
  names: tuple[str, ...]
  region: Optional[regions.Region]
  source: str
  ran_in: str = ""
  producers: tuple[Optional[int], ...] = ()
  higher_order: bool = False

  @property
  def path(self) -> str:
    """The module it runs in: the governing module call's full name (Haiku,
    Flax linen), else its named-scope path; ``""`` outside both."""
    if self.region is not None and self.region.module_name:
      return self.region.module_name
    return "/".join(regions.plain_scope_names(self.names))

  @property
  def policy_cast(self) -> bool:
    """Whether it is a cast a module policy made at a module boundary."""
    return regions.policy_cast_of(self.names) is not None


class _Every:
  """Holds every site index: `tagging(in_float32=EVERY)` runs the whole
  code in float32 (the float32 shadow of `compare_to_float32`)."""

  def __contains__(self, index) -> bool:
    return True


EVERY = _Every()


class _Tagger(observe.Observer):
  """Names every first-order and higher-order equation it is told of."""

  def __init__(self, found: list[Site], in_float32):
    self.found, self._in_float32 = found, in_float32
    self._open: list[tuple[int, Any]] = []
    self._made_by: dict[int, tuple[int, Any]] = {}  # id(value) -> site.

  def before(self, eq: observe.Equation, invals) -> None:
    index = len(self.found)
    producers = tuple(self._made_by.get(id(x), (None,))[0] for x in invals)
    eqn = eq.eqn
    self.found.append(Site(
        eq.primitive, eq.names, eq.region,
        jax_compat.user_location(eqn, _library_dirs()), producers=producers,
        higher_order=bool(jax_compat.jaxprs_in_params(eqn.params))))
    scope = jax.named_scope(f"{PREFIX}{index}")
    scope.__enter__()
    self._open.append((index, scope))

  def after(self, eq: observe.Equation, invals, outs) -> None:
    index, scope = self._open.pop()
    scope.__exit__(None, None, None)
    if eq.decision is not None:
      self.found[index].ran_in = eq.decision.ran_in
    for x in outs or ():
      self._made_by[id(x)] = (index, x)

  def in_float32(self, eq: observe.Equation) -> bool:
    return bool(self._open) and self._open[-1][0] in self._in_float32


@contextlib.contextmanager
def tagging(in_float32=frozenset()) -> Iterator[list[Site]]:
  """Names every equation the interpreter traces in the block.

  Args:
    in_float32: indices of sites to run in float32 (as numbered by a block
      that traced the same code), or `EVERY`.

  Yields:
    The list the block's `Site`s are appended to, in trace order.
  """
  found: list[Site] = []
  tagger = _Tagger(found, in_float32 if in_float32 is EVERY
                   else frozenset(in_float32))
  with observe.watching(tagger, fresh=True):
    yield found


# Libraries whose frames are not the user's code: a Haiku layer's matmul is
# reported where the user called the layer, not inside Haiku.
_LIBRARIES = ("haiku", "flax", "equinox", "optax", "jmp", "mpolicy", "numpy")


def _library_dirs() -> tuple[str, ...]:
  dirs = [os.path.dirname(os.__file__) + os.sep]  # The standard library.
  for name in _LIBRARIES:
    module = sys.modules.get(name)
    path = getattr(module, "__file__", None)
    if path:
      dirs.append(os.path.dirname(path) + os.sep)
  return tuple(dirs)


def site_of(names: tuple[str, ...]) -> Optional[int]:
  """The index of the innermost site among scope ``names``, else ``None``.

  >>> site_of(("encoder", PREFIX + "3", "jvp")), site_of(("encoder",))
  (3, None)
  """
  for name in reversed(names):
    if name.startswith(PREFIX):
      try:
        return int(name[len(PREFIX):])
      except ValueError:
        return None
  return None


