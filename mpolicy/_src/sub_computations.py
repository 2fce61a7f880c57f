"""No silent pass-through: every primitive that carries a sub-computation.

An equation whose params carry a sub-computation (a jaxpr, a closed
jaxpr, a traced function, or a callable that produces one) holds code the
op rules would miss if it were bound as it is. Each such primitive is, by
an explicit entry:

* interpreted: a rule of `higher_order` re-traces its sub-computations
  through the interpreter (``jit``, ``scan``, ``while``, ``cond``,
  ``remat2``, custom derivatives, ``shard_map``, the next-generation
  constructs of ``call_hi_primitive``, ...);
* a kernel: run as written, its operands in their traced dtypes, and
  listed by `explain` (host callbacks, ``pallas_call``: the ``kernel``
  fact, see `rules.kernels`);
* a scalar combiner: the ``add`` of a scatter-add, a reduction's monoid
  (not user code: the primitive runs as a first-order one; the
  ``combines_scalars`` fact, see `rules.classes`);
* refused: `check` raises `UnsupportedPrimitiveError` naming it, why,
  and the ways out (`full_precision()`, `OpRules.with_rule`).

`check` is the runtime guard: any equation with a sub-computation that
has no rule (these entries, or a custom rule of the user's) is refused, so
a primitive a newer JAX adds cannot pass through unnoticed.
"""

from __future__ import annotations

from typing import Optional

from mpolicy._src import higher_order
from mpolicy._src import jax_compat
from mpolicy._src.rules import facts

INTERPRETED = "interpreted"
KERNEL = "kernel"
COMBINER = "scalar combiner"
REFUSED = "refused"

# Primitives mpolicy knows carry a sub-computation and refuses, with why
# (by name: several exist only in some JAX versions or with Pallas loaded).
_AD_MADE = ("made by JAX's own differentiation; apply amp to the function "
            "before differentiating it")
REFUSED_PRIMITIVES: dict[str, str] = {
    "custom_vmap_call": ("a `jax.custom_batching.custom_vmap` function: its "
                         "batching rule is Python written for the traced "
                         "dtypes"),
    "custom_partitioning": ("its partitioning rules are Python written for "
                            "the traced dtypes"),
    "linear_call": "its transpose is written for the traced dtypes",
    "remat_opt": _AD_MADE,
    "custom_jvp_call_jaxpr": "a legacy form of custom_jvp_call",
    "composite": ("a `lax.composite`: a backend may replace its "
                  "decomposition by a kernel written for the traced dtypes"),
    "compute_on": "a `compute_on` region (placement on another device kind)",
    "xla_metadata_call": "a region carrying XLA metadata",
    "program_order": "a program-order region",
    "run_state": "a stateful program over references",
    "run_scoped": "a Pallas kernel's scoped allocation",
    "jaxpr_call": "a call inside a Pallas kernel",
    "core_map": "a Pallas core map",
    "mpmd_map": "a Pallas MPMD map",
    "emit_pipeline": "a Pallas TPU pipeline (inside a kernel)",
    "parallel_loop": "a Pallas loop (inside a kernel)",
    "pipeline_body": "a Pallas TPU pipeline (inside a kernel)",
    "custom_fusion": "a Pallas fuser fusion, written for the traced dtypes",
    "fusible": "a Pallas fuser fusion, written for the traced dtypes",
    "cudnn_fusion": "a cuDNN fusion",
}


def handling(primitive) -> Optional[str]:
  """How mpolicy handles ``primitive`` when its params carry a
  sub-computation: `INTERPRETED`, `KERNEL` (its ``kernel`` fact),
  `COMBINER` (its ``combines_scalars`` fact), `REFUSED` (with a reason,
  `REFUSED_PRIMITIVES`), or None: no entry (the guard refuses it with a
  generic reason).

  >>> import jax
  >>> handling(jax.lax.scan_p), handling(jax.lax.exp_p)
  ('interpreted', None)

  See also: `check`.
  """
  if higher_order.rule_for(primitive) is not None:
    return INTERPRETED
  known = facts.of(primitive)
  if known.kernel:
    return KERNEL
  if known.combines_scalars:
    return COMBINER
  if primitive.name in REFUSED_PRIMITIVES:
    return REFUSED
  return None


def check(eqn, rules) -> None:
  """The runtime guard, for an equation no higher-order rule enters.

  Args:
    eqn: the equation, about to run as a first-order one.
    rules: the `OpRules` table in force (a custom rule for the primitive
      is a way out).

  Raises:
    UnsupportedPrimitiveError: its params carry a sub-computation, it is
      no kernel or scalar combiner, and the table gives it no rule.
  """
  found = jax_compat.hijax.sub_computations(eqn.params)
  if not found:
    return
  prim = eqn.primitive
  if handling(prim) in (KERNEL, COMBINER) or rules.rule_of(prim.name):
    return
  what = ", ".join(sorted({type(v).__name__ for v in found}))
  reason = REFUSED_PRIMITIVES.get(prim.name)
  raise higher_order.UnsupportedPrimitiveError(
      f"mpolicy cannot apply its op rules to {prim.name!r}: its params carry "
      f"a sub-computation ({what})"
      + (f", {reason}" if reason else "")
      + f". mpolicy interprets {', '.join(higher_order.supported())} and "
      f"runs kernels ({', '.join(facts.names_with('kernel'))}) "
      f"with their traced dtypes; it passes nothing through unseen. Ways "
      f"out: run it as written inside `with mpolicy.full_precision():`, or "
      f"give it a rule of your own, `amp(fn, rules=mpolicy.DEFAULT_RULES"
      f".with_rule({prim.name!r}, rule))` with `rule(policy, *args, "
      f"**params)` returning its outputs.")
