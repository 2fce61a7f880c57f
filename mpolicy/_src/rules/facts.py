"""What mpolicy knows about each primitive, keyed by primitive object.

One `Facts` record per primitive, filled by `register` calls that sit
beside the code they describe: the element-wise and reduction primitives
in `classes`, the special ones in `special`, the kernels in `kernels`,
each matmul-like family in its own file (`matmul`, `conv`). The shipped
`OpRules` table (``DEFAULT_RULES``) is the ``op_class`` and ``reason`` of
every registered primitive, so adding an element-wise op that always runs
in float32 is one line:

>>> import jax
>>> f = of(jax.lax.exp_p)
>>> f.op_class, f.elementwise
('full', True)
>>> register(jax.lax.tanh_p, op_class=FULL, reason="tanh in float32",
...          elementwise=True)  # doctest: +SKIP

A primitive nothing is registered for has the empty record: it runs in
its inputs' dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
import dataclasses
from typing import Any, Optional, Union

from mpolicy._src import jax_compat

LOWER = "lower"
FULL = "full"
PROMOTE = "promote"
CLASSES = (LOWER, FULL, PROMOTE)


@dataclasses.dataclass(frozen=True)
class Facts:
  """What the rules know about one primitive.

  Attributes:
    op_class: its class in the shipped table (``lower``, ``full``,
      ``promote``), or ``None``: it runs in its inputs' dtype.
    reason: the one-line reason `explain` shows for ``op_class``; with no
      class, why the primitive runs in its inputs' dtype (every primitive
      has a class, a reason, or a higher-order rule: `op_rules.entry_of`).
    elementwise: it acts element by element on one floating operand, so as
      a ``full`` op under a bfloat16 policy it computes in float32 and
      stores its result in bfloat16.
    broadcasts: element-wise with size-1 broadcasting: a parameter it
      would broadcast is broadcast first, in its own dtype.
    scales: a product or quotient (no cancellation): a bfloat16 value
      scaled by a float32 statistic computes in float32, stored in bfloat16.
    commutes: its two operands may trade places (``a * b == b * a``): a
      product scales either operand by the other, a quotient only its
      first.
    offsets: a sum or difference: a bfloat16 value offset by a float32
      statistic spread along it (``x - mean(x)``) computes in float32,
      stored in bfloat16.
    spreads: its result repeats its operand along more elements (a
      broadcast): a float32 value spread so is a statistic.
    keeps_param: its result re-arranges its first operand (a reshape,
      slice, ...): a parameter stays a parameter.
    keeps_constant: its result holds what its first operand holds
      everywhere (a broadcast, a reshape): a scalar constant stays one.
    looks_up: its result holds entries of its first operand picked by
      index (a gather): a lookup in a float32 parameter table under a half
      policy is an embedding lookup, whose rows are used in the compute
      dtype.
    casts: it converts its operand to another dtype (the target
      `jax_compat.cast_target` reads): a cast to float32 reads its operand
      in float32, as a ``full`` op does.
    accumulates: its ``preferred_element_type`` follows re-typed inputs.
    binds_plainly: bound as is, never through the linearization cache of
      `staged` (see `base.bind`): it runs host code or has effects, names
      mesh axes, places or shards values, makes or unwraps PRNG keys, or
      makes or touches mutable references.
    combines_scalars: its jaxpr params are small scalar combiners (a
      scatter-add's ``add``, a reduction's monoid), not user code: it runs
      as a first-order primitive (see `sub_computations`).
    kernel: it runs code mpolicy does not see into (a host callback, a
      Pallas kernel): as written, its operands in their traced dtypes, and
      listed by `explain` (see `kernels`).
    moves: its results hold exactly its operands' values (moved, copied,
      negated): a result is not finite exactly when an operand is not (the
      debugger checks no such result, `debugging.check`).
    fills_ref: it puts a value into a mutable reference (``new_ref``
      makes one holding its operand; ``swap`` and ``addupdate`` write
      their second operand into their first): what the reference holds
      comes from that value (`debugging.check`).
    special: a rule for this primitive run before its class rule (see
      `dispatch`); it may decline by returning ``None``.
    lower: the family's half rule for a ``lower`` op: ``fn(op, compute,
      out_dtype) -> outputs``, with the operands already in ``compute``.
    lower_fp8: the family's float8 rule under ``c=f8``: ``fn(op) ->
      outputs``, or ``None`` to decline (it then runs as under bfloat16).
  """
  op_class: Optional[str] = None
  reason: Optional[str] = None
  elementwise: bool = False
  broadcasts: bool = False
  scales: bool = False
  commutes: bool = False
  offsets: bool = False
  spreads: bool = False
  keeps_param: bool = False
  keeps_constant: bool = False
  looks_up: bool = False
  casts: bool = False
  accumulates: bool = False
  binds_plainly: bool = False
  combines_scalars: bool = False
  kernel: bool = False
  moves: bool = False
  fills_ref: bool = False
  special: Optional[Callable[..., Any]] = None
  lower: Optional[Callable[..., Any]] = None
  lower_fp8: Optional[Callable[..., Any]] = None


_EMPTY = Facts()
_FACTS: dict[Any, Facts] = {}
_version = 0

Primitives = Union[Any, str, Iterable[Union[Any, str]]]


def _primitives(prims: Primitives) -> list:
  """Primitive objects; names are looked up among JAX's (absent ones, from
  an older or newer JAX, are skipped)."""
  if isinstance(prims, str) or hasattr(prims, "bind"):
    prims = [prims]
  objects: list = []
  names: list = []
  for p in prims:
    (names if isinstance(p, str) else objects).append(p)
  return objects + jax_compat.primitives_named(names)


def register(prims: Primitives, **facts: Any) -> None:
  """Records ``facts`` (fields of `Facts`) for each primitive.

  Args:
    prims: a primitive, its name, or an iterable of them.
    **facts: the fields to set; the others keep what was registered.

  Raises:
    TypeError: a field `Facts` does not have.
    ValueError: an ``op_class`` that is not a class, or one without a
      reason.
  """
  global _version
  fields = {f.name for f in dataclasses.fields(Facts)}
  unknown = sorted(set(facts) - fields)
  if unknown:
    raise TypeError(f"register(): unknown facts {unknown}; known: "
                    f"{sorted(fields)}")
  op_class = facts.get("op_class")
  if op_class is not None and op_class not in CLASSES:
    raise ValueError(f"register(): op_class must be one of {CLASSES}, got "
                     f"{op_class!r}")
  for p in _primitives(prims):
    old = _FACTS.get(p, _EMPTY)
    new = dataclasses.replace(old, **facts)
    if new.op_class is not None and (
        not new.reason or (old.op_class is None and "reason" not in facts)):
      # (A reason without a class says why it runs in its inputs' dtype.)
      raise ValueError(f"register({p.name!r}): a class needs a reason, the "
                       "one line `explain` shows")
    _FACTS[p] = new
  _version += 1


def unregister(prims: Primitives) -> None:
  """Forgets everything registered for these primitives."""
  global _version
  for p in _primitives(prims):
    _FACTS.pop(p, None)
  _version += 1


def of(primitive) -> Facts:
  """The facts registered for ``primitive`` (the empty record if none)."""
  return _FACTS.get(primitive, _EMPTY)


def default_table() -> dict[str, tuple[str, str]]:
  """Primitive name -> ``(op_class, reason)`` for every classed primitive."""
  return {p.name: (f.op_class, f.reason) for p, f in _FACTS.items()  # type: ignore[misc]  # Classed facts have reasons.
          if f.op_class is not None}


def names_with(fact: str) -> list[str]:
  """The sorted names of the primitives for which ``fact`` is set."""
  return sorted(p.name for p, f in _FACTS.items() if getattr(f, fact))


def version() -> int:
  """A number that changes whenever a registration does."""
  return _version
