"""What the interpreter decided, recorded for `explain`.

The interpreter appends one `Decision` per primitive it runs while a
`recording()` block is open on this thread; `explain` opens the block,
traces, and turns the rows into a `Report`. Outside a block nothing is
recorded.

>>> import jax, jax.numpy as jnp
>>> from mpolicy._src.amp import amp
>>> with recording() as rows:
...   _ = jax.make_jaxpr(amp(jnp.exp))(jnp.ones(3, jnp.bfloat16))
>>> [(r.primitive, r.ran_in, r.rule) for r in rows]
[('exp', 'float32', 'full')]
"""

from __future__ import annotations

from collections.abc import Iterator
import contextlib
import dataclasses
import threading
from typing import Optional


@dataclasses.dataclass(frozen=True)
class Decision:
  """What the interpreter did with one primitive (a row of `explain`).

  Attributes:
    scope: the name scope it was traced under (``""`` at top level).
    module_class: the Haiku module class whose call it is in, if known.
    primitive: the primitive's name, e.g. ``"dot_general"``.
    in_dtypes: the dtypes of its inputs as they arrived.
    ran_in: the floating dtype(s) it ran in (a cast: its result dtype; no
      floating input: its output dtype).
    rule: ``"lower"``, ``"full"``, ``"promote"``, ``"inputs"``,
      ``"policy cast"`` (a cast the Haiku bridge made for a module's policy),
      ``"explicit cast"`` (one written in the code), ``"jax cast"`` (one
      JAX made inside a function the code called), ``"as written"`` or
      ``"custom"`` (a function given by `OpRules.with_rule`, named in
      ``decided_by``).
    decided_by: the rule's reason and the registry entry or policy in force.
    casts: casts the interpreter inserted for it.
  """
  scope: str
  module_class: Optional[str]
  primitive: str
  in_dtypes: tuple[str, ...]
  ran_in: str
  rule: str
  decided_by: str
  casts: int


class _State(threading.local):
  rows: Optional[list[Decision]] = None
  runs: int = 0


_state = _State()


@contextlib.contextmanager
def recording() -> Iterator[list[Decision]]:
  """Collects a `Decision` per primitive interpreted inside the block."""
  prev_rows, prev_runs = _state.rows, _state.runs
  rows: list[Decision] = []
  _state.rows, _state.runs = rows, 0
  try:
    yield rows
  finally:
    _state.rows, _state.runs = prev_rows, prev_runs


def active() -> bool:
  """Whether a `recording()` block is open on this thread."""
  return _state.rows is not None


def record(decision: Decision) -> None:
  """Appends ``decision`` to the open block (no-op outside one)."""
  if _state.rows is not None:
    _state.rows.append(decision)


def count_run() -> None:
  """Notes that interpreted code was traced (see `interpreter_ran`)."""
  _state.runs += 1


def interpreter_ran() -> bool:
  """Whether interpreted code was traced inside the current `recording()`."""
  return _state.runs > 0
