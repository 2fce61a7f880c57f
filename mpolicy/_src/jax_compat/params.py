"""Primitive params: every read of a param by its key in mpolicy.

The params of a jaxpr equation are JAX's bookkeeping, and their keys and
shapes change between releases (a scan's counts became the flat trees
``ft_in``/``ft_out`` in JAX 0.11). The readers below accept each shape the
supported versions (0.10.2 to 0.12) use, so no other module names a key:
higher-order rules ask for a sub-jaxpr by its role (``"body"``,
``"cond"``, ``"branches"``, ...), first-order rules for the fact they need
(a cast's target, a matmul's dimension numbers, ...).
"""

from __future__ import annotations

from collections.abc import Mapping
import dataclasses
import enum
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from mpolicy._src.jax_compat import calls as _calls
from mpolicy._src.jax_compat import internals as _i

def _leaf_count(group, where: str) -> int:
  try:
    return len(group)
  except TypeError as e:
    raise TypeError(f"mpolicy: cannot count the operands in {where}: got "
                    f"{type(group).__name__}, expected a sized group") from e


def _unpacked(tree, arity: int, where: str) -> tuple:
  unpack = getattr(tree, "unpack", None)
  groups = unpack() if callable(unpack) else tree
  if not isinstance(groups, (tuple, list)) or len(groups) != arity:
    raise TypeError(f"mpolicy: expected {where} to split into {arity} groups, "
                    f"got {groups!r}")
  return tuple(groups)


def scan_counts(params) -> tuple[int, int]:
  """``(n_consts, n_carry)`` of a `scan` equation's params.

  A scan's operands are its consts, then its carry, then its scanned inputs.
  Accepts the counts as ``num_consts`` and ``num_carry`` (JAX 0.10) or as
  flat trees ``ft_in`` (consts, carry, xs) and ``ft_out`` (carry, ys), whose
  groups have a length (JAX 0.11 and later).

  Args:
    params: the params of a `scan` equation (a mapping).

  Returns:
    The number of leading const operands and of carry operands.

  Raises:
    KeyError: the params have neither form (an unsupported JAX).

  >>> scan_counts({"num_consts": 1, "num_carry": 2})
  (1, 2)

  See also: `while_counts`.
  """
  if "num_consts" in params and "num_carry" in params:
    return int(params["num_consts"]), int(params["num_carry"])
  if "ft_in" in params:
    consts, carry, _ = _unpacked(params["ft_in"], 3, "scan's ft_in")
    return (_leaf_count(consts, "scan's consts"),
            _leaf_count(carry, "scan's carry"))
  raise KeyError(
      "mpolicy: a scan equation has neither num_consts/num_carry nor ft_in "
      f"in its params ({sorted(params)}); this JAX version is not supported")


_SCAN_STRUCTURE = ("jaxpr", "num_consts", "num_carry", "linear", "ft_in",
                   "ft_out")


def scan_options(params) -> dict:
  """A `scan` equation's params as `jax.lax.scan` keyword arguments: all
  but its body and the layout of its operands (``length``, ``reverse``,
  ``unroll``, and whatever a newer JAX adds: `jax.lax.scan` refuses one
  it does not take, naming it).

  >>> scan_options({"num_consts": 0, "num_carry": 1, "length": 5,
  ...               "reverse": False, "unroll": 1, "linear": (False,)})
  {'length': 5, 'reverse': False, 'unroll': 1}
  """
  return {k: v for k, v in params.items() if k not in _SCAN_STRUCTURE}


def scan_layout(params) -> tuple[int, int, int, bool]:
  """``(n_consts, n_carry, length, reverse)`` of a `scan` equation's params.

  >>> scan_layout({"num_consts": 0, "num_carry": 1, "length": 5,
  ...              "reverse": True})
  (0, 1, 5, True)

  See also: `scan_counts`.
  """
  n_consts, n_carry = scan_counts(params)
  return n_consts, n_carry, int(params["length"]), bool(params["reverse"])


def while_counts(params) -> tuple[int, int]:
  """``(cond_nconsts, body_nconsts)`` of a `while` equation's params.

  The operands are the cond's consts, the body's consts, then the carry.
  Read here, like every higher-order param, so version differences stay in
  this module.

  Args:
    params: the params of a `while` equation (a mapping).

  Returns:
    The number of leading const operands of the cond and of the body.

  Raises:
    KeyError: the params lack the counts (an unsupported JAX).

  >>> while_counts({"cond_nconsts": 0, "body_nconsts": 3})
  (0, 3)

  See also: `scan_counts`.
  """
  try:
    return int(params["cond_nconsts"]), int(params["body_nconsts"])
  except KeyError as e:
    raise KeyError(
        "mpolicy: a while equation lacks cond_nconsts/body_nconsts in its "
        f"params ({sorted(params)}); this JAX version is not supported") from e


def custom_jvp_num_consts(params) -> int:
  """The number of leading const operands of a `custom_jvp_call` equation.

  Args:
    params: the params of a `custom_jvp_call` equation (a mapping).

  Returns:
    How many of its operands are consts (0 when the param is absent).

  >>> custom_jvp_num_consts({"num_consts": 2})
  2

  See also: `scan_counts`.
  """
  return int(params.get("num_consts", 0))


# --- Sub-jaxprs of higher-order primitives, by role -------------------------

_ROLES: dict[Any, dict[str, Any]] = {
    p: roles for p, roles in (
        (_i.jit_p, {"body": "jaxpr"}),
        (_i.scan_p, {"body": "jaxpr"}),
        (_i.while_p, {"cond": "cond_jaxpr", "body": "body_jaxpr"}),
        (_i.cond_p, {"branches": "branches"}),
        (_i.remat_p, {"body": "jaxpr", "policy": "policy"}),
        (_i.custom_jvp_call_p, {"body": "call_jaxpr", "jvp": "jvp_jaxpr_fun"}),
        (_i.custom_vjp_call_p, {"body": "call_jaxpr",
                                "fwd": "fwd_jaxpr_thunk"}),
        (_i.shard_map_p, {"body": "jaxpr"}),
    ) if p is not None}
# Every call primitive: its sub-jaxpr is ``call_jaxpr`` (``jaxpr`` in JAX
# 0.10.2's `eval_jaxpr`, which JAX stages as a `closed_call`).
_ROLES.update((p, {"body": ("call_jaxpr", "jaxpr")})
              for p in sum(_calls.call_primitives(), ()))


def _key(primitive, role: str, params) -> str:
  try:
    key = _ROLES[primitive][role]
  except KeyError:
    raise KeyError(
        f"mpolicy: {primitive.name!r} has no sub-jaxpr role {role!r} (roles: "
        f"{sorted(_ROLES.get(primitive, {}))})") from None
  if isinstance(key, tuple):  # Candidates: the one these params hold.
    key = next((k for k in key if k in params), key[0])
  return key


def sub_jaxpr(eqn, role: str = "body"):
  """The sub-jaxpr (or thunk) an equation holds in ``role``.

  Roles: ``"body"`` (every call-like primitive, `scan`, `while`'s body,
  `shard_map`, the primal of `custom_jvp`/`custom_vjp`), ``"cond"``
  (`while`), ``"branches"`` (`cond`, a tuple), ``"jvp"`` (`custom_jvp`'s
  rule thunk), ``"fwd"`` (`custom_vjp`'s forward thunk); and, not a
  sub-jaxpr, ``"policy"`` (`checkpoint`'s remat policy).
  """
  return eqn.params[_key(eqn.primitive, role, eqn.params)]


def bind_with(eqn, args, **by_role) -> list:
  """Binds ``eqn``'s primitive on ``args``, its sub-jaxprs replaced by role
  (``body=new_jaxpr``, ...); returns a list of outputs."""
  params = dict(eqn.params)
  for role, value in by_role.items():
    params[_key(eqn.primitive, role, eqn.params)] = value
  out = _i.bind(eqn.primitive, args, params)
  return list(out) if eqn.primitive.multiple_results else [out]


def shard_map_body_context(eqn):
  """A context where a `shard_map` equation's body may be traced again
  (see `internals.manual_axes_context`)."""
  p = eqn.params
  manual = frozenset(p.get("newly_manual_axes", p.get("manual_axes", ())))
  return _i.manual_axes_context(p["mesh"], manual, p.get("check_vma"))


def shard_map_manual_axes(eqn) -> tuple:
  """The mesh axes a `shard_map` equation's body is manual over, in the
  mesh's order."""
  p = eqn.params
  manual = p.get("newly_manual_axes", p.get("manual_axes"))
  names = tuple(p["mesh"].axis_names)
  return names if not manual else tuple(n for n in names if n in manual)


def shard_map_like(eqn, fn, n_in: int, n_out: int):
  """``fn`` as a `shard_map` over ``eqn``'s mesh and specs, with ``n_in``
  more operands (replicated) and ``n_out`` more outputs, one row per
  device (stacked along the manual axes)."""
  p = eqn.params
  spec = jax.sharding.PartitionSpec
  axes = shard_map_manual_axes(eqn)
  return jax.shard_map(
      fn, mesh=p["mesh"],
      in_specs=tuple(p["in_specs"]) + (spec(),) * n_in,
      out_specs=tuple(p["out_specs"]) + (spec(axes),) * n_out,
      axis_names=frozenset(axes), check_vma=bool(p.get("check_vma", True)))


# --- Kernels ------------------------------------------------------------------


def kernel_name(eqn) -> Optional[str]:
  """A Pallas kernel's name: ``pallas_call``'s ``name=``, else its kernel
  function's name; None for any other equation."""
  if _i.pallas_call_p is None or eqn.primitive is not _i.pallas_call_p:
    return None
  debug = getattr(eqn.params.get("jaxpr"), "debug_info", None)
  return eqn.params.get("name") or getattr(debug, "func_name", None) or None


# --- First-order params -----------------------------------------------------


def matmul_flops(eqn) -> Optional[tuple[int, np.dtype]]:
  """``(FLOPs, the dtype it multiplies in)`` of a matmul equation (a
  ``dot_general``, or a primitive with its ``dimension_numbers`` and a
  ``compute_dtype``, as mpolicy's own); ``None`` for any other. Two FLOPs
  per multiply-add."""
  dims = eqn.params.get("dimension_numbers")
  if (len(eqn.invars) != 2 or not isinstance(dims, tuple) or len(dims) != 2
      or not all(isinstance(d, tuple) and len(d) == 2 for d in dims)):
    return None
  (_, rhs_contract), (_, rhs_batch) = dims
  lhs, rhs = (v.aval for v in eqn.invars)
  free = [n for i, n in enumerate(rhs.shape)
          if i not in rhs_contract and i not in rhs_batch]
  flops = 2 * int(np.prod(lhs.shape, dtype=np.int64)) * int(
      np.prod(free, dtype=np.int64))
  dtype = eqn.params.get("compute_dtype") or lhs.dtype
  return flops, np.dtype(dtype)


def is_collective(eqn) -> bool:
  """Whether ``eqn`` names mesh axes (``psum``, ``all_gather``, ...): its
  result on one device depends on the others'."""
  return "axes" in eqn.params or "axis_name" in eqn.params



def cast_target(eqn) -> tuple[np.dtype, bool]:
  """A `convert_element_type` equation's ``(new dtype, plain)``: plain
  unless the cast makes a weakly typed value or names a sharding."""
  p = eqn.params
  plain = not p.get("weak_type", False) and p.get("sharding") is None
  return np.dtype(p["new_dtype"]), plain


def result_dtype(eqn) -> Optional[np.dtype]:
  """The ``preferred_element_type`` of a matmul or convolution, if any."""
  pet = eqn.params.get("preferred_element_type")
  return None if pet is None else np.dtype(pet)


def params_with_result_dtype(eqn, dtype) -> dict:
  """``eqn``'s params asking for results in ``dtype``."""
  return dict(eqn.params, preferred_element_type=np.dtype(dtype))


def out_sharding(eqn):
  """The explicit output sharding a matmul or convolution names, or None."""
  return eqn.params.get("out_sharding")


def dot_params(eqn) -> tuple[Any, Any]:
  """A `dot_general` equation's ``(dimension_numbers, precision)``."""
  return eqn.params["dimension_numbers"], eqn.params.get("precision")


def reduction_order(eqn):
  """The ``reduction_order`` an equation names (JAX 0.12.1: `dot_general`,
  `ragged_dot_general`, the reductions), or None."""
  return eqn.params.get("reduction_order")


def is_leaf_order(order) -> bool:
  """Whether a ``reduction_order`` is one order for a whole contraction
  (None, ``linear``, ``unordered``, a named intrinsic) rather than a
  composite of orders (tiles, padding, a cast, a ring), whose parts name
  dimensions of the result."""
  if order is None or isinstance(order, (str, enum.Enum)):
    return True
  return dataclasses.is_dataclass(order) and all(
      isinstance(getattr(order, f.name), (str, type(None)))
      for f in dataclasses.fields(order))


def unknown_params(eqn, known) -> list[str]:
  """The sorted names of ``eqn``'s params that are not in ``known`` (what
  a newer JAX added that a rule does not know how to carry)."""
  return sorted(set(eqn.params) - set(known))


def ragged_dot_dimension_numbers(eqn):
  """A `ragged_dot_general` equation's ragged dimension numbers."""
  return eqn.params["ragged_dot_dimension_numbers"]


# Params of `conv_general_dilated` about its result rather than its shape.
_CONV_RESULT_PARAMS = ("preferred_element_type", "out_sharding")


def conv_params(eqn_or_params, precision: bool = True) -> dict:
  """The shape params of a convolution (strides, padding, dilations,
  dimension numbers, groups, precision), without those about its result.
  Takes an equation or its params; ``precision=False`` sets the default
  precision (``None``).
  """
  params = getattr(eqn_or_params, "params", eqn_or_params)
  out = {k: v for k, v in params.items() if k not in _CONV_RESULT_PARAMS}
  if not precision:
    out["precision"] = None
  return out


def conv_dimension_numbers(eqn):
  """A convolution equation's `ConvDimensionNumbers` (its specs)."""
  return eqn.params["dimension_numbers"]


def canonical_conv_params(lhs_shape, rhs_shape, **params) -> dict:
  """The shape params a `conv_general_dilated` equation holds for
  `jax.lax.conv_general_dilated`'s keyword arguments (string paddings and
  dimension numbers put in canonical, hashable form)."""
  closed = jax.make_jaxpr(functools.partial(jax.lax.conv_general_dilated,
                                            **params))(
      jax.ShapeDtypeStruct(lhs_shape, jnp.float32),
      jax.ShapeDtypeStruct(rhs_shape, jnp.float32))
  (eqn,) = [e for e in closed.jaxpr.eqns
            if e.primitive is _i.conv_general_dilated_p]
  return conv_params(eqn)


@functools.lru_cache(maxsize=None)
def _conv_result_keys() -> tuple[str, ...]:
  probe = jax.make_jaxpr(lambda a, b: jax.lax.conv(a, b, (1,), "VALID"))(
      jax.ShapeDtypeStruct((1, 1, 1), jnp.float32),
      jax.ShapeDtypeStruct((1, 1, 1), jnp.float32))
  return tuple(k for k in probe.eqns[0].params if k in _CONV_RESULT_PARAMS)


def bind_conv(lhs, rhs, shape_params: Mapping[str, Any], result_dtype=None,
              out_sharding=None):
  """Binds `conv_general_dilated` with ``shape_params`` (see `conv_params`),
  asking for ``result_dtype`` (None: the operands') and ``out_sharding``
  (None: none), whichever of those params the installed JAX's primitive
  takes."""
  extra = {"preferred_element_type": (None if result_dtype is None
                                      else np.dtype(result_dtype))}
  extra.update({k: None for k in _conv_result_keys()
                if k != "preferred_element_type"})
  if "out_sharding" in extra:
    extra["out_sharding"] = out_sharding
  return jax.lax.conv_general_dilated_p.bind(lhs, rhs, **shape_params, **extra)


__all__ = [
    "bind_conv",
    "bind_with",
    "canonical_conv_params",
    "cast_target",
    "conv_dimension_numbers",
    "conv_params",
    "custom_jvp_num_consts",
    "dot_params",
    "is_collective",
    "is_leaf_order",
    "kernel_name",
    "matmul_flops",
    "out_sharding",
    "params_with_result_dtype",
    "ragged_dot_dimension_numbers",
    "reduction_order",
    "result_dtype",
    "scan_options",
    "scan_counts",
    "scan_layout",
    "shard_map_body_context",
    "shard_map_like",
    "shard_map_manual_axes",
    "sub_jaxpr",
    "unknown_params",
    "while_counts",
]
