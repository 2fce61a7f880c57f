"""The interpreter loop: re-runs a jaxpr, one rule per equation.

`eval_jaxpr` evaluates a jaxpr equation by equation on whatever trace it is
called under (eager, `jit`, `grad`, `vmap`, ...). For each equation it reads
the region that governs it from the equation's name stack (the Haiku
bridge's markers, `full_precision()` blocks, named scopes matching a
registry pattern, or `amp`'s own ``policy``), then hands it on:

* a higher-order primitive to its rule in `higher_order`, which re-traces
  its sub-jaxprs through `Scope.trace`;
* any other primitive to `rules.run`, which looks up its rules.

Each decision of the loop is its `Mode`'s (`Config.mode`): `Rules` as
above; `Sharing`, which also interprets a deep model's identical layers
once each, bound as calls of one body (`repeats`); `Replay`, which runs a
finished program as written for the debugger (`replay`), stepping through
its constructs (`stepping`). The values live in an `environment.Env`;
tools watch each equation through `observe`.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
import dataclasses
from typing import Any, Optional

import jax.numpy as jnp
import numpy as np

from mpolicy._src import dtypes
from mpolicy._src import environment
from mpolicy._src import higher_order
from mpolicy._src import jax_compat
from mpolicy._src import op_rules as op_rules_lib
from mpolicy._src import observe
from mpolicy._src import regions
from mpolicy._src import registry
from mpolicy._src import repeats
from mpolicy._src import rules
from mpolicy._src import stepping
from mpolicy._src import sub_computations
from mpolicy._src.blocks import recipe
from mpolicy._src.rules import amp_primitive
from mpolicy._src.rules import facts as facts_lib


Env = environment.Env
_INDEX = jax_compat.aval_of(np.int32(0))  # A loop body's iteration.


# --- Configuration of one run -------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Config:
  rules: op_rules_lib.OpRules
  outer: Optional[regions.Region]
  mode: "Mode"  # What the loop does at each decision (`Mode`).
  quiet: bool = False
  # Regions resolved in this run, by scope names (a look-up per scope).
  region_cache: dict = dataclasses.field(default_factory=dict, compare=False)
  # Sub-jaxprs interpreted in this run (`Scope.trace`); those unnamed.
  trace_cache: dict = dataclasses.field(default_factory=dict, compare=False)
  unnamed_cache: dict = dataclasses.field(default_factory=dict, compare=False)
  shared: dict = dataclasses.field(default_factory=dict, compare=False)

  def region(self, names: tuple[str, ...]) -> Optional[regions.Region]:
    return self.mode.region(self, names)


class Scope:
  """What a higher-order rule needs: tracing and casting at its call site.

  Attributes:
    names: the plain scope names of the higher-order equation (the prefix of
      every equation inside its sub-jaxprs).
  """

  def __init__(self, config: Config, env: Env, names: tuple[str, ...],
               invals: Sequence[Any] = (), eqn=None):
    self._config = config
    self._env = env
    self.names = names
    self._invals = list(invals)
    self._eqn = eqn

  def _per_input(self, flags: list, in_avals, eqn, none=False) -> list:
    """``flags`` (one per operand) mapped onto a sub-jaxpr's inputs: one to
    one (`jit`, `checkpoint`, `scan`, `shard_map`, a `custom_jvp` primal) or
    after the index (`cond`); other layouts (a `while` cond, a JVP rule) and
    a `scan`'s carries (they change per iteration) get ``none``."""
    if len(in_avals) == len(flags):
      out = list(flags)
    elif len(in_avals) == len(flags) - 1:
      out = list(flags[1:])
    else:
      return [none] * len(in_avals)
    if eqn is not None and eqn.primitive is jax_compat.scan_p:
      start, n_carry = jax_compat.scan_counts(eqn.params)
      out[start:start + n_carry] = [none] * n_carry
    return out

  def _arg_params(self, in_avals, eqn) -> list[bool]:
    """Which sub-jaxpr inputs are parameters or inputs of the `amp` call."""
    return self._per_input([self._env.is_param(x) for x in self._invals],
                           in_avals, eqn, False)

  def _arg_consts(self, in_avals, eqn) -> list:
    """The scalar constant each sub-jaxpr input holds, or ``None``."""
    return self._per_input([self._env.const_of(x) for x in self._invals],
                           in_avals, eqn, None)

  def as_written(self) -> bool:
    """Whether code at this call site runs as written (`full_precision()`)."""
    region = self._config.region(self.names)
    return region is not None and region.full_precision

  def cast(self, x, dtype):
    """``x`` cast to ``dtype`` (cached) if it is floating, else ``x``."""
    if dtype is None or not dtypes.float_value((x)) or not dtypes.is_float(dtype):
      return x
    return self._env.cast(x, dtype)

  @property
  def places(self) -> int:
    """How many block matmuls drew keys by place so far (see `trace`)."""
    return self._env.places[0]

  @places.setter
  def places(self, count: int) -> None:
    self._env.places[0] = count

  def trace(self, closed, in_avals, out_dtypes=None, *,
            quiet: bool = False, cast_inputs_to=None,
            iteration: bool = False) -> jax_compat.ClosedJaxpr:
    """Interprets ``closed`` at ``in_avals`` into a new closed jaxpr;
    ``out_dtypes`` fixes floating outputs' dtypes (``None``: as they come),
    ``cast_inputs_to`` the inputs' first; ``quiet`` keeps the equations out
    of `explain` (probes, lazily traced rules). With ``iteration`` the new
    jaxpr takes one more input, last: a loop body's iteration (an int32
    scalar), folded into the keys of the block matmuls inside."""
    config = dataclasses.replace(self._config,
                                 quiet=self._config.quiet or quiet)
    names = self.names
    arg_params = self._arg_params(in_avals, self._eqn)
    arg_consts = self._arg_consts(in_avals, self._eqn)
    key = self._cache_key(config, closed, in_avals, out_dtypes,
                          cast_inputs_to, arg_params, arg_consts)
    if key is not None and key in config.trace_cache and not iteration:
      return config.trace_cache[key]

    def run(*args):
      if iteration:
        *args, index = args
        with recipe.iteration(index):
          return interpret(*args)
      return interpret(*args)

    def interpret(*args):
      env = Env()
      env.arg_params, env.arg_consts = arg_params, arg_consts
      env.keys_from(self._env)
      if cast_inputs_to is not None:
        args = [env.cast(a, d.dtype) if dtypes.float_value((a)) else a
                for a, d in zip(args, cast_inputs_to)]
      outs = eval_jaxpr(closed.jaxpr, closed.consts, args, config, names, env)
      if out_dtypes is not None:
        outs = [o if d is None or not dtypes.float_value((o)) else env.cast(o, d)
                for o, d in zip(outs, out_dtypes)]
      return outs

    places = self.places
    in_avals = [*in_avals, *([_INDEX] if iteration else [])]
    new = jax_compat.trace_to_closed_jaxpr(run, in_avals, like=closed.jaxpr)
    if key is not None and self.places == places and not iteration:
      config.trace_cache[key] = new  # It drew no keys by place: reusable.
    return new

  def _cache_key(self, config, closed, in_avals, out_dtypes, cast_inputs_to,
                 arg_params, arg_consts) -> Optional[tuple]:
    """What `trace` depends on, where one answer serves every call site:
    a sub-jaxpr without scope names (`jnp.where`'s `jit` body) depends only
    on the policy at its call site, so a deep model's layers share one
    interpretation (and JAX's caches hit). Nothing is shared while an
    observer watches (each site is a row), nor without sharing."""
    if not config.mode.reuses_traces():
      return None
    if not repeats.unnamed(closed.jaxpr, config.unnamed_cache):
      return None
    region = config.region(self.names)
    governs = (None if region is None
               else (region.policy, region.full_precision))
    try:
      key = (closed, tuple(in_avals),
             None if out_dtypes is None else tuple(out_dtypes),
             None if cast_inputs_to is None else tuple(cast_inputs_to),
             config.quiet, tuple(arg_params),
             tuple(None if c is None else (c.dtype, c.tobytes())
                   for c in arg_consts), governs)
      hash(key)
    except TypeError:
      return None
    return key


# --- The loop -----------------------------------------------------------------


def eval_jaxpr(jaxpr, consts, args, config: Config,
               prefix: tuple[str, ...], env: Optional[Env] = None) -> list:
  """Evaluates ``jaxpr`` on ``consts`` and ``args`` in ``config``'s mode.

  Args:
    jaxpr: an open jaxpr.
    consts, args: values for its constvars and invars.
    config: the rule table, the outer region and the mode of this run.
    prefix: the scope names the jaxpr's equations sit under.
    env: the environment to evaluate in (a new one if ``None``).

  Returns:
    The values of its outvars.
  """
  env = Env() if env is None else env
  base = jax_compat.current_name_stack()
  mode = config.mode
  env.values.update(zip(jaxpr.constvars, consts))
  env.values.update(zip(jaxpr.invars, args))
  mode.enter(env, jaxpr, consts, config)
  if not mode.shared(env, jaxpr, config, prefix, base):
    reads, dead = mode.liveness(jaxpr)
    for n, eqn in enumerate(jaxpr.eqns):
      _eval_eqn(env, eqn, config, prefix, base, reads)
      for var in dead[n] if dead is not None else ():
        env.values.pop(var, None)  # Read for the last time: its memory goes.
  return [env.read(v) for v in jaxpr.outvars]


def _eval_eqn(env: Env, eqn, config: Config, prefix, base, reads=None,
              drop: int = 0) -> None:
  """Runs one equation; ``drop`` leading scopes of its name stack are
  those of the call it now runs inside (`repeats`)."""
  invals = [env.read(v) for v in eqn.invars]
  names = prefix + jax_compat.eqn_scope_names(eqn)
  with jax_compat.eqn_context_under(base, eqn, drop):
    outs = _observed(env, eqn, invals, names, config, reads)
  for var, out in zip(eqn.outvars, outs):
    if not isinstance(var, jax_compat.DropVar):
      env.values[var] = out


def _observed(env: Env, eqn, invals, names, config: Config, reads) -> list:
  """Runs one equation, told to the observers (`observe`) if any watch."""
  if not observe.active():
    return _run(env, eqn, invals, names, config, None)
  eq = observe.Equation(eqn, names, config.region(names), config.quiet)
  config.mode.describe(eq, eqn, reads)
  observe.before(eq, invals)
  outs = None
  try:
    outs = _run(env, eqn, invals, names, config, eq)
  finally:
    observe.after(eq, invals, outs)
  return outs


def _run(env: Env, eqn, invals, names, config: Config, eq) -> list:
  """Runs one equation as the mode runs a higher- or first-order one."""
  rule = higher_order.rule_for(eqn.primitive)
  if rule is not None:
    return config.mode.higher_order(env, eqn, invals, names, config, eq, rule)
  return config.mode.first_order(env, eqn, invals, names, config, eq)


# --- The modes ----------------------------------------------------------------


class Mode(abc.ABC):
  """What the loop does at each of its decisions: one object per way of
  running a jaxpr (`Rules`, `Sharing`, `Replay`), given to the loop in
  `Config.mode` as JAX's interpreters are given their rules. A decision
  left out is an error at construction."""

  @abc.abstractmethod
  def region(self, config: Config, names) -> Optional[regions.Region]:
    """The region that governs code under scope ``names``."""

  @abc.abstractmethod
  def enter(self, env: Env, jaxpr, consts, config: Config) -> None:
    """Marks what the rules read of ``jaxpr``'s bound inputs."""

  @abc.abstractmethod
  def shared(self, env: Env, jaxpr, config: Config, prefix, base) -> bool:
    """Runs ``jaxpr``'s identical layers as calls of one body, the rest
    around them; ``False`` (nothing run): the loop runs it instead."""

  @abc.abstractmethod
  def liveness(self, jaxpr) -> tuple[Optional[set], Optional[list]]:
    """The variables the forward pass reads (for the observers) and, per
    equation, those dead after it (dropped); ``None`` for neither."""

  @abc.abstractmethod
  def describe(self, eq: observe.Equation, eqn, reads) -> None:
    """Fills in what the observers see of ``eqn`` beyond its region."""

  @abc.abstractmethod
  def first_order(self, env: Env, eqn, invals, names, config: Config,
                  eq) -> list:
    """The outputs of a first-order equation."""

  @abc.abstractmethod
  def higher_order(self, env: Env, eqn, invals, names, config: Config, eq,
                   rule) -> list:
    """The outputs of a higher-order equation (``rule``: its rule in
    `higher_order`)."""

  @abc.abstractmethod
  def reuses_traces(self) -> bool:
    """Whether `Scope.trace` may serve one interpretation of an unnamed
    sub-jaxpr to every call site."""


@dataclasses.dataclass(frozen=True)
class Rules(Mode):
  """Each equation under the rules of its region, where it stands."""

  def region(self, config, names):
    try:
      return config.region_cache[names]
    except KeyError:
      region = registry.region_for_scopes(names, outer=config.outer)
      config.region_cache[names] = region
      return region

  def enter(self, env, jaxpr, consts, config):
    for x in consts:
      env.mark_param(x)
    env.full_only = _read_only_by_full(jaxpr, config.rules)
    flags = env.arg_params
    for var, flag in zip(jaxpr.invars, flags or [True] * len(jaxpr.invars)):
      if flag:
        env.mark_param(env.values[var])
    for var, value in zip(jaxpr.invars, env.arg_consts or ()):
      if value is not None:
        env.mark_const(env.values[var], value)

  def shared(self, env, jaxpr, config, prefix, base):
    return False

  def liveness(self, jaxpr):
    return None, None

  def describe(self, eq, eqn, reads):
    pass

  def first_order(self, env, eqn, invals, names, config, eq):
    region = config.region(names)
    if region is None or not region.full_precision:
      sub_computations.check(eqn, config.rules)
    if eq is not None and observe.in_float32(eq):  # An op-level island.
      return rules.run_in_float32(env, eqn, invals, config.rules, names,
                                  quiet=config.quiet)
    return rules.run(env, eqn, invals, config.rules, region, names,
                     quiet=config.quiet)

  def higher_order(self, env, eqn, invals, names, config, eq, rule):
    return rule(Scope(config, env, names, invals, eqn), eqn, invals)

  def reuses_traces(self):
    return False


@dataclasses.dataclass(frozen=True)
class Sharing(Rules):
  """The rules, with a deep model's identical layers interpreted once each
  and bound as calls of one body (`repeats`; `OpRules.with_sharing`)."""

  def shared(self, env, jaxpr, config, prefix, base):
    plan = repeats.plan(jaxpr, prefix, config.region, env.full_only)
    if plan is None:
      return False

    def evaluate(inner: Env, run: repeats.Repeat) -> list:
      inner.full_only = env.full_only
      inner.keys_from(env)
      here = jax_compat.current_name_stack()
      for eqn in jaxpr.eqns[run.start:run.end]:
        _eval_eqn(inner, eqn, config, prefix, here, drop=run.depth)
      return [inner.read(v) for v in run.outputs]

    # Watched, every layer runs where it stands; the observers are told
    # which would share a body.
    watched = observe.active()
    bodies: dict[Any, list[str]] = {}
    for item in plan:
      if not isinstance(item, repeats.Repeat):
        _eval_eqn(env, jaxpr.eqns[item], config, prefix, base)
        continue
      if watched:
        bodies.setdefault(repeats.body_key(item, env), []).append(item.scope)
        for eqn in jaxpr.eqns[item.start:item.end]:
          _eval_eqn(env, eqn, config, prefix, base)
        continue
      with jax_compat.eqn_context_under(base, jaxpr.eqns[item.start],
                                        keep=item.depth):
        outs = repeats.call(item, env, config.shared, evaluate, Env)
      env.values.update(zip(item.outputs, outs))
    for scopes in bodies.values():
      if len(scopes) > 1:
        observe.shared(tuple(scopes))
    return True

  def reuses_traces(self):
    return not observe.active()  # Watched, each call site is a row.


def rules_mode(table: op_rules_lib.OpRules) -> Mode:
  """The mode that runs under ``table``: `Sharing` unless it says not."""
  return Sharing() if table.sharing else Rules()


def _read_only_by_full(jaxpr, rules) -> set:
  """The variables of ``jaxpr`` read only in float32: by first-order `full`
  ops or by casts to float32 (as `jnp.sum` of a half array casts)."""
  readers: dict[Any, bool] = {}
  for eqn in jaxpr.eqns:
    full = ((rules.class_of(eqn.primitive.name) == op_rules_lib.FULL
             and higher_order.rule_for(eqn.primitive) is None)
            or (facts_lib.of(eqn.primitive).casts
                and jax_compat.cast_target(eqn)[0] == jnp.float32))
    for v in eqn.invars:
      if not isinstance(v, jax_compat.Literal):
        readers[v] = readers.get(v, True) and full
  for v in jaxpr.outvars:
    if not isinstance(v, jax_compat.Literal):
      readers[v] = False
  return {v for v, only_full in readers.items() if only_full}


# --- Replaying a program as written -------------------------------------------


@dataclasses.dataclass(frozen=True)
class Replay(Mode):
  """A program run as written (see `replay`): no region governs, no rule
  applies, loops are stepped through; where it runs.

  Attributes:
    iteration: the loop iteration (``None``: outside loops).
    device: the `shard_map` device (a traced index inside its body).
    transforms: the transforms on the name stack above it.
    traced: inside a body traced once for every device.
    outs_read: per output, whether the forward pass reads it (``None``:
      all of them, outside a backward pass).
    binds: primitive -> ``bind(eqn, invals)`` (see `replay_binding`).
  """
  iteration: Optional[int] = None
  device: Any = None
  transforms: tuple[str, ...] = ()
  traced: bool = False
  outs_read: Optional[tuple[bool, ...]] = None
  binds: Any = None

  def region(self, config, names):
    return None  # Nothing governs.

  def enter(self, env, jaxpr, consts, config):
    pass  # No rule reads the marks.

  def shared(self, env, jaxpr, config, prefix, base):
    return False

  def liveness(self, jaxpr):
    """What equations outside a backward pass read (and the outputs that
    `outs_read` says are read), then `_dead_after`."""
    outs_read = self.outs_read
    if outs_read is None:
      outs_read = ("transpose" not in self.transforms,) * len(jaxpr.outvars)
    reads = {v for v, read in zip(jaxpr.outvars, outs_read)
             if read and not isinstance(v, jax_compat.Literal)}
    for eqn in jaxpr.eqns:
      if "transpose" not in self.transforms + jax_compat.eqn_transforms(eqn):
        reads.update(v for v in eqn.invars
                     if not isinstance(v, jax_compat.Literal))
    return reads, _dead_after(jaxpr)

  def describe(self, eq, eqn, reads):
    eq.iteration, eq.device, eq.traced = (self.iteration, self.device,
                                          self.traced)
    eq.transforms = self.transforms + jax_compat.eqn_transforms(eqn)
    eq.outs_read = tuple(v in reads for v in eqn.outvars)
    eq.feeds_forward = any(eq.outs_read) or bool(eqn.effects)  # A write.

  def first_order(self, env, eqn, invals, names, config, eq):
    return self.higher_order(env, eqn, invals, names, config, eq, None)

  def higher_order(self, env, eqn, invals, names, config, eq, rule):
    """As `binds` says, by its step rule (`stepping`), else as one."""
    bind = (self.binds or {}).get(eqn.primitive)
    if bind is not None:
      return list(bind(eqn, invals))
    step_rule = (None if rule is None else
                 stepping.rule_for(eqn.primitive, self.traced))
    if step_rule is not None:
      reads = None if eq is None else eq.outs_read
      outs = step_rule(Stepper(config, self, names, eqn, eq, reads), eqn, invals)
      if outs is not None:
        if eq is not None:
          eq.stepped = True
        return list(outs)
    out = jax_compat.bind(eqn.primitive, invals, eqn.params)
    return list(out) if eqn.primitive.multiple_results else [out]

  def reuses_traces(self):
    return False


def replay(closed: jax_compat.ClosedJaxpr, args) -> list:
  """Runs ``closed`` as written, one equation at a time, eagerly.

  No rule applies: each first-order equation is bound as it is (one
  executable per primitive and shape, none the program's size), a
  higher-order one stepped through by its step rule (`stepping`). Observers
  see every equation with concrete values, iteration and device: the
  debugger checks programs so.
  """
  config = Config(rules=op_rules_lib.DEFAULT_RULES, outer=None,
                  mode=Replay())
  return eval_jaxpr(closed.jaxpr, list(closed.consts), list(args), config,
                    ())


def replay_binding(closed: jax_compat.ClosedJaxpr, args, binds) -> list:
  """Runs ``closed`` on ``args`` as written, untold to observers, binding
  the primitives of ``binds`` (primitive -> ``bind(eqn, invals)``) as it
  says: for an op rule reusing JAX's rule (a convolution's transpose)."""
  config = Config(rules=op_rules_lib.DEFAULT_RULES, outer=None, quiet=True,
                  mode=Replay(binds=binds))
  with observe.unwatched():
    return eval_jaxpr(closed.jaxpr, list(closed.consts), list(args), config,
                      ())


amp_primitive.install_replay(replay_binding)


class Stepper:
  """What a step rule needs: running a body, reporting moved values."""

  def __init__(self, config: Config, mode: Replay, names, eqn, eq,
               outs_read):
    self._config, self._mode, self._names, self._eq = config, mode, names, eq
    self.eqn = eqn
    self.outs_read = list(outs_read or [True] * len(eqn.outvars))

  def run(self, sub, args, *, iteration=None, traced=False,
          outs_read=None) -> list:
    """Replays ``sub`` (an open or closed jaxpr) on ``args``."""
    jaxpr, consts = ((sub.jaxpr, list(sub.consts)) if hasattr(sub, "consts")
                     else (sub, []))
    mode = self._mode
    inner = dataclasses.replace(
        mode, transforms=mode.transforms + jax_compat.eqn_transforms(self.eqn),
        iteration=mode.iteration if iteration is None else iteration,
        traced=mode.traced or traced,
        outs_read=tuple(self.outs_read if outs_read is None else outs_read))
    return eval_jaxpr(jaxpr, consts, list(args),
                      dataclasses.replace(self._config, mode=inner),
                      self._names)

  def moved(self, source, value) -> None:
    if self._eq is not None:
      observe.moved(self._eq, source, value)

  def per_device(self, index):
    """A block around the tracing of a `shard_map` body (device ``index``,
    traced); ``as`` gives a function returning the array the observers
    carry out of it, one row per device once the body has run."""
    self._mode = dataclasses.replace(self._mode, device=index)
    return observe.per_device(self._eq)

  def devices_ran(self, carried, outs) -> None:
    observe.devices_ran(self._eq, carried, outs)


def _dead_after(jaxpr) -> list[list]:
  """Per equation of ``jaxpr``, the variables no later equation (and no
  output) reads: a replay drops them once it has run that equation."""
  last = {}
  for n, eqn in enumerate(jaxpr.eqns):
    for var in (*eqn.invars, *eqn.outvars):
      if not isinstance(var, (jax_compat.Literal, jax_compat.DropVar)):
        last[var] = n
  for var in jaxpr.outvars:
    last.pop(var, None)
  found: list[list] = [[] for _ in jaxpr.eqns]
  for var, n in last.items():
    found[n].append(var)
  return found
