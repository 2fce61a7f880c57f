"""How one first-order primitive runs: two rule tables, looked up in order.

1. A custom rule the `OpRules` table holds for the primitive
   (`OpRules.with_rule`), except inside `full_precision()`.
2. `SPECIAL_RULES`, by primitive: the primitives whose handling does not
   follow from their op class (an explicit cast, a bit reinterpretation, a
   broadcast or gather of a down-cast value). A special rule may decline by
   returning ``None``; the class rule then runs.
3. `CLASS_RULES`, by the class the `OpRules` table gives the primitive:
   ``lower``, ``full``, ``promote``, ``None`` for primitives it does not
   list, and `AS_WRITTEN` inside `full_precision()` and where a policy
   that computes in float32 or wider (``full``) governs: there no class
   or special rule applies, and the code runs exactly as written.

A rule takes an `Op` (the equation, its arguments and what governs it),
returns the outputs, and notes on the `Op` what it decided, which becomes a
row of `explain`.

What each class means:

* ``lower`` (matmul, convolution): inputs cast to the compute dtype of the
  governing policy, float32 accumulation; run as written where no half
  policy governs or an input is float64. Under a float8 policy (``c=f8``)
  matmuls and convolutions run in `fp8`, and every other op as under
  ``c=bf16``.
* ``full`` (exp, log, sums, ...): half inputs cast to float32 where a half
  policy governs or none does; the result stays float32, as with autocast. Under a bfloat16 policy
  (bfloat16 has float32's range) an element-wise ``full`` op on a bfloat16
  value computes in float32 and stores its result, and the derivative the
  backward pass keeps, in bfloat16, unless only float32 readers use it.
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
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from mpolicy._src import dtypes
from mpolicy._src import fp8
from mpolicy._src import jax_compat
from mpolicy._src import lowp
from mpolicy._src import op_rules as op_rules_lib
from mpolicy._src import policy as policy_lib
from mpolicy._src import recording
from mpolicy._src import regions

AS_WRITTEN = "as written"
"""The class of every primitive inside `full_precision()`."""

JAX_CAST = "jax cast"
"""The rule of a cast that JAX made itself (a promotion inside ``jnp.mean``),
not written in the code: counted neither as the code's nor as the rules'."""

# Primitives whose result is a re-arrangement of (part of) their first
# input: a parameter or input reshaped, broadcast, transposed or sliced is
# still a parameter or input (see the environment's ``is_param``).
SHAPE_OPS = frozenset({
    "reshape", "broadcast_in_dim", "transpose", "squeeze", "expand_dims",
    "slice", "dynamic_slice", "gather", "rev", "copy", "copy_p", "device_put",
    "sharding_constraint"})


@dataclasses.dataclass
class Op:
  """One equation being run, and what its rule decided.

  Attributes:
    eqn: the equation.
    env: the environment (values, cached casts, which values are parameters).
    rules: the `OpRules` table in force.
    region: what governs the equation, or ``None``.
    args: its arguments: as they arrived, then as the rule ran it (a rule
      that casts them stores the cast ones here; `explain` reports their
      dtypes unless ``ran_in`` says otherwise).
    names: the scope names it was traced under, markers included.
    op_class: the class the table gives it, or `AS_WRITTEN`.
    policy: the governing policy, as elementwise ops see it (a float8
      policy's elementwise dtype is bfloat16); ``None`` if none governs or
      inside `full_precision()`.
    fp8_dtype: the float8 dtype of a float8 policy, else ``None``.
    rule, why, ran_in: what the rule decided, for `explain` (``ran_in`` is
      set where the op runs in another dtype than its arguments).
  """
  eqn: Any
  env: Any
  rules: op_rules_lib.OpRules
  region: Optional[regions.Region]
  args: list
  names: tuple[str, ...] = ()
  op_class: Optional[str] = None
  policy: Optional[policy_lib.Policy] = None
  fp8_dtype: Optional[np.dtype] = None
  rule: str = "inputs"
  why: str = "no rule: runs in its inputs' dtype"
  ran_in: Optional[str] = None

  @property
  def prim(self):
    return self.eqn.primitive

  @property
  def reason(self) -> str:
    """The table's one-line reason for this primitive's class."""
    return self.rules.reason_of(self.prim.name)

  @property
  def decided_by(self) -> str:
    return self.region.decided_by if self.region is not None else "-"

  def half_compute(self) -> Optional[np.dtype]:
    """The governing half compute dtype, if a half policy governs."""
    if self.policy is None or not dtypes.is_half(self.policy.compute_dtype):
      return None
    return np.dtype(self.policy.compute_dtype)

  def bf16_storage(self) -> Optional[np.dtype]:
    """bfloat16 where a bfloat16 policy governs, else ``None``."""
    if (self.policy is None
        or np.dtype(self.policy.compute_dtype) != jnp.bfloat16):
      return None
    return np.dtype(jnp.bfloat16)


Rule = Callable[[Op], Optional[list]]

SPECIAL_RULES: dict[Any, Rule] = {}
"""Primitive object -> rule; a rule may decline (return ``None``)."""

CLASS_RULES: dict[Optional[str], Callable[[Op], list]] = {}
"""Op class (``lower``, ``full``, ``promote``, ``None``, `AS_WRITTEN`) -> rule."""


# --- Binding -------------------------------------------------------------------


def bind(eqn, args, params=None) -> list:
  """Binds ``eqn``'s primitive on ``args``; always returns a list."""
  params = eqn.params if params is None else params
  out = eqn.primitive.bind(*args, **params)
  return list(out) if eqn.primitive.multiple_results else [out]


# Primitives with a dtype parameter that follows their inputs: when the
# inputs change dtype, the parameter follows (if it was the input dtype).
_ACCUMULATING = frozenset({jax_compat.dot_general_p,
                           jax_compat.conv_general_dilated_p})


def _follow_inputs(eqn, args) -> dict:
  """``eqn.params`` with accumulation dtypes following re-typed inputs."""
  params = eqn.params
  if eqn.primitive in _ACCUMULATING:
    pet = params.get("preferred_element_type")
    traced = eqn.invars[0].aval.dtype
    now = dtypes.dtype_of(args[0])
    if pet is not None and np.dtype(pet) == traced and now != traced:
      params = dict(params, preferred_element_type=now)
  return params


def _cast_as_traced(env, x, dtype):
  return env.cast(x, dtype) if dtypes.dtype_of(x) != dtype else x


def _bind_natural(env, eqn, args) -> tuple[list, Optional[str]]:
  """Binds on ``args`` as they are, or else at the traced dtypes.

  An equation whose params hold a combiner (a scatter's update, a generic
  reduce or reduce_window) runs at the traced dtypes: its combiner was
  traced for them, and JAX accepts other operand dtypes that XLA then
  rejects. So does an equation JAX refuses to re-type.

  Returns the outputs, and ``None`` if ``args`` ran as they are, else why
  they ran at the traced dtypes.
  """
  traced = [v.aval.dtype for v in eqn.invars]
  if all(dtypes.dtype_of(a) == t for a, t in zip(args, traced)):
    return bind(eqn, args), None
  as_traced = lambda: bind(eqn, [_cast_as_traced(env, a, t)
                                 for a, t in zip(args, traced)])
  if jax_compat.jaxprs_in_params(eqn.params):
    return as_traced(), (
        "its combiner was traced for "
        f"{','.join(sorted({np.dtype(t).name for t in traced}))}: ran as traced")
  try:
    return bind(eqn, args, _follow_inputs(eqn, args)), None
  except Exception:  # pylint: disable=broad-except
    return as_traced(), "JAX refused other dtypes: ran as traced"


def _bind_op(op: Op) -> list:
  """`_bind_natural` on ``op``'s arguments; notes a fallback in its row."""
  outs, as_traced = _bind_natural(op.env, op.eqn, op.args)
  if as_traced is not None:
    op.why += f" ({as_traced})"
    op.args = [_cast_as_traced(op.env, a, v.aval.dtype)
               for a, v in zip(op.args, op.eqn.invars)]
  return outs


# --- Special primitives -----------------------------------------------------------


def _plain_convert(eqn) -> bool:
  params = eqn.params
  return (not params.get("weak_type", False)
          and params.get("sharding", None) is None)


# The JAX functions that cast (the function the user's code called, as
# `jax_compat.called_jax_function` names it): `x.astype`, `jnp.astype`,
# `jnp.asarray`, `jnp.array`, `jnp.float32(x)`, `lax.convert_element_type`.
_CAST_FUNCTIONS = frozenset({"astype", "_astype", "asarray", "array",
                             "convert_element_type", "_ScalarMeta.__call__"})


def _written_cast(eqn) -> tuple[bool, str]:
  """Whether a cast was written in the code (else JAX made it inside the
  function it names, such as a type promotion in ``jnp.mean``)."""
  called = jax_compat.called_jax_function(eqn)
  if called is None:
    return True, ""
  name = called[1] or "a function JAX traced itself"
  return (name in _CAST_FUNCTIONS
          or name.rsplit(".", 1)[-1] in _CAST_FUNCTIONS - {"__call__"}), name


def _convert(op: Op) -> Optional[list]:
  """A cast: made through the environment's cache (at most once)."""
  if not _plain_convert(op.eqn):
    return None
  what = regions.policy_cast_of(op.names)
  written, inside = _written_cast(op.eqn)
  if what is not None:
    op.rule = "policy cast"
    op.why = f"the module's policy casts its {what}"
  elif written:
    op.rule, op.why = "explicit cast", "convert_element_type in the traced code"
  else:
    op.rule = JAX_CAST
    op.why = f"convert_element_type that JAX made inside {inside}"
  if op.op_class == AS_WRITTEN:
    # As written: the cast alone, as XLA would compile it without `amp`
    # (no rounding made explicit, see `widen`).
    return bind(op.eqn, op.args)
  return [op.env.cast(op.args[0], op.eqn.params["new_dtype"])]


SPECIAL_RULES[jax_compat.convert_element_type_p] = _convert


def _reinterpret(op: Op) -> list:
  """Bit casts and random bits: floating inputs keep their traced dtypes."""
  op.rule, op.why = AS_WRITTEN, "reinterprets bits: runs as traced"
  return bind(op.eqn, [_cast_as_traced(op.env, a, v.aval.dtype)
                       for a, v in zip(op.args, op.eqn.invars)])


SPECIAL_RULES[jax_compat.bitcast_convert_type_p] = _reinterpret


def _callback(op: Op) -> list:
  """A host callback is code as written: its operands arrive in the dtypes
  the traced code had (its results are declared in them too)."""
  op.rule, op.why = AS_WRITTEN, "host callback: operands in their traced dtypes"
  op.args = [_cast_as_traced(op.env, a, v.aval.dtype)
             for a, v in zip(op.args, op.eqn.invars)]
  return bind(op.eqn, op.args)


for _p in jax_compat.CALLBACK_PRIMITIVES:
  SPECIAL_RULES[_p] = _callback


def _in_wider_source(op: Op) -> Optional[list]:
  """A broadcast or gather of a value cast down from float32 (a bias, an
  embedding table) runs on the float32 value, then casts.

  The values are the same, and under grad the transpose (a sum over the
  broadcast dims, a scatter-add into the table) accumulates in float32
  instead of in half. On GPUs a half scatter-add into a small table is also
  slow: its atomics contend. Declines for primitives the table classes, and
  inside `full_precision()`.
  """
  x = op.args[0]
  wide = op.env.wider_source(x)
  if op.op_class is not None or wide is x:
    return None
  op.why = (f"{op.prim.name} of a down-cast value: runs in its wider dtype, "
            "then cast (its gradient sums in float32)")
  return [op.env.cast(o, dtypes.dtype_of(x))
          for o in bind(op.eqn, [wide, *op.args[1:]])]


SPECIAL_RULES[jax_compat.broadcast_in_dim_p] = _in_wider_source
SPECIAL_RULES[jax_compat.gather_p] = _in_wider_source


# --- lower ------------------------------------------------------------------------


def _lower(op: Op) -> list:
  """Matmuls and convolutions in the half compute dtype (or float8)."""
  env, eqn, args = op.env, op.eqn, op.args
  floats = [dtypes.dtype_of(a) for a in args if dtypes.float_value(a)]
  if any(map(dtypes.is_double, floats)):
    # float64 is never narrowed: not to half, not to float8.
    return _inputs(op, why="lower op on float64: not eligible, runs in float64 as written")
  if op.fp8_dtype is not None and fp8.handles(eqn, args):
    # Quantized from the widest value at hand (a float32 parameter's
    # gradient then comes back in float32; only float8 copies are saved).
    op.rule, op.ran_in = op_rules_lib.LOWER, op.fp8_dtype.name
    op.why = (f"lower in {op.fp8_dtype.name} ({fp8.REASON}); policy from "
              f"{op.decided_by}")
    return fp8.run_equation(eqn, [env.wider_source(a) for a in args],
                            op.policy.compute_dtype)
  compute = op.half_compute()
  fp8_note = ""
  if op.fp8_dtype is not None and eqn.params.get("out_sharding") is not None:
    fp8_note = (f", not {op.fp8_dtype.name}: the dot names an out_sharding, "
                "which the float8 matmul does not carry")
  if compute is None or not floats:
    return _inputs(
        op, why="lower op, but no half compute dtype governs: runs as written")
  op.rule = op_rules_lib.LOWER
  op.why = f"lower ({op.reason}){fp8_note}; policy from {op.decided_by}"
  op.args = args = [env.cast(a, compute) if dtypes.float_value(a) else a
                    for a in args]
  if (eqn.primitive not in _ACCUMULATING
      or not all(dtypes.float_value(a) for a in args)):
    return _bind_op(op)
  out_dtype = compute
  pet = eqn.params.get("preferred_element_type")
  traced_in = eqn.invars[0].aval.dtype
  if pet is not None and np.dtype(pet).itemsize > np.dtype(compute).itemsize and (
      np.dtype(pet).itemsize > np.dtype(traced_in).itemsize
      or _explicit_result_dtype(eqn)):
    out_dtype = np.dtype(pet)  # The user asked for a wider result: keep it.
  if eqn.primitive is jax_compat.dot_general_p:
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
        compute_dtype=compute, out_sharding=eqn.params.get("out_sharding"))]
  if eqn.params.get("out_sharding") is None:
    params = {k: v for k, v in eqn.params.items()
              if k not in ("preferred_element_type", "out_sharding")}
    return [lowp.amp_conv_general_dilated(args[0], args[1], **params,
                                          out_dtype=out_dtype)]
  # A convolution with an explicit output sharding (which the amp primitive
  # does not carry): float32 accumulation, then cast. Under grad its
  # backward convolutions see a float32 cotangent (see `lowp`).
  out = bind(eqn, args, dict(eqn.params, preferred_element_type=jnp.float32))
  return [env.cast(o, out_dtype) for o in out]


CLASS_RULES[op_rules_lib.LOWER] = _lower


def _explicit_result_dtype(eqn) -> bool:
  """Whether the code wrote ``eqn``'s ``preferred_element_type`` itself.

  `jax.numpy`'s matmuls (``@``, ``jnp.dot``, ``jnp.einsum``) set it to
  their result dtype on their own, `jax.lax`'s do not: it is explicit if
  the code called a `jax.lax` function, or wrote the keyword in its call.
  """
  called = jax_compat.called_jax_function(eqn)
  if called is not None and "/lax/" in called[0].replace("\\", "/"):
    return True
  return "preferred_element_type" in jax_compat.user_source(eqn)


# --- full ---------------------------------------------------------------------------

# `full` primitives that act element by element. Under a bfloat16 policy
# they compute in float32 and store their result in bfloat16; reductions,
# scans and linear algebra keep float32 results.
_ELEMENTWISE_FULL = frozenset({
    "exp", "exp2", "expm1", "log", "log1p", "pow", "integer_pow", "square",
    "rsqrt", "sqrt", "cbrt", "erf", "erfc", "erf_inv", "lgamma", "digamma",
    "polygamma", "igamma", "igammac", "zeta", "regularized_incomplete_beta",
    "bessel_i0e", "bessel_i1e", "acos", "asin", "atan", "acosh", "asinh",
    "atanh", "cosh", "sinh", "tan", "tanh", "logistic", "sin", "cos"})


def _full(op: Op) -> list:
  """Fragile ops in float32 (bfloat16 storage for element-wise ones)."""
  env, eqn, args = op.env, op.eqn, op.args
  op.rule, op.why = op_rules_lib.FULL, f"full: {op.reason}"
  store = op.bf16_storage()
  floats = [i for i, a in enumerate(args) if dtypes.float_value(a)]
  if (store is not None and op.prim.name in _ELEMENTWISE_FULL
      and len(eqn.outvars) == 1 and len(floats) == 1
      and dtypes.dtype_of(args[floats[0]]) == store
      and dtypes.is_traced(args[floats[0]])
      and eqn.outvars[0] not in env.full_only):
    # bfloat16 has float32's range: rounding the float32 result to it
    # loses one rounding, as any bfloat16 activation does, and under grad
    # what is saved for the backward pass is half as big. (Read only by
    # other `full` ops, the result stays float32.)
    i = floats[0]
    fn = lambda v: bind(eqn, [*args[:i], v, *args[i + 1:]])[0]
    op.ran_in = "float32"
    op.why += "; computed in float32, stored in bfloat16"
    return [lowp.unary_in_float32(fn, args[i], store)]
  op.args = [env.cast(a, jnp.float32) if dtypes.is_half(dtypes.dtype_of(a))
             else a for a in args]
  return _bind_op(op)


CLASS_RULES[op_rules_lib.FULL] = _full


# --- promote, inputs and as written -------------------------------------------------


def _promote(op: Op) -> list:
  """The widest floating dtype among the inputs."""
  op.rule, op.why = op_rules_lib.PROMOTE, f"promote: {op.reason}"
  floats = [dtypes.dtype_of(a) for a in op.args if dtypes.float_value(a)]
  return _run_at(op, dtypes.widest(floats) if len(set(floats)) > 1 else None)


CLASS_RULES[op_rules_lib.PROMOTE] = _promote


def _inputs(op: Op, why: Optional[str] = None) -> list:
  """No rule: the inputs' dtype; where they disagree, see `_array_target`.

  ``why``, if given, is the reason shown (for a ``lower`` op that is not
  eligible).
  """
  compute = op.half_compute()
  target = _array_target(op.eqn, op.args, op.env, compute)
  if compute is not None and target == compute and any(
      op.env.is_param(a) and dtypes.dtype_of(a) != target
      for a in op.args if dtypes.float_value(a)):
    op.why = ("parameters and inputs are used in the compute dtype "
              f"{target.name} (policy from {op.decided_by})")
  if why is not None:
    op.why = why
  return _run_at(op, target)


CLASS_RULES[None] = _inputs


def _as_written(op: Op) -> list:
  """Inside `full_precision()`, or where a policy that computes in float32
  (or wider) governs: no op rule applies, the ``full`` class's up-cast of
  half inputs included. Disagreeing inputs meet at the widest."""
  op.rule = AS_WRITTEN
  if op.region is None or op.region.full_precision:
    op.why = "full_precision()"
  else:
    # Values the rules outside made narrower than the code had them (a
    # half matmul's result entering a `full` region) are read as the code
    # had them; half values the code made itself stay half.
    op.args = [_cast_as_traced(op.env, a, v.aval.dtype)
               if dtypes.float_value(a) and dtypes.is_float(v.aval.dtype)
               and dtypes.dtype_of(a).itemsize < np.dtype(v.aval.dtype).itemsize
               else a for a, v in zip(op.args, op.eqn.invars)]
  return _run_at(op, _array_target(op.eqn, op.args))


CLASS_RULES[AS_WRITTEN] = _as_written


def _array_target(eqn, args, env=None, compute=None) -> Optional[np.dtype]:
  """The dtype disagreeing floating inputs meet at (``None``: they agree).

  Literals follow the arrays. With a half ``compute`` dtype, parameters and
  inputs wider than it count as ``compute``: they are used in the compute
  dtype, not the other way round; float64 ones do not (float64 is never
  narrowed).
  """
  arrays, followers, actual = [], [], set()
  for var, a in zip(eqn.invars, args):
    d = dtypes.dtype_of(a)
    if not dtypes.is_float(d):
      continue
    actual.add(d)
    weak = (isinstance(var, jax_compat.Literal)
            or getattr(var.aval, "weak_type", False))
    if (compute is not None and env.is_param(a) and not dtypes.is_double(d)
        and d.itemsize > np.dtype(compute).itemsize):
      d = np.dtype(compute)
    scalar_const = not dtypes.is_traced(a) and np.ndim(a) == 0
    (followers if weak or scalar_const else arrays).append(d)
  if len(actual) <= 1:
    return None
  return dtypes.widest(arrays or followers)


# Ops whose result has a small relative error whatever their operands'
# magnitudes (no cancellation): a float32 one storing its result in
# bfloat16 loses only that one rounding.
_SCALING = frozenset({"mul", "div"})


def _run_at(op: Op, target: Optional[np.dtype]) -> list:
  """Runs ``op`` with its floating arguments at ``target`` (``None``: as
  they are), or, for a bfloat16 value scaled by a float32 statistic under a
  bfloat16 policy, in float32 stored in bfloat16."""
  env, eqn = op.env, op.eqn
  store = op.bf16_storage()
  scaled = (None if store is None or op.prim.name not in _SCALING
            or target != jnp.float32
            else _scaled_half(env, eqn, op.args, store))
  if scaled is not None:
    # A bfloat16 activation scaled by a float32 value that is no parameter
    # (softmax's division by its sum, typically): computed in float32,
    # stored in bfloat16. A product or quotient has no cancellation, so the
    # storage costs one rounding.
    x, s, x_first = scaled
    op.ran_in = "float32"
    op.why += ("; a bfloat16 value scaled by a float32 statistic: computed "
               "in float32, stored in bfloat16")
    return [lowp.scale_in_float32(op.prim.name, x, s, store, x_first)]
  if target is not None:
    op.args = _widen_params(env, eqn, op.args, target)
    op.args = [env.cast(a, target) if dtypes.float_value(a) else a
               for a in op.args]
  return _bind_op(op)


def _scaled_half(env, eqn, args, half):
  """``(x, s, x_first)`` if a `mul`/`div` scales a ``half`` array ``x`` by
  a float32 array ``s`` that is no parameter (for `div`, ``x / s``)."""
  if len(args) != 2 or any(isinstance(v, jax_compat.Literal)
                           or not dtypes.is_traced(a)
                           for v, a in zip(eqn.invars, args)):
    return None
  a, b = args
  for x, s, x_first in ((a, b, True), (b, a, False)):
    if (dtypes.dtype_of(x) == half and dtypes.dtype_of(s) == jnp.float32
        and not env.is_param(s)
        and (x_first or eqn.primitive.name == "mul")):
      return x, s, x_first
  return None


# Element-wise primitives that broadcast size-1 dimensions of their
# operands to the shape of their result.
_BROADCASTING = frozenset({
    "add", "add_any", "sub", "mul", "div", "rem", "pow", "max", "min",
    "atan2", "nextafter", "select_n", "clamp"})


def _widen_params(env, eqn, args, target) -> list:
  """Parameters about to be cast down to ``target`` that an element-wise op
  would broadcast (a ``[1, n]`` bias added to ``[b, n]``) are broadcast
  first, in their own dtype: under grad the sum over the broadcast dims then
  runs in float32 instead of in half. Other ops (a matmul, a concatenation)
  take their operands as they are."""
  if len(eqn.outvars) != 1 or eqn.primitive.name not in _BROADCASTING:
    return args
  shape = tuple(eqn.outvars[0].aval.shape)
  out = []
  for a in args:
    a_shape = tuple(np.shape(a))
    if (env.is_param(a) and dtypes.dtype_of(a) != target
        and len(a_shape) == len(shape) and a_shape != shape
        and all(n in (1, m) for n, m in zip(a_shape, shape))):
      a = jax.lax.broadcast_in_dim(a, shape, tuple(range(len(shape))))
    out.append(a)
  return out


# --- Custom rules -------------------------------------------------------------------


def _custom(op: Op, fn) -> list:
  """Runs the equation as the user's rule ``fn`` says (`OpRules.with_rule`)."""
  name = op_rules_lib.rule_name(fn)
  policy = op.region.policy if op.region is not None else None
  outs = _check_custom_outputs(op.eqn, fn(policy, *op.args, **op.eqn.params),
                               name)
  op.rule, op.why = "custom", f"custom rule {name}"
  if op.region is not None:
    op.why += f"; policy from {op.decided_by}"
  floats = sorted({dtypes.dtype_of(o).name for o in outs
                   if dtypes.float_value(o)})
  op.ran_in = ",".join(floats) if floats else "-"
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


# --- Dispatch -----------------------------------------------------------------------


def run(env, eqn, invals, rules: op_rules_lib.OpRules,
        region: Optional[regions.Region], names: tuple[str, ...],
        quiet: bool = False) -> list:
  """Runs one first-order equation by the tables; records it for `explain`.

  Args:
    env: the environment of the enclosing jaxpr.
    eqn: the equation.
    invals: its input values.
    rules: the `OpRules` table in force.
    region: what governs it (``None``: nothing).
    names: its scope names (for the recorded row and policy casts).
    quiet: if ``True``, nothing is recorded.

  Returns:
    The output values.
  """
  casts_before = env.inserted
  wide = region is not None and _wide_policy(region.policy)
  as_written = region is not None and (region.full_precision or wide)
  policy = None if region is None or as_written else region.policy
  op = Op(eqn=eqn, env=env, rules=rules, region=region, args=list(invals),
          names=names, op_class=AS_WRITTEN if as_written else rules.class_of(
              eqn.primitive.name))
  if wide:
    op.why = (f"policy {region.policy} from {region.decided_by} computes in "
              f"{np.dtype(region.policy.compute_dtype).name}: no op rule "
              "applies, runs as written")
  if policy is not None and policy_lib.is_fp8(policy.compute_dtype):
    # Matmuls and convolutions go to `fp8`; everything else runs as under
    # the policy's elementwise (bfloat16) compute dtype.
    op.fp8_dtype = np.dtype(policy.compute_dtype)
    policy = policy_lib.Policy(policy.param_dtype,
                               policy_lib.elementwise_dtype(policy),
                               policy.output_dtype)
  op.policy = policy

  custom = (None if region is not None and region.full_precision
            else rules.rule_of(eqn.primitive.name))
  if custom is not None:
    outs = _custom(op, custom)
  else:
    special = SPECIAL_RULES.get(eqn.primitive)
    outs = special(op) if special is not None else None
    if outs is None:
      outs = CLASS_RULES[op.op_class](op)

  if (eqn.primitive.name in SHAPE_OPS and invals and env.is_param(invals[0])
      and len(outs) == 1):
    env.mark_param(outs[0])
  if recording.active() and not quiet:
    # A cast in the traced code (or made for a module's policy) is the
    # code's own, even though the environment makes it: not counted.
    inserted = (0 if op.rule in ("explicit cast", "policy cast", JAX_CAST)
                else env.inserted - casts_before)
    recording.record(_decision(op, invals, outs, names, inserted))
  return outs


def _wide_policy(policy: Optional[policy_lib.Policy]) -> bool:
  """Whether ``policy`` computes in float32 or wider (``full``, say): where
  it governs, the code runs as written."""
  if policy is None:
    return False
  compute = np.dtype(policy.compute_dtype)
  return not dtypes.is_half(compute) and not policy_lib.is_fp8(compute)


def _decision(op: Op, invals, outs, names, casts: int) -> recording.Decision:
  if op.ran_in is not None:
    ran = [op.ran_in]
  else:
    ran = sorted({dtypes.dtype_of(a).name for a in op.args
                  if dtypes.float_value(a)})
    if not ran or op.rule in ("explicit cast", "policy cast", JAX_CAST):
      ran = sorted({dtypes.dtype_of(o).name for o in outs})  # Its result.
  return recording.Decision(
      scope="/".join(regions.plain_scope_names(names)),
      module_class=op.region.module_class if op.region is not None else None,
      primitive=op.prim.name,
      in_dtypes=tuple(dtypes.dtype_of(a).name for a in invals),
      ran_in=",".join(ran) if ran else "-",
      rule=op.rule,
      decided_by=op.why,
      casts=casts)
