"""JAX's call primitives and the linear parts of custom rules, by name.

A call primitive applies a sub-jaxpr to its operands and nothing more.
JAX 0.10.2 has two: ``closed_call`` (its ``call_jaxpr`` a closed jaxpr)
and ``call`` (an open one). JAX 0.12 replaced both by ``eval_jaxpr`` (a
closed jaxpr), keeping the attribute names ``closed_call_p`` and
``call_p`` only as aliases of ``eval_jaxpr_p``; code matching on those
attributes registers two rules on one key today and none the day the
aliases go. Looking the primitives up by name finds each distinct one once,
whether or not the aliases exist.

>>> import jax
>>> closed, opened = call_primitives()
>>> all(isinstance(p, jax.extend.core.Primitive) for p in closed + opened)
True
>>> len({id(p) for p in closed + opened}) == len(closed + opened)
True
"""

from __future__ import annotations

from mpolicy._src.jax_compat import internals as _i

# Primitives that apply a closed sub-jaxpr (``closed_call``, ``eval_jaxpr``)
# and an open one (``call``), by name.
CLOSED_CALL_NAMES = ("closed_call", "eval_jaxpr")
OPEN_CALL_NAMES = ("call",)


def _distinct(primitives, seen: set) -> tuple:
  out = []
  for p in primitives:
    if id(p) not in seen:
      seen.add(id(p))
      out.append(p)
  return tuple(out)


def call_primitives() -> tuple[tuple, tuple]:
  """``(closed, opened)``: the distinct call primitives the installed JAX
  defines that apply a closed sub-jaxpr, and those that apply an open one
  (looked up by name now, not through module attributes)."""
  seen: set = set()
  closed = _distinct(_i.primitives_named(CLOSED_CALL_NAMES), seen)
  opened = _distinct(_i.primitives_named(OPEN_CALL_NAMES), seen)
  return closed, opened


_CLOSED, _OPEN = call_primitives()

# The linear part of a custom VJP rule under forward-mode or linearizing
# autodiff (a `custom_vjp` function differentiated inside a JVP rule, say):
# ``custom_lin`` (classic `custom_vjp`) and ``call_hi_primitive_linearized``
# (``jax_custom_vjp3``). Each stands for the user's backward rule, run
# when JAX transposes it.
LINEARIZED_CUSTOM_RULES = tuple(_i.primitives_named(
    ("custom_lin", "call_hi_primitive_linearized")))
# The primitive of a closed call: ``closed_call`` where it exists, else
# ``eval_jaxpr``; and of an open call (``None`` from JAX 0.12 on).
closed_call_p = _CLOSED[0] if _CLOSED else None
core_call_p = _OPEN[0] if _OPEN else None


__all__ = [
    "call_primitives",
    "LINEARIZED_CUSTOM_RULES",
    "closed_call_p",
    "core_call_p",
]
