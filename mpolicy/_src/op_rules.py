"""The op-rule table: which primitives run in half, which in float32.

The table sorts primitives into three classes:

* ``lower``: worth running in the governing compute dtype (matmuls and
  convolutions, with float32 accumulation);
* ``full``: numerically fragile in half, always run in float32 (exp, log,
  pow, sums of many values, ...);
* ``promote``: run in the widest floating dtype among the inputs
  (concatenation, scatter, select, ...).

Every primitive not in the table runs in the dtype of its inputs.

The table is data: a primitive name maps to its class and a one-line reason
that `explain` shows. `DEFAULT_RULES` follows PyTorch autocast's op lists,
translated to JAX primitives: it is built from the classes each primitive
family registers (`rules.facts`); `OpRules.with_ops` derives a new table, and
`OpRules.with_rule` hands one primitive to a function of the user's.
Primitive names are checked against the primitives JAX (and mpolicy)
define, so a typo is an error rather than a rule that never fires.

JAX decomposes composite functions into primitives, so the rules for those
follow from the table: `jax.nn.softmax`, `log_softmax` and `logsumexp` are
``reduce_max``, ``sub``, ``exp``, ``reduce_sum`` and ``log``; with ``exp`` and
``reduce_sum`` in ``full`` they run in float32. ``reduce_max`` is exact in
half and stays in the input dtype. Layer and batch norms sum many values
(``reduce_sum``) and take ``rsqrt``, so their statistics run in float32 too.

>>> DEFAULT_RULES.class_of("exp"), DEFAULT_RULES.class_of("tanh")
('full', None)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
import dataclasses
import difflib
import types
from typing import Any, Optional, Union

import numpy as np

from mpolicy._src import higher_order
from mpolicy._src import jax_compat
from mpolicy._src import sub_computations
from mpolicy._src import rules as _families  # pylint: disable=unused-import  (registers their facts)
from mpolicy._src.rules import collectives
from mpolicy._src.rules import custom
from mpolicy._src.rules import facts as facts_lib
from mpolicy._src.rules import fp8_placement
from mpolicy._src.rules import kernels

LOWER = facts_lib.LOWER
FULL = facts_lib.FULL
PROMOTE = facts_lib.PROMOTE
CLASSES = facts_lib.CLASSES

Names = Union[str, Iterable[str]]


RuleFn = Callable[..., Any]
"""A custom rule: ``fn(policy, *args, **params) -> outputs`` (see `with_rule`)."""


def known_primitive_names() -> frozenset[str]:
  """Names a rule may refer to: JAX's primitives, mpolicy's and the table's.

  Returns:
    A frozenset of primitive names. JAX's are those defined by the JAX
    modules imported so far (`jax.lax`, its linear algebra, collectives,
    control flow, random numbers, ...); mpolicy's are its own
    (``amp_dot_general``, ...).

  >>> {"exp", "dot_general", "amp_dot_general"} <= known_primitive_names()
  True

  See also: `OpRules.with_ops`, `OpRules.with_rule` (their ``strict``).
  """
  return (jax_compat.primitive_names(("jax", "mpolicy"))
          | frozenset(facts_lib.default_table()))


rule_name = custom.rule_name


def entry_of(primitive) -> Optional[str]:
  """How mpolicy runs ``primitive``, in one line: its class and reason,
  why it runs in its inputs' dtype, or how its sub-computations are
  handled; ``None`` for a primitive new to mpolicy (a test names each
  primitive of the installed JAX without one).

  >>> import jax
  >>> entry_of(jax.lax.exp_p).split(":")[0], entry_of(jax.lax.scan_p)
  ('full', 'interpreted')
  >>> entry_of(jax.lax.add_p).startswith("inputs: element-wise")
  True
  """
  known = facts_lib.of(primitive)
  if known.op_class is not None or known.reason:
    return f"{known.op_class or 'inputs'}: {known.reason}"
  return sub_computations.handling(primitive)


def _check_known(names: Iterable[str], where: str, known: frozenset[str],
                 strict: bool) -> None:
  """Raises if a name is not a primitive that exists (unless not strict)."""
  if not strict:
    return
  unknown = [n for n in names if n not in known]
  if not unknown:
    return
  all_known = known | known_primitive_names()
  for name in unknown:
    if name in all_known:
      continue
    close = difflib.get_close_matches(name, sorted(all_known), n=5,
                                      cutoff=0.6)
    hint = (f"did you mean {', '.join(repr(c) for c in close)}?" if close
            else "no primitive has a similar name.")
    raise ValueError(
        f"{where}: unknown primitive name {name!r}; {hint} Names are "
        f"`Primitive.name`s as they appear in a jaxpr (e.g. 'dot_general', "
        f"'exp', 'reduce_sum'). For a primitive JAX does not define (your "
        f"own), pass strict=False.")


def _as_names(names: Optional[Names], arg: str,
              where: str = "OpRules.with_ops") -> tuple[str, ...]:
  """Checks and normalises one keyword of `OpRules.with_ops`."""
  if names is None:
    return ()
  if isinstance(names, str):
    names = (names,)
  try:
    names = tuple(names)
  except TypeError:
    raise TypeError(
        f"{where}({arg}=...) takes a primitive name or an iterable "
        f"of names, got {names!r}") from None
  for name in names:
    if not isinstance(name, str):
      hint = (f" (use {name.name!r})" if isinstance(getattr(name, "name", None),
                                                     str) else "")
      raise TypeError(
          f"{where}({arg}=...): primitive names must be strings such "
          f"as 'dot_general', got {name!r}{hint}")
    if not name:
      raise ValueError(f"{where}({arg}=...): empty primitive name")
  return names


def _hash_rule(item: tuple[str, RuleFn]) -> int:
  try:
    return hash(item)
  except TypeError:  # An unhashable callable: equal only to itself.
    return hash((item[0], id(item[1])))


@dataclasses.dataclass(frozen=True, eq=False)
class OpRules:
  """An immutable table: primitive name -> op class and reason, or a rule.

  Build one from `DEFAULT_RULES` with `with_ops`, `without_ops` and
  `with_rule`, and pass it as ``rules=`` to `amp` or `transform_amp`.

  >>> rules = DEFAULT_RULES.with_ops(full=["dot_general"])
  >>> rules.class_of("dot_general"), DEFAULT_RULES.class_of("dot_general")
  ('full', 'lower')
  >>> rules.class_of("add") is None
  True
  >>> "exp" in DEFAULT_RULES.full and "dot_general" in DEFAULT_RULES.lower
  True

  A primitive has at most one entry: a class (`with_ops`) or a custom rule
  function (`with_rule`); the later call wins. Tables can be copied, deep
  copied and pickled:

  >>> import copy, pickle
  >>> pickle.loads(pickle.dumps(rules)) == rules == copy.deepcopy(rules)
  True

  See also: `DEFAULT_RULES`, `amp`, `explain` (which shows `reason_of`).
  """
  _table: Mapping[str, tuple[str, str]] = dataclasses.field(
      default_factory=dict)
  _rules: Mapping[str, RuleFn] = dataclasses.field(default_factory=dict)
  _fp8: fp8_placement.Fp8Options = fp8_placement.Fp8Options()
  _sum_dtype: Optional[np.dtype] = None
  _sharing: bool = True

  def __post_init__(self):
    object.__setattr__(self, "_table",
                       types.MappingProxyType(dict(self._table)))
    object.__setattr__(self, "_rules",
                       types.MappingProxyType(dict(self._rules)))

  def class_of(self, name: str) -> Optional[str]:
    """The class of primitive ``name``.

    Returns:
      ``'lower'``, ``'full'``, ``'promote'``, or ``None`` (runs as its
      inputs, or as its custom rule says: see `rule_of`).
    """
    entry = self._table.get(name)
    return entry[0] if entry else None

  def reason_of(self, name: str) -> Optional[str]:
    """The one-line reason for ``name``'s class, or ``None`` if unlisted."""
    entry = self._table.get(name)
    if entry:
      return entry[1]
    fn = self._rules.get(name)
    return f"custom rule {rule_name(fn)}" if fn is not None else None

  def rule_of(self, name: str) -> Optional[RuleFn]:
    """The custom rule function given for ``name`` by `with_rule`, or ``None``."""
    return self._rules.get(name)

  def names(self, op_class: str) -> frozenset[str]:
    """All primitive names in ``op_class``.

    Raises:
      ValueError: ``op_class`` is not ``'lower'``, ``'full'`` or ``'promote'``.
    """
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

  @property
  def custom(self) -> frozenset[str]:
    """Primitives run by a custom rule function (see `with_rule`)."""
    return frozenset(self._rules)

  def _known(self) -> frozenset[str]:
    return frozenset(self._table) | frozenset(self._rules)

  def with_ops(self, *, lower: Optional[Names] = None,
               full: Optional[Names] = None,
               promote: Optional[Names] = None,
               reason: str = "user rule", strict: bool = True) -> OpRules:
    """A new table where each named primitive moves to the class given.

    A custom rule given earlier for a named primitive is dropped.

    >>> r = DEFAULT_RULES.with_ops(lower="exp", full=("dot_general",))
    >>> r.class_of("exp"), r.reason_of("exp")
    ('lower', 'user rule')

    Args:
      lower, full, promote: a primitive name or an iterable of names
        (`Primitive.name`, as in a jaxpr).
      reason: the reason `explain` shows for these entries.
      strict: if ``True`` (the default), a name that is no known primitive
        (see `known_primitive_names`) raises ``ValueError`` listing close
        matches; ``False`` accepts any name (for primitives of your own).

    Returns:
      A new `OpRules`; this one is unchanged.

    See also: `OpRules.without_ops`, `OpRules.with_rule`.
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
    for op_class, names in moves.items():
      _check_known(names, f"OpRules.with_ops({op_class}=...)", self._known(),
                   strict)
    table = dict(self._table)
    table.update({name: (op_class, reason) for name, op_class in seen.items()})
    rules = {n: f for n, f in self._rules.items() if n not in seen}
    return dataclasses.replace(self, _table=table, _rules=rules)

  def with_rule(self, name: str, fn: RuleFn, *, strict: bool = True) -> OpRules:
    """A new table where primitive ``name`` runs as ``fn`` says.

    ``fn(policy, *args, **params) -> outputs`` replaces the primitive
    wherever the op rules apply (not inside `full_precision()` blocks), and
    overrides its class. ``policy`` is the `Policy` governing the equation
    (``None`` where none does); ``args`` are the primitive's operands in
    the dtypes they arrive in, and ``params`` its parameters. ``fn`` does
    its own casts: the interpreter inserts none around it, and runs the
    operations ``fn`` binds as they are (no rules inside). It returns one
    array for a primitive with one result, or a sequence of arrays, one per
    result, for a primitive with several (``multiple_results``). Each
    output must have the shape of the primitive's; its dtype is ``fn``'s
    choice.

    >>> import jax, jax.numpy as jnp
    >>> def exp_in_bf16(policy, x, **params):
    ...   return jax.lax.exp(x.astype(jnp.bfloat16))
    >>> rules = DEFAULT_RULES.with_rule("exp", exp_in_bf16)
    >>> rules.rule_of("exp") is exp_in_bf16, rules.class_of("exp")
    (True, None)

    A Pallas kernel takes a rule by its name, ``"pallas_call:<kernel>"``
    (its ``pallas_call(..., name=)``, else its kernel function's name);
    ``"pallas_call"`` gives every kernel without one of its own a rule.
    Without a rule, a kernel runs as written on operands in its traced
    dtypes.

    Args:
      name: the primitive's name (`Primitive.name`, e.g. ``"exp"``), or
        ``"pallas_call:<kernel>"``.
      fn: the rule function.
      strict: if ``True`` (the default), an unknown primitive name raises
        ``ValueError`` listing close matches; ``False`` accepts any name.

    Returns:
      A new `OpRules`; this one is unchanged.

    See also: `OpRules.with_ops`, `explain` (which names ``fn``).
    """
    if not isinstance(name, str) or not name:
      hint = (f" (use {name.name!r})" if isinstance(getattr(name, "name", None),  # type: ignore[attr-defined]
                                                     str) else "")
      raise TypeError(
          f"OpRules.with_rule(name=...): the primitive's name must be a "
          f"non-empty string such as 'exp', got {name!r}{hint}")
    if not callable(fn):
      raise TypeError(
          f"OpRules.with_rule({name!r}, fn): fn must be callable as "
          f"fn(policy, *args, **params) -> outputs, got {fn!r}")
    if name in higher_order.supported():
      raise ValueError(
          f"OpRules.with_rule({name!r}, ...): {name!r} is a higher-order "
          f"primitive (it carries sub-jaxprs the interpreter enters); custom "
          f"rules are for first-order primitives such as 'exp' or "
          f"'dot_general', kernels ('pallas_call', 'pallas_call:<kernel>') "
          f"and primitives mpolicy refuses")
    base, colon, kernel = name.partition(":")
    if colon and (base not in kernels.NAMED or not kernel):
      raise ValueError(
          f"OpRules.with_rule({name!r}, ...): a name with ':' gives one "
          f"kernel a rule, as 'pallas_call:<kernel>' (the kernel's "
          f"pallas_call name=, else its kernel function's name); "
          f"{'it names no kernel' if base in kernels.NAMED else repr(base) + ' takes no kernel name'}")
    _check_known((base,), "OpRules.with_rule(name=...)", self._known(), strict)
    table = {n: e for n, e in self._table.items() if n != name}
    return dataclasses.replace(self, _table=table,
                               _rules=dict(self._rules, **{name: fn}))

  @property
  def fp8(self) -> fp8_placement.Fp8Options:
    """Where and how float8 runs under a ``c=f8`` policy (`with_fp8`)."""
    return self._fp8

  def with_fp8(self, *, matmuls: Optional[str] = None,
               min_size: Any = fp8_placement.UNSET,
               scaling: Optional[str] = None, **recipe: Any) -> OpRules:
    """A new table with other float8 options (for ``c=f8`` policies).

    >>> r = DEFAULT_RULES.with_fp8(matmuls="all", min_size=0)
    >>> r.fp8.matmuls, r.fp8.min_size, r.fp8.scaling
    ('all', 0, 'per_row')
    >>> r == DEFAULT_RULES.with_fp8(min_size=0).with_fp8(matmuls="all")
    True

    Args:
      matmuls: ``"weights"`` (the default: float8 only where an operand is
        a parameter or input) or ``"all"``; ``None`` keeps this table's.
      min_size: the smallest ``M*K*N`` run in float8, an int >= 0, or
        ``None`` for the device kind's threshold (the default); left out,
        this table's.
      scaling: ``"per_row"`` (the default) or ``"per_tensor"``; ``None``
        keeps this table's.
      **recipe: the block formats' NVFP4-recipe options of `Fp8Options`
        (``stochastic_rounding``, ``hadamard``, ``weight_tiles``: booleans,
        all on by default; ``seed``: an int, 0 by default). One set here
        (to ``True``, or a seed) that the format a matmul runs in does
        not use (mxfp8 uses none; mxfp4 all but ``weight_tiles``) warns
        when that matmul is traced.

    Returns:
      A new `OpRules`; this one is unchanged.

    Raises:
      ValueError: an option outside the values above.
    """
    changes: dict[str, Any] = {k: v for k, v in (("matmuls", matmuls), ("scaling", scaling))
               if v is not None}
    if min_size is not fp8_placement.UNSET:
      changes["min_size"] = min_size
    unknown = set(recipe) - set(fp8_placement.RECIPE_OPTIONS)
    if unknown:
      raise TypeError(f"OpRules.with_fp8 got unknown options {sorted(unknown)}"
                      f"; it takes matmuls, min_size, scaling and "
                      f"{', '.join(fp8_placement.RECIPE_OPTIONS)}")
    changes.update(recipe)
    changes["given"] = frozenset(
        (self._fp8.given - set(recipe))
        | {k for k, v in recipe.items() if v is not False})
    return dataclasses.replace(
        self, _fp8=dataclasses.replace(self._fp8, **changes))

  @property
  def collective_sum_dtype(self) -> Optional[np.dtype]:
    """The dtype cross-device sums of narrower values run in (see
    `with_collectives`), or ``None``: each in its operands' dtype."""
    return self._sum_dtype

  def with_collectives(self, *, sum_dtype: Any) -> OpRules:
    """A new table whose cross-device sums run in ``sum_dtype``.

    Under `amp` / `transform_amp`, every ``psum`` (so ``pmean`` too) and
    ``psum_scatter`` of values narrower than ``sum_dtype`` inside
    ``shard_map`` or ``pmap`` casts them to ``sum_dtype``, sums, and casts
    the result back to their dtype: a bfloat16 partial matmul of a
    row-parallel layer is summed in float32 and stays bfloat16 after.
    `explain` shows each such sum. So do the sums in the transposes of an
    ``all_gather`` (FSDP's reduce-scatter of a weight's gradient) and of a
    ``pvary``, under `jax.grad` of the amp-ed function. Under ``jax.jit``
    without ``shard_map``, where XLA's partitioner places the sums of a
    matmul whose contracting dimension is sharded on the matmul's result,
    half matmuls and convolutions (and their transposes) ask for their
    result in ``sum_dtype`` and cast it after, so those sums run in it too
    (on CPU they already do; on GPU and TPU this writes float32 results,
    and cuDNN runs such a convolution in float32).

    >>> import jax.numpy as jnp
    >>> r = DEFAULT_RULES.with_collectives(sum_dtype=jnp.float32)
    >>> r.collective_sum_dtype, DEFAULT_RULES.collective_sum_dtype
    (dtype('float32'), None)

    Args:
      sum_dtype: a floating dtype, or ``None`` for each sum in its
        operands' dtype (as written).

    Returns:
      A new `OpRules`; this one is unchanged.

    Raises:
      ValueError: ``sum_dtype`` is neither ``None`` nor a floating dtype.
    """
    return dataclasses.replace(
        self, _sum_dtype=collectives.check_sum_dtype(sum_dtype))

  @property
  def sharing(self) -> bool:
    """Whether identical layers share one interpretation (`with_sharing`)."""
    return self._sharing

  def with_sharing(self, on: bool) -> OpRules:
    """A new table that shares (``True``, the default) or not the work of
    identical layers.

    With sharing, the runs of equations one module call or
    `jax.named_scope` made are keyed by what they compute and how the
    rules see them, and those whose key repeats are interpreted once and
    bound as calls of one body; an unnamed sub-jaxpr (`jnp.where`'s
    `jit`) is interpreted once per call-site context. Either way the
    values, policies, keys and reports are those of interpreting every
    equation where it stands; ``with_sharing(False)`` does exactly that
    (a program with no calls added, each layer interpreted by itself).

    >>> DEFAULT_RULES.with_sharing(False).sharing, DEFAULT_RULES.sharing
    (False, True)

    Args:
      on: whether to share.

    Returns:
      A new `OpRules`; this one is unchanged.

    Raises:
      TypeError: ``on`` is not a bool.
    """
    if not isinstance(on, (bool, np.bool_)):
      raise TypeError(f"OpRules.with_sharing(on={on!r}): expected True (share "
                      "identical layers' interpretation, the default) or "
                      "False (interpret every layer where it stands)")
    return dataclasses.replace(self, _sharing=bool(on))

  def without_ops(self, *names: str, strict: bool = True) -> OpRules:
    """A new table where ``names`` run in the dtype of their inputs.

    Their class or custom rule, if any, is dropped.

    >>> DEFAULT_RULES.without_ops("exp").class_of("exp") is None
    True

    Args:
      *names: primitive names.
      strict: as in `with_ops`.

    Returns:
      A new `OpRules`; this one is unchanged.

    See also: `OpRules.with_ops`.
    """
    names = _as_names(names, "names", "OpRules.without_ops")
    _check_known(names, "OpRules.without_ops", self._known(), strict)
    return dataclasses.replace(
        self, _table={n: e for n, e in self._table.items() if n not in names},
        _rules={n: f for n, f in self._rules.items() if n not in names})

  def __reduce__(self):
    # Rebuilt from plain dicts: `copy.deepcopy` and `pickle` work (custom
    # rule functions must be picklable themselves, as module-level
    # functions are).
    return (OpRules, (dict(self._table), dict(self._rules), self._fp8,
                      self._sum_dtype, self._sharing))

  def __iter__(self) -> Iterator[str]:
    return iter(sorted(self._known()))

  def __len__(self) -> int:
    return len(self._known())

  def __contains__(self, name: object) -> bool:
    return name in self._table or name in self._rules

  def __eq__(self, other: object) -> bool:
    return (isinstance(other, OpRules)
            and dict(self._table) == dict(other._table)
            and dict(self._rules) == dict(other._rules)
            and self._fp8 == other._fp8
            and self._sum_dtype == other._sum_dtype
            and self._sharing == other._sharing)

  def __hash__(self) -> int:
    return hash((frozenset(self._table.items()),
                 frozenset(_hash_rule(i) for i in self._rules.items()),
                 self._fp8, self._sum_dtype, self._sharing))

  def __repr__(self) -> str:
    parts = [f"{c}={sorted(self.names(c))}" for c in CLASSES]
    if self._rules:
      parts.append("custom={" + ", ".join(
          f"{n!r}: {rule_name(f)}" for n, f in sorted(self._rules.items()))
                   + "}")
    if self._fp8 != fp8_placement.Fp8Options():
      parts.append(f"fp8={self._fp8!r}")
    if self._sum_dtype is not None:
      parts.append(f"collectives=sum_dtype {self._sum_dtype.name}")
    if not self._sharing:
      parts.append("sharing=False")
    return f"OpRules({', '.join(parts)})"


DEFAULT_RULES = OpRules(facts_lib.default_table())
"""The shipped table: PyTorch autocast's lists translated to JAX primitives."""

_defaults = (facts_lib.version(), DEFAULT_RULES)


def default_rules() -> OpRules:
  """The table `amp` and `transform_amp` take when called without one.

  `DEFAULT_RULES`, plus whatever was registered in `rules.facts` after
  it was built (a primitive of your own, registered with one line).

  >>> default_rules() == DEFAULT_RULES
  True
  """
  global _defaults
  version, table = _defaults
  if version != facts_lib.version():
    table = OpRules(facts_lib.default_table())
    _defaults = (facts_lib.version(), table)
  return table
