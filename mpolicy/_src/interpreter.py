"""The interpreter: re-runs a traced function, one rule per primitive.

`amp(fn)` traces ``fn`` to a jaxpr and evaluates it equation by equation on
whatever trace it is called under (eager, `jit`, `grad`, `vmap`, ...). For
each equation it reads the region that governs it (from the name stack: the
Haiku bridge's markers, `full_precision()` blocks, named scopes matching a
registry pattern, or `amp`'s own ``policy``), looks the primitive up in the
`OpRules` table and binds it in the dtype the rule gives:

* ``lower`` (matmul, convolution): inputs cast to the compute dtype of the
  governing policy, float32 accumulation; run as written where no policy
  governs or the compute dtype is float32. Under a float8 policy (``c=f8``)
  matmuls and convolutions run in `fp8` (per-tensor scaled float8), and
  every other op as under ``c=bf16``.
* ``full`` (exp, log, sums, ...): half inputs cast to float32, governed or
  not; the result stays float32, as with autocast. Under a bfloat16 policy
  (bfloat16 has float32's range) an element-wise ``full`` op on a bfloat16
  value computes in float32 and stores its result, and the derivative the
  backward pass keeps, in bfloat16, unless only float32 readers (sums,
  casts to float32) use it.
* ``promote``: the widest floating dtype among the inputs.
* anything else: the dtype of its inputs. Where floating inputs disagree,
  literals follow the arrays; parameters and inputs (arrays that entered
  the call, and reshapes, broadcasts, transposes and slices of them) are
  used in the compute dtype; otherwise the widest dtype wins (so
  ``x - mean(x)`` runs in float32). Under a bfloat16 policy, a ``mul`` or
  ``div`` of a bfloat16 value by a float32 statistic (softmax's division by
  its sum) computes in float32 and stores its result in bfloat16. If JAX
  rejects the re-typed equation, it runs on inputs cast back to the dtypes
  it was traced with.

Casts are cached per (value, dtype), so a parameter used three times is cast
once, and an up-cast remembers its half source so casting back is free.
Higher-order primitives are rebuilt around interpreted sub-jaxprs by the one
table in `higher_order`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
import contextlib
import dataclasses
import functools
import threading
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from mpolicy._src import fp8
from mpolicy._src import higher_order
from mpolicy._src import jax_compat
from mpolicy._src import lowp
from mpolicy._src import op_rules as op_rules_lib
from mpolicy._src import policy as policy_lib
from mpolicy._src import regions
from mpolicy._src import registry

AMP_ATTRIBUTE = "__mpolicy_amp__"

# Primitives that reinterpret bits or make random numbers: their floating
# inputs (if any) must keep the dtype they were traced with.
_AS_TRACED = frozenset({jax_compat.bitcast_convert_type_p})

# Primitives whose result is a re-arrangement of (part of) their first
# input: a parameter or input reshaped, broadcast, transposed or sliced is
# still a parameter or input (see `_Env.is_param`).
_SHAPE_OPS = frozenset({
    "reshape", "broadcast_in_dim", "transpose", "squeeze", "expand_dims",
    "slice", "dynamic_slice", "gather", "rev", "copy", "copy_p", "device_put",
    "sharding_constraint"})

# `full` primitives that act element by element. Under a bfloat16 policy
# they compute in float32 and store their result in bfloat16 (see
# `_first_order`); reductions, scans and linear algebra keep float32 results.
_ELEMENTWISE_FULL = frozenset({
    "exp", "exp2", "expm1", "log", "log1p", "pow", "integer_pow", "square",
    "rsqrt", "sqrt", "cbrt", "erf", "erfc", "erf_inv", "lgamma", "digamma",
    "polygamma", "igamma", "igammac", "zeta", "regularized_incomplete_beta",
    "bessel_i0e", "bessel_i1e", "acos", "asin", "atan", "acosh", "asinh",
    "atanh", "cosh", "sinh", "tan", "tanh", "logistic", "sin", "cos"})

# Ops whose result has a small relative error whatever their operands'
# magnitudes (no cancellation): a float32 one storing its result in
# bfloat16 loses only that one rounding.
_SCALING = frozenset({"mul", "div"})

# Primitives with a dtype parameter that follows their inputs: when the
# inputs change dtype, the parameter follows (if it was the input dtype).
_ACCUMULATING = frozenset({jax_compat.dot_general_p,
                           jax_compat.conv_general_dilated_p})

# Primitives whose transpose sums the cotangent (over broadcast dims, into
# gathered rows): given a value cast down from float32, they run on the
# float32 value and cast their result, so their gradients sum in float32.
_SUMMING_TRANSPOSE = frozenset({jax_compat.broadcast_in_dim_p,
                                jax_compat.gather_p})


# --- Recording (read by `explain`) -------------------------------------------


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
      ``"explicit cast"``, ``"as written"`` or ``"custom"`` (a function
      given by `OpRules.with_rule`, named in ``decided_by``).
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


class _Recording(threading.local):
  rows: Optional[list[Decision]] = None
  runs: int = 0


_recording = _Recording()


@contextlib.contextmanager
def recording() -> Iterator[list[Decision]]:
  """Collects a `Decision` per equation interpreted inside the block."""
  prev_rows, prev_runs = _recording.rows, _recording.runs
  rows: list[Decision] = []
  _recording.rows, _recording.runs = rows, 0
  try:
    yield rows
  finally:
    _recording.rows, _recording.runs = prev_rows, prev_runs


def interpreter_ran() -> bool:
  """Whether `interpret`-ed code was traced inside the current `recording`."""
  return _recording.runs > 0


# --- Dtype helpers -----------------------------------------------------------


def _dtype(x) -> np.dtype:
  dtype = getattr(x, "dtype", None)
  return np.asarray(x).dtype if dtype is None else dtype


def _is_float(dtype) -> bool:
  return jnp.issubdtype(dtype, jnp.floating)


def _is_half(dtype) -> bool:
  return _is_float(dtype) and np.dtype(dtype).itemsize < 4


def _is_double(dtype) -> bool:
  """float64 (under x64): never narrowed, and not eligible for ``lower``."""
  return _is_float(dtype) and np.dtype(dtype).itemsize > 4


def _widest(dtypes: Sequence[np.dtype]) -> np.dtype:
  """The dtype JAX promotes ``dtypes`` to (bfloat16 with float16: float32)."""
  return np.dtype(functools.reduce(jnp.promote_types, dtypes))


def _is_traced(x) -> bool:
  return isinstance(x, jax.Array) or isinstance(x, jax_compat.Tracer)


# --- The environment ----------------------------------------------------------


class _Env:
  """Values of one jaxpr's variables, and the casts made of them.

  It also knows which values are parameters or inputs: the arrays that
  entered the `amp` call (arguments, closed-over constants) and reshapes,
  broadcasts, transposes and slices of them. Where such a value is wider
  than the governing compute dtype and meets half values in an op without a
  rule, it is used in the compute dtype (as Haiku's policies cast
  parameters), so ``x @ w + b`` adds the bias in half.
  """

  def __init__(self):
    self.values: dict[Any, Any] = {}
    self._casts: dict[tuple[int, np.dtype], Any] = {}
    self._wider: dict[int, Any] = {}  # Down-cast value -> its source.
    self._keep: list[Any] = []  # Keeps ids in `_casts` alive.
    self._params: set[int] = set()  # Ids of parameters and inputs.
    # Which of the jaxpr's invars are parameters or inputs (``None``: all,
    # as at the top of an `amp` call).
    self.arg_params: Optional[Sequence[bool]] = None
    # Variables read only by `full` ops (they keep float32 results).
    self.full_only: set[Any] = set()
    self.inserted = 0

  def mark_param(self, x) -> None:
    """Records ``x`` as a parameter or input."""
    if _is_traced(x) and _is_float(_dtype(x)):
      self._params.add(id(x))
      self._keep.append(x)

  def is_param(self, x) -> bool:
    return _is_traced(x) and id(x) in self._params

  def read(self, var):
    if isinstance(var, jax_compat.Literal):
      return var.val
    return self.values[var]

  def cast(self, x, dtype):
    """``x`` as ``dtype``, made at most once per (value, dtype)."""
    dtype = np.dtype(dtype)
    src = _dtype(x)
    if src == dtype:
      return x
    if not _is_traced(x):  # Literals and numpy consts: fold now.
      return np.asarray(x).astype(dtype)
    key = (id(x), dtype)
    hit = self._casts.get(key)
    if hit is not None:
      return hit
    y = jax.lax.convert_element_type(x, dtype)
    self._casts[key] = y
    self._keep += [x, y]
    self.inserted += 1
    if _is_float(src) and _is_float(dtype):
      if dtype.itemsize > src.itemsize:
        self._casts[(id(y), src)] = x  # Exact up-cast: casting back is free.
      else:
        self._wider[id(y)] = x
    return y

  def wider_source(self, x):
    """The wider float value ``x`` was cast down from here, else ``x``."""
    return self._wider.get(id(x), x)


# --- Configuration of one run -------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Config:
  rules: op_rules_lib.OpRules
  outer: Optional[regions.Region]
  quiet: bool = False
  # Regions already resolved in this run, by scope names (one registry
  # look-up per scope rather than per equation).
  region_cache: dict = dataclasses.field(default_factory=dict, compare=False)

  def region(self, names: tuple[str, ...]) -> Optional[regions.Region]:
    try:
      return self.region_cache[names]
    except KeyError:
      region = registry.region_for_scopes(names, outer=self.outer)
      self.region_cache[names] = region
      return region


class Scope:
  """What a higher-order rule needs: tracing and casting at its call site.

  Attributes:
    names: the plain scope names of the higher-order equation (the prefix of
      every equation inside its sub-jaxprs).
  """

  def __init__(self, config: _Config, env: _Env, names: tuple[str, ...],
               invals: Sequence[Any] = (), eqn_params=None):
    self._config = config
    self._env = env
    self.names = names
    self._invals = list(invals)
    self._eqn_params = eqn_params

  def _arg_params(self, in_avals, eqn_params) -> list[bool]:
    """Which sub-jaxpr inputs are parameters or inputs of the `amp` call.

    Operands map onto a sub-jaxpr's inputs one to one (`jit`, `checkpoint`,
    `scan`, `shard_map`, a `custom_jvp` primal), or after the index (`cond`);
    other layouts (a `while` cond, a JVP rule) get no parameters.
    """
    flags = [self._env.is_param(x) for x in self._invals]
    if len(in_avals) == len(flags):
      out = flags
    elif len(in_avals) == len(flags) - 1:
      out = flags[1:]
    else:
      return [False] * len(in_avals)
    if eqn_params is not None and "num_carry" in eqn_params:
      # Loop carries change from one iteration to the next.
      start = eqn_params["num_consts"]
      out = list(out)
      out[start:start + eqn_params["num_carry"]] = (
          [False] * eqn_params["num_carry"])
    return out

  def cast(self, x, dtype):
    """``x`` cast to ``dtype`` (cached) if it is floating, else ``x``."""
    if dtype is None or not _is_float(_dtype(x)) or not _is_float(dtype):
      return x
    return self._env.cast(x, dtype)

  def trace(self, closed, in_avals, out_dtypes=None, *,
            quiet: bool = False,
            cast_inputs_to=None) -> jax_compat.ClosedJaxpr:
    """Interprets ``closed`` at ``in_avals`` into a new closed jaxpr.

    ``out_dtypes``, when given, fixes the dtype of each floating output
    (``None`` entries are left as they come); ``cast_inputs_to`` likewise
    casts the inputs to the dtypes of these avals first. ``quiet`` keeps the
    equations out of `explain` (for probes and lazily traced rules).
    """
    config = dataclasses.replace(self._config,
                                 quiet=self._config.quiet or quiet)
    names = self.names
    arg_params = self._arg_params(in_avals, self._eqn_params)

    def run(*args):
      env = _Env()
      env.arg_params = arg_params
      if cast_inputs_to is not None:
        args = [env.cast(a, d.dtype) if _is_float(_dtype(a)) else a
                for a, d in zip(args, cast_inputs_to)]
      outs = _eval_jaxpr(closed.jaxpr, closed.consts, args, config, names, env)
      if out_dtypes is not None:
        outs = [o if d is None or not _is_float(_dtype(o)) else env.cast(o, d)
                for o, d in zip(outs, out_dtypes)]
      return outs

    return jax_compat.trace_to_closed_jaxpr(run, in_avals, like=closed.jaxpr)


# --- The loop -----------------------------------------------------------------


def _eval_jaxpr(jaxpr, consts, args, config: _Config,
                prefix: tuple[str, ...], env: Optional[_Env] = None) -> list:
  env = _Env() if env is None else env
  base = jax_compat.current_name_stack()
  env.values.update(zip(jaxpr.constvars, consts))
  env.values.update(zip(jaxpr.invars, args))
  for x in consts:
    env.mark_param(x)
  env.full_only = _read_only_by_full(jaxpr, config.rules)
  flags = env.arg_params
  for var, flag in zip(jaxpr.invars, flags or [True] * len(jaxpr.invars)):
    if flag:
      env.mark_param(env.values[var])
  for eqn in jaxpr.eqns:
    invals = [env.read(v) for v in eqn.invars]
    names = prefix + jax_compat.eqn_scope_names(eqn)
    with jax_compat.eqn_context_under(base, eqn):
      rule = higher_order.rule_for(eqn.primitive)
      if rule is not None:
        outs = rule(Scope(config, env, names, invals, eqn.params), eqn,
                    invals)
      else:
        region = config.region(names)
        if region is None or not region.full_precision:
          higher_order.check_first_order(eqn)
        outs = _first_order(config, env, eqn, invals, names, region)
    for var, out in zip(eqn.outvars, outs):
      if not isinstance(var, jax_compat.DropVar):
        env.values[var] = out
  return [env.read(v) for v in jaxpr.outvars]


def _read_only_by_full(jaxpr, rules) -> set:
  """The variables of ``jaxpr`` read only in float32: by first-order `full`
  ops or by casts to float32 (as `jnp.sum` of a half array casts)."""
  readers: dict[Any, bool] = {}
  for eqn in jaxpr.eqns:
    full = ((rules.class_of(eqn.primitive.name) == op_rules_lib.FULL
             and higher_order.rule_for(eqn.primitive) is None)
            or (eqn.primitive is jax_compat.convert_element_type_p
                and np.dtype(eqn.params["new_dtype"]) == jnp.float32))
    for v in eqn.invars:
      if not isinstance(v, jax_compat.Literal):
        readers[v] = readers.get(v, True) and full
  for v in jaxpr.outvars:
    if not isinstance(v, jax_compat.Literal):
      readers[v] = False
  return {v for v, only_full in readers.items() if only_full}


def _bind(eqn, args, params=None) -> list:
  params = eqn.params if params is None else params
  out = eqn.primitive.bind(*args, **params)
  return list(out) if eqn.primitive.multiple_results else [out]


def _follow_inputs(eqn, args) -> dict:
  """``eqn.params`` with accumulation dtypes following re-typed inputs."""
  params = eqn.params
  if eqn.primitive in _ACCUMULATING:
    pet = params.get("preferred_element_type")
    traced = eqn.invars[0].aval.dtype
    now = _dtype(args[0])
    if pet is not None and np.dtype(pet) == traced and now != traced:
      params = dict(params, preferred_element_type=now)
  return params


def _bind_natural(env: _Env, eqn, args) -> tuple[list, bool]:
  """Binds on ``args`` as they are; if JAX refuses, at the traced dtypes."""
  traced = [v.aval.dtype for v in eqn.invars]
  if all(_dtype(a) == t for a, t in zip(args, traced)):
    return _bind(eqn, args), True
  try:
    return _bind(eqn, args, _follow_inputs(eqn, args)), True
  except Exception:  # pylint: disable=broad-except
    # JAX refused the re-typed equation (e.g. a reduce whose combiner is
    # typed): run it exactly as traced.
    return _bind(eqn, [_cast_as_traced(env, a, t)
                       for a, t in zip(args, traced)]), False


def _cast_as_traced(env: _Env, x, dtype):
  return env.cast(x, dtype) if _dtype(x) != dtype else x


def _unify(env: _Env, eqn, args, target) -> list:
  return [env.cast(a, target) if _is_float(_dtype(a)) else a for a in args]


def _bf16_storage(policy) -> Optional[np.dtype]:
  """bfloat16 where a bfloat16 policy governs, else ``None``."""
  if policy is None or np.dtype(policy.compute_dtype) != jnp.bfloat16:
    return None
  return np.dtype(jnp.bfloat16)


def _scaled_half(env: _Env, eqn, args, half):
  """``(x, s, x_first)`` if a `mul`/`div` scales a ``half`` array ``x`` by
  a float32 array ``s`` that is no parameter (for `div`, ``x / s``)."""
  if len(args) != 2 or any(isinstance(v, jax_compat.Literal)
                           or not _is_traced(a)
                           for v, a in zip(eqn.invars, args)):
    return None
  a, b = args
  for x, s, x_first in ((a, b, True), (b, a, False)):
    if (_dtype(x) == half and _dtype(s) == jnp.float32
        and not env.is_param(s)
        and (x_first or eqn.primitive.name == "mul")):
      return x, s, x_first
  return None


def _widen_params(env: _Env, eqn, args, target) -> list:
  """Parameters about to be cast down to ``target`` that the op would
  broadcast (a ``[1, n]`` bias added to ``[b, n]``) are broadcast first, in
  their own dtype: under grad the sum over the broadcast dims then runs in
  float32 instead of in half."""
  if len(eqn.outvars) != 1:
    return args
  shape = tuple(eqn.outvars[0].aval.shape)
  out = []
  for a in args:
    if (env.is_param(a) and _dtype(a) != target and np.ndim(a) == len(shape)
        and tuple(np.shape(a)) != shape):
      a = jax.lax.broadcast_in_dim(a, shape, tuple(range(len(shape))))
    out.append(a)
  return out


def _array_target(eqn, args, env: Optional[_Env] = None,
                  compute=None) -> Optional[np.dtype]:
  """The dtype disagreeing floating inputs meet at.

  Literals follow the arrays. With a half ``compute`` dtype, parameters and
  inputs (`_Env.is_param`) wider than it count as ``compute``: they are used
  in the compute dtype, not the other way round.
  """
  arrays, followers, actual = [], [], set()
  for var, a in zip(eqn.invars, args):
    d = _dtype(a)
    if not _is_float(d):
      continue
    actual.add(np.dtype(d))
    weak = isinstance(var, jax_compat.Literal) or getattr(var.aval, "weak_type",
                                                          False)
    if (compute is not None and env is not None and env.is_param(a)
        and np.dtype(d).itemsize > np.dtype(compute).itemsize):
      d = np.dtype(compute)
    (followers if weak or not _is_traced(a) and np.ndim(a) == 0
     else arrays).append(d)
  pool = arrays or followers
  if len(actual) <= 1:
    return None
  return _widest(pool)


def _first_order(config: _Config, env: _Env, eqn, invals, names,
                 region: Optional[regions.Region]) -> list:
  prim = eqn.primitive
  custom = config.rules.rule_of(prim.name)
  if custom is not None and (region is None or not region.full_precision):
    return _run_custom(config, eqn, invals, names, region, custom)
  casts_before = env.inserted
  ran_in = None  # Set where the op runs in another dtype than its args.
  op_class = config.rules.class_of(prim.name)
  policy = region.policy if region is not None else None
  fp8_dtype = None
  if policy is not None and policy_lib.is_fp8(policy.compute_dtype):
    # A float8 policy: matmuls and convolutions go to `fp8`, everything
    # else runs as under the policy's elementwise (bfloat16) compute dtype.
    fp8_dtype = np.dtype(policy.compute_dtype)
    policy = policy_lib.Policy(policy.param_dtype,
                               policy_lib.elementwise_dtype(policy),
                               policy.output_dtype)
  args = list(invals)

  if region is not None and region.full_precision:
    rule, why = "as written", "full_precision()"
    op_class = None
  else:
    rule, why = "inputs", "no rule: runs in its inputs' dtype"

  if prim is jax_compat.convert_element_type_p and _plain_convert(eqn):
    outs = [env.cast(args[0], eqn.params["new_dtype"])]
    rule, why = "explicit cast", "convert_element_type in the traced code"
  elif prim in _AS_TRACED:
    outs = _bind(eqn, [_cast_as_traced(env, a, v.aval.dtype)
                       for a, v in zip(args, eqn.invars)])
    rule, why = "as written", "reinterprets bits: runs as traced"
  elif (fp8_dtype is not None and op_class == op_rules_lib.LOWER
        and rule != "as written" and fp8.handles(eqn, args)):
    # Quantized from the widest value at hand (a float32 parameter's
    # gradient then comes back in float32; only float8 copies are saved).
    outs = fp8.run_equation(eqn, [env.wider_source(a) for a in args],
                            policy.compute_dtype)
    rule, ran_in = "lower", fp8_dtype.name
    why = f"lower in {fp8_dtype.name} ({fp8.REASON}); policy from {region.decided_by}"
  elif (op_class == op_rules_lib.LOWER and policy is not None
        and _is_half(policy.compute_dtype)
        and any(_is_float(_dtype(a)) for a in args)
        and not any(_is_double(_dtype(a)) for a in args)):
    compute = np.dtype(policy.compute_dtype)
    args = [env.cast(a, compute) if _is_float(_dtype(a)) else a for a in args]
    outs = _lower(env, eqn, args, compute)
    rule = "lower"
    why = f"lower ({config.rules.reason_of(prim.name)}); policy from {region.decided_by}"
  elif op_class == op_rules_lib.FULL:
    rule, why = "full", f"full: {config.rules.reason_of(prim.name)}"
    store = _bf16_storage(policy)
    floats = [a for a in args if _is_float(_dtype(a))]
    if (store is not None and prim.name in _ELEMENTWISE_FULL
        and len(eqn.outvars) == 1 and len(floats) == 1
        and _dtype(floats[0]) == store and _is_traced(floats[0])
        and eqn.outvars[0] not in env.full_only):
      # bfloat16 has float32's range: rounding the float32 result to it
      # loses one rounding, as any bfloat16 activation does, and under
      # grad what is saved for the backward pass is half as big. (Read
      # only by other `full` ops, the result stays float32.)
      i = next(i for i, a in enumerate(args) if _is_float(_dtype(a)))
      fn = lambda v: _bind(eqn, [*args[:i], v, *args[i + 1:]])[0]
      outs = [lowp.unary_in_float32(fn, args[i], store)]
      ran_in = "float32"
      why += "; computed in float32, stored in bfloat16"
    else:
      args = [env.cast(a, jnp.float32) if _is_half(_dtype(a)) else a
              for a in args]
      outs, _ = _bind_natural(env, eqn, args)
  elif (prim in _SUMMING_TRANSPOSE and rule != "as written"
        and op_class is None
        and env.wider_source(args[0]) is not args[0]):
    # A broadcast or gather of a value cast down from float32 (a bias, an
    # embedding table): run it on the float32 value, then cast. The values
    # are the same, and under grad the transpose (a sum over the broadcast
    # dims, a scatter-add into the table) accumulates in float32 instead of
    # in half. On GPUs a half scatter-add into a small table is also slow:
    # its atomics contend.
    wide = env.wider_source(args[0])
    outs = [env.cast(o, _dtype(args[0]))
            for o in _bind(eqn, [wide, *args[1:]])]
    why = (f"{prim.name} of a down-cast value: runs in its wider dtype, "
           "then cast (its gradient sums in float32)")
  else:
    if op_class == op_rules_lib.PROMOTE:
      floats = [_dtype(a) for a in args if _is_float(_dtype(a))]
      target = _widest(floats) if len(set(floats)) > 1 else None
      rule, why = "promote", f"promote: {config.rules.reason_of(prim.name)}"
    else:
      param_compute = None
      if (rule != "as written" and policy is not None
          and _is_half(policy.compute_dtype)):
        param_compute = np.dtype(policy.compute_dtype)
      target = _array_target(eqn, args, env, param_compute)
      if param_compute is not None and target == param_compute and any(
          env.is_param(a) and _dtype(a) != target
          for a in args if _is_float(_dtype(a))):
        why = ("parameters and inputs are used in the compute dtype "
               f"{target.name} (policy from {region.decided_by})")
      if op_class == op_rules_lib.LOWER and rule != "as written":
        why = ("lower op, but no half compute dtype governs: runs as written"
               if policy is None or not _is_half(policy.compute_dtype) else
               "lower op on float64: not eligible, runs as written")
    store = _bf16_storage(policy) if rule != "as written" else None
    scaled = (None if store is None or prim.name not in _SCALING
              or target != jnp.float32
              else _scaled_half(env, eqn, args, store))
    if scaled is not None:
      # A bfloat16 activation scaled by a float32 value that is no
      # parameter (softmax's division by its sum, typically): computed in
      # float32, stored in bfloat16. A product or quotient has no
      # cancellation, so the storage costs one rounding.
      x, s, x_first = scaled
      outs = [lowp.scale_in_float32(prim.name, x, s, store, x_first)]
      ran_in = "float32"
      why += ("; a bfloat16 value scaled by a float32 statistic: computed "
              "in float32, stored in bfloat16")
    else:
      if target is not None:
        args = _widen_params(env, eqn, args, target)
        args = _unify(env, eqn, args, target)
      outs, natural = _bind_natural(env, eqn, args)
      if not natural:
        why += " (JAX refused other dtypes: ran as traced)"

  if (prim.name in _SHAPE_OPS and invals and env.is_param(invals[0])
      and len(outs) == 1):
    env.mark_param(outs[0])

  if _recording.rows is not None and not config.quiet:
    ran = sorted({_dtype(a).name for a in args if _is_float(_dtype(a))})
    if not ran or rule == "explicit cast":  # A cast "runs in" its result.
      ran = sorted({_dtype(o).name for o in outs})
    if ran_in is not None:
      ran = [ran_in]
    _recording.rows.append(Decision(
        scope="/".join(regions.plain_scope_names(names)),
        module_class=region.module_class if region is not None else None,
        primitive=prim.name,
        in_dtypes=tuple(_dtype(a).name for a in invals),
        ran_in=",".join(ran) if ran else "-",
        rule=rule,
        decided_by=why,
        casts=env.inserted - casts_before))
  return outs


def _plain_convert(eqn) -> bool:
  params = eqn.params
  return (not params.get("weak_type", False)
          and params.get("sharding", None) is None)


def _lower(env: _Env, eqn, args, compute) -> list:
  """Runs a ``lower`` primitive in the half ``compute`` dtype."""
  prim = eqn.primitive
  args = [env.cast(a, compute) if _is_float(_dtype(a)) else a for a in args]
  if prim not in _ACCUMULATING or not all(_is_float(_dtype(a)) for a in args):
    outs, _ = _bind_natural(env, eqn, args)
    return outs
  out_dtype = compute
  pet = eqn.params.get("preferred_element_type")
  traced_in = eqn.invars[0].aval.dtype
  if pet is not None and np.dtype(pet).itemsize > np.dtype(traced_in).itemsize:
    out_dtype = np.dtype(pet)  # The user asked for a wider result: keep it.
  if prim is jax_compat.dot_general_p:
    # Operands cast down from float32 (a parameter, typically) go in as
    # float32: the primitive casts them itself, and their gradients then
    # come from its float32 accumulator, not rounded to half and back.
    # Only parameters and inputs: they are kept alive anyway, whereas
    # saving a float32 activation for the backward pass would double the
    # memory its half copy needs.
    lhs, rhs = (w if env.is_param(w := env.wider_source(a)) else a
                for a in args)
    return [lowp.amp_dot_general(
        lhs, rhs, dimension_numbers=eqn.params["dimension_numbers"],
        precision=eqn.params.get("precision"), out_dtype=out_dtype,
        compute_dtype=compute)]
  if eqn.params.get("out_sharding") is None:
    params = {k: v for k, v in eqn.params.items()
              if k not in ("preferred_element_type", "out_sharding")}
    return [lowp.amp_conv_general_dilated(args[0], args[1], **params,
                                          out_dtype=out_dtype)]
  # A convolution with an explicit output sharding (which the amp primitive
  # does not carry): float32 accumulation, then cast. Under grad its
  # backward convolutions see a float32 cotangent (see `lowp`).
  out = _bind(eqn, args, dict(eqn.params, preferred_element_type=jnp.float32))
  return [env.cast(o, out_dtype) for o in out]


def _run_custom(config: _Config, eqn, invals, names,
                region: Optional[regions.Region], fn) -> list:
  """Runs ``eqn`` as the custom rule ``fn`` says (see `OpRules.with_rule`)."""
  prim = eqn.primitive
  policy = region.policy if region is not None else None
  name = op_rules_lib.rule_name(fn)
  result = fn(policy, *invals, **eqn.params)
  outs = _check_custom_outputs(eqn, result, name)
  if _recording.rows is not None and not config.quiet:
    ran = sorted({_dtype(o).name for o in outs if _is_float(_dtype(o))})
    why = f"custom rule {name}"
    if region is not None:
      why += f"; policy from {region.decided_by}"
    _recording.rows.append(Decision(
        scope="/".join(regions.plain_scope_names(names)),
        module_class=region.module_class if region is not None else None,
        primitive=prim.name,
        in_dtypes=tuple(_dtype(a).name for a in invals),
        ran_in=",".join(ran) if ran else "-", rule="custom", decided_by=why,
        casts=0))
  return outs


def _check_custom_outputs(eqn, result, name: str) -> list:
  """A custom rule's ``result`` as a list, checked against ``eqn``'s outputs."""
  prim = eqn.primitive.name
  want = [v.aval for v in eqn.outvars]
  if eqn.primitive.multiple_results:
    if not isinstance(result, (tuple, list)):
      raise TypeError(
          f"custom rule {name} for {prim!r} returned {type(result).__name__}; "
          f"{prim!r} has {len(want)} results, so the rule must return a tuple "
          f"or list of {len(want)} arrays")
    outs = list(result)
  else:
    if isinstance(result, (tuple, list)):
      raise TypeError(
          f"custom rule {name} for {prim!r} returned a {type(result).__name__} "
          f"of {len(result)}; {prim!r} has one result, so the rule must "
          f"return one array")
    outs = [result]
  if len(outs) != len(want):
    raise ValueError(
        f"custom rule {name} for {prim!r} returned {len(outs)} outputs; the "
        f"primitive has {len(want)}")
  for i, (out, aval) in enumerate(zip(outs, want)):
    shape = getattr(out, "shape", None)
    if shape is None or not hasattr(out, "dtype"):
      raise TypeError(
          f"custom rule {name} for {prim!r}: output {i} is "
          f"{type(out).__name__}, not an array (return jax arrays, e.g. "
          f"from jax.lax or jax.numpy)")
    if tuple(shape) != tuple(aval.shape):
      raise ValueError(
          f"custom rule {name} for {prim!r}: output {i} has shape "
          f"{tuple(shape)}, the primitive's has {tuple(aval.shape)}; a rule "
          f"may choose the dtype, not the shape")
  return outs


# --- Entry points -------------------------------------------------------------


def _is_array_leaf(x) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, jax_compat.Tracer))


def _static_key(x) -> Any:
  """A key for a static leaf that tells apart what only compares equal.

  ``1``, ``1.0`` and ``True`` are equal in Python but trace to different
  programs, so the type is part of the key. Floats key by their bits, so
  ``0.0`` and ``-0.0`` differ and a NaN matches itself.
  """
  if isinstance(x, float):
    return (type(x), x.hex())
  if isinstance(x, complex):
    return (type(x), x.real.hex(), x.imag.hex())
  return (type(x), x)


class _Static:
  """Non-array arguments as a jit static argument.

  Compared by type and value (see `_static_key`), as `jax.jit` tells static
  arguments apart: a cache entry made for ``f(x, 2)`` is not reused for
  ``f(x, 2.0)``.
  """

  def __init__(self, leaves, treedef, traced):
    self.value = (leaves, treedef, traced)
    self._key = (tuple(_static_key(x) for x in leaves), treedef, traced)

  def hashable(self) -> bool:
    try:
      hash(self)
      return True
    except TypeError:
      return False

  def __hash__(self):
    return hash(self._key)

  def __eq__(self, other):
    return isinstance(other, _Static) and self._key == other._key


def _is_output_leaf(x) -> bool:
  return _is_array_leaf(x) or isinstance(x, (bool, int, float, complex,
                                             np.generic))


def _check_outputs(fn, out) -> None:
  """Raises a `TypeError` naming any output leaf JAX cannot return."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(out)[0]:
    if not _is_output_leaf(leaf):
      where = jax.tree_util.keystr(path) or "(the whole output)"
      name = getattr(fn, "__qualname__", None) or repr(fn)
      raise TypeError(
          f"amp: the output of {name} at {where} is {leaf!r} of type "
          f"{type(leaf).__module__}.{type(leaf).__qualname__}, which is not a "
          "valid JAX type. An amp-wrapped function may return only arrays, "
          "Python numbers and bools, and pytrees of them; return other "
          "values from outside it.")


_NNX_SPLIT_MERGE = """\
  graphdef, params, stats = nnx.split(model, nnx.Param, nnx.BatchStat)

  def forward(params, stats, x):
    model = nnx.merge(graphdef, params, stats)
    return model(x), nnx.state(model, nnx.BatchStat)

  y, stats = mpolicy.amp(forward, policy)(params, stats, x)
  nnx.update(model, stats)"""


def _trace_user_fn(flat_fn, in_avals):
  """Traces the user's function; explains what amp cannot trace.

  A Flax NNX module closed over by the function cannot update its own
  variables (BatchNorm statistics) inside amp's trace, which is a new trace
  level: Flax raises `TraceContextError`. That becomes a `TypeError` showing
  the split/merge form, which passes the state in and out explicitly.
  """
  try:
    return jax_compat.trace_to_closed_jaxpr(flat_fn, in_avals)
  except Exception as e:  # pylint: disable=broad-except
    if (type(e).__name__ != "TraceContextError"
        or not type(e).__module__.startswith("flax")):
      raise
    raise TypeError(
        "amp: the function updates a Flax NNX variable that was created "
        f"outside the amp call ({e}). amp traces the function on its own, so "
        "a module it closes over cannot update its state (e.g. BatchNorm "
        "statistics) in place. Pass the state in and out explicitly with "
        "nnx.split / nnx.merge (split off every variable type it updates, "
        "e.g. also nnx.RngState for dropout):\n\n"
        + _NNX_SPLIT_MERGE) from e


def interpret(fn: Callable[..., Any], *, policy=None,
              rules: Optional[op_rules_lib.OpRules] = None,
              cast_outputs: bool = True) -> Callable[..., Any]:
  """``fn`` re-run under the op rules (the engine behind `amp`).

  Array leaves of the arguments (JAX and numpy arrays, tracers) are traced;
  every other leaf (Python scalars and bools, strings, None, objects) is
  passed through as a static value.

  Args:
    fn: any JAX function.
    policy: a `Policy` or spec string that governs the whole call, or
      ``None`` (then only regions tagged by the Haiku bridge, registry name
      patterns and the ``full`` rule change anything).
    rules: the `OpRules` table; `DEFAULT_RULES` if ``None``.
    cast_outputs: if ``True``, floating outputs are cast to ``policy``'s
      output dtype (to the dtypes ``fn`` itself returns when no policy is
      given). If ``False``, they are cast back to the dtypes ``fn`` itself
      returns, so the interpreted function has ``fn``'s exact signature (the
      Haiku bridge: module outputs already follow their policies).

  Returns:
    The interpreted function, marked so that `explain` recognises it.
  """
  rules = op_rules_lib.DEFAULT_RULES if rules is None else rules
  if not isinstance(rules, op_rules_lib.OpRules):
    raise TypeError(f"rules must be an OpRules table, got {rules!r}")
  pol = None if policy is None else policy_lib.get_policy(policy)
  outer = (None if pol is None else
           regions.Region(policy=pol, decided_by=f"amp(policy={pol})"))
  config = _Config(rules=rules, outer=outer)

  def run(leaves, treedef, traced, arrays):
    out_trees = []

    def flat_fn(*arrs):
      it = iter(arrs)
      full = [next(it) if t else x for x, t in zip(leaves, traced)]
      a, k = jax.tree_util.tree_unflatten(treedef, full)
      out = fn(*a, **k)
      _check_outputs(fn, out)
      outs, out_tree = jax.tree_util.tree_flatten(out)
      out_trees.append(out_tree)
      return outs

    # Traced at the arguments' own avals, so that what `make_jaxpr` would
    # drop is kept: inside `shard_map`, which mesh axes a value varies over
    # (JAX then inserts the `pvary`s that mixing varying and replicated
    # values needs).
    closed = _trace_user_fn(flat_fn, [jax_compat.aval_of(a) for a in arrays])
    out_avals, out_tree = closed.out_avals, out_trees[-1]
    _recording.runs += 1
    env = _Env()
    outs = _eval_jaxpr(closed.jaxpr, closed.consts, arrays,
                       dataclasses.replace(config, region_cache={}),
                       jax_compat.current_scope_names(), env)
    final = []
    for out, aval in zip(outs, out_avals):
      target = aval.dtype
      if (cast_outputs and pol is not None
          and not (_is_double(_dtype(out)) and not _is_double(
              pol.output_dtype))):
        # float64 outputs are never narrowed to the policy's output dtype.
        target = pol.output_dtype
      if _is_float(_dtype(out)) and _is_float(target):
        out = env.cast(out, target)
      final.append(out)
    return jax.tree_util.tree_unflatten(out_tree, final)

  # Called eagerly, the interpreted program is compiled once per signature
  # rather than dispatched primitive by primitive.
  # The registry's state is part of JAX's cache key (see `registry`), so a
  # change of it retraces this and any enclosing `jax.jit`.
  jitted = jax.jit(lambda static, arrays: run(*static.value, arrays),
                   static_argnums=0)

  @functools.wraps(fn)
  def interpreted(*args, **kwargs):
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    traced = tuple(_is_array_leaf(x) for x in leaves)
    arrays = [x for x, t in zip(leaves, traced) if t]
    if not any(isinstance(x, jax_compat.Tracer) for x in arrays):
      static = _Static(tuple(None if t else x for x, t in zip(leaves, traced)),
                       treedef, traced)
      if static.hashable():
        return jitted(static, arrays)
    return run(leaves, treedef, traced, arrays)

  setattr(interpreted, AMP_ATTRIBUTE, (pol, rules))
  return interpreted


def amp(fn: Callable[..., Any], policy=None, *,
        rules: Optional[op_rules_lib.OpRules] = None) -> Callable[..., Any]:
  """Runs each primitive of ``fn`` in the dtype the op rules give it.

  Like PyTorch autocast: matmuls and convolutions run in ``policy``'s compute
  dtype with float32 accumulation, fragile ops (exp, log, sums, ...) in
  float32, everything else in the dtype of its inputs. Inputs are not cast
  wholesale; floating outputs are cast to ``policy``'s output dtype. Under
  x64, float64 values are never narrowed: ops on them are not eligible for
  the compute dtype and float64 outputs stay float64, so ``amp(f, "full")``
  computes exactly what ``f`` does. Works
  under `jit`, `grad`, `vmap`, `pmap` and inside `shard_map`; the rules
  reach into nested `jit`, `scan`, `while_loop`, `cond`, `checkpoint`,
  `custom_jvp` and `custom_vjp`.

  >>> import jax, jax.numpy as jnp
  >>> f = amp(lambda x, w: jax.nn.relu(x @ w), "p=f32,c=bf16,o=f32")
  >>> f(jnp.ones((2, 3)), jnp.ones((3, 4))).dtype
  dtype('float32')
  >>> jax.make_jaxpr(f)(jnp.ones((2, 3)), jnp.ones((3, 4))).eqns[2].primitive
  amp_dot_general

  Args:
    fn: any JAX function (plain JAX, Flax, Equinox).
    policy: a `Policy` or spec string governing the whole call; ``None`` lets
      only registry name patterns (on `jax.named_scope`s) and the ``full``
      rule act.
    rules: an `OpRules` table; `DEFAULT_RULES` if ``None``.

  Returns:
    A function with ``fn``'s signature. Non-array arguments (Python scalars,
    bools, strings, None) are passed through as static values; arguments of
    different types (``2`` and ``2.0``, ``1`` and ``True``) are never
    mistaken for each other. An output that is not an array, a Python
    number or a bool raises a `TypeError` naming its place in the output.

  See also: `full_precision`, `OpRules`, `explain`, `transform_amp`.
  """
  return interpret(fn, policy=policy, rules=rules, cast_outputs=True)


class full_precision(contextlib.ContextDecorator):  # pylint: disable=invalid-name
  """Context manager and decorator: inside, everything runs as written.

  The op rules are off in the block: no half matmuls, no float32 safety net;
  code on float32 inputs runs in float32.

  >>> import jax, jax.numpy as jnp
  >>> def f(x, w):
  ...   with full_precision():
  ...     return x @ w
  >>> f = amp(f, "p=f32,c=bf16,o=f32")
  >>> jax.make_jaxpr(f)(jnp.ones((2, 3)), jnp.ones((3, 4))).eqns[0].primitive
  dot_general

  Also usable as ``@full_precision()`` or ``@full_precision``.

  See also: `amp`, `set_policy`.
  """

  def __new__(cls, fn: Optional[Callable[..., Any]] = None):
    self = super().__new__(cls)
    if fn is not None:  # Used bare, as `@full_precision`.
      self.__init__()
      return self(fn)
    return self

  def __init__(self, fn: Optional[Callable[..., Any]] = None):
    del fn
    self._stack: list[contextlib.ExitStack] = []

  def __enter__(self):
    stack = contextlib.ExitStack()
    stack.enter_context(regions.tagged(regions.FULL_PRECISION))
    self._stack.append(stack)
    return self

  def __exit__(self, *exc):
    return self._stack.pop().__exit__(*exc)
