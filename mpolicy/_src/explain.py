"""Inspection: which dtype each primitive ran in, and who decided.

`explain` traces a function once, watching the interpreter (`observe`),
and turns what the interpreter decided into a `Report`: one row per primitive,
plus totals. It only reads decisions; it never changes them.

A primitive run by a custom rule function (`OpRules.with_rule`) has the rule
``"custom"``, and its ``decided_by`` names the function by its qualified
name (``module.function``), so a report says whose code decided.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable

import jax

from mpolicy._src import amp as amp_lib
from mpolicy._src import arguments
from mpolicy._src import observe
from mpolicy._src import regions


NOT_AMPED = "not amp-ed: runs as written"
"""The note of a report on a function that no `amp` interprets."""

# What governs such a function while `explain` traces it: nothing decides
# (no op rule, no module policy, no name pattern), as when it runs.
_AS_WRITTEN = regions.Region(policy=None, decided_by=NOT_AMPED,
                             full_precision=True)


Row = observe.Decision
"""One primitive the interpreter ran: see `observe.Decision`."""


class _Recorder(observe.Observer):
  """Collects the decision of every first-order primitive the interpreter
  runs, except in probes and lazily traced rules."""

  def __init__(self):
    self.rows: list[Row] = []
    self.layers_shared: list[tuple[str, ...]] = []

  def shared(self, scopes: tuple[str, ...]) -> None:
    self.layers_shared.append(scopes)

  def after(self, eq: observe.Equation, invals, outs) -> None:
    if eq.decision is not None and not eq.quiet:
      self.rows.append(eq.decision)


def _recorded(fn, args, kwargs) -> tuple[list[Row], bool, list]:
  """The rows of tracing ``fn``, whether the interpreter ran (a `jax.jit`
  of an `amp`-ed function that already ran is traced again), and the
  layers that share a body."""
  with observe.watching(_Recorder(), fresh=True) as recorder:
    _trace(fn, args, kwargs)
    return (recorder.rows, observe.interpreter_ran(),
            recorder.layers_shared)


@dataclasses.dataclass(frozen=True)
class Report:
  """What `explain` found: rows and totals.

  ``str(report)`` is a table, one line per row, ending in `summary`'s line.

  Attributes:
    rows: one `Row` per primitive run, in trace order.
    note: how the function was interpreted (e.g. wrapped in `amp`).
    shared: the scopes of the identical layers that run as calls of one
      shared body, one tuple per body (`OpRules.with_sharing`); the rows
      report each layer where it stands.

  >>> import jax.numpy as jnp
  >>> from mpolicy._src.amp import amp
  >>> report = explain(amp(jnp.exp), jnp.ones(3, jnp.bfloat16))
  >>> report.ops_per_dtype, report.casts_inserted
  ({'float32': 1}, 1)
  >>> report.summary()
  '1 op: 1 float32; casts: 1 by op rules, 0 by module policies, 0 in the code'

  See also: `explain`.
  """
  rows: tuple[Row, ...]
  note: str = ""
  shared: tuple[tuple[str, ...], ...] = ()

  @property
  def casts_inserted(self) -> int:
    """Casts the interpreter inserted for its op rules."""
    return sum(r.casts for r in self.rows)

  @property
  def casts_by_policies(self) -> int:
    """Casts made for module policies by `transform_amp` (rows whose rule is
    ``"policy cast"``): parameters, inputs and outputs at module calls."""
    return sum(r.rule == "policy cast" for r in self.rows)

  @property
  def casts_in_code(self) -> int:
    """Casts written in the traced code (rows whose rule is
    ``"explicit cast"``), such as the function's own ``astype`` calls."""
    return sum(r.rule == "explicit cast" for r in self.rows)

  @property
  def custom_rules(self) -> dict[str, str]:
    """Primitive name -> the custom rule function that ran it (its name)."""
    return {r.primitive: r.decided_by.split(";")[0][len("custom rule "):]
            for r in self.rows if r.rule == "custom"}

  @property
  def ops_per_dtype(self) -> dict[str, int]:
    """How many primitives ran in each dtype: most first, ties by name."""
    counts = collections.Counter(r.ran_in for r in self.rows)
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))

  def summary(self) -> str:
    """The totals in one line, as `str` ends and the examples print them.

    ``"{ops} ops: {n} {dtype}, ...; casts: {i} by op rules, {p} by module
    policies, {c} in the code"`` (``"1 op"`` for one): every primitive run
    (`ops_per_dtype`, most first; casts are ops too), then the casts the
    interpreter inserted for its op rules (`casts_inserted`), those made
    for module policies (`casts_by_policies`) and those written in the code
    (`casts_in_code`). A report with a `note` (a function that no `amp`
    interprets: ``"not amp-ed: runs as written"``) leads with the note.
    The same numbers are ``to_dict()["totals"]``.

    >>> import jax.numpy as jnp
    >>> import mpolicy
    >>> f = mpolicy.amp(lambda x, w: jnp.exp(x @ w), "p=f32,c=bf16,o=f32")
    >>> explain(f, jnp.ones((2, 3)), jnp.ones((3, 4))).summary()
    '2 ops: 1 bfloat16, 1 float32; casts: 2 by op rules, 0 by module policies, 0 in the code'
    >>> explain(lambda x, w: jnp.exp(x @ w), jnp.ones((2, 3)),
    ...         jnp.ones((3, 4))).summary()
    'not amp-ed: runs as written; 2 ops: 2 float32; casts: 0 by op rules, 0 by module policies, 0 in the code'
    """
    totals = self._totals()
    per = ", ".join(f"{n} {d}" for d, n in totals["ops_per_dtype"].items())
    ops = f"{totals['ops']} op{'' if totals['ops'] == 1 else 's'}"
    line = (f"{ops}{': ' + per if per else ''}; "
            f"casts: {totals['casts_inserted']} by op rules, "
            f"{totals['casts_by_policies']} by module policies, "
            f"{totals['casts_in_code']} in the code")
    return f"{self.note}; {line}" if self.note else line

  def _totals(self) -> dict[str, Any]:
    return {"ops": len(self.rows),
            "ops_per_dtype": self.ops_per_dtype,
            "casts_inserted": self.casts_inserted,
            "casts_by_policies": self.casts_by_policies,
            "casts_in_code": self.casts_in_code}

  def to_dict(self) -> dict[str, Any]:
    """Plain data (lists, dicts, strings, ints) for logging or JSON.

    ``"totals"`` holds the numbers `summary` prints: ``ops``,
    ``ops_per_dtype``, ``casts_inserted``, ``casts_by_policies`` and
    ``casts_in_code``.
    """
    return {
        "rows": [dataclasses.asdict(r) | {"in_dtypes": list(r.in_dtypes)}
                 for r in self.rows],
        "totals": self._totals(),
        "note": self.note,
        "shared": [list(s) for s in self.shared],
    }

  def __str__(self) -> str:
    header = ("scope", "module", "primitive", "inputs", "ran in", "decided by")
    lines = [(r.scope or "-", r.module_class or "-", r.primitive,
              ",".join(r.in_dtypes) or "-", r.ran_in, r.decided_by)
             for r in self.rows]
    widths = [max([len(h)] + [len(l[i]) for l in lines])
              for i, h in enumerate(header[:-1])]

    def fmt(cols):
      return "  ".join(c.ljust(w) for c, w in zip(cols, widths)) + "  " + cols[-1]

    out = [fmt(header), fmt(tuple("-" * w for w in widths) + ("-" * 10,))]
    if self.note == NOT_AMPED:
      out.insert(0, f"{NOT_AMPED}: no op rule or policy applies to this "
                 "function; wrap it in mpolicy.amp (or build it with "
                 "mpolicy.transform_amp) for them.")
    out += [fmt(l) for l in lines]
    out += [f"one shared body: {', '.join(s)}" for s in self.shared]
    out.append(self.summary())  # With the note, if any.
    return "\n".join(out)


def explain(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Report:
  """Traces ``fn(*args, **kwargs)`` and reports the dtype of every primitive.

  ``fn`` is an `amp`-ed function or the ``apply`` of `transform_amp` (or
  a function that calls one, such as a `jax.jit` of it, also once it ran:
  `explain` traces it again). Any other function runs as written, and so
  the report describes it: every row ran in the dtypes the code gives it,
  decided by ``"not amp-ed: runs as written"``, and the report's `note`
  says so and leads its summary and its table (a Flax linen
  ``model.apply`` or a plain ``hk.transform``'s apply are such functions:
  the registry's class policies apply only under `amp`).
  Nothing is computed: ``fn`` is only traced.

  >>> import jax.numpy as jnp
  >>> from mpolicy._src.amp import amp
  >>> f = amp(lambda x, w: jnp.exp(x @ w), "p=f32,c=bf16,o=f32")
  >>> report = explain(f, jnp.ones((2, 3)), jnp.ones((3, 4)))
  >>> [(r.primitive, r.ran_in) for r in report.rows if r.rule != "explicit cast"]
  [('dot_general', 'bfloat16'), ('exp', 'float32')]

  See also: `amp`, `transform_amp`, `explain_policy`.
  """
  arguments.require_callable(
      fn, "explain", "fn", "an amp-ed function or transform_amp's apply, "
      "called as explain(fn, *args)")
  note = ""
  rows, ran, shared = _recorded(fn, args, kwargs)
  if not ran:
    # Recorded by the interpreter with every rule and hook off, so the
    # rows have the shape of any other report's.
    note = NOT_AMPED
    rows, _, shared = _recorded(amp_lib.amp(_as_written(fn)), args, kwargs)
  return Report(rows=tuple(rows), note=note, shared=tuple(shared))


def _as_written(fn: Callable[..., Any]) -> Callable[..., Any]:
  """``fn`` traced under a region where nothing decides (see `explain`)."""

  def run(*args, **kwargs):
    with regions.tagged(_AS_WRITTEN):
      return fn(*args, **kwargs)

  return run


def _trace(fn, args, kwargs) -> None:
  """Traces ``fn`` on the array leaves, as `amp` splits them."""
  static, arrays = amp_lib.split_arguments(args, kwargs)

  def flat(*arrays):
    a, k = amp_lib.join_arguments(static, arrays)
    return fn(*a, **k)

  jax.make_jaxpr(flat)(*arrays)
