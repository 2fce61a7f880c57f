"""Structural keys of equations: two runs of a jaxpr that compute the same.

`run_key` gives a slice of a jaxpr's equations a hashable key that two
slices share exactly when they apply the same primitives, with equal
params, to inputs of the same types wired the same way: a deep model's
identical layers. Variables are numbered by first appearance; literals,
constants and sub-jaxprs key by value and structure; what cannot be
compared by value (an effect, a traced constant, a Python callback a
custom rule closes over) makes the slice `Unkeyable`: it is then never
taken for another one.

>>> import jax, jax.numpy as jnp
>>> eqns = jax.make_jaxpr(lambda x: jnp.sin(x) + jnp.sin(x * 2))(1.).eqns
>>> run_key(eqns[0:1], [eqns[0].invars[0]]) == run_key(
...     eqns[2:3], [eqns[2].invars[0]])
True
>>> run_key(eqns[0:1], [eqns[0].invars[0]]) == run_key(
...     eqns[1:2], [eqns[1].invars[0]])
False
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import enum
import functools
import types
from typing import Any, Optional

import numpy as np

from mpolicy._src.jax_compat import internals


class Unkeyable(Exception):
  """The equations hold something that cannot be compared by value."""


_SIMPLE = (int, float, complex, str, bytes, bool, type(None), np.dtype,
           np.generic, enum.Enum, slice, type)


class _Keys:
  """Keys of one search: sub-jaxprs' keys cached in ``memo``; ``extra``
  (with the scope names of each equation, those of the equations around
  it included) a part of every equation's key, nested ones included."""

  def __init__(self, memo: Optional[dict], extra=None, outer: tuple = ()):
    self.memo = {} if memo is None else memo
    self.extra, self.outer = extra, outer

  def value(self, x) -> Any:
    if isinstance(x, _SIMPLE):
      return (type(x), x.hex() if isinstance(x, float) else x)
    if isinstance(x, (tuple, list)):
      return (type(x), tuple(self.value(v) for v in x))
    if isinstance(x, dict):
      return (dict, tuple(sorted((k, self.value(v)) for k, v in x.items())))
    if isinstance(x, internals.ClosedJaxpr):
      return ("closed", self.jaxpr(x.jaxpr),
              tuple(self.value(c) for c in x.consts))
    if isinstance(x, internals.Jaxpr):
      return ("open", self.jaxpr(x))
    if isinstance(x, np.ndarray):
      return ("array", x.dtype, x.shape, x.tobytes())
    if isinstance(x, (internals.Tracer, types.FunctionType, types.MethodType,
                      functools.partial)) or hasattr(x, "call_wrapped"):
      raise Unkeyable(type(x).__name__)  # Traced, or code run later.
    if hasattr(x, "shape") and hasattr(x, "dtype"):  # A concrete jax.Array.
      return self.value(np.asarray(x))
    try:
      hash(x)
    except TypeError:
      raise Unkeyable(type(x).__name__) from None
    return (type(x), x)  # Meshes, shardings, dimension numbers, avals.

  def params(self, eqn) -> Any:
    """``eqn``'s params by value. A custom JVP rule keys by the jaxpr it
    traces to (all tangents nonzero): its thunk is a new closure at every
    call site. A rule calling its own function again (`jax.nn.relu`'s)
    meets the same primal there: that one keys by the primal alone."""
    if eqn.primitive is not internals.custom_jvp_call_p:
      return tuple((k, self.value(v)) for k, v in sorted(eqn.params.items()))
    primal = self.value(eqn.params["call_jaxpr"])
    stack = self.memo.setdefault("custom_jvp", [])
    if primal in stack:
      return ("again", primal)
    stack.append(primal)
    try:
      items = []
      for name, value in sorted(eqn.params.items()):
        if name in ("jvp_jaxpr_fun", "jvp_jaxpr_thunk"):
          n = len(eqn.invars) - eqn.params.get("num_consts", 0)
          jaxpr, consts, zeros = internals.call_thunk(value, *[False] * n)
          value = (jaxpr, list(consts), zeros)
        items.append((name, self.value(value)))
      return tuple(items)
    finally:
      stack.pop()

  def jaxpr(self, jaxpr) -> Any:
    """A whole open jaxpr's key (cached by identity, and by the scope
    names around it where ``extra`` reads them)."""
    at = (id(jaxpr), None if self.extra is None else self.outer)
    hit = self.memo.get(at)
    if hit is not None:
      return hit[1]
    key = ("jaxpr", self.run(jaxpr.eqns, [*jaxpr.constvars, *jaxpr.invars],
                             jaxpr.outvars))
    self.memo[at] = (jaxpr, key)  # Holds the jaxpr: its id stays its own.
    return key

  def run(self, eqns, inputs, outputs) -> tuple:
    number = {v: ("in", i) for i, v in enumerate(inputs)}

    def ref(v):
      if isinstance(v, internals.Literal):
        return ("lit", v.aval, self.value(v.val))
      return number[v]

    parts = []
    for eqn in eqns:
      if eqn.effects:
        raise Unkeyable(f"{eqn.primitive} has effects")
      outs = []
      for v in eqn.outvars:
        if isinstance(v, internals.DropVar):
          outs.append(("drop", v.aval))
        else:
          number[v] = ("v", len(number))
          outs.append(v.aval)
      names = self.outer + internals.eqn_scope_names(eqn)
      inner = self if self.extra is None else _Keys(self.memo, self.extra,
                                                    names)
      parts.append((eqn.primitive, inner.params(eqn),
                    tuple(ref(v) for v in eqn.invars), tuple(outs),
                    None if self.extra is None else self.extra(names)))
    return (tuple(v.aval for v in inputs), tuple(parts),
            tuple(ref(v) for v in outputs))


def value_key(x, memo: dict) -> Any:
  """A hashable key equal for params equal in value (`Unkeyable` if none)."""
  return _Keys(memo).value(x)


def jaxpr_key(jaxpr, memo: dict) -> Any:
  """A whole open jaxpr's structural key (cached in ``memo`` by identity)."""
  return _Keys(memo).jaxpr(jaxpr)


def run_key(eqns: Sequence[Any], inputs: Sequence[Any],
            outputs: Sequence[Any] = (), *,
            extra: Optional[Callable[[tuple], Any]] = None,
            memo: Optional[dict] = None) -> tuple:
  """The key of ``eqns`` read as a function of ``inputs`` to ``outputs``.

  Args:
    eqns: consecutive equations of one jaxpr.
    inputs: the variables they read that are defined before them, in order.
    outputs: the variables (or literals) the function returns.
    extra: ``extra(names)``, a hashable part of the key of each equation,
      those inside sub-jaxprs included, from its scope names (relative to
      ``eqns``' jaxpr: an equation inside a sub-jaxpr has those of the
      equations around it first): what decides how it is interpreted.
    memo: a cache of sub-jaxprs' keys, shared across calls.

  Raises:
    Unkeyable: an equation has effects or an uncomparable param.
  """
  return _Keys(memo, extra).run(eqns, inputs, outputs)


def leading_scopes(eqn, n: int) -> bool:
  """Whether ``eqn``'s name stack starts with ``n`` scope entries (no
  transform among them): a call can take them over."""
  stack = eqn.source_info.name_stack
  return (len(getattr(stack, "stack", ())) >= n
          and len(internals.scope_names(stack[:n])) == n)


__all__ = ["Unkeyable", "jaxpr_key", "leading_scopes", "run_key",
           "value_key"]
