"""What float8 quantization loses, measured on a probe batch.

`fp8_stats` runs a function once forward and backward with the float8
probe open (`rules.fp8_probe`) and reports, for each float8 matmul and
convolution, the fraction of its operands' and its cotangent's values that
underflowed to zero and that saturated, and the range of the scales used.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from mpolicy._src import amp as amp_lib
from mpolicy._src import arguments
from mpolicy._src import dtypes
from mpolicy._src import tables
from mpolicy._src.rules import fp8_probe

ROLES = ("lhs", "rhs", "cotangent")
"""The quantized values of one op: its two operands, then its cotangent."""

Counts = fp8_probe.Counts


@dataclasses.dataclass(frozen=True)
class Fp8Row:
  """One float8 op and what quantizing its values lost.

  Attributes:
    scope: the name scope it was traced under (``""`` at top level).
    primitive: ``"dot_general"`` or ``"conv_general_dilated"``.
    shapes: its operands' shapes, ``"MxK, KxN"``.
    counts: `Counts` by role (``"lhs"``, ``"rhs"``, ``"cotangent"``; the
      cotangent's only where the backward pass reached the op).
  """
  scope: str
  primitive: str
  shapes: str
  counts: dict[str, Counts]

  def underflow(self, role: str) -> float:
    """Fraction of ``role``'s nonzero values that became zero in float8."""
    return self.counts[role].underflow_fraction

  def saturated(self, role: str) -> float:
    """Fraction of ``role``'s values clamped to the float8 range."""
    return self.counts[role].saturated_fraction


@dataclasses.dataclass(frozen=True)
class Fp8Report:
  """What `fp8_stats` found: one `Fp8Row` per float8 op, in trace order.

  ``str(report)`` is a table: per op and role, the underflow and saturation
  percentages and the scale range.
  """
  rows: tuple[Fp8Row, ...]
  note: str = ""

  def to_dict(self) -> dict[str, Any]:
    """Plain data for logging or JSON."""
    return {"rows": [{"scope": r.scope, "primitive": r.primitive,
                      "shapes": r.shapes,
                      "counts": {k: dataclasses.asdict(v)
                                 for k, v in r.counts.items()}}
                     for r in self.rows],
            "note": self.note}

  def __str__(self) -> str:
    header = ("scope", "primitive", "shapes", "values", "underflow",
              "saturated", "scales")
    lines = []
    for r in self.rows:
      for role in ROLES:
        c = r.counts.get(role)
        if c is None:
          continue
        lines.append((r.scope or "-", r.primitive, r.shapes, role,
                      f"{100 * c.underflow_fraction:.3f}%",
                      f"{100 * c.saturated_fraction:.3f}%",
                      f"{c.scale_min:.3g} .. {c.scale_max:.3g}"))
    out = [tables.text_table(header, lines)]
    out.append(f"{len(self.rows)} float8 op{'' if len(self.rows) == 1 else 's'}"
               + (f" ({self.note})" if self.note else ""))
    return "\n".join(out)


def fp8_stats(fn: Callable[..., Any], *args, **kwargs) -> Fp8Report:
  """Runs ``fn(*args, **kwargs)`` forward and backward on a probe batch and
  reports, per float8 op, what quantization lost.

  ``fn`` is an `amp`-ed function (or `transform_amp`'s ``apply``) under a
  float8 policy (``c=f8``). The forward pass quantizes each op's operands,
  the backward pass (the gradient of the sum of ``fn``'s floating outputs
  with respect to its floating array arguments: pass your loss function to
  see the cotangents training sees) its cotangent. For each, the report
  gives the fraction of nonzero values that underflowed to zero, the
  fraction clamped to the float8 range (non-finite values included), and
  the smallest and largest scale. Counts add up over every call of an op
  (inside a loop, say). The program runs for real, once, with extra
  reductions and host callbacks; a later call of ``fn`` compiles without
  them.

  >>> import jax, jax.numpy as jnp
  >>> import mpolicy
  >>> f = mpolicy.amp(lambda x, w: jnp.sum(x @ w), "p=f32,c=f8,o=f32")
  >>> x = jnp.array([[1.0, 1e-9], [2.0, 3.0]])
  >>> report = fp8_stats(f, x, jnp.ones((2, 3)))
  >>> (row,) = report.rows
  >>> row.primitive, row.shapes, sorted(row.counts)
  ('dot_general', '2x2, 2x3', ['cotangent', 'lhs', 'rhs'])
  >>> row.counts["lhs"].underflow, row.saturated("rhs")
  (1, 0.0)

  Args:
    fn: the function, as you would call it.
    *args, **kwargs: a probe batch: its arguments.

  Returns:
    An `Fp8Report`.

  See also: `explain` (which dtype each op ran in), `amp`.
  """
  arguments.require_callable(
      fn, "fp8_stats", "fn", "an amp-ed function under a float8 policy, "
      "called as fp8_stats(fn, *args)")
  static, arrays = amp_lib.split_arguments(args, kwargs)
  wrt = tuple(i for i, a in enumerate(arrays) if dtypes.float_value(a))

  def flat(*arrays):
    a, k = amp_lib.join_arguments(static, arrays)
    return fn(*a, **k)

  def total(*arrays):
    leaves = jax.tree_util.tree_leaves(flat(*arrays))
    return sum(jnp.sum(l.astype(jnp.float32)) for l in leaves
               if dtypes.float_value(l))

  with fp8_probe.probe() as sites:
    if wrt:
      jax.grad(total, argnums=wrt)(*arrays)
    else:
      flat(*arrays)
    jax.effects_barrier()
  rows = tuple(Fp8Row(s.scope, s.primitive, s.shape, dict(s.counts))
               for s in sites.values())
  note = "" if rows else ("no float8 op ran: is fn amp-ed under a policy "
                          "whose compute dtype is f8?")
  return Fp8Report(rows, note)
