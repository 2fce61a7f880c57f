"""Primitives whose handling does not follow from their op class.

An explicit cast, a bit reinterpretation, a write to a mutable reference,
and a broadcast or gather of a value cast down from float32. Each rule is
registered as its primitive's ``special`` fact; a special rule may decline
(return ``None``), and the class rule then runs. The primitives that make,
read, write or freeze references are bound as they are (``binds_plainly``).
Host callbacks and Pallas kernels are in `kernels`.
"""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp
import numpy as np

from mpolicy._src import dtypes
from mpolicy._src import jax_compat
from mpolicy._src import regions
from mpolicy._src.rules import base
from mpolicy._src.rules import facts
from mpolicy._src.rules import half_storage

# The JAX functions that cast (the function the user's code called, as
# `jax_compat.called_jax_function` names it): `x.astype`, `jnp.astype`,
# `jnp.asarray`, `jnp.array`, `jnp.float32(x)`, `lax.convert_element_type`.
_CAST_FUNCTIONS = frozenset({"astype", "_astype", "asarray", "array",
                             "convert_element_type", "_ScalarMeta.__call__"})

CODE_CASTS = ("explicit cast", "policy cast", base.JAX_CAST)
"""Rules of casts that are the code's own (not counted as inserted)."""


def _written_cast(eqn) -> tuple[bool, str]:
  """Whether a cast was written in the code (else JAX made it inside the
  function it names, such as a type promotion in ``jnp.mean``)."""
  called = jax_compat.called_jax_function(eqn)
  if called is None:
    return True, ""
  name = called[1] or "a function JAX traced itself"
  return (name in _CAST_FUNCTIONS
          or name.rsplit(".", 1)[-1] in _CAST_FUNCTIONS - {"__call__"}), name


def _convert(op: base.Op) -> Optional[list]:
  """A cast: made through the environment's cache (at most once)."""
  new_dtype, plain = jax_compat.cast_target(op.eqn)
  if not plain:
    return None
  what = regions.policy_cast_of(op.names)
  written, inside = _written_cast(op.eqn)
  if what is not None:
    op.rule = "policy cast"
    op.why = f"the module's policy casts its {what}"
  elif written:
    op.rule, op.why = "explicit cast", "convert_element_type in the traced code"
  else:
    op.rule = base.JAX_CAST
    op.why = f"convert_element_type that JAX made inside {inside}"
  if op.op_class == base.AS_WRITTEN:
    # As written: the cast alone, as XLA would compile it without `amp`
    # (no rounding made explicit, see `widen`).
    return base.bind(op.eqn, op.args)
  if op.rule == base.JAX_CAST and _loses_range(op, new_dtype):
    op.why += ("; kept in float32, as a full op's result: float16 would "
               "overflow where float32 does not")
    op.ran_in = "float32"
    return [op.args[0]]
  if op.rule == base.JAX_CAST and _rounds_a_float32_result(op, new_dtype):
    op.why += ("; kept in float32, as a full op's result (the code traced "
               "on float32 values has no such cast)")
    op.ran_in = "float32"
    return [op.args[0]]
  return [op.env.cast(op.args[0], new_dtype)]


def _loses_range(op: base.Op, new_dtype) -> bool:
  """Whether ``op`` is JAX narrowing a float32 value it computed back to
  float16: ``jnp.var`` of a float16 array computes in float32 and returns
  float16, and a variance past 65504 becomes inf there (a LayerNorm then
  hands on its offset alone, every value finite). Kept in float32, the
  statistic reaches its readers (``rsqrt``, ``x - mean``) whole, as a
  ``full`` op's float32 result does under float16."""
  x = op.args[0]
  return (np.dtype(new_dtype) == jnp.float16
          and dtypes.dtype_of(x) == jnp.float32 and dtypes.is_traced(x)
          and op.env.const_of(x) is None)


def _rounds_a_float32_result(op: base.Op, new_dtype) -> bool:
  """Whether ``op`` is JAX rounding a result it computed in float32 back to
  the half dtype of its input, under a half policy: ``jnp.mean`` and
  ``jax.nn.logsumexp`` of a half array sum in float32 and return half. In
  code traced on half values (a module a class policy governs casts its
  inputs to the compute dtype) that would round a loss or a statistic
  that the same code traced on float32 values keeps in float32 (a
  per-token loss, ``logsumexp(z) - z[label]``, and its mean). Only in a
  module call: elsewhere a half value is the code's own (``jnp.var(
  x.astype(jnp.bfloat16))`` is rounded as JAX rounds it)."""
  x = op.args[0]
  return (op.half_compute() is not None
          and op.region is not None and op.region.module_class is not None
          and np.dtype(new_dtype) == np.dtype(op.eqn.outvars[0].aval.dtype)
          and dtypes.is_half(new_dtype)
          and np.dtype(op.eqn.invars[0].aval.dtype) == jnp.float32
          and dtypes.dtype_of(x) == jnp.float32 and dtypes.is_traced(x)
          and op.env.const_of(x) is None)


facts.register(jax_compat.convert_element_type_p, special=_convert,
               casts=True)


def _reinterpret(op: base.Op) -> list:
  """Bit casts and random bits: floating inputs keep their traced dtypes."""
  op.rule, op.why = base.AS_WRITTEN, "reinterprets bits: runs as traced"
  return base.bind(op.eqn, [base.cast_as_traced(op.env, a, v.aval.dtype)
                            for a, v in zip(op.args, op.eqn.invars)])


facts.register(jax_compat.bitcast_convert_type_p, special=_reinterpret)


def _store(op: base.Op) -> list:
  """A write to a mutable reference (a scan3 loop's carry): the value is
  cast to the reference's dtype, which is the dtype the value entered the
  loop with, as a classic scan's carry keeps it."""
  ref, value, *rest = op.args
  op.rule = base.AS_WRITTEN
  op.why = "write to a reference: the value in the reference's dtype"
  op.args = [ref, base.cast_as_traced(op.env, value, dtypes.dtype_of(ref)),
             *rest]
  return base.bind(op.eqn, op.args)


facts.register([p for p in (jax_compat.ref_swap_p, jax_compat.ref_addupdate_p)
                if p is not None], special=_store)
# Making, reading, writing and freezing references: bound as is, never
# through `staged`'s linearization cache (`base.bind`): a traced function
# may not return a reference.
facts.register(("new_ref", "empty_ref", "get", "swap", "addupdate", "freeze"),
               binds_plainly=True)


def _in_wider_source(op: base.Op) -> Optional[list]:
  """A broadcast or gather of a value cast down from float32 (a bias, an
  embedding table) runs on the float32 value, then casts; so does a gather
  of a float32 parameter under a half policy (an embedding lookup), whose
  rows are then used in the compute dtype.

  The values are the same, and under grad the transpose (a sum over the
  broadcast dims, a scatter-add into the table) accumulates in float32
  instead of in half. On GPUs a half scatter-add into a small table is also
  slow: its atomics contend. Declines for primitives the table classes, and
  inside `full_precision()`.
  """
  x = op.args[0]
  if op.op_class is not None:
    return None
  # A broadcast, as a function of its one operand (cast before it spreads).
  fn = base.bound(op.eqn) if op.facts.spreads and len(op.args) == 1 else None
  wide = op.env.wider_source(x)
  if wide is not x:
    op.why = (f"{op.prim.name} of a down-cast value: runs in its wider dtype, "
              "then cast (its gradient sums in float32)")
    if fn is not None:
      # The same values, cast before they are spread: the forward pass
      # converts the small array only (see `half_storage.cast_after`).
      out = half_storage.cast_after(fn, wide, dtypes.dtype_of(x))
      op.env.mark_wider(out, lambda: _spread(op.env, fn, wide),
                        param=op.env.is_param(wide))
      return [out]
    outs = base.bind(op.eqn, [wide, *op.args[1:]])
    if op.env.is_param(wide):
      op.env.mark_param(outs[0])  # Rows of a parameter table.
    return [op.env.cast(o, dtypes.dtype_of(x)) for o in outs]
  compute = op.half_compute()
  if (fn is not None and compute is not None and op.env.is_param(x)
      and dtypes.float_value(x) and not dtypes.is_double(dtypes.dtype_of(x))
      and dtypes.dtype_of(x).itemsize > compute.itemsize):
    # A broadcast parameter (a bias): used in the compute dtype, it is cast
    # before it is spread (see `half_storage.cast_after`).
    (out,) = base.bind(op.eqn, op.args)
    op.env.precast(out, compute,
                   lambda: half_storage.cast_after(fn, x, compute))
    return [out]
  if (op.facts.looks_up and compute is not None
      and op.env.is_param(x) and dtypes.float_value(x)
      and not dtypes.is_double(dtypes.dtype_of(x))
      and dtypes.dtype_of(x).itemsize > compute.itemsize):
    # An embedding lookup: the rows a parameter table gives are used in the
    # compute dtype, as the table cast by a module's policy would give them.
    op.why = (f"gather of a {dtypes.dtype_of(x).name} parameter: runs in "
              f"{dtypes.dtype_of(x).name}, its rows used in the compute dtype "
              f"{compute.name} (policy from {op.decided_by}; its gradient "
              "sums in float32)")
    return [op.env.cast(o, compute) for o in base.bind_op(op)]
  return None


def _spread(env, fn, wide):
  """``fn(wide)``, a parameter still if ``wide`` is one."""
  out = fn(wide)
  if env.is_param(wide):
    env.mark_param(out)
  return out


facts.register((jax_compat.broadcast_in_dim_p, jax_compat.gather_p),
               special=_in_wider_source)
facts.register(jax_compat.gather_p, looks_up=True)
