"""The int8 matmul's rule under ``c=int8``, and what an export tells it.

The matmuls the float8 placement admits (`fp8_placement.admit`: weight
matmuls above the size threshold) run as `blocks.int8.dot_general`: each
operand read as the program gives it (a float32 parameter as float32),
quantized to int8 along its contracting dimensions, multiplied exactly in
int32, rescaled and rounded to the result dtype (bfloat16); the backward
pass is the bfloat16 matmul's (straight-through). The weight is the right
operand where it is a parameter or input, else the left one where that
is (``weight @ x``).

`Weights` is how `export_quantized` talks to the rule, through the
environment the program runs in (`Env.int8`): it counts every read of
every value, records each value the rule reads as an int8 operand, and
gives the rule int8 codes and scales to use instead of quantizing a value
(a weight stored in int8).
"""

from __future__ import annotations

import collections
import functools
from typing import Any, Callable, Optional
import warnings

from mpolicy._src import jax_compat
from mpolicy._src import observe
from mpolicy._src.blocks import int8
from mpolicy._src.rules import base
from mpolicy._src.rules import fp8_placement

REASON = ("int8 operands, the weight scaled per output channel and the "
          "other per row (amax/127 at each call, round half to even), "
          "int8 x int8 summed in int32; backward straight-through, as the "
          "bfloat16 matmul")


class Weights:
  """The int8 rule's side of an export (see the module doc).

  Attributes:
    given: ``id(value) -> (q, s, contracting)``: the value arrives
      quantized (``contracting``: the axes its scales were taken over).
    reads: ``id(value) -> n``: how many equations read it.
    operands: ``id(source) -> [(value, contracting), ...]``: each int8
      operand read whose widest value at hand (`Env.wider_source`) is
      ``source``: the value the matmul read and the axes it contracts.
  """

  def __init__(self, given: Optional[dict] = None):
    self.given = {} if given is None else given
    self.reads: collections.Counter = collections.Counter()
    self.operands: dict[int, list] = collections.defaultdict(list)
    self._keep: list[Any] = []  # Keeps the ids above alive.

  def read(self, value) -> None:
    """Counts one read of ``value`` by an equation."""
    self.reads[id(value)] += 1
    self._keep.append(value)

  def record(self, value, source, contracting: tuple[int, ...]) -> None:
    """Records an int8 operand read: ``value``, widest as ``source``."""
    self.operands[id(source)].append((value, contracting))
    self._keep += [value, source]

  def only_int8(self, source) -> Optional[tuple[int, ...]]:
    """The contracting axes of ``source`` if every read of it is an int8
    operand's, directly or through casts read by int8 matmuls only, all
    contracting the same axes; else ``None``."""
    uses = self.operands.get(id(source), [])
    axes = {c for _, c in uses}
    if len(axes) != 1:
      return None
    direct = sum(1 for v, _ in uses if v is source)
    casts = {id(v) for v, _ in uses if v is not source}
    per_cast = collections.Counter(id(v) for v, _ in uses if v is not source)
    if self.reads[id(source)] != direct + len(casts):
      return None
    if any(self.reads[c] != n for c, n in per_cast.items()):
      return None
    return axes.pop()


def decline(op: base.Op, why: str) -> None:
  """Runs ``op`` as under bfloat16 (returns ``None``), saying so in
  `explain` and in a warning: ``c=int8`` never drops an op in silence."""
  op.note = f", not int8: {why}"
  where = f" at {op.scope!r}" if op.scope else ""
  warnings.warn(
      f"c=int8: the {op.prim.name}{where} {why}. Give it a bfloat16 policy "
      "(set_policy on its module or name scope) to say so and silence this; "
      "export_quantized keeps its weights as they are.", UserWarning,
      stacklevel=2)
  return None


def lower(op: base.Op, sizes: tuple[int, ...],
          bf16_dot: Callable[..., Any]) -> Optional[list]:
  """The int8 matmul of ``op`` where the placement admits it, else
  ``None`` (it runs as under bfloat16). ``sizes``: its ``(B,) M, K, N``;
  ``bf16_dot(lhs, rhs, *, dimension_numbers, precision, out_dtype)``: the
  backward pass's matmul."""
  order = jax_compat.reduction_order(op.eqn)
  if order is not None:
    decline(op, f"names reduction_order={order!r}, which int8's exact "
            "int32 sums have no use for; it runs in bfloat16, its order kept")
    return None
  dims, precision = jax_compat.dot_params(op.eqn)
  admitted = fp8_placement.admit(op, "dot", sizes, REASON)
  if admitted is None:
    return None
  lhs, rhs, out_dtype, label = admitted
  env = op.env
  weight = "lhs" if env.is_param(lhs) and not env.is_param(rhs) else "rhs"
  (lc, rc), _ = dims
  hook: Optional[Weights] = getattr(env, "int8", None)
  given = [None, None]
  if hook is not None:
    for i, (read, source, axes) in enumerate(((op.args[0], lhs, tuple(lc)),
                                              (op.args[1], rhs, tuple(rc)))):
      hook.record(read, source, axes)
      stored = hook.given.get(id(source))
      if stored is not None and stored[2] == axes:
        given[i] = stored[:2]
  for role, x, axes in (("lhs", lhs, lc), ("rhs", rhs, rc)):
    if label is not None:
      q, s = int8.quantize(x, tuple(axes))
      observe.quantized(label, observe.Quantization(
          role, int8.NAME, x, q=q, scale=s, fmax=float(int8.QMAX)))
  if given != [None, None]:  # A served program: no gradient.
    return [int8.matmul(lhs, rhs, dims, out_dtype, weight=weight,
                        lhs_given=given[0], rhs_given=given[1])]
  backward = functools.partial(bf16_dot, dimension_numbers=dims,
                               precision=precision, out_dtype=out_dtype)
  return [int8.dot_general(lhs, rhs, dims, out_dtype=out_dtype,
                           weight=weight, backward=backward)]
