"""Kernels: code mpolicy does not see into, run with its traced dtypes.

A host callback (`jax.pure_callback`, `io_callback`, `jax.debug.callback`
and `jax.debug.print`) is Python code, and a Pallas kernel (`pallas_call`)
is a program written for the dtypes its operands were traced with: its
refs are typed, and its body is lowered as written. Neither is entered:
each runs as an opaque kernel, its operands cast back to their traced
dtypes, and `explain` lists it. A kernel gets a dtype rule of the user's
by name: ``OpRules.with_rule("pallas_call:<kernel>", fn)`` for one Pallas
kernel (its ``name=``, else its kernel function's name), or
``OpRules.with_rule("pallas_call", fn)`` for every kernel.
"""

from __future__ import annotations

from mpolicy._src import jax_compat
from mpolicy._src.rules import base
from mpolicy._src.rules import facts


NAMED = frozenset(p.name for p in (jax_compat.pallas_call_p,) if p is not None)
"""Primitives whose kernels take rules by name (``"pallas_call:<kernel>"``)."""


def rule_keys(eqn) -> tuple[str, ...]:
  """The `OpRules` keys a custom rule for ``eqn`` may have, most specific
  first: ``("pallas_call:<kernel>", "pallas_call")`` for a Pallas kernel,
  the primitive's name for anything else."""
  kernel = jax_compat.kernel_name(eqn)
  name = eqn.primitive.name
  return (f"{name}:{kernel}", name) if kernel else (name,)


def _as_traced(op: base.Op) -> list:
  op.args = [base.cast_as_traced(op.env, a, v.aval.dtype)
             for a, v in zip(op.args, op.eqn.invars)]
  prim = op.eqn.primitive
  out = jax_compat.bind(prim, op.args, op.eqn.params)
  return list(out) if prim.multiple_results else [out]


def _callback(op: base.Op) -> list:
  """A host callback is code as written: its operands arrive in the dtypes
  the traced code had (its results are declared in them too)."""
  op.rule, op.why = base.AS_WRITTEN, "host callback: operands in their traced dtypes"
  return _as_traced(op)


def _pallas(op: base.Op) -> list:
  """A Pallas kernel runs as written, on operands in its traced dtypes."""
  kernel = jax_compat.kernel_name(op.eqn)
  op.rule = base.AS_WRITTEN
  op.why = (f"Pallas kernel {kernel!r}: operands in their traced dtypes "
            f"(a dtype rule of yours: OpRules.with_rule('pallas_call:{kernel}'"
            ", fn))")
  return _as_traced(op)


facts.register([p for p in jax_compat.KERNEL_PRIMITIVES
                if p is not jax_compat.pallas_call_p], special=_callback)
if jax_compat.pallas_call_p is not None:
  facts.register(jax_compat.pallas_call_p, special=_pallas)
facts.register(jax_compat.KERNEL_PRIMITIVES, kernel=True)
# A host callback runs Python code (with effects, for some): bound as is,
# never through `staged`'s linearization cache (`base.bind`).
facts.register(jax_compat.CALLBACK_PRIMITIVES, binds_plainly=True)
