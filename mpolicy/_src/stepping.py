"""How the interpreter steps through a higher-order primitive, eagerly.

When the interpreter replays a program as written (`interpreter.replay`,
for the debugger), it runs each equation on concrete values, and a
higher-order one by the step rule here that goes with its rule in
`higher_order`'s table: the bodies of `jit`, `checkpoint`, custom
derivatives and calls run inline; `scan` and `while` iterate in Python
(each iteration numbered; a reversed scan's iteration is the index of the
element it reads, so a backward scan names its forward iteration); `cond`
runs the branch its index picks; a `shard_map` body is traced once for
every device (`Stepper.per_device`). JAX's next-generation constructs
(``call_hi_primitive``) step as their classic primitives do; a scan3
loop's carries stay in their references.

A step rule gets a `Stepper` (what the interpreter lends it: run a body,
report values it moves) rather than importing the interpreter. A
primitive without a step rule, or one that needs concrete values inside a
traced body (`while`, `cond`), is bound as written, as one equation.
"""

from __future__ import annotations

from collections.abc import Callable
import itertools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from mpolicy._src import higher_order
from mpolicy._src import jax_compat

_hj = jax_compat.hijax


def _parts(sub) -> tuple[Any, list]:
  """``(jaxpr, consts)`` of an open or closed jaxpr."""
  if hasattr(sub, "consts"):
    return sub.jaxpr, list(sub.consts)
  return sub, []


def _inline(stepper, eqn, invals):
  """`jit`, `checkpoint`, custom derivatives, calls: the body, inline."""
  return stepper.run(jax_compat.sub_jaxpr(eqn), invals)


def _stacked(stepper, rows: list, aval, length: int):
  """Per-iteration values stacked (the stacked value moves them)."""
  if not rows:
    return jnp.zeros((length, *aval.shape), aval.dtype)
  value = jnp.stack(rows)
  stepper.moved(rows, value)
  return value


def _sliced(stepper, x, i: int):
  row = x[i]
  stepper.moved(x, row)
  return row


def _iterations(length: int, reverse: bool):
  return range(length - 1, -1, -1) if reverse else range(length)


def _scan(stepper, eqn, invals):
  n_consts, n_carry, length, reverse = jax_compat.scan_layout(eqn.params)
  body = jax_compat.sub_jaxpr(eqn)
  consts = invals[:n_consts]
  carry = invals[n_consts:n_consts + n_carry]
  xs = invals[n_consts + n_carry:]
  reads = stepper.outs_read
  rows: list = [None] * length
  for i in _iterations(length, reverse):
    outs = stepper.run(body, [*consts, *carry,
                              *(_sliced(stepper, x, i) for x in xs)],
                       iteration=i,
                       outs_read=[True] * n_carry + reads[n_carry:])
    carry, rows[i] = outs[:n_carry], outs[n_carry:]
  ys = [_stacked(stepper, [r[k] for r in rows], var.aval, length)
        for k, var in enumerate(body.jaxpr.outvars[n_carry:])]
  return [*carry, *ys]


def _while(stepper, eqn, invals):
  n_cond, n_body = jax_compat.while_counts(eqn.params)
  cond_j = jax_compat.sub_jaxpr(eqn, "cond")
  body_j = jax_compat.sub_jaxpr(eqn, "body")
  c_args, b_args = invals[:n_cond], invals[n_cond:n_cond + n_body]
  carry = invals[n_cond + n_body:]
  for i in itertools.count():
    (go,) = stepper.run(cond_j, [*c_args, *carry], iteration=i,
                        outs_read=[True])
    if not bool(go):
      return list(carry)
    # The carry feeds the next iteration: the forward pass reads it.
    carry = stepper.run(body_j, [*b_args, *carry], iteration=i,
                        outs_read=[True] * len(carry))


def _cond(stepper, eqn, invals):
  branches = jax_compat.sub_jaxpr(eqn, "branches")
  index = int(np.clip(int(invals[0]), 0, len(branches) - 1))
  return stepper.run(branches[index], invals[1:])


def _shard_map(stepper, eqn, invals):
  """The body traced once, inside the mesh, for every device; what the
  observers carry out of it comes back one row per device."""
  body = jax_compat.sub_jaxpr(eqn)
  axes = jax_compat.shard_map_manual_axes(eqn)
  n_out = len(_parts(body)[0].outvars)

  def local(*vals):
    with stepper.per_device(jax.lax.axis_index(axes)) as carried:
      for x, shard in zip(invals, vals):
        stepper.moved(x, shard)
      outs = stepper.run(body, list(vals), traced=True)
      extra = carried(outs)
    return (*outs, jax_compat.make_varying(extra, axes)[None])

  # Under `jit`: traced, not run device by device (eager `shard_map` has
  # no references, which a scan3 loop in the body makes).
  results = jax.jit(jax_compat.shard_map_like(eqn, local, 0, 1))(*invals)
  outs = list(results[:n_out])
  stepper.devices_ran(results[n_out], outs)
  return outs


# --- The next-generation constructs -------------------------------------------


def _scan3(stepper, eqn, invals):
  """A scan3 loop: its body per iteration, its carries in references (the
  operands that are not scanned over), its outputs stacked."""
  obj = _hj.hi_object(eqn)
  length, reverse, scanned = _hj.scan_loop(obj)
  body = _hj.scan_body(obj)
  reads = stepper.outs_read
  rows: list = [None] * length
  for i in _iterations(length, reverse):
    args = [_sliced(stepper, x, i) if s else x
            for x, s in zip(invals, scanned)]
    rows[i] = stepper.run(body, args, iteration=i, outs_read=reads)
  return [_stacked(stepper, [r[k] for r in rows], aval, length)
          for k, aval in enumerate(body.out_avals)]


def _construct_inline(body_of: Callable[[Any], Any]):
  def step(stepper, eqn, invals):
    body = body_of(_hj.hi_object(eqn))
    if body is None or len(body.in_avals) != len(invals):
      return None  # Bound as written.
    return stepper.run(body, invals)
  return step


_CONSTRUCTS = {
    "scan": _scan3,
    "remat": _construct_inline(_hj.remat_body),
    "custom_vjp": _construct_inline(_hj.custom_primal),
    "custom_jvp": _construct_inline(_hj.custom_primal),
}


def _construct(stepper, eqn, invals):
  """``call_hi_primitive``: the step rule of its construct's kind."""
  rule = _CONSTRUCTS.get(_hj.kind(_hj.hi_object(eqn)))
  return None if rule is None else rule(stepper, eqn, invals)


# Step rules, keyed by the primitives' rules in `higher_order`'s table.
_BY_PRIMITIVE = {
    jax_compat.jit_p: _inline,
    jax_compat.remat_p: _inline,
    jax_compat.custom_jvp_call_p: _inline,
    jax_compat.custom_vjp_call_p: _inline,
    jax_compat.scan_p: _scan,
    jax_compat.while_p: _while,
    jax_compat.cond_p: _cond,
    jax_compat.closed_call_p: _inline,
    jax_compat.core_call_p: _inline,
    jax_compat.shard_map_p: _shard_map,
    _hj.call_hi_primitive_p: _construct,
}
_STEPS = {higher_order.rule_for(p): rule for p, rule in _BY_PRIMITIVE.items()
          if p is not None and higher_order.rule_for(p) is not None}
# Rules that need concrete values (a Python loop's test, a branch index):
# inside a traced body the equation is bound as one instead.
_CONCRETE = frozenset({_while, _cond, _shard_map})


def rule_for(primitive, traced: bool) -> Optional[Callable[..., Any]]:
  """The step rule of ``primitive`` (a rule of `higher_order`'s table);
  ``None``: bind it as written, as one equation. ``traced``: inside a
  traced body (a `shard_map`'s), where values are not concrete."""
  rule = _STEPS.get(higher_order.rule_for(primitive))
  if rule is None or (traced and rule in _CONCRETE):
    return None
  return rule
