"""Repeated module calls, interpreted once: a deep model's identical layers.

A model traced into one flat jaxpr repeats the equations of each identical
layer, and the interpreter would apply its rules to every copy, and JAX
would then differentiate, transpose and lower every copy. `plan` finds the
runs of equations that one governed module call made (the equations under
one region marker), keys each by what it computes and how the rules see it
(`jax_compat.run_key`, with the region that governs each equation, those
inside its sub-jaxprs included), and
marks those whose key repeats. `call` interprets such a run once per key,
inside a `jax.jit` made for it, and binds every copy as one call of it:
the rules run once per distinct layer, and JAX's caches (JVP, linearize,
transpose, lowering) meet one body.

Values carry marks across the call both ways (parameter, constant,
broadcast, the wider value a half one was cast down from), so each layer is
computed bit for bit as it would be inline. Nothing is shared under
``OpRules.with_sharing(False)``, while an observer watches (explain and
the debugger report every layer, and are told which would share,
`body_key`), while a program is replayed, or where a block format draws
random keys by place.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator, Sequence
import dataclasses
import re
from typing import Any, Optional

import jax
import numpy as np

from mpolicy._src import dtypes
from mpolicy._src import jax_compat
from mpolicy._src import regions
from mpolicy._src.blocks import formats

MIN_EQNS = 12
"""Runs shorter than this stay inline (a call costs about as much)."""


@dataclasses.dataclass(frozen=True, eq=False)
class Repeat:
  """Equations ``start:end`` of a jaxpr, made by one module call.

  ``depth`` scope names (those of the call) lead every equation's name
  stack; ``inputs`` are the variables read from before the run, ``outputs``
  those read after it.
  """
  start: int
  end: int
  depth: int
  inputs: tuple
  outputs: tuple
  key: Any
  name: str
  scope: str = ""


def _units(names: Sequence[tuple], lo: int, hi: int,
           depth: int) -> Iterator[int | tuple[int, int, int]]:
  """Splits equations ``lo:hi`` (sharing ``depth`` scope names) into loose
  equations (ints) and runs ``(start, end, depth + 1)``: the consecutive
  equations under the same next scope name (a module call's, a region
  marker's, a `jax.named_scope`'s)."""
  i = lo
  while i < hi:
    if len(names[i]) <= depth:
      yield i
      i += 1
      continue
    unit, j = names[i][:depth + 1], i + 1
    while j < hi and names[j][:depth + 1] == unit:
      j += 1
    yield (i, j, depth + 1)
    i = j


def _all_runs(names, lo, hi, depth, found: list) -> None:
  for unit in _units(names, lo, hi, depth):
    if isinstance(unit, tuple):
      found.append(unit)
      _all_runs(names, *unit, found)


def _boundary(eqns, start: int, end: int, last_read: dict, returned: set):
  """The variables a run reads from before it and those read after it."""
  defined: set = set()
  inputs: dict = {}
  for eqn in eqns[start:end]:
    for v in eqn.invars:
      if not isinstance(v, jax_compat.Literal) and v not in defined:
        inputs.setdefault(v, None)
    defined.update(eqn.outvars)
  outputs = [v for e in eqns[start:end] for v in e.outvars
             if not isinstance(v, jax_compat.DropVar)
             and (last_read.get(v, -1) >= end or v in returned)]
  return tuple(inputs), tuple(outputs)


def plan(jaxpr, prefix: tuple, region_of: Callable[[tuple], Any],
         full_only: set) -> Optional[list]:
  """``jaxpr``'s equations as indices and repeated `Repeat`s, in order; or
  ``None`` when nothing repeats (or sharing is off: see the module)."""
  eqns = jaxpr.eqns
  if len(eqns) < 2 * MIN_EQNS:
    return None
  names = [jax_compat.eqn_scope_names(e) for e in eqns]
  candidates: list = []
  _all_runs(names, 0, len(eqns), 0, candidates)
  seen: set = set()
  shapes: dict = {}
  for s, e, d in candidates:
    if e - s >= MIN_EQNS and (s, e) not in seen:  # A call and its only
      seen.add((s, e))                            # inner call: once.
      shape = (e - s, tuple(q.primitive for q in eqns[s:e]))
      shapes.setdefault(shape, []).append((s, e, d))
  returned = {v for v in jaxpr.outvars
              if not isinstance(v, jax_compat.Literal)}
  last_read = {v: n for n, eqn in enumerate(eqns) for v in eqn.invars
               if not isinstance(v, jax_compat.Literal)}
  runs: dict = {}
  counts: dict = {}
  memo: dict = {}
  for group in shapes.values():
    for s, e, d in group if len(group) > 1 else ():
      run = _keyed(eqns, names, s, e, d, prefix, region_of, full_only,
                   last_read, returned, memo)
      if run is not None:
        runs[s, e] = run
        counts[run.key] = counts.get(run.key, 0) + 1
  if not any(c > 1 for c in counts.values()):
    return None
  out: list = []
  _emit(names, 0, len(eqns), 0, runs, counts, out)
  # A run whose copies all sit inside other shared runs is one call here:
  # inline it.
  emitted = collections.Counter(r.key for r in out if isinstance(r, Repeat))
  out = [i for r in out for i in (
      range(r.start, r.end) if isinstance(r, Repeat) and emitted[r.key] < 2
      else (r,))]
  return out if any(isinstance(r, Repeat) for r in out) else None


def unnamed(jaxpr, cache: dict) -> bool:
  """Whether no equation of ``jaxpr`` (or of its sub-jaxprs) has scope
  names: one interpretation of it serves every call site."""
  try:
    return cache[jaxpr]
  except KeyError:
    pass
  out = all(not jax_compat.eqn_scope_names(eqn)
            and all(unnamed(sub.jaxpr if hasattr(sub, "consts") else sub,
                            cache)
                    for sub in jax_compat.jaxprs_in_params(eqn.params))
            for eqn in jaxpr.eqns)
  cache[jaxpr] = out
  return out


def _emit(names, lo, hi, depth, runs, counts, out: list) -> None:
  for unit in _units(names, lo, hi, depth):
    run = runs.get(unit[:2]) if isinstance(unit, tuple) else None
    if run is not None and counts[run.key] > 1:
      out.append(run)
    elif isinstance(unit, tuple):
      _emit(names, *unit, runs, counts, out)
    else:
      out.append(unit)


def _keyed(eqns, names, s, e, d, prefix, region_of, full_only, last_read,
           returned, memo) -> Optional[Repeat]:
  """The `Repeat` of equations ``s:e``, or ``None`` if it cannot be shared."""
  if not all(jax_compat.leading_scopes(q, d) for q in eqns[s:e]):
    return None
  inputs, outputs = _boundary(eqns, s, e, last_read, returned)
  by_names = {}

  def governs(n):  # Equations in sub-jaxprs too: their regions differ.
    if n not in by_names:
      region = region_of(prefix + n)
      policy = None if region is None else region.policy
      if policy is not None and policy.matmul_format in formats.FORMATS:
        raise jax_compat.Unkeyable("block format: keys drawn by place")
      if policy is not None and policy.matmul_format == "int8":
        # An export stores a weight in int8 where it reads it: inline.
        raise jax_compat.Unkeyable("int8: weights found where read")
      by_names[n] = (None if region is None else  # What rules read.
                     (policy, region.full_precision,
                      region.module_class is not None),
                     regions.policy_cast_of(n))
    return by_names[n]

  try:
    key = jax_compat.run_key(eqns[s:e], inputs, outputs, extra=governs,
                             memo=memo)
  except jax_compat.Unkeyable:
    return None
  plain = regions.plain_scope_names(names[s][:d])
  name = re.sub(r"_\d+$", "", plain[-1]) if plain else "scope"
  return Repeat(s, e, d, inputs, outputs,
             (key, tuple(v in full_only for v in outputs)),
             re.sub(r"\W", "_", name) or "scope",
             "/".join(regions.plain_scope_names(prefix + names[s][:d])))


# --- Calling a shared run -----------------------------------------------------


_UNMARKED = (False, None, False, False)


def _marks(env, x) -> tuple:
  """What the rules know of ``x`` beyond its value (nothing of a concrete
  value: marks are kept on traced ones)."""
  if not dtypes.is_traced(x):
    return _UNMARKED
  const = env.const_of(x)
  return (env.is_param(x), None if const is None else
          (const.dtype, const.tobytes()), env.is_spread(x),
          env.has_wider(x))


def _mark(env, x, marks, wider=None) -> None:
  param, const, spread, has_wider = marks
  if param:
    env.mark_param(x)
  if const is not None:
    env.mark_const(x, np.frombuffer(const[1], const[0])[0])
  if spread:
    env.mark_spread(x)
  if has_wider:
    env.mark_wider(x, lambda: wider)


class _Body:
  """One shared run: a `jax.jit` of its interpretation; the marks of its
  outputs, found when it is traced."""

  def __init__(self, run: Repeat, in_marks, evaluate, new_env):
    self.run, self.in_marks = run, in_marks
    self.out_marks: Optional[list] = None
    self._evaluate, self._new_env = evaluate, new_env

    def body(*args):
      return self._trace(args)

    body.__name__ = body.__qualname__ = run.name
    self.jitted = jax.jit(body)

  def _trace(self, args):
    run, env = self.run, self._new_env()
    n = len(run.inputs)
    widers = iter(args[n:])
    for var, x, marks in zip(run.inputs, args, self.in_marks):
      env.values[var] = x
      _mark(env, x, marks, next(widers) if marks[3] else None)
    outs = self._evaluate(env, run)
    self.out_marks = [_marks(env, o) for o in outs]
    return [*outs, *(env.wider_source(o) for o, m in
                     zip(outs, self.out_marks) if m[3])]


def body_key(run: Repeat, env) -> tuple:
  """The key of the shared body ``run`` is bound as a call of in ``env``:
  runs with equal keys are calls of one body."""
  return (run.key, tuple(_marks(env, env.values[v]) for v in run.inputs))


def call(run: Repeat, env, cache: dict, evaluate, new_env) -> list:
  """Binds ``run`` as one call of its shared body; returns its outputs.

  ``evaluate(env, run)`` interprets the run's equations in ``env`` (a
  ``new_env()`` whose inputs are set) and returns its outputs' values.
  """
  values = [env.values[v] for v in run.inputs]
  _, in_marks = body_key(run, env)
  body = cache.get((run.key, in_marks))
  if body is None:
    body = cache[run.key, in_marks] = _Body(run, in_marks, evaluate, new_env)
  widers = [env.wider_source(x) for x, m in zip(values, in_marks) if m[3]]
  res = body.jitted(*values, *widers)
  outs, extra = res[:len(run.outputs)], iter(res[len(run.outputs):])
  for o, marks in zip(outs, body.out_marks):  # type: ignore[arg-type]  # Set by the trace.
    _mark(env, o, marks, next(extra) if marks[3] else None)
  return outs
