"""The op-rule table: which primitives run in half, which in float32.

Like PyTorch autocast, mpolicy sorts operations into classes (API §5):

* ``lower``: worth running in the governing compute dtype (matmuls and
  convolutions, with float32 accumulation);
* ``full``: numerically fragile in half, always run in float32 (exp, log,
  pow, sums of many values, ...);
* ``promote``: run in the widest floating dtype among the inputs
  (concatenation, scatter, select, ...).

Every primitive not in the table runs in the dtype of its inputs.

The table is data: a primitive name maps to its class and a one-line reason
that `explain` shows. `DEFAULT_RULES` translates autocast's published op
lists to JAX primitives; `OpRules.with_ops` derives a new table.

JAX decomposes composite functions into primitives, so the rules for those
follow from the table: `jax.nn.softmax`, `log_softmax` and `logsumexp` are
``reduce_max``, ``sub``, ``exp``, ``reduce_sum`` and ``log``; with ``exp`` and
``reduce_sum`` in ``full`` they run in float32. ``reduce_max`` is exact in
half and stays in the input dtype. Layer and batch norms sum many values
(``reduce_sum``) and take ``rsqrt``, so their statistics run in float32 too.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
import dataclasses
import types
from typing import Optional, Union

LOWER = "lower"
FULL = "full"
PROMOTE = "promote"
CLASSES = (LOWER, FULL, PROMOTE)

Names = Union[str, Iterable[str]]

_LOWER_MATMUL = "matmul family: half inputs, float32 accumulation (autocast fp16 list)"
_LOWER_CONV = "convolution: half inputs, float32 accumulation (autocast fp16 list)"
_FULL_TRANSCENDENTAL = "range/precision loss in half (autocast fp32 list)"
_FULL_SUM = "sums many values: accumulate in float32 (autocast fp32 list)"
_PROMOTE = "combines several inputs: widest dtype (autocast promote list)"
_FULL_LINALG = ("linear algebra: no half kernels, unstable in half "
                "(autocast fp32 list)")

# One entry per primitive: (class, reason). Names are `Primitive.name`.
_DEFAULT_TABLE: dict[str, tuple[str, str]] = {
    # lower: the matmul and convolution family.
    "dot_general": (LOWER, _LOWER_MATMUL),
    "ragged_dot_general": (LOWER, _LOWER_MATMUL),
    "conv_general_dilated": (LOWER, _LOWER_CONV),
    # full: exponentials, logarithms and powers.
    "exp": (FULL, "exp overflows half beyond ~11 (autocast fp32 list)"),
    "exp2": (FULL, "exp2 overflows half (autocast fp32 list)"),
    "expm1": (FULL, "expm1 loses precision near 0 in half (autocast fp32 list)"),
    "log": (FULL, "log loses precision in half (autocast fp32 list)"),
    "log1p": (FULL, "log1p loses precision near 0 in half (autocast fp32 list)"),
    "pow": (FULL, "pow overflows half (autocast fp32 list)"),
    "integer_pow": (FULL, "x**n overflows float16, and squares summed in "
                    "half lose the small terms of E[x^2] - E[x]^2 "
                    "(autocast fp32 list: pow)"),
    "square": (FULL, "x**2 overflows float16, and squares summed in half "
               "lose the small terms of E[x^2] - E[x]^2 "
               "(autocast fp32 list: pow)"),
    "rsqrt": (FULL, "rsqrt of small variances overflows half (autocast fp32 list)"),
    "erf_inv": (FULL, "erf_inv diverges near +-1 (autocast fp32 list)"),
    "lgamma": (FULL, "lgamma overflows half (autocast fp32 list)"),
    "digamma": (FULL, "digamma loses precision in half (autocast fp32 list)"),
    "polygamma": (FULL, _FULL_TRANSCENDENTAL),
    "igamma": (FULL, _FULL_TRANSCENDENTAL),
    "igammac": (FULL, _FULL_TRANSCENDENTAL),
    "zeta": (FULL, _FULL_TRANSCENDENTAL),
    "regularized_incomplete_beta": (FULL, _FULL_TRANSCENDENTAL),
    "bessel_i0e": (FULL, _FULL_TRANSCENDENTAL),
    "bessel_i1e": (FULL, _FULL_TRANSCENDENTAL),
    "acos": (FULL, "acos loses precision near +-1 (autocast fp32 list)"),
    "asin": (FULL, "asin loses precision near +-1 (autocast fp32 list)"),
    "cosh": (FULL, "cosh overflows half (autocast fp32 list)"),
    "sinh": (FULL, "sinh overflows half (autocast fp32 list)"),
    "tan": (FULL, "tan loses precision near poles (autocast fp32 list)"),
    # full: reductions and scans that sum (or multiply) many values.
    "reduce_sum": (FULL, _FULL_SUM),
    "reduce_prod": (FULL, "products of many values overflow half (autocast fp32 list)"),
    "reduce_window_sum": (FULL, _FULL_SUM),
    "cumsum": (FULL, _FULL_SUM),
    "cumprod": (FULL, "products of many values overflow half (autocast fp32 list)"),
    "cumlogsumexp": (FULL, _FULL_SUM),
    # full: linear algebra. LAPACK has no half kernels, and decompositions
    # and solves lose too much in half (autocast runs them in float32).
    **{name: (FULL, _FULL_LINALG) for name in (
        "cholesky", "cholesky_update", "eig", "eigh", "hessenberg",
        "householder_product", "lu", "ormqr", "qr", "schur", "svd",
        "symmetric_product", "triangular_solve", "tridiagonal",
        "tridiagonal_solve")},
    # promote: operations that combine several inputs into one array.
    "concatenate": (PROMOTE, _PROMOTE),
    "select_n": (PROMOTE, _PROMOTE),
    "dynamic_update_slice": (PROMOTE, _PROMOTE),
    "scatter": (PROMOTE, _PROMOTE),
    "scatter-add": (PROMOTE, _PROMOTE),
    "scatter-mul": (PROMOTE, _PROMOTE),
    "pad": (PROMOTE, _PROMOTE),
    "clamp": (PROMOTE, _PROMOTE),
    "atan2": (PROMOTE, _PROMOTE),
}


def _as_names(names: Optional[Names], arg: str) -> tuple[str, ...]:
  """Checks and normalises one keyword of `OpRules.with_ops`."""
  if names is None:
    return ()
  if isinstance(names, str):
    names = (names,)
  try:
    names = tuple(names)
  except TypeError:
    raise TypeError(
        f"OpRules.with_ops({arg}=...) takes a primitive name or an iterable "
        f"of names, got {names!r}") from None
  for name in names:
    if not isinstance(name, str):
      hint = (f" (use {name.name!r})" if isinstance(getattr(name, "name", None),
                                                     str) else "")
      raise TypeError(
          f"OpRules.with_ops({arg}=...): primitive names must be strings such "
          f"as 'dot_general', got {name!r}{hint}")
    if not name:
      raise ValueError(f"OpRules.with_ops({arg}=...): empty primitive name")
  return names


@dataclasses.dataclass(frozen=True, eq=False)
class OpRules:
  """An immutable table: primitive name -> op class and reason.

  >>> rules = DEFAULT_RULES.with_ops(full=["dot_general"])
  >>> rules.class_of("dot_general"), DEFAULT_RULES.class_of("dot_general")
  ('full', 'lower')
  >>> rules.class_of("add") is None
  True
  >>> "exp" in DEFAULT_RULES.full and "dot_general" in DEFAULT_RULES.lower
  True

  See also: `DEFAULT_RULES`, `amp`, `explain` (which shows `reason_of`).
  """
  _table: Mapping[str, tuple[str, str]] = dataclasses.field(
      default_factory=dict)

  def __post_init__(self):
    object.__setattr__(self, "_table",
                       types.MappingProxyType(dict(self._table)))

  def class_of(self, name: str) -> Optional[str]:
    """``'lower'``, ``'full'``, ``'promote'``, or ``None`` (runs as its inputs)."""
    entry = self._table.get(name)
    return entry[0] if entry else None

  def reason_of(self, name: str) -> Optional[str]:
    """The one-line reason for ``name``'s class, or ``None`` if unlisted."""
    entry = self._table.get(name)
    return entry[1] if entry else None

  def names(self, op_class: str) -> frozenset[str]:
    """All primitive names in ``op_class``."""
    if op_class not in CLASSES:
      raise ValueError(f"op class must be one of {CLASSES}, got {op_class!r}")
    return frozenset(n for n, (c, _) in self._table.items() if c == op_class)

  @property
  def lower(self) -> frozenset[str]:
    """Primitives run in the compute dtype (float32 accumulation)."""
    return self.names(LOWER)

  @property
  def full(self) -> frozenset[str]:
    """Primitives always run in float32."""
    return self.names(FULL)

  @property
  def promote(self) -> frozenset[str]:
    """Primitives run in the widest floating dtype among their inputs."""
    return self.names(PROMOTE)

  def with_ops(self, *, lower: Optional[Names] = None,
               full: Optional[Names] = None,
               promote: Optional[Names] = None,
               reason: str = "user rule") -> OpRules:
    """A new table where each named primitive moves to the class given.

    >>> r = DEFAULT_RULES.with_ops(lower="exp", full=("dot_general",))
    >>> r.class_of("exp"), r.reason_of("exp")
    ('lower', 'user rule')

    See also: `OpRules.without_ops`, to let primitives run as their inputs.
    """
    moves = {LOWER: _as_names(lower, LOWER), FULL: _as_names(full, FULL),
             PROMOTE: _as_names(promote, PROMOTE)}
    seen: dict[str, str] = {}
    for op_class, names in moves.items():
      for name in names:
        if name in seen and seen[name] != op_class:
          raise ValueError(
              f"OpRules.with_ops: {name!r} is given both as {seen[name]!r} "
              f"and as {op_class!r}; a primitive has one class")
        seen[name] = op_class
    table = dict(self._table)
    table.update({name: (op_class, reason) for name, op_class in seen.items()})
    return OpRules(table)

  def without_ops(self, *names: str) -> OpRules:
    """A new table where ``names`` run in the dtype of their inputs.

    >>> DEFAULT_RULES.without_ops("exp").class_of("exp") is None
    True

    See also: `OpRules.with_ops`.
    """
    names = _as_names(names, "names")
    return OpRules({n: e for n, e in self._table.items() if n not in names})

  def __iter__(self) -> Iterator[str]:
    return iter(sorted(self._table))

  def __len__(self) -> int:
    return len(self._table)

  def __contains__(self, name: object) -> bool:
    return name in self._table

  def __eq__(self, other: object) -> bool:
    return isinstance(other, OpRules) and dict(self._table) == dict(other._table)

  def __hash__(self) -> int:
    return hash(frozenset(self._table.items()))

  def __repr__(self) -> str:
    parts = [f"{c}={sorted(self.names(c))}" for c in CLASSES]
    return f"OpRules({', '.join(parts)})"


DEFAULT_RULES = OpRules(_DEFAULT_TABLE)
"""The shipped table: PyTorch autocast's lists translated to JAX primitives."""
