"""`compare_to_float32`: each module's error against its float32 shadow.

The computation (the loss, and with ``grad`` its gradients) runs twice, op
by op (`interpreter.replay`, watched by `check`): as given, and as its float32 shadow, traced with every
registry entry ``full`` and every op in float32 (`sites.tagging` with
every site in float32: half operands widened, narrowing casts kept wide),
which covers an `amp` policy too.

A module's *outputs* are the values its ops make that something outside it
reads: an op of another module that is not inside it, or the caller.
Casts that module policies make at the boundaries pass values through.
Outside modules, every op is its own unit. For each unit the outputs of
the two runs are paired by the op that made them and how often it had,
pooled over every call (every loop iteration), and compared norm-wise:
``||got - want|| / ||want||``, split into a bias (the mean signed
difference) and a noise (the spread around it), both relative to the RMS
of ``want``, so that ``rel_error**2 == bias**2 + noise**2``. A module's
parameters' gradients are compared the same way, as one vector. Of a value
with more than `SAMPLE` elements a fixed random `SAMPLE` are kept and
compared (gradients whole): a run holds a bounded sample of every value it
made, and the replay drops each value after its last read.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
import dataclasses
import functools
import os
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from mpolicy._src import registry
from mpolicy._src import sites
from mpolicy._src import tables
from mpolicy._src.debugging import program as program_lib
from mpolicy._src.rules import facts
from mpolicy._src.debugging import check


@dataclasses.dataclass(frozen=True)
class Error:
  """``got`` against ``want``: norm-wise relative error, bias and noise."""
  rel_error: float
  bias: float
  noise: float
  values: int

  @classmethod
  def of(cls, got: list, want: list) -> Optional["Error"]:
    """The error of ``got`` against ``want``, pooled: arrays, or `Kept`
    samples, each weighted by how many elements it stands for."""
    if not got:
      return None
    g, weights = _flat(got)
    w, _ = _flat(want)
    if not g.size:
      return None
    d = g - w
    if not np.all(np.isfinite(d)):
      return cls(float("inf"), float("nan"), float("nan"), g.size)
    count = float(np.sum(weights))
    norm = float(np.sqrt(np.sum(weights * w * w)))
    if norm == 0.0:
      rel = 0.0 if not np.any(d) else float("inf")
      return cls(rel, 0.0 if rel == 0 else float("nan"),
                 0.0 if rel == 0 else float("nan"), g.size)
    rms = norm / np.sqrt(count)
    mean = float(np.sum(weights * d)) / count
    spread = float(np.sqrt(np.sum(weights * (d - mean) ** 2) / count))
    return cls(float(np.sqrt(np.sum(weights * d * d))) / norm, mean / rms,
               spread / rms, g.size)


class Kept(NamedTuple):
  """What a run keeps of one value: its elements, or a random `SAMPLE` of
  them (``weight``: how many elements each kept one stands for)."""
  values: Any
  weight: float
  shape: tuple


def _flat(items: list) -> tuple[np.ndarray, np.ndarray]:
  """The elements of ``items`` (arrays or `Kept`) as one float64 vector,
  and each element's weight."""
  parts, weights = [], []
  for item in items:
    values, weight = ((item.values, item.weight) if isinstance(item, Kept)
                      else (item, 1.0))
    flat = np.asarray(values, np.float64).reshape(-1)
    parts.append(flat)
    weights.append(np.full(flat.shape, weight))
  return np.concatenate(parts), np.concatenate(weights)


@dataclasses.dataclass(frozen=True)
class ShadowRow:
  """One module (or one op outside modules) against float32.

  Attributes:
    path: the module's path (as `locate_nonfinite` names it); ``""`` for
      an op outside modules.
    op: for an op outside modules, its primitive and ``file:line``; else
      ``""``.
    rel_error: the norm-wise relative error of its outputs, pooled over its
      calls (``None``: it handed out nothing floating).
    bias: the mean signed error of its outputs, relative to their RMS.
    noise: the RMS of its outputs' error around that mean, likewise.
    grad_rel_error: the relative error of its parameters' gradients as one
      vector (``None`` without ``grad`` or without parameters).
    input_rel_error: the relative error of what it read from other
      modules (``None``: nothing; its own inputs); ``rel_error`` well
      above it means the module itself loses precision, rather than
      passing on what it was given.
    backward_rel_error: the relative error of what its backward pass
      hands out (the cotangents of its inputs, its parameters' gradients),
      pooled (``None`` without ``grad``).
    backward_input_rel_error: that of the cotangents it was handed.
    values: how many output values were compared (at most `SAMPLE` of
      each).
    dtype: the dtype(s) it made its outputs in, in the run as given.
  """
  path: str
  op: str
  rel_error: Optional[float]
  bias: Optional[float]
  noise: Optional[float]
  grad_rel_error: Optional[float]
  input_rel_error: Optional[float]
  values: int
  dtype: str
  backward_rel_error: Optional[float] = None
  backward_input_rel_error: Optional[float] = None

  def added(self) -> float:
    """The error it adds of its own: in the forward or the backward pass,
    the error of what it hands out less that of what it was handed."""
    found = 0.0
    for out, inp in ((self.rel_error, self.input_rel_error),
                     (self.backward_rel_error, self.backward_input_rel_error)):
      if out is not None:
        found = max(found, out - (inp or 0.0))
    return found

  @property
  def name(self) -> str:
    return self.path or self.op


def _fmt(x: Optional[float], signed: bool = False) -> str:
  if x is None:
    return "-"
  return f"{x:+.2e}" if signed else f"{x:.2e}"


@dataclasses.dataclass(frozen=True)
class ShadowReport:
  """What `compare_to_float32` found: rows, largest error first.

  ``str(report)`` is a table: per row its relative error, bias and noise,
  its parameters' gradient error and the dtype its outputs had.

  Attributes:
    rows: one `ShadowRow` per module path (per op outside modules), sorted
      by ``rel_error``, largest first (then by ``grad_rel_error``).
    loss: the loss as given.
    loss_float32: the loss of the float32 shadow.
    grad_rel_error: the relative error of all gradients as one vector
      (``None`` without ``grad``).
  """
  rows: tuple[ShadowRow, ...]
  loss: float
  loss_float32: float
  grad_rel_error: Optional[float] = None

  def row(self, name: str) -> ShadowRow:
    """The row of module ``name`` (or of the op outside modules ``name``)."""
    for r in self.rows:
      if r.name == name:
        return r
    raise KeyError(f"no row named {name!r}; rows: "
                   f"{', '.join(repr(r.name) for r in self.rows)}")

  def __str__(self) -> str:
    header = ("module (or op)", "rel error", "bias", "noise", "inputs' error",
              "grad rel error", "backward", "values", "dtype")
    lines = [(r.name, _fmt(r.rel_error), _fmt(r.bias, True), _fmt(r.noise),
              _fmt(r.input_rel_error), _fmt(r.grad_rel_error),
              _fmt(r.backward_rel_error), str(r.values), r.dtype)
             for r in self.rows]
    out = [tables.text_table(header, lines)]
    loss_err = (abs(self.loss - self.loss_float32)
                / max(abs(self.loss_float32), 1e-30))
    out.append(f"loss {self.loss:.6g} (float32: {self.loss_float32:.6g}, "
               f"rel error {loss_err:.2e})"
               + (f"; gradients' rel error {self.grad_rel_error:.2e}"
                  if self.grad_rel_error is not None else ""))
    return "\n".join(out)

  def plot(self, path: Optional[str] = None, top: int = 20) -> Any:
    """A bar chart of the largest errors (matplotlib); saved to ``path``
    if given. Returns the figure."""
    import matplotlib  # pylint: disable=g-import-not-at-top
    if path is not None:
      matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
    rows = [r for r in self.rows if r.rel_error is not None][:top]
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(rows) + 1.5))
    y = np.arange(len(rows))
    ax.barh(y - 0.2, [r.rel_error for r in rows], 0.4, label="outputs")
    ax.barh(y + 0.2, [r.grad_rel_error or 0.0 for r in rows], 0.4,
            label="parameter gradients")
    ax.set_yticks(y, [r.name for r in rows])
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("relative error against float32")
    ax.legend()
    fig.tight_layout()
    if path is not None:
      fig.savefig(path)
    return fig


# --- Module outputs ---------------------------------------------------------------


def _unit_outputs_leave(consumer: Optional[tuple], producer: tuple) -> bool:
  """Whether a value of unit ``producer`` read by ``consumer`` (``None``:
  the caller) leaves it. A unit is ``(path, site)``; ``site`` is set only
  for an op outside modules, its own unit."""
  if consumer is None:
    return True
  path, site = producer
  if not path:
    return consumer != producer
  other = consumer[0]
  return not (other == path or other.startswith(path + "/"))


# Casts, what only moves values and what puts them into references:
# outside modules they pass values on.
_PASSING = frozenset({"convert_element_type", "reduce_precision"}) | (
    frozenset(facts.names_with("moves") + facts.names_with("fills_ref")))


class Outputs:
  """Collects what each unit hands out, and reads, while a checker watches
  a replay (its watcher): in the forward pass, values; in the backward pass,
  cotangents (and the gradients it hands back).

  Attributes:
    values: ``(unit, k)`` -> the ``k``-th value that left ``unit``.
    reads: ``(unit, k)`` -> the ``k``-th value ``unit`` read from another.
    backward_values, backward_reads: the same for the backward pass.
    dtypes: unit -> the dtypes of its outputs, as it made them.

  A unit is ``(path, "")`` for a module, ``("", "exp at model.py:12")``
  for the ops of one primitive on one line outside modules, and
  ``("", "(code outside amp)")`` for code outside the interpreted program.
  """

  def __init__(self, events: list, found: list):
    self._events, self._found = events, found
    # Value id -> (direction, unit, value, the dtype its unit made it in).
    self._made: dict[int, tuple] = {}
    self._left: set[int] = set()
    self._read_by: set[tuple] = set()
    self._count: collections.Counter = collections.Counter()
    self._kept: dict[str, tuple[dict, dict]] = {
        "forward": ({}, {}), "backward": ({}, {})}
    self.values, self.reads = self._kept["forward"]
    self.backward_values, self.backward_reads = self._kept["backward"]
    self.dtypes: dict[tuple, set] = collections.defaultdict(set)

  def _unit(self, event: int) -> Optional[tuple]:
    """The unit an equation belongs to (see the class); ``None`` for a
    cast, which passes its value through (a module policy's, JAX's inside
    ``jnp.mean``, one outside every op), and for the interpreter's casts
    at a loop's or a branch's boundary."""
    ev = self._events[event]
    site = self._found[ev.site] if ev.site is not None else None
    if site is None and ev.primitive in _PASSING:
      return None
    if site is not None and (site.policy_cast or site.higher_order or (
        not site.path and site.primitive in _PASSING)):
      return None
    if site is None:
      return ("", "(code outside amp)")
    if site.path:
      return (site.path, "")
    return ("", f"{site.primitive} at {os.path.basename(site.source) or '?'}")

  def made(self, event: int, in_ids, out_ids, outs) -> None:
    ev = self._events[event]
    if "transpose" in ev.transforms:
      direction = "backward"
    elif ev.backward:
      return  # A derivative's coefficient: neither pass hands it out.
    else:
      direction = "forward"
    unit = self._unit(event)
    if unit is None:
      self.passed(in_ids, out_ids[0], outs[0])
      return
    for vid in in_ids:
      self._read(vid, unit, direction)
    for vid, x in zip(out_ids, outs):
      if vid != check.FINITE:
        self._made[vid] = (direction, unit, sample(x),
                           np.dtype(x.dtype).name)

  def passed(self, in_ids, out_id, value) -> None:
    source = next((self._made[i] for i in in_ids if i in self._made), None)
    if source is not None and out_id != check.FINITE:
      self._made[out_id] = (source[0], source[1], sample(value), source[3])

  def finish(self, out_ids) -> None:
    """The program's results leave every unit."""
    for vid in out_ids:
      found = self._made.get(vid)
      if found is not None:
        self._read(vid, None, found[0])

  def _read(self, vid: int, consumer, direction: str) -> None:
    found = self._made.get(vid)
    if found is None or found[0] != direction:
      return
    _, unit, value, dtype = found
    values, reads = self._kept[direction]
    if consumer is not None and consumer != unit and (
        (vid, consumer) not in self._read_by):
      self._read_by.add((vid, consumer))
      key = (direction, "read", consumer)
      reads[(consumer, self._count[key])] = value
      self._count[key] += 1
    if vid not in self._left and _unit_outputs_leave(consumer, unit):
      self._left.add(vid)
      values[(unit, self._count[(direction, unit)])] = value
      self._count[(direction, unit)] += 1
      if direction == "forward":
        self.dtypes[unit].add(dtype)


SAMPLE = 1 << 14
"""The most elements of one value `Outputs` keeps (a fixed random subset):
what a run holds stays bounded by the number of values, not their size."""


def sample(x) -> Kept:
  """``x`` itself, or, with more than `SAMPLE` elements, `SAMPLE` of them
  picked at random, the same ones for every value of that size (both runs'
  are paired). Random, not strided: a stride that divides a row would keep
  the same few features of every row. Weighted by the elements each
  stands for, samples of values of different sizes pool as the whole
  values would."""
  size = int(np.size(x))
  if size <= SAMPLE:
    return Kept(x, 1.0, tuple(np.shape(x)))
  return Kept(_take(x, _indices(size)), size / SAMPLE, tuple(np.shape(x)))


@functools.lru_cache(maxsize=256)
def _indices(size: int) -> jax.Array:
  picked = np.random.default_rng(size).choice(size, SAMPLE, replace=False)
  return jnp.asarray(np.sort(picked).astype(np.int32))


@jax.jit
def _take(x, indices):
  return x.reshape(-1)[indices]


def float32_run(call: program_lib.Call, grad: bool,
                loss_scale: Any = None) -> program_lib.Run:
  """The float32 shadow's run (its `Outputs` observed), its gradients
  those of the loss times ``loss_scale``'s scale, divided after."""
  with registry.push_everywhere("full"):
    return program_lib.run(call, call.program(grad, loss_scale, True),
                           in_float32=sites.EVERY,
                           checking=False, observer=Outputs)


def _module_of(param: str, modules: set) -> Optional[str]:
  """The module a parameter (``"attention/query/w"``) belongs to: the
  longest run of its path's components (the leaf's name left out) that
  names a module (Flax's ``"params/dense/kernel"`` belongs to ``dense``)."""
  parts = param.split("/")[:-1]
  for start in range(len(parts)):
    for end in range(len(parts), start, -1):
      name = "/".join(parts[start:end])
      if name in modules:
        return name
  return None


def compare_to_float32(fn: Callable[..., Any], *args: Any, grad: bool = True,
                       loss_scale: Any = None) -> ShadowReport:
  """Compares each module's outputs (and its parameters' gradients) with
  a float32 shadow of the same computation.

  ``fn`` returns a scalar loss, as for `locate_nonfinite` (a model under
  `amp` or `transform_amp`). It runs twice, op by op: as given, and with
  every op in float32 (half operands widened, no narrowing casts: what
  every policy ``full`` computes). Each module's outputs (the values it
  hands out, pooled over its calls; every op outside modules is its own
  row) and its parameters' gradients (with ``grad``, the gradient of the
  loss with respect to the first argument) are compared norm-wise:
  ``||got - want|| / ||want||``, with the error split into a bias (mean
  signed) and a noise (RMS around the mean). The rows are sorted by error,
  largest first: where precision is lost, and whether rounding is biased
  (a cancellation, a drifting sum) or noise.

  >>> import jax, jax.numpy as jnp, mpolicy
  >>> def loss(x):
  ...   with jax.named_scope("cancel"):
  ...     d = (x + 100.0) - 100.0  # x drowns in 100's rounding.
  ...   with jax.named_scope("residual"):
  ...     y = x + 0.01 * d
  ...   return jnp.mean(y)
  >>> f = mpolicy.amp(loss, "p=f32,c=bf16,o=f32")
  >>> x = jnp.linspace(0.1, 1.0, 8, dtype=jnp.bfloat16)
  >>> report = compare_to_float32(f, x, grad=False)
  >>> report.rows[0].path, report.rows[0].rel_error > 0.1
  ('cancel', True)
  >>> report.row("residual").rel_error < 0.01 < report.row("residual").input_rel_error
  True

  Args:
    fn: the loss function, as you call it.
    *args: its arguments (gradients are taken with respect to the first).
    grad: also compare the parameters' gradients.
    loss_scale: ``None``, a number or an mpolicy loss scale: the backward
      pass starts from the loss times its scale and the gradients are
      divided by it after, as a training step computes them (a float16
      model's unscaled gradients may underflow where its step's do not).

  Returns:
    A `ShadowReport`.

  See also: `locate_nonfinite`, `suggest_policy`, `explain`.
  """
  loss_scale = program_lib.check_loss_scale(loss_scale, "compare_to_float32")
  call = program_lib.Call(fn, args, "compare_to_float32")
  got = program_lib.run(call, call.program(grad, loss_scale, True),
                        checking=False, observer=Outputs)
  return report_of(call, got, float32_run(call, grad, loss_scale), grad)


def report_of(call: program_lib.Call, got: program_lib.Run,
              want: program_lib.Run, grad: bool) -> ShadowReport:
  """The report of run ``got`` against its float32 shadow ``want`` (both
  observed by `Outputs`)."""
  got_out, want_out = got.observer, want.observer

  def pooled(keys, kind: str) -> tuple[list, list]:
    mine, theirs = getattr(got_out, kind), getattr(want_out, kind)
    pairs = [(mine[k], theirs.get(k)) for k in keys]
    pairs = [(g, w) for g, w in pairs
             if w is not None and g.shape == w.shape]
    return [g for g, _ in pairs], [w for _, w in pairs]

  def by_unit(kept: dict) -> dict:
    found = collections.defaultdict(list)
    for key in kept:
      found[key[0]].append(key)
    return found

  outputs, reads = by_unit(got_out.values), by_unit(got_out.reads)
  b_outputs = by_unit(got_out.backward_values)
  b_reads = by_unit(got_out.backward_reads)
  grads = _grads_by_module(call, got.outs, want.outs,
                           {u[0] for u in outputs if u[0]})
  rows = []
  for unit in list(outputs) + [(m, "") for m in grads
                               if (m, "") not in outputs]:
    out = Error.of(*pooled(outputs.get(unit, []), "values"))
    inp = Error.of(*pooled(reads.get(unit, []), "reads"))
    b_out = Error.of(*pooled(b_outputs.get(unit, []), "backward_values"))
    b_inp = Error.of(*pooled(b_reads.get(unit, []), "backward_reads"))
    g = Error.of(*grads[unit[0]]) if unit[0] in grads and unit[0] else None
    rows.append(ShadowRow(
        path=unit[0], op=unit[1],
        rel_error=out.rel_error if out else None,
        bias=out.bias if out else None, noise=out.noise if out else None,
        grad_rel_error=g.rel_error if g else None,
        input_rel_error=inp.rel_error if inp else None,
        values=out.values if out else 0,
        dtype=",".join(sorted(got_out.dtypes[unit])),
        backward_rel_error=b_out.rel_error if b_out else None,
        backward_input_rel_error=b_inp.rel_error if b_inp else None))
  rows = [r for r in rows if r.values or r.grad_rel_error is not None]
  # Largest error first; of equal ones, the one given the most accurate
  # inputs (its own doing rather than passed on).
  rows.sort(key=lambda r: (-(r.rel_error if r.rel_error is not None else -1),
                           r.input_rel_error or 0.0,
                           -(r.grad_rel_error or 0.0)))
  total = Error.of(got.outs[1:], want.outs[1:]) if grad else None
  return ShadowReport(tuple(rows), float(got.outs[0]), float(want.outs[0]),
                      total.rel_error if total else None)


def _grads_by_module(call, got: list, want: list, modules: set) -> dict:
  """Module path -> (its parameters' gradients as given, in float32)."""
  grads: dict[str, tuple[list, list]] = {}
  for k, i in enumerate(call.wrt):
    if len(got) <= 1 + k:
      break
    param = call.param_path(i)
    module = _module_of(param, modules)
    if module is None:
      module = param.rpartition("/")[0]
    grads.setdefault(module, ([], []))
    grads[module][0].append(got[1 + k])
    grads[module][1].append(want[1 + k])
  return grads
