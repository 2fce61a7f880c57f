"""What float8, block-format and int8 quantization loses, measured on a
probe batch.

`fp8_stats` runs a function once forward and backward, watching the
interpreter through its seam (`observe`): the rule of each float8,
block-format or int8 matmul and convolution tells the seam of every value it
quantizes (its operands forward, its cotangent backward), and the counter
here adds up, per op, role and format, the values that underflowed to zero
and that saturated, and the range of the scales used.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Any, Callable

import jax
import jax.numpy as jnp

from mpolicy._src import amp as amp_lib
from mpolicy._src import arguments
from mpolicy._src import dtypes
from mpolicy._src import observe
from mpolicy._src import tables
from mpolicy._src.blocks import quantize as blocks_quantize

ROLES = ("lhs", "rhs", "cotangent")
"""The quantized values of one op: its two operands, then its cotangent."""

_LOCK = threading.Lock()


@dataclasses.dataclass
class Counts:
  """What one value's quantizations lost, summed over the calls seen.

  Attributes:
    values: how many values were quantized.
    nonzero: how many of them were nonzero.
    underflow: nonzero values that became zero.
    saturated: values beyond the format's range (clamped at its largest
      value, after their scale), non-finite ones included.
    scale_min, scale_max: the smallest and largest scale used (for a block
      format, the blocks' scales; nvfp4's times its tensor scale).
    calls: how many quantizations were counted.
    format: the format: ``"float8_e4m3fn"``, ``"float8_e5m2"``,
      ``"mxfp8"``, ``"mxfp4"``, ``"nvfp4"`` or ``"int8"``.
  """
  values: int = 0
  nonzero: int = 0
  underflow: int = 0
  saturated: int = 0
  scale_min: float = float("inf")
  scale_max: float = float("-inf")
  calls: int = 0
  format: str = ""

  def add(self, values, nonzero, underflow, saturated, smin, smax,
          calls=1) -> None:
    self.values += int(values)
    self.nonzero += int(nonzero)
    self.underflow += int(underflow)
    self.saturated += int(saturated)
    self.scale_min = min(self.scale_min, float(smin))
    self.scale_max = max(self.scale_max, float(smax))
    self.calls += int(calls)

  @property
  def underflow_fraction(self) -> float:
    """Nonzero values that became zero, as a fraction of the nonzero ones."""
    return self.underflow / self.nonzero if self.nonzero else 0.0

  @property
  def saturated_fraction(self) -> float:
    """Values clamped to the format's range, as a fraction of all values."""
    return self.saturated / self.values if self.values else 0.0


def _float8_stats(qz: observe.Quantization) -> tuple:
  x = qz.x.astype(jnp.float32)
  nonzero = x != 0
  return (jnp.asarray(x.size, jnp.int32), jnp.sum(nonzero, dtype=jnp.int32),
          jnp.sum(nonzero & (qz.q.astype(jnp.float32) == 0), dtype=jnp.int32),
          jnp.sum(~(jnp.abs(x / qz.scale) <= qz.fmax), dtype=jnp.int32),
          jnp.min(qz.scale), jnp.max(qz.scale))


def _int8_stats(qz: observe.Quantization) -> tuple:
  """An element underflows if nonzero but quantized to zero, is clipped if
  its quotient by its scale rounds beyond +-127 (or is not finite)."""
  x = qz.x.astype(jnp.float32)
  nonzero = x != 0
  clipped = ~(jnp.abs(jnp.round(x / qz.scale)) <= qz.fmax)
  return (jnp.asarray(x.size, jnp.int32), jnp.sum(nonzero, dtype=jnp.int32),
          jnp.sum(nonzero & (qz.q == 0), dtype=jnp.int32),
          jnp.sum(clipped | ~jnp.isfinite(x), dtype=jnp.int32),
          jnp.nanmin(qz.scale), jnp.nanmax(qz.scale))


def _block_stats(qz: observe.Quantization) -> tuple:
  """An element underflows if nonzero but quantized to zero, saturates if
  clamped at the format's largest element after its block's scale (or not
  finite); counted as rounding to nearest quantizes."""
  q = blocks_quantize.quantize_blocks(qz.x, qz.fmt, qz.axis, two_d=qz.two_d)
  x = qz.x.astype(jnp.float32)
  back = blocks_quantize.dequantize_blocks(q)
  elements = q.elements.astype(jnp.float32)
  fmax = float(jnp.finfo(q.elements.dtype).max)
  nonzero = x != 0
  clamped = (jnp.abs(elements) == fmax) & (jnp.abs(x) > jnp.abs(back))
  scales = q.scales.astype(jnp.float32)
  if q.tensor_scale is not None:
    scales = scales * q.tensor_scale
  return (jnp.asarray(x.size, jnp.int32), jnp.sum(nonzero, dtype=jnp.int32),
          jnp.sum(nonzero & jnp.isfinite(x) & (elements == 0),
                  dtype=jnp.int32),
          jnp.sum(~jnp.isfinite(x) | clamped, dtype=jnp.int32),
          jnp.nanmin(scales), jnp.nanmax(scales))


class _Counter(observe.Observer):
  """Counts each quantization the rules tell the seam of, per op and role
  (on the host, as the program runs)."""

  def __init__(self):
    self.ops: dict[int, tuple[observe.QuantizedOp, dict[str, Counts]]] = {}

  def quantized(self, op: observe.QuantizedOp,
                quantization: observe.Quantization) -> None:
    counts = self.ops.setdefault(id(op), (op, {}))[1]
    if quantization.fmt == "int8":
      stats = _int8_stats(quantization)
    elif quantization.q is not None:
      stats = _float8_stats(quantization)
    else:
      stats = _block_stats(quantization)
    jax.debug.callback(functools.partial(
        _collect, counts, quantization.role, quantization.fmt), *stats)


def _collect(counts: dict, role: str, fmt: str, *stats) -> None:
  with _LOCK:
    counts.setdefault(role, Counts(format=fmt)).add(*stats)


@dataclasses.dataclass(frozen=True)
class Fp8Row:
  """One float8 or block-format op and what quantizing its values lost.

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
  """What `fp8_stats` found: one `Fp8Row` per quantized op, in trace order.

  ``str(report)`` is a table: per op and role, the format, the underflow
  and saturation percentages and the scale range; then the same per format
  (`by_format`).
  """
  rows: tuple[Fp8Row, ...]
  note: str = ""

  def by_format(self) -> dict[str, Counts]:
    """The counts summed over every op and role, per format, in the order
    first seen (``{"float8_e4m3fn": ..., "float8_e5m2": ...}``)."""
    out: dict[str, Counts] = {}
    for r in self.rows:
      for role in ROLES:
        c = r.counts.get(role)
        if c is not None:
          out.setdefault(c.format, Counts(format=c.format)).add(
              c.values, c.nonzero, c.underflow, c.saturated, c.scale_min,
              c.scale_max, c.calls)
    return out

  def to_dict(self) -> dict[str, Any]:
    """Plain data for logging or JSON."""
    return {"rows": [{"scope": r.scope, "primitive": r.primitive,
                      "shapes": r.shapes,
                      "counts": {k: dataclasses.asdict(v)
                                 for k, v in r.counts.items()}}
                     for r in self.rows],
            "formats": {k: dataclasses.asdict(v)
                        for k, v in self.by_format().items()},
            "note": self.note}

  def __str__(self) -> str:
    header = ("scope", "primitive", "shapes", "values", "format",
              "underflow", "saturated", "scales")
    numbers = lambda c: (f"{100 * c.underflow_fraction:.3f}%",
                         f"{100 * c.saturated_fraction:.3f}%",
                         f"{c.scale_min:.3g} .. {c.scale_max:.3g}")
    lines = [(r.scope or "-", r.primitive, r.shapes, role,
              r.counts[role].format, *numbers(r.counts[role]))
             for r in self.rows for role in ROLES if role in r.counts]
    out = [tables.text_table(header, lines)]
    formats = self.by_format()
    if formats:
      out.append(tables.text_table(
          ("format", "values", "underflow", "saturated", "scales"),
          [(f, str(c.values), *numbers(c)) for f, c in formats.items()]))
    kind = ("float8" if all(f.startswith("float8") for f in formats)
            else "quantized")
    out.append(f"{len(self.rows)} {kind} op{'' if len(self.rows) == 1 else 's'}"
               + (f" ({self.note})" if self.note else ""))
    return "\n".join(out)


def fp8_stats(fn: Callable[..., Any], *args: Any,
              **kwargs: Any) -> Fp8Report:
  """Runs ``fn(*args, **kwargs)`` forward and backward on a probe batch and
  reports, per float8 or block-format op and per format, what quantization
  lost.

  ``fn`` is an `amp`-ed function (or `transform_amp`'s ``apply``) under a
  float8 policy (``c=f8``), a block format (``c=mxfp8``, ``c=mxfp4``,
  ``c=nvfp4``) or int8 (``c=int8``). The forward pass quantizes each op's
  operands,
  the backward pass (the gradient of the sum of ``fn``'s floating outputs
  with respect to its floating array arguments: pass your loss function to
  see the cotangents training sees) its cotangent. For each, the report
  gives the fraction of nonzero values that underflowed to zero, the
  fraction clamped at the format's largest value after its scale
  (non-finite values included), and the smallest and largest scale. Under
  a block format the cotangent is quantized twice (once per backward
  matmul; two calls), the scales are the blocks', and the counts are those
  of rounding to nearest. Under int8 only the operands are quantized (the
  backward pass is bfloat16's), with one scale per row or output channel,
  and a value counts as clipped if it rounds beyond +-127 after its scale
  or is not finite. Counts add up over every call of an op (inside a
  loop, say). The program is compiled with `jax.jit` and runs for real,
  once, with extra reductions and host callbacks; a later call of ``fn``
  compiles without them.

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
    *args: a probe batch: its positional arguments.
    **kwargs: its keyword arguments.

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

  # Fresh: a run never reuses a program compiled without it or by another
  # run (whose callbacks count for that run), nor the reverse.
  with observe.watching(_Counter(), fresh=True) as counter:
    jax.jit(jax.grad(total, argnums=wrt) if wrt else flat)(*arrays)
    jax.effects_barrier()
  rows = tuple(Fp8Row(op.scope, op.primitive, op.shapes, dict(counts))
               for op, counts in counter.ops.values())
  note = "" if rows else (
      "no float8 op ran: is fn amp-ed under a policy whose compute dtype is "
      "f8, a block format (mxfp8, mxfp4, nvfp4) or int8?")
  return Fp8Report(rows, note)
