"""The checked run: where each non-finite value of a replayed program began.

`Checker` watches the interpreter (`observe`) replay a program as written
(`interpreter.replay`: eagerly, one equation at a time, loops stepped).
Beside each floating result it dispatches an "is anything here not
finite?" check, and it logs every equation run as an `Entry`: which values
it read and made (values are numbered as they are made), and the checks of
what it made. `origins` then follows the log in execution order, on the
host, after one transfer of every check: a value that is not finite is
*tainted* by the earliest origin among the values it was made from, or,
if they were all finite, is an origin itself. A non-finite value the
program masks (``jnp.where(x > 0, jnp.log(x), 0)``'s forward, a ``-inf``
attention mask before its softmax) is then no origin of a non-finite
result.

Equations that only move values (`Facts.moves`; widening casts) make a
non-finite value exactly when they read one: they are not checked. A
`shard_map` body is traced once for every device; its log comes back with
each device's checks and is replayed per device (`Checker.devices_ran`).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import weakref
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from mpolicy._src import dtypes
from mpolicy._src import jax_compat
from mpolicy._src import observe
from mpolicy._src import sites
from mpolicy._src.rules import facts

FINITE = 0
"""The value id of constants and of values known to be finite."""

facts.register((
    "reshape", "transpose", "broadcast_in_dim", "squeeze", "neg", "abs",
    "copy", "rev", "concatenate", "stop_gradient", "real", "imag", "conj",
    "pvary", "device_put", "sharding_constraint", "get"), moves=True)
facts.register(("new_ref", "swap", "addupdate"), fills_ref=True)


@dataclasses.dataclass(frozen=True)
class Event:
  """One equation of the program (or one of its inputs), however often run.

  Attributes:
    primitive: the equation's primitive (``"input"`` for an argument).
    names: its scope names, from the top of the program.
    transforms: the transforms on its name stack (``"transpose"``: it is
      part of a backward pass).
    site: the `sites.Site` index it was traced under, if any.
    where: for an input, the argument's path.
    feeds_forward: whether an equation outside the backward pass reads
      its result (else it is a derivative's coefficient, or dead).
    collective: whether its result on one device depends on the others'.
  """
  primitive: str
  names: tuple[str, ...] = ()
  transforms: tuple[str, ...] = ()
  site: Optional[int] = None
  where: str = ""
  feeds_forward: bool = True
  collective: bool = False

  @property
  def backward(self) -> bool:
    """Whether it computes a derivative: part of the backward pass, or a
    coefficient only the backward pass reads (``0.5 / sqrt(x)``)."""
    return "transpose" in self.transforms or not self.feeds_forward


@dataclasses.dataclass(frozen=True)
class Entry:
  """One run of one equation: its `Event`'s index, the ids of the values
  it read (`FINITE` for constants) and made, per result the index of its
  check (``None``: not floating, or moved), its loop iteration and device,
  and whether it read a non-finite constant (a ``-inf`` literal)."""
  event: int
  ins: tuple[int, ...]
  outs: tuple[int, ...]
  checks: tuple[Optional[int], ...]
  iteration: Optional[int] = None
  device: Optional[int] = None
  constant: bool = False


@dataclasses.dataclass(frozen=True)
class Origin:
  """Where a non-finite value began: the entry, and its run's order."""
  order: tuple[int, int]
  entry: Entry


def floating(x) -> bool:
  """Whether ``x`` is a value that can be non-finite (real or complex
  floats; not a mutable reference)."""
  aval = jax_compat.aval_of(x)
  if not hasattr(aval, "shape") or type(aval).__name__ == "AbstractRef":
    return False
  dtype = aval.dtype
  return dtypes.is_float(dtype) or jnp.issubdtype(dtype, jnp.complexfloating)


@jax.jit
def _nonfinite(x) -> jax.Array:
  """Whether ``x`` holds a non-finite value (one dispatch)."""
  return ~jnp.all(jnp.isfinite(x))


def _widening(eqn) -> bool:
  """A cast to a wider float (it can make no non-finite value)."""
  if eqn.primitive is not jax_compat.convert_element_type_p:
    return False
  src = eqn.invars[0].aval.dtype
  dst = jax_compat.cast_target(eqn)[0]
  return (dtypes.is_float(src) and dtypes.is_float(dst)
          and np.dtype(dst).itemsize >= np.dtype(src).itemsize)


@dataclasses.dataclass
class _Log:
  """Entries and their checks (a traced body keeps its own)."""
  entries: list = dataclasses.field(default_factory=list)
  checks: list = dataclasses.field(default_factory=list)
  n_checks: int = 0
  out_ids: list = dataclasses.field(default_factory=list)


class Checker(observe.Observer):
  """Logs every equation the interpreter replays, checking each result.

  Attributes:
    events: the program's `Event`s, in the order first run.
    log: its `Entry`s in execution order and their checks (arrays of "not
      finite" flags, one per check, in check order; a `shard_map` body's
      come as one array, a row per device).
    flops: the matmul FLOPs run, by (site index, dtype): a loop body's
      count once per iteration, a `shard_map` body's once.
    watcher: if set, ``watcher.made(event, in_ids, out_ids, outs)`` is
      called for every equation run on concrete values, and
      ``watcher.passed(in_ids, out_id, value)`` for every value the
      interpreter moves itself (a loop's slice or stack).
  """

  def __init__(self, checking: bool = True):
    self.events: list[Event] = []
    self.checking = checking
    self.watcher: Any = None
    self.log = _Log()
    self._body: Optional[_Log] = None  # A traced body's, while traced.
    self._ids = itertools.count(1)
    self._vid: dict[int, int] = {}  # id(value) -> its value id.
    self._event_of: dict[tuple, int] = {}
    self._constants: dict[int, tuple[Any, bool]] = {}
    self._keep: list[Any] = []
    # (site index or None, dtype name) -> the matmul FLOPs run there.
    self.flops: collections.Counter = collections.Counter()

  # --- Value ids ---

  def vid(self, x) -> int:
    """The id of value ``x`` (`FINITE` for constants and unknown values)."""
    return self._vid.get(id(x), FINITE)

  def _alias(self, x, vid: int) -> None:
    key = id(x)
    self._vid[key] = vid
    try:
      weakref.finalize(x, self._forget, key, vid)
    except TypeError:  # Not weakly referable: kept alive instead.
      self._keep.append(x)

  def _forget(self, key: int, vid: int) -> None:
    if self._vid.get(key) == vid:
      del self._vid[key]

  def _name(self, x) -> int:
    """A new id for value ``x`` (`FINITE` if it cannot be non-finite)."""
    if not floating(x):
      return FINITE
    vid = next(self._ids)
    self._alias(x, vid)
    return vid

  # --- The log ---

  def _current(self) -> _Log:
    return self.log if self._body is None else self._body

  def _check(self, x) -> Optional[int]:
    if not self.checking:
      return None
    log = self._current()
    log.checks.append(_nonfinite(x))
    log.n_checks += 1
    return log.n_checks - 1

  def event(self, eq: observe.Equation) -> int:
    """The event of ``eq`` (one per equation and scope, however often run)."""
    key = (id(eq.eqn), eq.names, eq.transforms)
    found = self._event_of.get(key)
    if found is None:
      self.events.append(Event(
          eq.primitive, eq.names, eq.transforms, sites.site_of(eq.names),
          feeds_forward=eq.feeds_forward,
          collective=jax_compat.is_collective(eq.eqn)))
      found = self._event_of[key] = len(self.events) - 1
      self._keep.append(eq.eqn)  # Its id stays its own.
    return found

  def _log(self, event: int, ins, outs, checks, eq, constant=False,
           values=None, passed=False) -> None:
    traced = self._body is not None
    self._current().entries.append(Entry(
        event, tuple(ins), tuple(outs), tuple(checks),
        None if eq is None else eq.iteration,
        None if traced or eq is None else eq.device, constant))
    if self.watcher is not None and values is not None and not traced:
      if passed:
        self.watcher.passed(ins, outs[0], values[0])
      else:
        self.watcher.made(event, ins, outs, values)

  def inputs(self, arrays, paths) -> None:
    """Logs the program's arguments (each checked)."""
    for x, path in zip(arrays, paths):
      if floating(x):
        self.events.append(Event("input", where=path))
        self._log(len(self.events) - 1, (), [self._name(x)],
                  [self._check(x)], None)

  def _bad_constant(self, x) -> bool:
    """Whether ``x``, a literal or a jaxpr's constant, is not finite."""
    if isinstance(x, jax_compat.Tracer) or not floating(x):
      return False
    key = id(x)
    if key not in self._constants:
      self._constants[key] = (x, not bool(np.all(np.isfinite(np.asarray(x)))))
    return self._constants[key][1]

  # --- What the interpreter tells ---

  def after(self, eq: observe.Equation, invals, outs) -> None:
    if outs is None or eq.stepped:
      return  # It failed; or its bodies' equations were told.
    matmul = jax_compat.matmul_flops(eq.eqn)
    if matmul is not None:
      self.flops[(sites.site_of(eq.names), np.dtype(matmul[1]).name)] += (
          matmul[0])
    in_ids = [self.vid(x) for x in invals]
    found = facts.of(eq.eqn.primitive)
    if found.fills_ref:  # The reference now holds the value written.
      ref, value = (outs[0], invals[0]) if len(invals) == 1 else invals[:2]
      self._alias(ref, self.vid(value))
    if not any(floating(o) for o in outs):
      return
    mover = found.moves or _widening(eq.eqn)
    out_ids = [self._name(o) for o in outs]
    checks = [None if mover or not floating(o) else self._check(o)
              for o in outs]
    constant = self.checking and any(
        i == FINITE and self._bad_constant(x) for x, i in zip(invals, in_ids))
    self._log(self.event(eq), in_ids, out_ids, checks, eq, constant,
              list(outs))

  def moved(self, eq: observe.Equation, source, value) -> None:
    """A slice or shard of ``source`` (checked), or rows stacked (moved)."""
    if not floating(value):
      return
    if isinstance(source, list):
      ins, check = [self.vid(r) for r in source], None
    else:
      ins, check = [self.vid(source)], self._check(value)
    self._log(self.event(eq), ins, [self._name(value)], [check], eq,
              values=[value], passed=True)

  def per_device(self, eq: observe.Equation) -> None:
    self._body = _Log()

  def carried(self, eq: observe.Equation, outs):
    body = self._body
    assert body is not None  # Set by `per_device`.
    body.out_ids = [self.vid(o) for o in outs]
    return (jnp.stack(body.checks) if body.checks
            else jnp.zeros((0,), bool))

  def devices_ran(self, eq: observe.Equation, per_device, outs) -> None:
    body, self._body = self._body, None
    made = self._replay(body, per_device)  # type: ignore[arg-type]  # Set by `per_device`.
    event = self.event(eq)
    for parts, value in zip(made, outs):
      vid = self._name(value)
      if vid != FINITE:  # Each device's part, gathered: a mover.
        self._log(event, parts, [vid], [None], eq, values=[value])


  def _replay(self, body: _Log, per_device) -> list[list[int]]:
    """Appends ``body``'s log to the program's for every device, with that
    device's row of ``per_device`` (``[devices, checks]``) as its checks
    and new ids for the values the body made. The devices run side by
    side: each entry is appended for every device before the next, and a
    collective's result on each device reads every device's operands.

    Returns:
      For each of the body's outputs, its id on each device.
    """
    made_here = {i for e in body.entries for i in e.outs}
    n_devices, n_checks = per_device.shape
    self.log.checks.append(per_device)
    base = self.log.n_checks
    self.log.n_checks += n_devices * n_checks
    ids: list[dict[int, int]] = [{} for _ in range(n_devices)]

    def renamed(device, vid):
      if vid not in made_here:
        return vid  # A value from outside the body, or a constant.
      return ids[device].setdefault(vid, next(self._ids))

    for e in body.entries:
      every = tuple(renamed(d, i) for d in range(n_devices) for i in e.ins)
      for d in range(n_devices):
        offset = base + d * n_checks
        self.log.entries.append(dataclasses.replace(
            e, ins=every if self.events[e.event].collective
            else tuple(renamed(d, i) for i in e.ins),
            outs=tuple(renamed(d, i) for i in e.outs),
            checks=tuple(None if c is None else offset + c for c in e.checks),
            device=d))
    return [[renamed(d, vid) for d in range(n_devices)]
            for vid in body.out_ids]


def origins(checker: Checker, out_ids) -> list[Optional[Origin]]:
  """For each of ``out_ids``, where its non-finiteness began (``None``:
  finite), following the log in execution order.

  Entries are ordered by when they ran; an origin that read a non-finite
  constant (a ``-inf`` mask's literal) ranks after every other, so a
  non-finite value the data made comes first.
  """
  flags = np.concatenate([np.asarray(c, bool).reshape(-1)
                          for c in jax.device_get(checker.log.checks)] or
                         [np.zeros(0, bool)])
  taint: dict[int, Origin] = {}
  for n, entry in enumerate(checker.log.entries):
    bad = [taint[i] for i in entry.ins if i in taint]
    earliest = min(bad, key=lambda o: o.order) if bad else None
    for vid, check in zip(entry.outs, entry.checks):
      if vid == FINITE:
        continue
      if check is None:  # A mover: tainted exactly when an input is.
        if earliest is not None:
          taint[vid] = earliest
      elif flags[check]:
        taint[vid] = earliest or Origin((int(entry.constant), n), entry)
  return [taint.get(i) for i in out_ids]
