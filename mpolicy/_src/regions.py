"""Region tags: how the Haiku bridge tells the interpreter who governs what.

When a governed Haiku module method runs (or a `full_precision()` block is
entered), the code inside is traced under a `jax.named_scope` whose name is a
short marker such as ``mpolicy:3``. The marker stands for a `Region`: the
policy in force there, and which registry entry decided it. JAX records the
name stack on every equation, so the interpreter can read each equation's
region back from the jaxpr, and `explain` can say why.

Markers are interned: the same region always gets the same marker, so traces
stay deterministic and the table only grows with distinct regions.
"""

from __future__ import annotations

from collections.abc import Iterator
import contextlib
import dataclasses
import threading
from typing import Optional

import jax

from mpolicy._src import policy as policy_lib

MARKER_PREFIX = "mpolicy:"


@dataclasses.dataclass(frozen=True)
class Region:
  """What governs a traced region.

  Attributes:
    policy: the policy in force, or ``None`` in a `full_precision()` block.
    decided_by: the registry entry or rule that chose it, in words, e.g.
      ``"class hk.BatchNorm"`` or ``"pattern 'encoder/*'"``.
    module_name: the Haiku module whose call this is, if any.
    module_class: that module's class name, if any.
    inherited: ``True`` when the policy comes from an enclosing module call
      or named scope rather than from an entry of its own.
    full_precision: ``True`` inside `full_precision()`: the rules are off.
  """
  policy: Optional[policy_lib.Policy]
  decided_by: str
  module_name: Optional[str] = None
  module_class: Optional[str] = None
  inherited: bool = False
  full_precision: bool = False


FULL_PRECISION = Region(policy=None, decided_by="full_precision()",
                        full_precision=True)

_lock = threading.Lock()
_marker_of: dict[Region, str] = {}
_region_of: dict[str, Region] = {}


def marker_for(region: Region) -> str:
  """The scope name that stands for ``region`` (interned).

  Args:
    region: a `Region`.

  Returns:
    A marker such as ``"mpolicy:3"``; the same region always gets the same
    marker.

  >>> region_of_marker(marker_for(FULL_PRECISION)) == FULL_PRECISION
  True
  """
  with _lock:
    marker = _marker_of.get(region)
    if marker is None:
      marker = f"{MARKER_PREFIX}{len(_marker_of)}"
      _marker_of[region] = marker
      _region_of[marker] = region
    return marker


def region_of_marker(name: str) -> Optional[Region]:
  """The region a scope name stands for, or ``None`` for ordinary scopes.

  Args:
    name: a scope name from a name stack.

  Returns:
    The `Region` of a marker made by `marker_for`, else ``None``.
  """
  if not name.startswith(MARKER_PREFIX):
    return None
  with _lock:
    return _region_of.get(name)


def in_full_precision(names: tuple[str, ...]) -> bool:
  """Whether scope ``names`` lie inside a region where nothing decides.

  That is a `full_precision()` block, or any other region marked
  ``full_precision`` (such as the one `explain` traces a function that is
  not amp-ed under): module bridges leave the calls inside as written.

  >>> in_full_precision(("encoder", marker_for(FULL_PRECISION), "mlp"))
  True
  >>> in_full_precision(("encoder",))
  False
  """
  for name in names:
    if name.startswith(MARKER_PREFIX):
      region = region_of_marker(name)
      if region is not None and region.full_precision:
        return True
  return False


@contextlib.contextmanager
def tagged(region: Region) -> Iterator[None]:
  """A context manager: traces its body under the marker of ``region``."""
  with jax.named_scope(marker_for(region)):
    yield


def plain_scope_names(names: tuple[str, ...]) -> tuple[str, ...]:
  """The scope names with mpolicy's markers removed (what users named).

  >>> plain_scope_names(("encoder", marker_for(FULL_PRECISION), "mlp"))
  ('encoder', 'mlp')
  """
  return tuple(n for n in names if not n.startswith(MARKER_PREFIX))


POLICY_CAST = MARKER_PREFIX + "cast-"
"""The prefix of the scopes the Haiku bridge traces its policy casts under
(``mpolicy:cast-inputs``, ...), so `explain` tells them apart from casts
written in the code."""


@contextlib.contextmanager
def policy_casts(what: str) -> Iterator[None]:
  """Traces the body's casts as a module policy's casts of ``what``.

  Args:
    what: what is cast, e.g. ``"inputs"``, ``"parameters"``, ``"outputs"``.
  """
  with jax.named_scope(POLICY_CAST + what):
    yield


def policy_cast_of(names: tuple[str, ...]) -> Optional[str]:
  """What a policy cast traced under scope ``names`` casts, else ``None``.

  >>> policy_cast_of(("encoder", POLICY_CAST + "inputs"))
  'inputs'
  >>> policy_cast_of(("encoder",)) is None
  True
  """
  for name in reversed(names):
    if name.startswith(POLICY_CAST):
      return name[len(POLICY_CAST):]
  return None


class CallStack(threading.local):
  """The regions of the module calls a bridge is tracing, in this thread.

  Each framework bridge keeps one: the innermost entry is what governs
  the module call in progress (``None``: a call that runs as written).

  >>> calls = CallStack()
  >>> with calls.entered(FULL_PRECISION):
  ...   print(calls.active, calls.innermost() is FULL_PRECISION)
  True True
  >>> calls.active, calls.innermost()
  (False, None)
  """

  def __init__(self):
    super().__init__()
    self._regions: list[Optional[Region]] = []

  @contextlib.contextmanager
  def entered(self, region: Optional[Region]) -> Iterator[None]:
    self._regions.append(region)
    try:
      yield
    finally:
      self._regions.pop()

  @property
  def active(self) -> bool:
    """Whether a module call is being traced."""
    return bool(self._regions)

  def innermost(self) -> Optional[Region]:
    return self._regions[-1] if self._regions else None
