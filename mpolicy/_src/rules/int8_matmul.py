"""The int8 matmul's rule under ``c=int8``, and what an export tells it.

The matmuls the float8 placement admits (`fp8_placement.admit`: weight
matmuls above the size threshold) run as `blocks.int8.matmul` (the
``int8`` value of `quantized_matmul`): each
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
from typing import Any, Optional
import warnings

from mpolicy._src import observe
from mpolicy._src.blocks import int8
from mpolicy._src.rules import base

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


def keep_order(op: base.Op, order) -> None:
  """A dot naming a reduction order runs as under bfloat16, saying so."""
  decline(op, f"names reduction_order={order!r}, which int8's exact "
          "int32 sums have no use for; it runs in bfloat16, its order kept")


def given(op: base.Op, lhs, rhs, dims, label):
  """What an export (`Env.int8`) learns from and gives an admitted int8
  matmul of ``lhs`` and ``rhs`` (the widest values of its operands): each
  read is recorded; the operands stored in int8 come back as ``(q, s)``
  pairs, ``(lhs's or None, rhs's or None)``, else ``None``. The observers
  are told both quantizations."""
  (lc, rc), _ = dims
  hook: Optional[Weights] = getattr(op.env, "int8", None)
  stored = [None, None]
  if hook is not None:
    for i, (read, source, axes) in enumerate(((op.args[0], lhs, tuple(lc)),
                                              (op.args[1], rhs, tuple(rc)))):
      hook.record(read, source, axes)
      kept = hook.given.get(id(source))
      if kept is not None and kept[2] == axes:
        stored[i] = kept[:2]
  for role, x, axes in (("lhs", lhs, lc), ("rhs", rhs, rc)):
    if label is not None:
      q, s = int8.quantize(x, tuple(axes))
      observe.quantized(label, observe.Quantization(
          role, int8.NAME, x, q=q, scale=s, fmax=float(int8.QMAX)))
  return None if stored == [None, None] else tuple(stored)
