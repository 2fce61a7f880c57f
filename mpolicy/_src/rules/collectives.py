"""Cross-device sums in the dtype asked (`OpRules.with_collectives`).

A sum across devices of half values (``psum``, ``pmean``'s sum,
``psum_scatter``; inside ``shard_map`` or ``pmap``) runs in the values'
dtype as written: bfloat16 partial sums added in bfloat16. With
``sum_dtype`` set on the table, each such sum under amp casts its half
operands to ``sum_dtype``, sums, and casts the result back to the
operand's dtype, so what the program holds keeps its dtype and only the
sum is wider. Nothing changes where no table asks, for operands already as
wide, and as written (``full_precision()``, a float32 policy).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from mpolicy._src import dtypes
from mpolicy._src.rules import base
from mpolicy._src.rules import facts

# The primitives that add values across devices: `lax.psum` (`psum` with
# check_vma=False or under pmap, `psum_invariant` under check_vma=True),
# `lax.psum_scatter` (`reduce_scatter`).
SUMS = ("psum", "psum_invariant", "reduce_scatter")


def _sum_in(op: base.Op) -> Optional[list]:
  """The sum in the table's ``sum_dtype``, cast back; ``None`` (declines)
  where nothing is asked or nothing is narrower."""
  wide = op.rules.collective_sum_dtype
  if wide is None or op.op_class == base.AS_WRITTEN:
    return None
  narrow = [dtypes.dtype_of(a) for a in op.args]
  if not any(dtypes.is_float(d) and d.itemsize < wide.itemsize
             for d in narrow):
    return None
  args = [base.cast_as_traced(op.env, a, wide)
          if dtypes.is_float(d) and d.itemsize < wide.itemsize else a
          for a, d in zip(op.args, narrow)]
  outs = base.bind(op.eqn, args)
  op.args = args
  op.rule = f"sum in {wide.name}"
  op.why = (f"cross-device sum in {wide.name} (OpRules.with_collectives), "
            f"cast back to {', '.join(sorted({d.name for d in narrow}))}")
  op.ran_in = wide.name
  return [base.cast_as_traced(op.env, o, d) for o, d in zip(outs, narrow)]


facts.register(SUMS, special=_sum_in)


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
