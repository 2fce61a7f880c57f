"""The checked run: a program run op by op, with where each non-finite began.

`Walker.run` evaluates a jaxpr one equation at a time, eagerly: each
primitive is dispatched on its own (JAX caches one executable per
primitive and shape, so a deep model's repeated layers compile once and
nothing the size of the whole program is compiled), and beside each
floating result it dispatches an "is anything here not finite?" check. It
logs every equation it runs as an `Entry`: which values it read and made,
and the checks of what it made. `origins` then follows the log in
execution order, on the host, after one transfer of every check: a value
that is not finite is *tainted* by the earliest origin among the values it
was made from, or, if they were all finite, is an origin itself. A
non-finite value the program masks (``jnp.where(x > 0, jnp.log(x), 0)``'s
forward, a ``-inf`` attention mask before its softmax) is then no origin
of a non-finite result.

Higher-order primitives are entered: `jit`, `checkpoint`, `custom_jvp`,
`custom_vjp` and call bodies are evaluated inline; `scan` and `while`
iterate in Python (an entry knows its iteration; a reversed scan's
iteration is the index of the element it reads, so a backward scan names
its forward iteration); `cond` runs the branch its index picks. A
`shard_map` body is traced once into a `shard_map` that returns every
device's checks, and its log is replayed per device; inside it, loops are
unrolled and a `while` or `cond` is checked as one equation. Equations
that only move values (reshape, transpose, broadcast, negation, widening
casts) make a non-finite value exactly when they read one: they are not
checked.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import itertools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from mpolicy._src import dtypes
from mpolicy._src import jax_compat
from mpolicy._src import sites

FINITE = 0
"""The value id of constants and of values known to be finite."""

# Primitives whose results hold exactly their operands' values (moved,
# copied, negated): a result is not finite exactly when an operand is not.
MOVERS = frozenset({
    "reshape", "transpose", "broadcast_in_dim", "squeeze", "expand_dims",
    "neg", "abs", "copy", "copy_p", "rev", "concatenate", "stop_gradient",
    "real", "imag", "conj", "pvary", "pcast", "device_put",
    "sharding_constraint",
})


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
    collective: whether its result on one device depends on the others'
      (``psum``, ``all_gather``).
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
  """One run of one equation.

  Attributes:
    event: its `Event`'s index.
    ins: the ids of the values it read (`FINITE` for constants).
    outs: the ids of the values it made.
    checks: per result, the index of its check, or ``None`` (not floating,
      or made by a mover: not finite exactly when an input is not).
    iteration: the loop iteration it ran in, else ``None``.
    device: the `shard_map` device it ran on, else ``None``.
    constant: whether it read a non-finite constant (a ``-inf`` literal).
  """
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


@dataclasses.dataclass(frozen=True)
class _Ctx:
  """Where an equation runs: its scope, loop iteration, device."""
  names: tuple[str, ...] = ()
  transforms: tuple[str, ...] = ()
  iteration: Optional[int] = None
  device: Any = None
  traced: bool = False  # Inside a traced `shard_map` body.

  def inside(self, eqn, **changes) -> "_Ctx":
    return dataclasses.replace(
        self, names=self.names + jax_compat.eqn_scope_names(eqn),
        transforms=self.transforms + jax_compat.eqn_transforms(eqn),
        **changes)


def floating_dtype(dtype) -> bool:
  """Whether values of ``dtype`` can be non-finite (real or complex floats)."""
  return dtypes.is_float(dtype) or jnp.issubdtype(dtype, jnp.complexfloating)


def floating(x) -> bool:
  return floating_dtype(dtypes.dtype_of(x))


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


def _forward_read(jaxpr, ctx: _Ctx, outs_read=None) -> set:
  """The variables of ``jaxpr`` that equations outside the backward pass
  read; its outputs count where ``outs_read`` says the enclosing equation's
  results are so read (all of them if ``None``, outside a backward pass)."""
  found = set()
  if outs_read is None:
    outs_read = ["transpose" not in ctx.transforms] * len(jaxpr.outvars)
  found.update(v for v, read in zip(jaxpr.outvars, outs_read)
               if read and not isinstance(v, jax_compat.Literal))
  for eqn in jaxpr.eqns:
    if "transpose" not in ctx.transforms + jax_compat.eqn_transforms(eqn):
      found.update(v for v in eqn.invars
                   if not isinstance(v, jax_compat.Literal))
  return found


# --- The walker ---------------------------------------------------------------


class Walker:
  """Runs jaxprs op by op, logging every run and checking every result."""

  def __init__(self, events: Optional[list[Event]] = None,
               ids: Optional[itertools.count] = None, *,
               checking: bool = True, observer: Any = None):
    """A walker.

    Args:
      events: the event list to number events in (shared by a body's
        walker).
      ids: the value id counter (likewise).
      checking: whether results are checked for non-finite values.
      observer: if given, ``observer.made(event, in_ids, out_ids, outs)``
        is called for every equation run eagerly, and
        ``observer.passed(in_ids, out_id, value)`` for every value the
        walker itself moves (a loop's slice or stack).
    """
    self.events: list[Event] = [] if events is None else events
    self.checking, self.observer = checking, observer
    self.entries: list[Entry] = []
    # Arrays of "not finite" flags, one per check, in check order (a
    # replayed body adds its per-device flags as one array).
    self.checks: list[Any] = []
    self._n_checks = 0
    self._ids = itertools.count(1) if ids is None else ids
    self._event_of: dict[tuple, int] = {}
    self._constants: dict[int, tuple[Any, bool]] = {}
    self._keep: list[Any] = []  # Keeps the ids of keyed equations alive.
    self._dead: dict[int, list[list]] = {}

  def new_id(self) -> int:
    return next(self._ids)

  def event(self, eqn, ctx: _Ctx, feeds_forward: bool) -> int:
    """The event of ``eqn`` run in ``ctx`` (made once per equation and
    scope, however often it runs)."""
    key = (id(eqn), ctx.names, ctx.transforms)
    found = self._event_of.get(key)
    if found is None:
      names = ctx.names + jax_compat.eqn_scope_names(eqn)
      self.events.append(Event(
          eqn.primitive.name, names,
          ctx.transforms + jax_compat.eqn_transforms(eqn),
          sites.site_of(names), feeds_forward=feeds_forward,
          collective=jax_compat.is_collective(eqn)))
      found = self._event_of[key] = len(self.events) - 1
      self._keep.append(eqn)
    return found

  def check(self, x) -> int:
    """Dispatches the check of ``x``; returns its index."""
    self.checks.append(_nonfinite(x))
    self._n_checks += 1
    return self._n_checks - 1

  def child(self) -> "Walker":
    """A walker for a traced body: its events and ids are this one's, its
    log and checks its own (see `replay`)."""
    body = Walker(self.events, self._ids, checking=self.checking)
    body._event_of, body._keep = self._event_of, self._keep  # pylint: disable=protected-access
    body._dead = self._dead  # pylint: disable=protected-access
    return body

  def replay(self, into: "Walker", per_device, out_ids) -> list[list[int]]:
    """Appends this (traced body's) log to ``into`` for every device, with
    that device's row of ``per_device`` (``[devices, checks]``) as its
    checks and new ids for the values the body made. The devices run side
    by side: each entry is appended for every device before the next, and
    a collective's result on each device reads every device's operands.

    Returns:
      For each of the body's ``out_ids``, its id on each device.
    """
    made_here = {i for e in self.entries for i in e.outs}
    n_devices, n_checks = per_device.shape
    into.checks.append(per_device)
    base = into._n_checks  # pylint: disable=protected-access
    into._n_checks += n_devices * n_checks  # pylint: disable=protected-access
    ids: list[dict[int, int]] = [{} for _ in range(n_devices)]

    def renamed(device, vid):
      if vid not in made_here:
        return vid  # A value from outside the body, or a constant.
      return ids[device].setdefault(vid, into.new_id())

    for e in self.entries:
      every = tuple(renamed(d, i) for d in range(n_devices) for i in e.ins)
      for d in range(n_devices):
        offset = base + d * n_checks
        into.entries.append(dataclasses.replace(
            e, ins=every if self.events[e.event].collective
            else tuple(renamed(d, i) for i in e.ins),
            outs=tuple(renamed(d, i) for i in e.outs),
            checks=tuple(None if c is None else offset + c for c in e.checks),
            device=d))
    return [[renamed(d, vid) for d in range(n_devices)] for vid in out_ids]

  def log(self, event: int, ins, outs, checks, ctx: _Ctx,
          constant: bool = False, values=None, passed=False) -> None:
    """Logs one run; tells the observer (``values``: the results; a
    ``passed`` value is one the walker moved, not an equation's)."""
    self.entries.append(Entry(event, tuple(ins), tuple(outs), tuple(checks),
                              ctx.iteration, None if ctx.traced
                              else ctx.device, constant))
    if self.observer is not None and values is not None and not ctx.traced:
      if passed:
        self.observer.passed(ins, outs[0], values[0])
      else:
        self.observer.made(event, ins, outs, values)

  def inputs(self, arrays, paths) -> list[int]:
    """Logs the program's arguments (each checked); returns their ids."""
    ids = []
    for x, path in zip(arrays, paths):
      if not floating(x):
        ids.append(FINITE)
        continue
      self.events.append(Event("input", where=path))
      ids.append(self.new_id())
      self.log(len(self.events) - 1, (), [ids[-1]],
               [self.check(x) if self.checking else None], _Ctx())
    return ids

  def run(self, jaxpr, consts, args, arg_ids, ctx: _Ctx = _Ctx(),
          outs_read=None) -> tuple[list, list]:
    """Evaluates ``jaxpr``; returns its outputs and their value ids.

    ``outs_read`` says, per output, whether the forward pass reads it
    (where the jaxpr is a body: whether it reads the enclosing equation's
    result); see `Event.feeds_forward`.
    """
    env: dict[Any, tuple[Any, int]] = {}
    for var, x in zip(jaxpr.constvars, consts):
      env[var] = (x, FINITE)
    for var, x, i in zip(jaxpr.invars, args, arg_ids):
      env[var] = (x, i)

    def read(var):
      if isinstance(var, jax_compat.Literal):
        return var.val, FINITE
      return env[var]

    forward_read = _forward_read(jaxpr, ctx, outs_read)
    dead = self._dead_after(jaxpr)
    for n, eqn in enumerate(jaxpr.eqns):
      pairs = [read(v) for v in eqn.invars]
      invals = [x for x, _ in pairs]
      in_ids = [i for _, i in pairs]
      rule = _RULES.get(eqn.primitive)
      read_out = [v in forward_read for v in eqn.outvars]
      if rule is not None and not (ctx.traced and rule in _EAGER_ONLY):
        outs, out_ids = rule(self, eqn, invals, in_ids, ctx, read_out)
      else:
        outs, out_ids = self.first_order(eqn, invals, in_ids, ctx,
                                         any(read_out))
      for var, x, i in zip(eqn.outvars, outs, out_ids):
        if not isinstance(var, jax_compat.DropVar):
          env[var] = (x, i)
      for var in dead[n]:  # Read for the last time: its memory goes.
        env.pop(var, None)
    pairs = [read(v) for v in jaxpr.outvars]
    return [x for x, _ in pairs], [i for _, i in pairs]

  def _dead_after(self, jaxpr) -> list[list]:
    """Per equation of ``jaxpr``, the variables no later equation (and no
    output) reads: a run drops them once it has run that equation, so it
    holds what a program would, not every value it ever made."""
    key = id(jaxpr)
    found = self._dead.get(key)
    if found is None:
      last = {}
      for n, eqn in enumerate(jaxpr.eqns):
        for var in (*eqn.invars, *eqn.outvars):
          if not isinstance(var, (jax_compat.Literal, jax_compat.DropVar)):
            last[var] = n
      for var in jaxpr.outvars:
        last.pop(var, None)
      found = [[] for _ in jaxpr.eqns]
      for var, n in last.items():
        found[n].append(var)
      self._dead[key] = found
      self._keep.append(jaxpr)  # Its id stays its own.
    return found

  def first_order(self, eqn, invals, in_ids, ctx, feeds_forward=True):
    """Binds one equation as it is, and logs it."""
    out = jax_compat.bind(eqn.primitive, invals, eqn.params)
    outs = list(out) if eqn.primitive.multiple_results else [out]
    if not any(floating(o) for o in outs):
      return outs, [FINITE] * len(outs)
    event = self.event(eqn, ctx, feeds_forward)
    mover = eqn.primitive.name in MOVERS or _widening(eqn)
    out_ids = [self.new_id() if floating(o) else FINITE for o in outs]
    checks = [None if mover or not floating(o) or not self.checking
              else self.check(o) for o in outs]
    self.log(event, in_ids, out_ids, checks, ctx,
             self.checking and any(i == FINITE and self._bad_constant(x)
                                   for x, i in zip(invals, in_ids)), outs)
    return outs, out_ids

  def _bad_constant(self, x) -> bool:
    """Whether ``x``, a literal or a jaxpr's constant, is not finite
    (looked at once per constant)."""
    if isinstance(x, jax_compat.Tracer) or not floating(x):
      return False
    key = id(x)
    if key not in self._constants:
      self._constants[key] = (x, not bool(np.all(np.isfinite(np.asarray(x)))))
    return self._constants[key][1]

  def checked_copy(self, eqn, x, source: int, ctx) -> int:
    """Logs ``x`` (a slice or shard of value ``source``) as read by
    ``eqn``'s body; returns its id."""
    if not floating(x):
      return FINITE
    vid = self.new_id()
    self.log(self.event(eqn, ctx, True), [source], [vid],
             [self.check(x) if self.checking else None], ctx, values=[x],
             passed=True)
    return vid


# --- Higher-order primitives ----------------------------------------------------


def _closed_parts(sub) -> tuple[Any, list]:
  if hasattr(sub, "consts"):
    return sub.jaxpr, list(sub.consts)
  return sub, []


def _inline(walker, eqn, invals, in_ids, ctx, read_out):
  """`jit`, `checkpoint`, custom derivatives, calls: the body, inline."""
  jaxpr, consts = _closed_parts(jax_compat.sub_jaxpr(eqn))
  return walker.run(jaxpr, consts, invals, in_ids, ctx.inside(eqn),
                    read_out)


def _stacked(walker, eqn, rows, row_ids, aval, length, ctx):
  """The per-iteration values ``rows`` stacked (a logged mover)."""
  if not rows:
    return jnp.zeros((length, *aval.shape), aval.dtype), FINITE
  value = jnp.stack(rows)
  if not floating(value):
    return value, FINITE
  vid = walker.new_id()
  walker.log(walker.event(eqn, ctx, True), row_ids, [vid], [None], ctx,
             values=[value], passed=True)
  return value, vid


def _scan(walker, eqn, invals, in_ids, ctx, read_out):
  n_consts, n_carry, length, reverse = jax_compat.scan_layout(eqn.params)
  jaxpr, body_consts = _closed_parts(jax_compat.sub_jaxpr(eqn))
  split = (n_consts, n_consts + n_carry)
  consts, carry, xs = (invals[:split[0]], invals[split[0]:split[1]],
                       invals[split[1]:])
  c_ids, carry_ids, xs_ids = (in_ids[:split[0]], in_ids[split[0]:split[1]],
                              in_ids[split[1]:])
  inner = ctx.inside(eqn)
  rows: list = [None] * length
  order = range(length - 1, -1, -1) if reverse else range(length)
  for i in order:
    step = dataclasses.replace(inner, iteration=i)
    x = [v[i] for v in xs]
    x_ids = [walker.checked_copy(eqn, v, s, step) for v, s in zip(x, xs_ids)]
    outs, ids = walker.run(jaxpr, body_consts, [*consts, *carry, *x],
                           [*c_ids, *carry_ids, *x_ids], step,
                           [True] * n_carry + read_out[n_carry:])
    carry, carry_ids = outs[:n_carry], ids[:n_carry]
    rows[i] = (outs[n_carry:], ids[n_carry:])
  ys, ys_ids = [], []
  for k, var in enumerate(jaxpr.outvars[n_carry:]):
    value, vid = _stacked(walker, eqn, [r[0][k] for r in rows],
                          [r[1][k] for r in rows], var.aval, length, inner)
    ys.append(value)
    ys_ids.append(vid)
  return [*carry, *ys], [*carry_ids, *ys_ids]


def _while(walker, eqn, invals, in_ids, ctx, read_out):
  n_cond, n_body = jax_compat.while_counts(eqn.params)
  cond_j, cond_consts = _closed_parts(jax_compat.sub_jaxpr(eqn, "cond"))
  body_j, body_consts = _closed_parts(jax_compat.sub_jaxpr(eqn, "body"))
  c_args, b_args = invals[:n_cond], invals[n_cond:n_cond + n_body]
  c_ids, b_ids = in_ids[:n_cond], in_ids[n_cond:n_cond + n_body]
  carry, carry_ids = invals[n_cond + n_body:], in_ids[n_cond + n_body:]
  inner = ctx.inside(eqn)
  del read_out  # The carry feeds the next iteration: the forward pass.
  for i in itertools.count():
    step = dataclasses.replace(inner, iteration=i)
    (go,), _ = walker.run(cond_j, cond_consts, [*c_args, *carry],
                          [*c_ids, *carry_ids], step)
    if not bool(go):
      return list(carry), list(carry_ids)
    carry, carry_ids = walker.run(body_j, body_consts, [*b_args, *carry],
                                  [*b_ids, *carry_ids], step)


def _cond(walker, eqn, invals, in_ids, ctx, read_out):
  branches = jax_compat.sub_jaxpr(eqn, "branches")
  index = int(np.clip(int(invals[0]), 0, len(branches) - 1))
  jaxpr, consts = _closed_parts(branches[index])
  return walker.run(jaxpr, consts, invals[1:], in_ids[1:], ctx.inside(eqn),
                    read_out)


def _shard_map(walker, eqn, invals, in_ids, ctx, read_out):
  """The body traced once; its log replayed per device with that device's
  checks (returned stacked, one row per device)."""
  jaxpr, consts = _closed_parts(jax_compat.sub_jaxpr(eqn))
  axes = jax_compat.shard_map_manual_axes(eqn)
  body = walker.child()
  body_out: list[int] = []
  inner = ctx.inside(eqn, traced=True)

  def local(*vals):
    body.entries, body.checks, body._n_checks = [], [], 0  # pylint: disable=protected-access
    step = dataclasses.replace(inner, device=jax.lax.axis_index(axes))
    shards = [body.checked_copy(eqn, v, s, step) for v, s in zip(vals, in_ids)]
    outs, out_ids = body.run(jaxpr, consts, list(vals), shards, step,
                             read_out)
    body_out[:] = out_ids
    checks = (jnp.stack(body.checks) if body.checks
              else jnp.zeros((0,), bool))
    return (*outs, jax_compat.make_varying(checks, axes)[None])

  results = jax_compat.shard_map_like(eqn, local, 0, 1)(*invals)
  outs, per_device = list(results[:-1]), results[-1]
  made = body.replay(walker, per_device, body_out)
  out_ids = [walker.new_id() if floating(o) else FINITE for o in outs]
  event = walker.event(eqn, ctx, True)
  for vid, parts, value in zip(out_ids, made, outs):
    if vid != FINITE:  # Each device's part, gathered: a mover.
      walker.log(event, parts, [vid], [None], ctx, values=[value])
  return outs, out_ids


# Rules that need concrete values (a Python loop, a branch index): inside a
# traced `shard_map` body the equation is checked as one instead, except
# `scan`, which is unrolled (its length is static).
_EAGER_ONLY: set = set()

_RULES: dict[Any, Callable[..., tuple[list, list]]] = {
    jax_compat.jit_p: _inline,
    jax_compat.remat_p: _inline,
    jax_compat.custom_jvp_call_p: _inline,
    jax_compat.custom_vjp_call_p: _inline,
    jax_compat.scan_p: _scan,
    jax_compat.while_p: _while,
    jax_compat.cond_p: _cond,
}
for _p in (jax_compat.closed_call_p, jax_compat.core_call_p):
  if _p is not None:
    _RULES[_p] = _inline
if jax_compat.shard_map_p is not None:
  _RULES[jax_compat.shard_map_p] = _shard_map
_EAGER_ONLY.update({_while, _cond, _shard_map})


# --- Following the log --------------------------------------------------------


def origins(walker: Walker, out_ids) -> list[Optional[Origin]]:
  """For each of ``out_ids``, where its non-finiteness began (``None``:
  finite), following the log in execution order.

  Entries are ordered by when they ran; an origin that read a non-finite
  constant (a ``-inf`` mask's literal) ranks after every other, so a
  non-finite value the data made comes first.
  """
  flags = np.concatenate([np.asarray(c, bool).reshape(-1)
                          for c in jax.device_get(walker.checks)] or
                         [np.zeros(0, bool)])
  taint: dict[int, Origin] = {}
  for n, entry in enumerate(walker.entries):
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
