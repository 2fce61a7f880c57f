"""The one seam through which tools watch the interpreter, equation by equation.

While a `watching(observer)` block is open on this thread, the interpreter
tells the observer about every equation it runs: `Observer.before` as it
is about to bind it (the observer may open a scope around it, or ask for
it to run in float32), and `Observer.after` with its results. Each call
gets an `Equation`: the equation, its scope names, the region that governs
it (its module path and policy), the rule's `Decision` (first-order
equations), and, where the interpreter steps through a loop or a
`shard_map` (`interpreter.replay`), the iteration and the device.

`explain` records the decisions, the debugger names every op of the
user's code (`sites`) and checks every value of a replayed program
(`debugging.check`), and `fp8_stats` counts what each float8 or
block-format quantization loses (`Observer.quantized`, told by the rules
of the ops they quantize, forward and in the backward pass): all through
this seam. Outside a block the
interpreter does nothing extra.

>>> import jax, jax.numpy as jnp
>>> from mpolicy._src.amp import amp
>>> class Primitives(Observer):
...   def __init__(self):
...     self.seen = []
...   def after(self, eq, invals, outs):
...     self.seen.append((eq.primitive, eq.decision.ran_in))
>>> with watching(Primitives()) as watcher:
...   _ = jax.make_jaxpr(amp(jnp.exp))(jnp.ones(3, jnp.bfloat16))
>>> watcher.seen
[('exp', 'float32')]
"""

from __future__ import annotations

from collections.abc import Iterator
import contextlib
import dataclasses
import itertools
import threading
from typing import Any, Optional, TypeVar

import jax
import jax.numpy as jnp

from mpolicy._src import regions


@dataclasses.dataclass(frozen=True)
class Decision:
  """What the interpreter did with one first-order primitive (a row of
  `explain`).

  Attributes:
    scope: the name scope it was traced under (``""`` at top level).
    module_class: the module class whose call it is in, if known.
    primitive: the primitive's name, e.g. ``"dot_general"``.
    in_dtypes: the dtypes of its inputs as they arrived.
    ran_in: the floating dtype(s) it ran in (a cast: its result dtype; no
      floating input: its output dtype).
    rule: ``"lower"``, ``"full"``, ``"promote"``, ``"inputs"``,
      ``"policy cast"`` (a cast made for a module's policy),
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


@dataclasses.dataclass
class Equation:
  """One equation as the interpreter runs it (what an observer is told).

  Attributes:
    eqn: the jaxpr equation.
    names: its scope names from the top of the program, mpolicy's markers
      included.
    region: what governs it (``None``: nothing).
    quiet: whether it runs in a probe or a lazily traced rule (not a row
      of `explain`).
    decision: the rule's decision (first-order equations, once bound).
    iteration: the iteration of the loop it runs in, where the
      interpreter steps through loops (`interpreter.replay`), else ``None``.
    device: the `shard_map` device it runs on, likewise.
    transforms: the transforms on its name stack (``"transpose"``: part
      of a backward pass; `interpreter.replay`).
    feeds_forward: whether an equation outside the backward pass reads its
      results, or it writes a reference (`interpreter.replay`).
    outs_read: per result, whether such an equation reads it.
    traced: whether its values are tracers while the interpreter replays
      (a `shard_map` body, traced once for every device).
    stepped: a higher-order equation the interpreter stepped through
      (`stepping`): its bodies' equations were told one by one, and its
      results are theirs.
  """
  eqn: Any
  names: tuple[str, ...]
  region: Optional[regions.Region] = None
  quiet: bool = False
  decision: Optional[Decision] = None
  iteration: Optional[int] = None
  device: Optional[int] = None
  transforms: tuple[str, ...] = ()
  feeds_forward: bool = True
  outs_read: Optional[tuple[bool, ...]] = None
  traced: bool = False
  stepped: bool = False

  @property
  def primitive(self) -> str:
    return self.eqn.primitive.name

  @property
  def policy(self):
    """The policy in force (``None`` outside every region and inside
    `full_precision()`)."""
    return None if self.region is None else self.region.policy

  @property
  def path(self) -> str:
    """The module it runs in: the governing module call's full name
    (Haiku, Flax linen), else its named-scope path; ``""`` outside both."""
    if self.region is not None and self.region.module_name:
      return self.region.module_name
    return "/".join(regions.plain_scope_names(self.names))


@dataclasses.dataclass(frozen=True)
class QuantizedOp:
  """A float8 or block-format op whose quantizations are told to observers
  (`quantization_site`): the equation running it, its name scope, its
  primitive's name and its operands' shapes (``"MxK, KxN"``)."""
  eq: Optional[Equation]
  scope: str
  primitive: str
  shapes: str


@dataclasses.dataclass(frozen=True)
class Quantization:
  """One quantization an op's rule made (see `Observer.quantized`).

  Attributes:
    role: ``"lhs"``, ``"rhs"`` (forward operands) or ``"cotangent"``.
    fmt: the format: a float8 dtype's name (``"float8_e4m3fn"``), a block
      format's (``"mxfp8"``, ``"mxfp4"``, ``"nvfp4"``) or ``"int8"``.
    x: the values quantized (traced).
    q, scale, fmax: float8 and int8: the quantized values, their scale
      (``x ~= q * scale``) and the largest value (448, 127).
    axis, two_d: block formats: the blocked axis; 16 x 16 tiles.
  """
  role: str
  fmt: str
  x: Any
  q: Any = None
  scale: Any = None
  fmax: float = 0.0
  axis: int = -1
  two_d: bool = False


class Observer:
  """Watches the interpreter; each method does nothing unless overridden."""

  def before(self, eq: Equation, invals) -> None:
    """Called as ``eq`` is about to run on ``invals``."""

  def after(self, eq: Equation, invals, outs) -> None:
    """Called once ``eq`` has run and made ``outs``."""

  def in_float32(self, eq: Equation) -> bool:
    """Whether ``eq`` is to run in float32 (an op-level island): its half
    operands widened, a narrowing cast kept wide."""
    del eq
    return False

  def moved(self, eq: Equation, source, value) -> None:
    """Called where the interpreter, stepping through ``eq`` (a loop),
    moves values itself: ``value`` holds values of ``source`` (a slice of
    a scanned operand; the stacked rows of a scan's outputs, a list)."""


  def per_device(self, eq: Equation) -> None:
    """Called as the body of ``eq`` (a `shard_map`) is about to be traced
    once for every device (`Equation.device` is then a traced index)."""

  def carried(self, eq: Equation, outs):
    """What this observer carries out of the body of ``eq`` now traced
    (``outs``: the body's results): a 1-D array on each device, or
    ``None``."""
    del eq, outs
    return None

  def devices_ran(self, eq: Equation, per_device, outs) -> None:
    """Called once the body of ``eq`` ran: ``per_device`` holds a row per
    device of what `carried` returned; ``outs`` are its results."""

  def quantized(self, op: QuantizedOp, quantization: Quantization) -> None:
    """Called where the rule of ``op`` quantizes one of its values (while
    it is traced, forward or backward), if this observer overrides it."""

  def shared(self, scopes: tuple[str, ...]) -> None:
    """Called with the scopes of layers that would be bound as calls of one
    shared body (`repeats`) were no observer watching (each still runs
    where it stands, told to the observers)."""


def _wants_quantizations(o: Observer) -> bool:
  return type(o).quantized is not Observer.quantized


class _State(threading.local):
  observers: tuple[Observer, ...] = ()
  open: tuple[Equation, ...] = ()
  runs: int = 0
  unstepped: int = 0
  sites: Optional[dict[str, QuantizedOp]] = None


_state = _State()

# Part of JAX's jit cache key: a number per `watching(..., fresh=True)`
# block, so that no program traced outside it (or in another) is reused.
_BLOCK = jax.make_user_context(default_value=0)
_blocks = itertools.count(1)


_O = TypeVar("_O", bound=Observer)


@contextlib.contextmanager
def watching(observer: _O, *, fresh: bool = False) -> Iterator[_O]:
  """Tells ``observer`` about every equation the interpreter runs inside.

  With ``fresh``, jit's caches miss inside the block and it misses on what
  the block traced afterwards: a `jax.jit` function that ran before is
  traced again (and interpreted, so the observer sees it), and its later
  calls run a program compiled without the observer.
  """
  prev = (_state.observers, _state.runs, _state.sites)
  _state.observers, _state.runs = prev[0] + (observer,), 0
  _state.sites = {} if prev[2] is None else prev[2]
  try:
    with _BLOCK(next(_blocks)) if fresh else contextlib.nullcontext():
      yield observer
  finally:
    _state.observers, _state.runs, _state.sites = prev


@contextlib.contextmanager
def unwatched():
  """A block whose equations no observer is told of (a rule's own use of
  the interpreter, not the user's program)."""
  prev, _state.observers = _state.observers, ()
  try:
    yield
  finally:
    _state.observers = prev


def active() -> bool:
  """Whether an observer is watching on this thread."""
  return bool(_state.observers)


def before(eq: Equation, invals) -> None:
  _state.open += (eq,)
  for o in _state.observers:
    o.before(eq, invals)


def after(eq: Equation, invals, outs) -> None:
  _state.open = _state.open[:-1]
  for o in reversed(_state.observers):
    o.after(eq, invals, outs)


def in_float32(eq: Equation) -> bool:
  return any(o.in_float32(eq) for o in _state.observers)


def moved(eq: Equation, source, value) -> None:
  for o in _state.observers:
    o.moved(eq, source, value)


@contextlib.contextmanager
def per_device(eq: Equation):
  """A block around the tracing of a `shard_map` body for every device;
  ``as`` gives a function of the body's results returning the array the
  observers carry out of it (`Observer.carried`; at most one carries)."""
  for o in _state.observers:
    o.per_device(eq)

  def carried(outs):
    found = [c for c in (o.carried(eq, outs) for o in _state.observers)
             if c is not None]
    if len(found) > 1:
      raise RuntimeError(
          "mpolicy: two observers (e.g. locate_nonfinite inside "
          "compare_to_float32) each carry values out of one shard_map body; "
          "run one debugger tool at a time")
    return found[0] if found else jnp.zeros((0,), bool)

  yield carried


def devices_ran(eq: Equation, per_device, outs) -> None:
  for o in _state.observers:
    o.devices_ran(eq, per_device, outs)


def decided(decision: Decision) -> None:
  """Records the rule's decision on the equation being run (called by
  `rules.dispatch`; no-op outside a block)."""
  if _state.open:
    _state.open[-1].decision = decision


def quantization_site(scope: str, primitive: str,
                      shapes: str) -> Optional[str]:
  """A label for the float8 or block-format op being run, for its rule's
  quantizations to pass to `quantized` (now or in its backward pass);
  ``None`` (nothing added to the program) unless an observer overrides
  `Observer.quantized`."""
  if not any(_wants_quantizations(o) for o in _state.observers):
    return None
  sites = _state.sites
  assert sites is not None  # Set by `watching`, as observers are.
  label = f"{len(sites)}:{scope or '-'}/{primitive}"
  sites[label] = QuantizedOp(_state.open[-1] if _state.open else None,
                                    scope, primitive, shapes)
  return label


def quantized(label: Optional[str], quantization: Quantization) -> None:
  """Tells the observers of one quantization by the op ``label`` names
  (no-op for ``None`` or outside the block that labelled it)."""
  op = None if label is None else (_state.sites or {}).get(label)
  if op is not None:
    for o in _state.observers:
      if _wants_quantizations(o):
        o.quantized(op, quantization)


def shared(scopes: tuple[str, ...]) -> None:
  for o in _state.observers:
    o.shared(scopes)


def count_run() -> None:
  """Notes that interpreted code was traced (see `interpreter_ran`)."""
  _state.runs += 1


def drew_without_step() -> None:
  """Notes that a block matmul drawing random numbers (stochastic rounding,
  the Hadamard signs) was traced without a step count (see `unstepped`)."""
  _state.unstepped += 1


def unstepped() -> int:
  """How many random block matmuls were traced without a step so far (this
  thread): `make_train_step` warns when its loss traced one."""
  return _state.unstepped


def interpreter_ran() -> bool:
  """Whether interpreted code was traced in the innermost block."""
  return _state.runs > 0
