"""What every rule works with: the `Op` being run, the environment it may
ask (`RuleEnv`), the op-rule table it may read (`RuleTable`), and binding
an equation on re-typed operands."""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
from typing import Any, Optional, Protocol, TYPE_CHECKING

import jax.numpy as jnp
import numpy as np

from mpolicy._src import dtypes
from mpolicy._src import higher_order
from mpolicy._src import jax_compat
from mpolicy._src import policy as policy_lib
from mpolicy._src import regions
from mpolicy._src import staged
from mpolicy._src.rules import facts as facts_lib

if TYPE_CHECKING:
  from mpolicy._src.rules import fp8_placement

AS_WRITTEN = "as written"
"""The class of every primitive inside `full_precision()`, and where a
policy that computes in float32 or wider governs."""

JAX_CAST = "jax cast"
"""The rule of a cast that JAX made itself (a promotion inside ``jnp.mean``),
not written in the code: counted neither as the code's nor as the rules'."""


class RuleEnv(Protocol):
  """What a rule may ask of the environment it runs in."""

  full_only: set
  """Variables read only by ``full`` ops (they keep float32 results)."""
  places: list
  """``[n]``: the next block-format matmul's place (its random key)."""
  step: Any
  """The training step folded into block matmuls' keys, or ``None``."""
  iterations: tuple
  """The iterations of the loops around (a scan's, a microbatch's),
  outermost first, folded into block matmuls' keys after the step."""
  inserted: int
  """How many casts the environment has made (for `explain`)."""
  int8: Any
  """What an export tells the int8 matmuls (`int8_matmul.Weights`), else
  ``None``."""

  def cast(self, x, dtype):
    """``x`` as ``dtype``, made at most once per (value, dtype)."""

  def wider_source(self, x):
    """The wider value ``x`` was cast down from, else ``x``."""

  def precast(self, x, dtype, make) -> None:
    """Records that ``make()`` gives ``x`` cast to ``dtype`` (made on
    demand by `cast`)."""

  def mark_wider(self, x, make_source, param: bool = False) -> None:
    """Records that ``x`` is ``make_source()`` cast down (made on demand;
    ``param``: a parameter or input)."""

  def has_wider(self, x) -> bool:
    """Whether ``x`` was cast down from a wider value here."""

  def from_param(self, x) -> bool:
    """Whether ``x`` was cast down from a parameter or input here."""

  def is_param(self, x) -> bool:
    """Whether ``x`` is a parameter or input (or a re-arrangement of one)."""

  def mark_param(self, x) -> None:
    """Records ``x`` as a parameter or input."""

  def const_of(self, x):
    """The scalar constant ``x`` holds everywhere (a literal, a broadcast
    of one), else ``None``."""

  def mark_const(self, x, value) -> None:
    """Records that ``x`` holds the scalar ``value`` everywhere."""

  def is_spread(self, x) -> bool:
    """Whether ``x`` repeats a smaller array (a broadcast of one)."""

  def mark_spread(self, x) -> None:
    """Records that ``x`` repeats a smaller array."""


class RuleTable(Protocol):
  """What a rule may read of the op-rule table in force (an `OpRules`).

  Rules look primitives up by name, as the table keys them; nothing else
  of the table is theirs to read.
  """

  def class_of(self, name: str) -> Optional[str]:
    """The primitive's class (``lower``, ``full``, ``promote``), else
    ``None``."""

  def reason_of(self, name: str) -> Optional[str]:
    """The one-line reason `explain` shows for the primitive's entry."""

  def rule_of(self, name: str) -> Optional[Callable[..., Any]]:
    """The custom rule function given for the primitive, else ``None``."""

  @property
  def fp8(self) -> fp8_placement.Fp8Options:
    """Where and how float8 runs under a ``c=f8`` policy."""

  @property
  def collective_sum_dtype(self) -> Optional[np.dtype]:
    """The dtype cross-device sums of narrower values run in, else
    ``None`` (`OpRules.with_collectives`)."""


@dataclasses.dataclass
class Op:
  """One equation being run, and what its rule decided.

  Attributes:
    eqn: the equation.
    env: the environment (values, cached casts, which values are parameters).
    rules: the op-rule table in force (a `RuleTable`: an `OpRules`).
    region: what governs the equation, or ``None``.
    args: its arguments: as they arrived, then as the rule ran it (a rule
      that casts them stores the cast ones here; `explain` reports their
      dtypes unless ``ran_in`` says otherwise).
    names: the scope names it was traced under, markers included.
    op_class: the class the table gives it, or `AS_WRITTEN`.
    policy: the governing policy; ``None`` if none governs or inside
      `full_precision()`.
    matmul_format: that policy's `Policy.matmul_format` (``None`` if none
      governs).
    rule, why, ran_in: what the rule decided, for `explain` (``ran_in`` is
      set where the op runs in another dtype than its arguments).
    note: what a rule that declined adds to the reason of the rule that ran.
    entry: the table entry that classed it, where that is not its
      primitive's (a float16 ``mul`` of a value by itself is a ``square``).
  """
  eqn: Any
  env: RuleEnv
  rules: RuleTable
  region: Optional[regions.Region]
  args: list
  names: tuple[str, ...] = ()
  op_class: Optional[str] = None
  policy: Optional[policy_lib.Policy] = None
  matmul_format: Optional[str] = None
  rule: str = "inputs"
  why: str = "no rule: runs in its inputs' dtype"
  ran_in: Optional[str] = None
  note: str = ""
  entry: Optional[str] = None

  @property
  def prim(self):
    return self.eqn.primitive

  @property
  def facts(self) -> facts_lib.Facts:
    return facts_lib.of(self.eqn.primitive)

  @property
  def reason(self) -> Optional[str]:
    """The table's one-line reason for this primitive's class."""
    return self.rules.reason_of(self.entry or self.prim.name)

  @property
  def scope(self) -> str:
    """The plain scope names it was traced under, joined by ``/``."""
    return "/".join(regions.plain_scope_names(self.names))

  @property
  def decided_by(self) -> str:
    return self.region.decided_by if self.region is not None else "-"

  def half_compute(self) -> Optional[np.dtype]:
    """The governing half compute dtype, if a half policy governs."""
    if self.policy is None or not dtypes.is_half(self.policy.compute_dtype):
      return None
    return np.dtype(self.policy.compute_dtype)

  def bf16_storage(self) -> Optional[np.dtype]:
    """bfloat16 where a bfloat16 policy governs, else ``None``."""
    if (self.policy is None
        or np.dtype(self.policy.compute_dtype) != jnp.bfloat16):
      return None
    return np.dtype(jnp.bfloat16)


Rule = Callable[[Op], Optional[list]]


def check_params(eqn, known) -> None:
  """Refuses an equation with a param its rule does not carry (one a newer
  JAX added): every param survives its rule, or the rule says which not.

  Raises:
    UnsupportedPrimitiveError: naming each such param.
  """
  unknown = jax_compat.unknown_params(eqn, known)
  if unknown:
    raise higher_order.UnsupportedPrimitiveError(
        f"mpolicy cannot carry the param(s) {', '.join(map(repr, unknown))} "
        f"of {eqn.primitive.name!r} through its rule (it carries "
        f"{', '.join(known)}). Run the op inside `mpolicy.full_precision()`, "
        f"or give it a rule of your own with `OpRules.with_rule"
        f"({eqn.primitive.name!r}, fn)`.")


def bind(eqn, args, params=None) -> list:
  """Binds ``eqn``'s primitive on ``args``: as is where its facts say so
  (``binds_plainly``), else via `staged`; always returns a list."""
  params = eqn.params if params is None else params
  prim = eqn.primitive
  if facts_lib.of(prim).binds_plainly:
    out = prim.bind(*args, **params)
  else:
    out = staged.bind(prim, *args, **params)
  return list(out) if prim.multiple_results else [out]


def bound(eqn):
  """``eqn``'s primitive with its params, as a function of one operand with
  one result (one per primitive and params); ``None`` for unhashable
  params."""
  try:
    return staged.bound_one(eqn.primitive, tuple(sorted(eqn.params.items())))
  except TypeError:
    return None


def cast_as_traced(env, x, dtype):
  return env.cast(x, dtype) if dtypes.dtype_of(x) != dtype else x


def _follow_inputs(eqn, args):
  """``eqn``'s params, its accumulation dtype following re-typed inputs
  (if it was the input dtype); ``None`` where nothing changes."""
  if not facts_lib.of(eqn.primitive).accumulates:
    return None
  pet = jax_compat.result_dtype(eqn)
  traced = eqn.invars[0].aval.dtype
  now = dtypes.dtype_of(args[0])
  if pet is not None and pet == traced and now != traced:
    return jax_compat.params_with_result_dtype(eqn, now)
  return None


def bind_natural(env, eqn, args) -> tuple[list, Optional[str]]:
  """Binds on ``args`` as they are, or else at the traced dtypes.

  An equation whose params hold a combiner (a scatter's update, a generic
  reduce or reduce_window) runs at the traced dtypes: its combiner was
  traced for them, and JAX accepts other operand dtypes that XLA then
  rejects. So does an equation JAX refuses to re-type.

  Returns the outputs, and ``None`` if ``args`` ran as they are, else why
  they ran at the traced dtypes.
  """
  traced = [getattr(v.aval, "dtype", dtypes.NO_DTYPE) for v in eqn.invars]
  if all(dtypes.dtype_of(a) == t for a, t in zip(args, traced)):
    return bind(eqn, args), None
  as_traced = lambda: bind(eqn, [cast_as_traced(env, a, t)
                                 for a, t in zip(args, traced)])
  if jax_compat.jaxprs_in_params(eqn.params):
    return as_traced(), (
        "its combiner was traced for "
        f"{','.join(sorted({np.dtype(t).name for t in traced}))}: ran as traced")
  try:
    return bind(eqn, args, _follow_inputs(eqn, args)), None
  except Exception:  # pylint: disable=broad-except
    return as_traced(), "JAX refused other dtypes: ran as traced"


def bind_op(op: Op) -> list:
  """`bind_natural` on ``op``'s arguments; notes a fallback in its row."""
  outs, as_traced = bind_natural(op.env, op.eqn, op.args)
  if as_traced is not None:
    op.why += f" ({as_traced})"
    op.args = [cast_as_traced(op.env, a, v.aval.dtype)
               for a, v in zip(op.args, op.eqn.invars)]
  return outs


# --- What a matmul or convolution returns ------------------------------------


def result_dtype(eqn, compute) -> np.dtype:
  """What a matmul or convolution run in ``compute`` (half or float8)
  returns: ``compute`` (bfloat16 for float8), or the wider
  ``preferred_element_type`` the code asked for itself."""
  pet = jax_compat.result_dtype(eqn)
  traced_in = np.dtype(eqn.invars[0].aval.dtype)
  if pet is not None and pet.itemsize > np.dtype(compute).itemsize and (
      pet.itemsize > traced_in.itemsize or explicit_result_dtype(eqn)):
    return pet  # The user asked for a wider result: keep it.
  return np.dtype(compute)


def explicit_result_dtype(eqn) -> bool:
  """Whether the code wrote ``eqn``'s ``preferred_element_type`` itself.

  `jax.numpy`'s matmuls (``@``, ``jnp.dot``, ``jnp.einsum``) set it to
  their result dtype on their own, `jax.lax`'s do not: it is explicit if
  the code called a `jax.lax` function, or wrote the keyword in its call.
  """
  called = jax_compat.called_jax_function(eqn)
  if called is not None and "/lax/" in called[0].replace("\\", "/"):
    return True
  return "preferred_element_type" in jax_compat.user_source(eqn)
