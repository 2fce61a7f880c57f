"""The class rules, and the primitives classed by them that no family owns.

What each class means:

* ``lower`` (matmul, convolution): inputs cast to the compute dtype of the
  governing policy, float32 accumulation; run as written where no half
  policy governs or an input is float64. The family of the primitive
  (`matmul`, `conv`) says how; under a float8 policy (``c=f8``) it may run
  in float8, and every other op runs as under ``c=bf16``.
* ``full`` (exp, log, sums, ...): half inputs cast to float32 where a half
  policy governs or none does; the result stays float32, as with autocast.
  Under a bfloat16 policy (bfloat16 has float32's range) an element-wise
  ``full`` op on a bfloat16 value computes in float32 and stores its
  result, and the derivative the backward pass keeps, in bfloat16, unless
  only float32 readers use it.
* ``promote``: the widest floating dtype among the inputs; scalar
  constants (and broadcasts of them) follow the arrays.
* anything else (``None``): the dtype of its inputs. Where floating inputs
  disagree, literals follow the arrays; parameters and inputs (arrays that
  entered the call, and reshapes, broadcasts, transposes and slices of
  them) are used in the compute dtype; otherwise the widest dtype wins (so
  under float16 ``x - mean(x)`` runs in float32). Under a bfloat16 policy,
  a ``mul`` or ``div`` of a bfloat16 value (or a parameter) by a float32
  statistic (softmax's division by its sum, LayerNorm's ``scale *
  rsqrt(var)``), and an ``add`` or ``sub`` of one and a float32 statistic
  spread along it (LayerNorm's ``x - mean(x)``), give bfloat16 results
  without converting the activation (see `_stored_half`). If JAX rejects the
  re-typed equation, it runs on inputs cast back to the dtypes it was
  traced with.
* `base.AS_WRITTEN`: inside `full_precision()` and where a policy that
  computes in float32 or wider governs: the code runs exactly as written,
  except that a float64 policy computes in float64 (narrower floating
  inputs cast up, as `transform_amp` casts them).

The registrations below are PyTorch autocast's fp32 and promote lists,
translated to JAX primitives, and the facts the rules read (which
primitives act element by element, broadcast, scale, or re-arrange a
parameter, which carry scalar combiners, and which place, shard or key
values and so are bound as they are).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from mpolicy._src import dtypes
from mpolicy._src import jax_compat
from mpolicy._src import staged
from mpolicy._src import widen
from mpolicy._src.rules import base
from mpolicy._src.rules import facts
from mpolicy._src.rules import half_storage
from mpolicy._src.rules.facts import FULL, LOWER, PROMOTE

# --- lower ------------------------------------------------------------------


def _lower(op: base.Op) -> list:
  """Matmuls and convolutions in the half compute dtype (or float8), as
  their family says; any other primitive classed ``lower`` runs on its
  inputs cast to the compute dtype."""
  family = op.facts
  floats = [dtypes.dtype_of(a) for a in op.args if dtypes.float_value(a)]
  if any(map(dtypes.is_double, floats)):
    # float64 is never narrowed: not to half, not to float8.
    return _inputs(op, why="lower op on float64: not eligible, runs in "
                   "float64 as written")
  # The two operands of a matmul or convolution (a ragged dot's group sizes,
  # its third, are integers).
  all_float = len(op.args) >= 2 and all(
      dtypes.float_value(a) for a in op.args[:2])
  if (op.matmul_format is not None and family.lower_fp8 is not None
      and all_float):
    outs = family.lower_fp8(op)
    if outs is not None:
      return outs
  compute = op.half_compute()
  if compute is None or not floats:
    return _inputs(
        op, why="lower op, but no half compute dtype governs: runs as written")
  op.rule = LOWER
  op.why = f"lower ({op.reason}){op.note}; policy from {op.decided_by}"
  op.args = [op.env.cast(a, compute) if dtypes.float_value(a) else a
             for a in op.args]
  if family.lower is None or not all_float:
    return base.bind_op(op)
  return family.lower(op, compute, base.result_dtype(op.eqn, compute))


# --- full -------------------------------------------------------------------


def _full(op: base.Op) -> list:
  """Fragile ops in float32 (bfloat16 storage for element-wise ones)."""
  env, eqn, args = op.env, op.eqn, op.args
  op.rule, op.why = FULL, f"full: {op.reason}"
  store = op.bf16_storage()
  floats = [i for i, a in enumerate(args) if dtypes.float_value(a)]
  if (store is not None and op.facts.elementwise
      and len(eqn.outvars) == 1 and len(floats) == 1
      and dtypes.dtype_of(args[floats[0]]) == store
      and dtypes.is_traced(args[floats[0]])
      and eqn.outvars[0] not in env.full_only):
    # bfloat16 has float32's range: rounding the float32 result to it
    # loses one rounding, as any bfloat16 activation does, and under grad
    # what is saved for the backward pass is half as big. (Read only by
    # other `full` ops, the result stays float32.)
    op.ran_in = "float32"
    op.why += "; computed in float32, stored in bfloat16"
    return [half_storage.primitive_in_float32(eqn.primitive, eqn.params, args,
                                              floats[0], store)]
  op.args = [env.cast(a, jnp.float32) if dtypes.is_half(dtypes.dtype_of(a))
             else a for a in args]
  return base.bind_op(op)


# --- promote, inputs and as written -----------------------------------------


def _promote(op: base.Op) -> list:
  """The widest floating dtype among the inputs; scalar constants (and
  broadcasts of them) follow the arrays."""
  op.rule, op.why = PROMOTE, f"promote: {op.reason}"
  floats = [a for a in op.args if dtypes.float_value(a)]
  kinds = {dtypes.dtype_of(a) for a in floats}
  if len(kinds) <= 1:
    return _run_at(op, None)
  arrays = [dtypes.dtype_of(a) for a in floats if op.env.const_of(a) is None]
  return _run_at(op, dtypes.widest(arrays or kinds))


def _inputs(op: base.Op, why: Optional[str] = None) -> list:
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


def _as_written(op: base.Op) -> list:
  """Inside `full_precision()`, or where a policy that computes in float32
  (or wider) governs: no op rule applies, the ``full`` class's up-cast of
  half inputs included. Disagreeing inputs meet at the widest. Where a
  float64 policy governs, narrower floating inputs are cast up to float64
  (as `transform_amp` casts a module's inputs and parameters to it)."""
  op.rule = base.AS_WRITTEN
  if op.region is None or op.region.full_precision:
    op.why = op.region.decided_by if op.region else "full_precision()"
  else:
    compute = np.dtype(op.region.policy.compute_dtype)  # type: ignore[union-attr]  # Not full_precision.
    if dtypes.is_double(compute) and any(
        dtypes.float_value(a) and dtypes.dtype_of(a).itemsize
        < compute.itemsize for a in op.args):
      op.why = (f"policy {op.region.policy} from {op.region.decided_by} "
                f"computes in {compute.name}: floating inputs cast up to "
                f"{compute.name}")
      op.args = [_as_typed(a, v, compute)
                 for a, v in zip(op.args, op.eqn.invars)]
      return _run_at(op, compute)
    # Values the rules outside made narrower than the code had them (a
    # half matmul's result entering a `full` region) are read as the code
    # had them; half values the code made itself stay half.
    op.args = [base.cast_as_traced(op.env, a, v.aval.dtype)
               if dtypes.float_value(a) and dtypes.is_float(v.aval.dtype)
               and dtypes.dtype_of(a).itemsize < np.dtype(v.aval.dtype).itemsize
               else a for a, v in zip(op.args, op.eqn.invars)]
  return _run_at(op, _array_target(op.eqn, op.args))


def _as_typed(value, var, dtype):
  """A scalar literal (a Python float in the code, stored in a narrower
  dtype) as the shortest decimal its dtype prints for it, in ``dtype``:
  ``0.1`` rather than float32's 0.100000001...; else ``value``."""
  if (isinstance(var, jax_compat.Literal) and np.ndim(value) == 0
      and dtypes.is_float(var.aval.dtype)):
    return np.asarray(float(str(np.asarray(value, var.aval.dtype)[()])), dtype)
  return value


def _array_target(eqn, args, env=None, compute=None) -> Optional[np.dtype]:
  """The dtype disagreeing floating inputs meet at (``None``: they agree).

  Literals follow the arrays. With a half ``compute`` dtype, parameters and
  inputs wider than it count as ``compute``: they are used in the compute
  dtype, not the other way round; float64 ones do not (float64 is never
  narrowed).
  """
  arrays: list = []
  followers: list = []
  actual: set = set()
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
    scalar_const = (env.const_of(a) is not None if env is not None
                    else not dtypes.is_traced(a) and np.ndim(a) == 0)
    (followers if weak or scalar_const else arrays).append(d)
  if len(actual) <= 1:
    return None
  return dtypes.widest(arrays or followers)


def _run_at(op: base.Op, target: Optional[np.dtype]) -> list:
  """Runs ``op`` with its floating arguments at ``target`` (``None``: as
  they are), or, for a bfloat16 value scaled or offset by a float32
  statistic under a bfloat16 policy, as `_stored_half` says."""
  env, eqn = op.env, op.eqn
  store = op.bf16_storage()
  if store is not None and (target is None or target == jnp.float32):
    outs = _stored_half(op, store)
    if outs is not None:
      return outs
  op.args = _widen_params(env, eqn, op.args, target, op.half_compute())
  if target is not None:
    op.args = [env.cast(a, target) if dtypes.float_value(a) else a
               for a in op.args]
  return base.bind_op(op)


def _stored_half(op: base.Op, store: np.dtype) -> Optional[list]:
  """A ``store`` (bfloat16) array combined with a float32 statistic, stored
  in ``store``; ``None`` if ``op`` is no such combination.

  Two kinds. A product or quotient (softmax's division by its sum,
  LayerNorm's ``scale * rsqrt(var)``) has no cancellation: it runs in
  bfloat16 on the statistic rounded once, as a bfloat16 program computes
  it, and converts no activation-sized array. A sum or difference with a
  statistic spread along the array (LayerNorm's ``x - mean``) would cancel
  digits against a rounded statistic: the statistic is split into two
  bfloat16 parts, ``hi + lo``, and ``(x - hi) - lo`` is computed in
  bfloat16; ``x - hi`` is exact where the digits cancel, so the result is
  the float32 difference to within about a bfloat16 rounding, again
  without converting the activation. (A statistic as large as the array, a
  ``jnp.broadcast_to`` of one, is subtracted in float32 and the result
  rounded once: splitting it would convert two such arrays.) The backward
  pass keeps bfloat16 values. A parameter counts as bfloat16: it is used in
  the compute dtype. A result read only by ``full`` ops (``jnp.var``'s
  centred values) stays float32.
  """
  env, eqn, args = op.env, op.eqn, op.args
  facts_ = op.facts
  if (not (facts_.scales or facts_.offsets) or len(args) != 2
      or eqn.outvars[0] in env.full_only  # Read only in float32: kept so.
      or any(isinstance(v, jax_compat.Literal) or not dtypes.is_traced(a)
             for v, a in zip(eqn.invars, args))):
    return None
  for i in (0, 1):
    x, s = args[i], args[1 - i]
    x_dtype = dtypes.dtype_of(x)
    if (dtypes.dtype_of(s) != jnp.float32 or env.is_param(s)
        or not (x_dtype == store or (env.is_param(x)
                                     and x_dtype == jnp.float32))):
      continue
    if facts_.scales and (i == 0 or facts_.commutes):
      op.why += ("; a bfloat16 value scaled by a float32 statistic: in "
                 "bfloat16, the statistic rounded once")
      # A parameter is used in the compute dtype (broadcast first where it
      # meets an activation: its gradient then sums in float32).
      op.args = _widen_params(env, eqn, [x, env.cast(s, store)], store, store)
      op.args = [env.cast(a, store) for a in op.args][::1 if i == 0 else -1]
      return base.bind_op(op)
    x = env.cast(x, store)  # A parameter is used in the compute dtype.
    if facts_.offsets and np.size(s) < np.size(x):
      op.ran_in = "float32"
      op.why += ("; a bfloat16 value offset by a float32 statistic spread "
                 "along it: as bfloat16 parts of the statistic, exactly")
      return [_offset_in_parts(op, x, s, i, store)]
    if facts_.offsets and env.is_spread(s):
      op.ran_in = "float32"
      op.why += ("; a bfloat16 value offset by a float32 statistic spread "
                 "along it: computed in float32, stored in bfloat16")
      # A linear op: the backward pass keeps nothing of it.
      op.args = [env.cast(a, jnp.float32)
                 for a in ([x, s] if i == 0 else [s, x])]
      return [env.cast(o, store) for o in base.bind_op(op)]
  return None


def _offset_in_parts(op: base.Op, x, s, i: int, store: np.dtype):
  """``x + s``, ``x - s`` or ``s - x`` (``s`` at position ``1 - i``), with
  the float32 ``s`` as ``hi + lo`` in ``store``: two ops in ``store``."""
  env, eqn = op.env, op.eqn
  hi = env.cast(s, store)
  rounded = staged.call(widen.rounder(store), s)  # hi's value, in float32.
  lo = env.cast(staged.bind(jax.lax.sub_p, s, rounded), store)
  op.args = [x, hi][::1 if i == 0 else -1]
  (y,) = base.bind(eqn, op.args)
  if i == 1 and not op.facts.commutes:  # s - x: (hi - x) + lo
    return staged.bind(jax.lax.add_p, y, lo)
  return base.bind(eqn, [y, lo])[0]  # (x + hi) + lo, (x - hi) - lo


def _widen_params(env, eqn, args, target, compute) -> list:
  """Parameters an element-wise op broadcasts (a ``[1, n]`` bias added to
  ``[b, n]``) and uses in the half ``compute`` dtype are broadcast there
  with `half_storage.cast_after`: cast first, so the forward pass converts
  the small parameter only, while under grad the sum over the broadcast
  dims runs in float32 instead of in half. That holds for a float32
  parameter about to be cast down to ``target``, and for one the code cast
  down itself (a module policy's cast of its parameters). Other ops (a
  matmul, a concatenation) take their operands as they are."""
  if (compute is None or len(eqn.outvars) != 1
      or not facts.of(eqn.primitive).broadcasts):
    return args
  shape = tuple(eqn.outvars[0].aval.shape)
  if not any(tuple(np.shape(a)) == shape for a in args
             if dtypes.float_value(a)):
    return args  # No activation of the result's shape: nothing to spread.
  out = []
  for a in args:
    a_shape = tuple(np.shape(a))
    if (len(a_shape) == len(shape) and a_shape != shape
        and all(n in (1, m) for n, m in zip(a_shape, shape))
        and (target is None or target == compute) and dtypes.float_value(a)):
      wide = env.wider_source(a) if target is None else a
      if (env.is_param(wide) and not dtypes.is_double(dtypes.dtype_of(wide))
          and dtypes.dtype_of(wide).itemsize > compute.itemsize):
        a = half_storage.cast_after(half_storage.broadcaster(shape), wide,
                                    compute)
    out.append(a)
  return out


CLASS_RULES: dict[Optional[str], Callable[[base.Op], list]] = {
    LOWER: _lower,
    FULL: _full,
    PROMOTE: _promote,
    None: _inputs,
    base.AS_WRITTEN: _as_written,
}
"""Op class -> rule."""

inputs = _inputs  # A ``lower`` op that is not eligible runs as its inputs.


# --- The primitives no family owns --------------------------------------------

_TRANSCENDENTAL = "range/precision loss in half (autocast fp32 list)"
_SUM = "sums many values: accumulate in float32 (autocast fp32 list)"
_PRODUCT = "products of many values overflow half (autocast fp32 list)"
_SQUARES = ("x**{n} overflows float16, and squares summed in half lose the "
            "small terms of E[x^2] - E[x]^2 (autocast fp32 list: pow)")
_LINALG = ("linear algebra: no half kernels, unstable in half "
           "(autocast fp32 list)")
_PROMOTE = "combines several inputs: widest dtype (autocast promote list)"

# Element-wise primitives that always run in float32.
for _name, _reason in {
    "exp": "exp overflows half beyond ~11 (autocast fp32 list)",
    "exp2": "exp2 overflows half (autocast fp32 list)",
    "expm1": "expm1 loses precision near 0 in half (autocast fp32 list)",
    "exp2m1": "exp2m1 loses precision near 0 in half (as expm1)",
    "log": "log loses precision in half (autocast fp32 list)",
    "log2": "log2 loses precision in half (as log)",
    "log1p": "log1p loses precision near 0 in half (autocast fp32 list)",
    "log2p1": "log2p1 loses precision near 0 in half (as log1p)",
    "pow": "pow overflows half (autocast fp32 list)",
    "integer_pow": _SQUARES.format(n="n"),
    "square": _SQUARES.format(n="2"),
    "one_minus_square": _SQUARES.format(n="2"),
    "rsqrt": "rsqrt of small variances overflows half (autocast fp32 list)",
    "erf_inv": "erf_inv diverges near +-1 (autocast fp32 list)",
    "lgamma": "lgamma overflows half (autocast fp32 list)",
    "digamma": "digamma loses precision in half (autocast fp32 list)",
    "polygamma": _TRANSCENDENTAL,
    "igamma": _TRANSCENDENTAL,
    "igammac": _TRANSCENDENTAL,
    "zeta": _TRANSCENDENTAL,
    "regularized_incomplete_beta": _TRANSCENDENTAL,
    "bessel_i0e": _TRANSCENDENTAL,
    "bessel_i1e": _TRANSCENDENTAL,
    "acos": "acos loses precision near +-1 (autocast fp32 list)",
    "acospi": "acospi loses precision near +-1 (as acos)",
    "asin": "asin loses precision near +-1 (autocast fp32 list)",
    "asinpi": "asinpi loses precision near +-1 (as asin)",
    "cosh": "cosh overflows half (autocast fp32 list)",
    "sinh": "sinh overflows half (autocast fp32 list)",
    "tan": "tan loses precision near poles (autocast fp32 list)",
    "tanpi": "tanpi loses precision near poles (as tan)",
}.items():
  facts.register(_name, op_class=FULL, reason=_reason, elementwise=True)

# Element-wise primitives a user may class `full` (no class by default):
# as `full` ops they too compute in float32 and store bfloat16.
facts.register(("sqrt", "cbrt", "erf", "erfc", "atan", "atanpi", "acosh",
                "asinh", "atanh", "tanh", "logistic", "sin", "sinpi", "cos",
                "cospi"), elementwise=True)

# Several operands, always float32.
facts.register("fma", op_class=FULL, reason=(
    "fused multiply-add: its one rounding of a*b+c is its point (and "
    "XLA:CPU has no half fma)"))
facts.register("polynomial", op_class=FULL, reason=(
    "powers of x overflow half, and its sum of terms rounds in half (as "
    "pow)"))
facts.register("igamma_grad_a", op_class=FULL, reason=_TRANSCENDENTAL)

# Reductions and scans that sum (or multiply) many values: float32 results.
facts.register(("reduce_sum", "reduce_window_sum", "cumsum", "cumlogsumexp"),
               op_class=FULL, reason=_SUM)
facts.register(("reduce_prod", "cumprod"), op_class=FULL, reason=_PRODUCT)

# Linear algebra: LAPACK has no half kernels, and decompositions and solves
# lose too much in half (autocast runs them in float32).
facts.register((
    "cholesky", "cholesky_update", "eig", "eigh", "hessenberg",
    "householder_product", "lu", "ormqr", "qr", "schur", "svd",
    "symmetric_product", "triangular_solve", "tridiagonal",
    "tridiagonal_solve"), op_class=FULL, reason=_LINALG)

# Operations that combine several inputs into one array.
facts.register(("concatenate", "select_n", "dynamic_update_slice", "scatter",
                "scatter-add", "scatter-mul", "pad", "clamp", "atan2",
                "atan2pi"),
               op_class=PROMOTE, reason=_PROMOTE)

# Element-wise primitives that broadcast size-1 dimensions of their operands.
facts.register(("add", "add_any", "sub", "mul", "div", "rem", "pow", "max",
                "min", "atan2", "atan2pi", "nextafter", "select_n", "clamp"),
               broadcasts=True)

# Products and quotients: a small relative error whatever the operands'
# magnitudes (no cancellation).
facts.register(("mul", "div"), scales=True)

# Operations whose two operands may trade places.
facts.register(("add", "add_any", "mul", "max", "min"), commutes=True)

# Sums and differences: a bfloat16 value offset by a float32 statistic
# spread along it (``x - mean(x)``) subtracts it exactly, stored in bfloat16.
facts.register(("add", "sub"), offsets=True)

# A broadcast of a smaller array: a float32 value spread so is a statistic.
facts.register("broadcast_in_dim", spreads=True)

# Re-arrangements of (part of) their first operand: a parameter reshaped,
# broadcast, transposed or sliced is still a parameter.
facts.register(("reshape", "broadcast_in_dim", "transpose", "squeeze",
                "slice", "dynamic_slice", "gather", "rev", "copy",
                "device_put", "sharding_constraint"),
               keeps_param=True)

# Re-shapings of their first operand: a broadcast scalar constant (a mask's
# fill value) is still that constant, and follows the arrays it meets.
facts.register(("broadcast_in_dim", "reshape", "squeeze", "copy"),
               keeps_constant=True)

# Placement, sharding, named mesh axes and PRNG keys: bound as is, never
# through `staged`'s linearization cache (`base.bind`).
facts.register(("device_put", "sharding_constraint", "reshard", "pvary",
                "axis_index", "random_seed", "random_wrap", "random_unwrap"),
               binds_plainly=True)

# Primitives whose jaxpr params are small scalar combiners (a scatter-add's
# `add`, a generic reduction's monoid), not user code: they run as
# first-order primitives (`sub_computations`), at their traced dtypes
# (`base.bind_natural`).
facts.register(("scatter", "scatter-add", "scatter-sub", "scatter-mul",
                "scatter-min", "scatter-max", "reduce", "reduce_window",
                "select_and_scatter", "select_and_gather_add"),
               combines_scalars=True)

# --- The primitives that run in their inputs' dtype, and why -----------------
# Every primitive has an entry: a class above, a family's, a higher-order
# rule, or one of these reasons (no class: the dtype of its inputs). A
# primitive a newer JAX adds has none until it is given one, and a test
# names it.

_INPUTS = {
    ("add", "add_any", "sub", "mul", "div", "rem", "max", "min", "neg",
     "abs", "sign", "floor", "ceil", "round", "nextafter", "conj", "real",
     "imag", "complex", "fmuladd", "clz", "population_count", "not", "and",
     "or", "xor", "shift_left", "shift_right_arithmetic",
     "shift_right_logical"):
        "element-wise arithmetic, one rounding: runs in its inputs' dtype "
        "(autocast's lists leave it there)",
    ("sqrt", "cbrt", "erf", "erfc", "atan", "atanpi", "acosh", "asinh",
     "atanh", "tanh", "logistic", "sin", "sinpi", "cos", "cospi"):
        "bounded, well conditioned in half: runs in its inputs' dtype "
        "(autocast's lists leave it there; with_ops(full=...) moves it)",
    ("eq", "ne", "lt", "le", "gt", "ge", "eq_to", "le_to", "lt_to",
     "is_finite"):
        "compares: exact in any dtype",
    ("reshape", "transpose", "squeeze", "slice", "dynamic_slice", "rev",
     "copy", "broadcast_in_dim", "gather", "iota", "sort", "top_k",
     "approx_top_k", "argmax", "argmin", "stop_gradient", "reduce_max",
     "reduce_min", "reduce_and", "reduce_or", "reduce_xor",
     "reduce_window_max", "reduce_window_min", "cummax", "cummin",
     "select_and_scatter_add"):
        "moves, picks or compares values: exact in any dtype",
    ("convert_element_type", "bitcast_convert_type", "reduce_precision"):
        "the code's own cast or rounding: runs as written (special rules)",
    ("psum", "pmax", "pmin", "all_gather", "all_to_all", "ppermute",
     "ragged_all_to_all", "axis_index"):
        "a collective over devices: runs in its operands' dtype",
    ("random_bits", "random_fold_in", "random_gamma", "random_seed",
     "random_split", "random_wrap", "random_unwrap", "rng_bit_generator",
     "rng_uniform", "threefry2x32"):
        "random numbers: keys and bits, as written",
    ("after_all", "create_token", "device_put", "sharding_constraint",
     "name", "empty2", "get", "swap", "fft"):
        "placement, sharding, tokens, references, or a transform with its "
        "own dtype rules: as written",
}
for _names, _reason in _INPUTS.items():
  facts.register(_names, reason=_reason)
