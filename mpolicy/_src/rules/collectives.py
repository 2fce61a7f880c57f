"""Cross-device sums in the dtype asked (`OpRules.with_collectives`).

A sum across devices of half values (``psum``, ``pmean``'s sum,
``psum_scatter``; inside ``shard_map`` or ``pmap``) runs in the values'
dtype as written: bfloat16 partial sums added in bfloat16. With
``sum_dtype`` set on the table, each such sum under amp casts its half
operands to ``sum_dtype``, sums, and casts the result back to the
operand's dtype, so what the program holds keeps its dtype and only the
sum is wider. Nothing changes where no table asks, for operands already as
wide, and as written (``full_precision()``, a float32 policy).

Under `jax.jit` without ``shard_map``, XLA's partitioner places the sums of
a matmul whose contracting dimension is sharded when it compiles, on the
matmul's result. There ``sum_dtype`` makes each half matmul and
convolution ask for its result in ``sum_dtype`` and cast it after (on CPU
they already do; on GPUs and TPUs they would ask for the half result):
`partitioned_sum_dtype`.

Two collectives sum in their transpose, which JAX's AD writes when it
differentiates the interpreted program: an ``all_gather`` (FSDP's gather of
a weight shard; its transpose is a reduce-scatter of the gradient) and a
``pvary`` (a replicated value used by varying ones; its transpose is a
``psum`` of the gradient). Under ``sum_dtype`` each runs forward as
written, inside a `jax.custom_vjp` whose backward is that transpose in
``sum_dtype``.

The gradient helpers (`make_train_step`, `scaled_value_and_grad` with an
``axis_name``) differentiate inside `gradient_sums_in` their
``reduce_dtype``: there those transposes (and a ``psum``'s, a ``psum``
where JAX's types do not make it a ``pvary``) sum in the wider of the
table's ``sum_dtype`` and ``reduce_dtype``, even as written.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from mpolicy._src import dtypes
from mpolicy._src import jax_compat
from mpolicy._src.rules import base
from mpolicy._src.rules import classes
from mpolicy._src.rules import facts
from mpolicy._src.rules import fp8_mesh

# The primitives that add values across devices: `lax.psum` (`psum` with
# check_vma=False or under pmap, `psum_invariant` under check_vma=True),
# `lax.psum_scatter` (`reduce_scatter`).
SUMS = ("psum", "psum_invariant", "reduce_scatter")


# The dtype (its name) the gradient helpers ask the sums of the backward
# pass to run in while they differentiate: part of every jit cache key.
_GRADIENT_SUMS = jax.make_user_context(default_value=None)


def gradient_sums_in(dtype):
  """A block (a context manager) in which the transposes of amp-ed
  collectives sum in ``dtype`` at least (``None``: as the table says)."""
  return _GRADIENT_SUMS(None if dtype is None else np.dtype(dtype).name)


def _asked(op: base.Op, backward: bool) -> Optional[np.dtype]:
  """The sum dtype asked of ``op``'s sum (``backward``: of its
  transpose's): the table's, and in the backward pass the gradient
  helpers' too (the wider)."""
  asked = [] if op.op_class == base.AS_WRITTEN else [
      op.rules.collective_sum_dtype]
  if backward:
    asked.append(_GRADIENT_SUMS.value)
  dtypes = [np.dtype(d) for d in asked if d is not None]
  return max(dtypes, key=lambda d: d.itemsize) if dtypes else None


def _wider(op: base.Op, backward: bool = False
           ) -> tuple[Optional[np.dtype], list, list]:
  """``(sum_dtype, operand dtypes, the dtype each operand is summed in)``;
  ``sum_dtype`` is ``None`` where nothing is asked or no floating operand
  is narrower."""
  wide = _asked(op, backward)
  narrow = [dtypes.dtype_of(a) for a in op.args]
  if wide is None:
    return None, narrow, narrow
  widen = [wide if dtypes.is_float(d) and d.itemsize < wide.itemsize else d
           for d in narrow]
  return (wide if widen != narrow else None), narrow, widen


def _sum_in(op: base.Op) -> Optional[list]:
  """The sum in the table's ``sum_dtype``, cast back; ``None`` (declines)
  where nothing is asked or nothing is narrower."""
  wide, narrow, widen = _wider(op)
  if wide is None:
    # A psum's transpose is a psum (pmap, check_vma=False).
    return _summed_back_in(op) if op.eqn.primitive.name == "psum" else None
  args = [base.cast_as_traced(op.env, a, d) for a, d in zip(op.args, widen)]
  outs = base.bind(op.eqn, args)
  op.args = args
  op.rule = f"sum in {wide.name}"
  op.why = (f"cross-device sum in {wide.name} (OpRules.with_collectives), "
            f"cast back to {', '.join(sorted({d.name for d in narrow}))}")
  op.ran_in = wide.name
  return [base.cast_as_traced(op.env, o, d) for o, d in zip(outs, narrow)]


facts.register(SUMS, special=_sum_in)


def _summed_back_in(op: base.Op) -> Optional[list]:
  """The collective as written, its transpose (a sum) in ``sum_dtype``."""
  wide, narrow, widen = _wider(op, backward=True)
  if wide is None:
    return None
  eqn = op.eqn
  # Zeros typed as the operands (their shapes, the wide dtype, the mesh
  # axes they vary over): where `linear_transpose` reads the types from.
  types = [(np.shape(a), d, jax_compat.varying_axes(a))
           for a, d in zip(op.args, widen)]

  def forward(*xs):
    return tuple(base.bind(eqn, list(xs)))

  @jax.custom_vjp
  def collective(*xs):
    return forward(*xs)

  def fwd(*xs):
    return collective(*xs), None

  def bwd(_, cts):
    cts = tuple(ct.astype(d) for ct, d in zip(cts, widen))
    zeros = [jax_compat.make_varying(jnp.zeros(shape, d), vma)
             for shape, d, vma in types]
    back = jax.linear_transpose(forward, *zeros)(cts)
    return tuple(b.astype(d) for b, d in zip(back, narrow))

  collective.defvjp(fwd, bwd)
  op.rule = "as written"
  op.why = (f"runs as written; its transpose sums across devices in "
            f"{wide.name} (OpRules.with_collectives, or the gradient "
            "helpers' reduce_dtype)")
  return list(collective(*op.args))


def _pvary(op: base.Op) -> list:
  """`pvary` as `_summed_back_in` runs it, else as its inputs; its inputs
  recorded for the float8 scales (`fp8_mesh`)."""
  outs = _summed_back_in(op)
  return fp8_mesh.record_pvary(op, outs if outs is not None
                               else classes.inputs(op))


facts.register("all_gather", special=_summed_back_in)
facts.register("pvary", special=_pvary)


def check_sum_dtype(sum_dtype) -> Optional[np.dtype]:
  """``sum_dtype`` as a floating ``np.dtype`` (or ``None``), else a
  ValueError naming the argument."""
  if sum_dtype is None:
    return None
  try:
    dtype = np.dtype(sum_dtype)
  except TypeError:
    dtype = None
  if dtype is None or not dtypes.is_float(dtype):
    raise ValueError(
        "OpRules.with_collectives: sum_dtype must be a floating dtype (e.g. "
        "jnp.float32) or None (each sum in its operands' dtype), got "
        f"{sum_dtype!r}.")
  return dtype


def partitioned_sum_dtype(op: base.Op, out_dtype) -> Optional[np.dtype]:
  """The dtype a half matmul's or convolution's result should have on GPUs
  and TPUs for the sums XLA's partitioner places on it (a contracting
  dimension sharded under `jax.jit`) to run in the table's ``sum_dtype``;
  ``None`` where none is asked, the result is as wide, or the program runs
  inside `shard_map` / `pmap` (whose sums are its own collectives). Notes
  it on ``op`` for `explain`."""
  wide = op.rules.collective_sum_dtype
  if (wide is None or wide.itemsize <= np.dtype(out_dtype).itemsize
      or jax_compat.bound_axis_names()):
    return None
  op.why += (f"; result in {wide.name} on GPU and TPU, so sums XLA's "
             "partitioner places on it run in it (OpRules.with_collectives)")
  return wide
