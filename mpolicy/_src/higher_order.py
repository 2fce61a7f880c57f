"""Higher-order primitives: one table of how to rebuild each around rules.

A higher-order primitive (`jit`, `scan`, `while`, `cond`, `checkpoint`,
`custom_jvp_call`, `custom_vjp_call`, `shard_map`, ...) carries sub-jaxprs
in its params. Each rule here re-traces those sub-jaxprs through the
interpreter (`scope.trace`) at the dtypes its operands now have, and binds
the primitive again with the new sub-jaxprs:

* loop carries keep the dtype they enter with (carry outputs are cast back);
* `cond` branches must agree on output dtypes: each output takes the widest
  dtype any branch gives it;
* `custom_jvp` / `custom_vjp` keep their custom derivative: the rule runs on
  the dtypes it was written for, with casts at its boundary;
* `custom_linear_solve` runs exactly as traced (operands cast back to the
  dtypes its solver was written for), and so does the linear part of a
  custom VJP rule (``custom_lin``, ``call_hi_primitive_linearized``: a
  `custom_vjp` function differentiated inside a JVP rule), whose backward
  rule receives the dtypes it was written for.
* the call primitives (``closed_call`` and ``call``; ``eval_jaxpr`` from
  JAX 0.12 on) are found by name, each distinct primitive once.

Each rule is registered beside its definition (`_rule_for`).

JAX's next-generation constructs (``jax_scan3``, ``jax_remat3``,
``jax_custom_vjp3``, ``jax_custom_jvp3``) are one primitive,
``call_hi_primitive``, applying an object per construct; `_construct`
rebuilds each kind the way its classic primitive is rebuilt (a scan3 loop's
carries are references: what the body writes to one is cast to the
reference's dtype, see `rules.special`).

A primitive with sub-computations that is in no table raises
`UnsupportedPrimitiveError` rather than being silently skipped (see
`sub_computations`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import jax
import numpy as np

from mpolicy._src import dtypes
from mpolicy._src import jax_compat

_hj = jax_compat.hijax


class UnsupportedPrimitiveError(NotImplementedError):
  """A higher-order primitive the interpreter does not know how to enter."""


def _avals_like(invars, vals) -> list:
  """The avals of a sub-jaxpr's invars, with the dtypes of ``vals``."""
  out = []
  for var, x in zip(invars, vals):
    aval = var.aval
    if dtypes.dtype_of(x) != aval.dtype:
      aval = jax_compat.with_dtype(aval, dtypes.dtype_of(x))
    out.append(aval)
  return out


_bind = jax_compat.bind_with


def _closed(jaxpr) -> jax_compat.ClosedJaxpr:
  if isinstance(jaxpr, jax_compat.ClosedJaxpr):
    return jaxpr
  return jax_compat.ClosedJaxpr(jaxpr, ())


def _carry_dtypes(vals) -> list:
  return [dtypes.dtype_of(x) if dtypes.float_value(x) else None for x in vals]


# --- Rules ------------------------------------------------------------------

_RULES: dict[Any, Callable[..., list]] = {}


def _rule_for(*primitives):
  """Registers the decorated rule for each of ``primitives`` (``None``
  entries, primitives this JAX lacks, are left out). A primitive reached
  under two names (an alias) is registered once; one given two different
  rules is an error."""
  def register(rule):
    for p in primitives:
      if p is None:
        continue
      if _RULES.get(p, rule) is not rule:
        raise ValueError(
            f"mpolicy: the primitive {p.name!r} would get two higher-order "
            f"rules ({_RULES[p].__name__} and {rule.__name__})")
      _RULES[p] = rule
    return rule
  return register


@_rule_for(jax_compat.jit_p)
def _call(scope, eqn, invals):
  """`jit`/`closed_call`: one closed sub-jaxpr over all operands."""
  closed = jax_compat.sub_jaxpr(eqn)
  new = scope.trace(closed, _avals_like(closed.jaxpr.invars, invals))
  return _bind(eqn, invals, body=new)


def _open_call(scope, eqn, invals, **by_role):
  """`call`/`checkpoint`: one open sub-jaxpr; new consts become operands."""
  jaxpr = jax_compat.sub_jaxpr(eqn)
  new = scope.trace(_closed(jaxpr), _avals_like(jaxpr.invars, invals))
  new_jaxpr, consts = jax_compat.open_jaxpr_with_consts_first(new)
  return _bind(eqn, [*consts, *invals], body=new_jaxpr, **by_role)


def _register_calls() -> None:
  """`_call` for each call primitive over a closed jaxpr, `_open_call` for
  each over an open one: found by name (see `jax_compat.call_primitives`),
  so JAX 0.12's ``eval_jaxpr`` gets one rule whether or not its old
  aliases ``closed_call_p`` and ``call_p`` exist."""
  closed, opened = jax_compat.call_primitives()
  _rule_for(*closed)(_call)
  _rule_for(*opened)(_open_call)


_register_calls()


@_rule_for(jax_compat.remat_p)
def _checkpoint(scope, eqn, invals):
  """`jax.checkpoint`: its policy sees the half matmul and convolution
  primitives as the JAX ones they stand for (so ``dots_saveable`` keeps
  their results, as it keeps JAX's)."""
  policy = jax_compat.sub_jaxpr(eqn, "policy")
  return _open_call(scope, eqn, invals,
                    policy=jax_compat.policy_seeing_views(policy))


@_rule_for(jax_compat.scan_p)
def _scan(scope, eqn, invals):
  n_consts, n_carry = jax_compat.scan_counts(eqn.params)
  body = jax_compat.sub_jaxpr(eqn)
  carry = invals[n_consts:n_consts + n_carry]
  n_ys = len(body.jaxpr.outvars) - n_carry
  avals = _avals_like(body.jaxpr.invars, invals)
  out_dtypes = _carry_dtypes(carry) + [None] * n_ys
  places = scope.places
  new = scope.trace(body, avals, out_dtypes=out_dtypes)
  if scope.places == places:
    return _bind(eqn, invals, body=new)
  # Block matmuls inside drew keys by place: each iteration folds its own
  # index into them (the body traced again, taking it as a scanned input).
  scope.places = places
  new = scope.trace(body, avals, out_dtypes=out_dtypes, iteration=True)
  options = jax_compat.scan_options(eqn.params)

  def step(carry, x):
    outs = _hj.eval_closed(new, [*invals[:n_consts], *carry, *x])
    return outs[:n_carry], outs[n_carry:]

  xs = [*invals[n_consts + n_carry:],
        jax.numpy.arange(options["length"], dtype=np.int32)]
  carry, ys = jax.lax.scan(step, list(carry), xs, **options)
  return [*carry, *ys]


@_rule_for(jax_compat.while_p)
def _while(scope, eqn, invals):
  n_cond, n_body = jax_compat.while_counts(eqn.params)
  cond_consts = invals[:n_cond]
  body_consts = invals[n_cond:n_cond + n_body]
  carry = invals[n_cond + n_body:]
  cond_j = jax_compat.sub_jaxpr(eqn, "cond")
  body_j = jax_compat.sub_jaxpr(eqn, "body")
  new_cond = scope.trace(
      cond_j, _avals_like(cond_j.jaxpr.invars, [*cond_consts, *carry]))
  new_body = scope.trace(
      body_j, _avals_like(body_j.jaxpr.invars, [*body_consts, *carry]),
      out_dtypes=_carry_dtypes(carry))
  return _bind(eqn, invals, cond=new_cond, body=new_body)


@_rule_for(jax_compat.cond_p)
def _cond(scope, eqn, invals):
  branches = jax_compat.sub_jaxpr(eqn, "branches")
  operands = invals[1:]
  avals = [_avals_like(b.jaxpr.invars, operands) for b in branches]
  probes = [scope.trace(b, a, quiet=True) for b, a in zip(branches, avals)]
  unified = []
  for outs in zip(*(p.out_avals for p in probes)):
    floats = [o.dtype for o in outs if dtypes.is_float(o.dtype)]
    unified.append(dtypes.widest(floats)
                   if len(floats) == len(outs) else None)
  new = tuple(scope.trace(b, a, out_dtypes=unified)
              for b, a in zip(branches, avals))
  return _bind(eqn, invals, branches=new)


@_rule_for(jax_compat.custom_jvp_call_p)
def _custom_jvp(scope, eqn, invals):
  """The primal and the custom JVP rule both run under the rules, at the
  operands' dtypes; the rule's outputs follow the primal's output dtypes."""
  call = jax_compat.sub_jaxpr(eqn)
  n_consts = jax_compat.custom_jvp_num_consts(eqn.params)
  new_call = scope.trace(call, _avals_like(call.jaxpr.invars, invals))
  old_jvp = jax_compat.sub_jaxpr(eqn, "jvp")
  primal_avals = _avals_like(call.jaxpr.invars[n_consts:], invals[n_consts:])
  out_dtypes = [a.dtype for a in new_call.out_avals]

  def jvp_jaxpr_fun(*zeros):
    jvp_jaxpr, jvp_consts, out_zeros = jax_compat.call_thunk(old_jvp, *zeros)
    closed = jax_compat.ClosedJaxpr(jvp_jaxpr, jvp_consts)
    tangent_avals = [jax_compat.tangent_aval(a)
                     for a, z in zip(primal_avals, zeros) if not z]
    nz_out = [d for d, z in zip(out_dtypes, out_zeros) if not z]
    in_avals = [*primal_avals, *tangent_avals]
    try:
      new_jvp = scope.trace(closed, in_avals, out_dtypes=[*out_dtypes, *nz_out],
                            quiet=True)
    except Exception:  # pylint: disable=broad-except
      # The rule does not type-check at the new dtypes: run it at its own.
      new_jvp = scope.trace(closed, in_avals, out_dtypes=[*out_dtypes, *nz_out],
                            quiet=True, cast_inputs_to=closed.in_avals)
    return new_jvp.jaxpr, new_jvp.consts, out_zeros

  return _bind(eqn, invals, body=new_call,
               jvp=jax_compat.wrap_thunk(jvp_jaxpr_fun, old_jvp))


@_rule_for(jax_compat.custom_vjp_call_p)
def _custom_vjp(scope, eqn, invals):
  """The custom VJP rule sees the dtypes it was written for: operands are
  cast to those, and the primal and forward rule (both under the rules)
  return them."""
  call = jax_compat.sub_jaxpr(eqn)
  traced_in = [a.dtype for a in call.in_avals]
  args = [scope.cast(x, d) for x, d in zip(invals, traced_in)]
  out_dtypes = [a.dtype for a in call.out_avals]
  new_call = scope.trace(call, call.in_avals, out_dtypes=out_dtypes)
  old_fwd = jax_compat.sub_jaxpr(eqn, "fwd")

  def fwd_jaxpr_thunk(*nonzeros):
    fwd_jaxpr, fwd_consts = jax_compat.call_thunk(old_fwd, *nonzeros)
    fwd = jax_compat.ClosedJaxpr(fwd_jaxpr, fwd_consts)
    new_fwd = scope.trace(fwd, fwd.in_avals,
                          out_dtypes=[a.dtype for a in fwd.out_avals],
                          quiet=True)
    return new_fwd.jaxpr, new_fwd.consts

  return _bind(eqn, args, body=new_call,
               fwd=jax_compat.wrap_thunk(fwd_jaxpr_thunk, old_fwd))


@_rule_for(jax_compat.shard_map_p)
def _shard_map(scope, eqn, invals):
  """The body is traced again inside its mesh axes (for `pvary` and
  collectives), at the dtypes its operands now have."""
  jaxpr = jax_compat.sub_jaxpr(eqn)
  with jax_compat.shard_map_body_context(eqn):
    new = scope.trace(_closed(jaxpr), _avals_like(jaxpr.invars, invals))
  new_jaxpr, consts = jax_compat.open_jaxpr_with_consts_first(new)
  if consts:
    raise UnsupportedPrimitiveError(
        "mpolicy: a shard_map body gained constants while being interpreted; "
        "pass them as arguments to the shard_map-ed function instead")
  return _bind(eqn, invals, body=new_jaxpr)


@_rule_for(jax_compat.linear_solve_p, *jax_compat.LINEARIZED_CUSTOM_RULES)
def _as_traced(scope, eqn, invals):
  """Runs the primitive exactly as traced: operands cast back to the dtypes
  its sub-jaxprs were written for (linear solves: half has no kernels; the
  linear part of a custom VJP rule: its backward rule, run when JAX
  transposes it, receives residuals and cotangents of those dtypes)."""
  args = [scope.cast(x, dtypes.aval_dtype(v.aval))
          for x, v in zip(invals, eqn.invars)]
  return _bind(eqn, args)


# --- The next-generation constructs -------------------------------------------


def _rebuilt(scope, invals, body, rebuild):
  """A construct with one body run at its operands' dtypes: ``rebuild``
  makes it around the new body, whose consts become leading operands."""
  new = scope.trace(body, _avals_like(body.jaxpr.invars, invals))
  new_obj, consts = rebuild(new)
  return _hj.bind(new_obj, [*consts, *invals])


def _scan3(scope, eqn, obj, invals):
  """A scan3 loop: its body (carries are references) at the dtypes its
  operands now have; its outputs take what dtypes the rules give them."""
  del eqn
  return _rebuilt(scope, invals, _hj.scan_body(obj),
                  lambda body: _hj.scan_rebuild(obj, body))


def _remat3(scope, eqn, obj, invals):
  """`jax.checkpoint` under remat3: as `checkpoint` (its policy kept; JAX
  asks it about the half matmuls' views, see `jax_compat.remat`)."""
  del eqn
  return _rebuilt(scope, invals, _hj.remat_body(obj),
                  lambda body: _hj.remat_rebuild(obj, body))


def _primal_of(obj, invals) -> jax_compat.ClosedJaxpr:
  primal = _hj.custom_primal(obj)
  if primal is None or len(primal.in_avals) != len(invals):
    raise UnsupportedPrimitiveError(
        f"mpolicy: cannot match the operands of {_hj.name(obj)} to its "
        f"primal function ({len(invals)} operands); run it inside "
        "`mpolicy.full_precision()`")
  return primal


def _cast_now(x, dtype):
  """A cast made where a lazily run rule runs (not cached in an `Env`)."""
  if dtype is None or not dtypes.float_value(x) or dtypes.dtype_of(x) == dtype:
    return x
  return jax.lax.convert_element_type(x, dtype)


def _interpreted(scope, fn, out_dtypes=None, in_dtypes=None, written=None):
  """``fn``, one of JAX's rule functions (pytrees in and out), run under
  the rules wherever JAX calls it: traced, interpreted quietly and
  evaluated. ``out_dtypes(n)`` gives the dtype of each of its ``n`` output
  leaves (``None`` entries, or a ``None`` list: as they come); without
  it, each output keeps the dtype ``fn`` gives it. ``in_dtypes(n)``, if
  given, the dtypes to cast its ``n`` input leaves to where it does not
  trace at theirs; ``written`` (default ``fn``), the rule traced then: the
  one written for those dtypes."""

  def run(*args):
    try:
      closed, dynamic, finish = _hj.trace_rule(fn, args)
    except Exception:  # pylint: disable=broad-except
      if in_dtypes is None:
        raise
      leaves, tree = jax.tree_util.tree_flatten(args)
      want = in_dtypes(len(leaves))
      if want is None and written is None:
        raise
      if want is not None:
        args = jax.tree_util.tree_unflatten(
            tree, [_cast_now(x, d) for x, d in zip(leaves, want)])
      closed, dynamic, finish = _hj.trace_rule(written or fn, args)
    if out_dtypes is None:
      fixed = [a.dtype for a in closed.out_avals]
    else:
      wanted = out_dtypes(len(finish.out_dynamic))
      fixed = (None if wanted is None else
               [d for d, dyn in zip(wanted, finish.out_dynamic) if dyn])
    new = scope.trace(closed, closed.in_avals, out_dtypes=fixed, quiet=True)
    return finish(_hj.eval_closed(new, dynamic))

  return _hj.keep_name(run, fn)


def _custom_vjp3(scope, eqn, obj, invals):
  """As `_custom_vjp`: operands cast to the dtypes the rules were written
  for; the primal and the forward rule run under the rules and return
  those dtypes; the backward rule is kept."""
  primal = _primal_of(obj, invals)
  args = [scope.cast(x, v.aval.dtype) for x, v in zip(invals, eqn.invars)]
  new_primal = scope.trace(primal, primal.in_avals,
                           out_dtypes=[a.dtype for a in primal.out_avals])
  new_fwd = _interpreted(scope, _hj.custom_vjp_fwd(obj))
  return _hj.bind(_hj.custom_vjp_rebuild(obj, new_primal, new_fwd), args)


def _primals_and_tangents(written: list, n: int) -> Optional[list]:
  """The dtypes of a JVP rule's ``n`` operand leaves, its primals written
  as ``written``: each tangent as its primal, where that is known (every
  tangent given, or every primal of one floating dtype); else ``None``."""
  k = len(written)
  floats = {d for d in written if dtypes.is_float(d)}
  if n == 2 * k:
    return written * 2
  if k < n < 2 * k and len(floats) == 1:
    return written + [floats.pop()] * (n - k)
  return None


def _custom_jvp3(scope, eqn, obj, invals):
  """As `_custom_jvp`: the primal and the JVP rule run under the rules at
  the operands' dtypes (the rule at the dtypes it was written for where it
  does not trace at theirs); its outputs follow the primal's dtypes."""
  del eqn
  primal = _primal_of(obj, invals)
  new_primal = scope.trace(primal, _avals_like(primal.jaxpr.invars, invals))
  outs = [a.dtype for a in new_primal.out_avals]
  written = [a.dtype for a in primal.in_avals]
  # The rule maps (primals, tangents) to (outputs, output tangents). Where
  # it does not trace at the new dtypes (it computes its primal output
  # itself, at the dtypes it was written for), it runs as written.
  wrap = lambda rule, as_written: _interpreted(
      scope, rule,
      out_dtypes=lambda n: outs * 2 if n == 2 * len(outs) else None,
      in_dtypes=lambda n: _primals_and_tangents(written, n),
      written=as_written)
  return _hj.bind(_hj.custom_jvp_rebuild(obj, new_primal, wrap), invals)


def _checkpoint_name3(scope, eqn, obj, invals):
  """`checkpoint_name` under remat3: the same name on the value as it is."""
  del scope, eqn
  (x,) = invals
  return _hj.bind(_hj.checkpoint_name_rebuild(obj, jax_compat.aval_of(x)),
                  [x])


_CONSTRUCT_RULES: dict[str, Callable[..., list]] = {
    "scan": _scan3,
    "remat": _remat3,
    "custom_vjp": _custom_vjp3,
    "custom_jvp": _custom_jvp3,
    "checkpoint_name": _checkpoint_name3,
}


@_rule_for(_hj.call_hi_primitive_p)
def _construct(scope, eqn, invals):
  """``call_hi_primitive``: the rule of its construct's kind. A construct
  mpolicy does not know runs as traced if it carries no sub-computation
  (a first-order operation of JAX's or the user's), and is refused if it
  does, except inside `full_precision()`."""
  obj = _hj.hi_object(eqn)
  rule = _CONSTRUCT_RULES.get(_hj.kind(obj))
  if rule is not None:
    return rule(scope, eqn, obj, invals)
  if (_hj.sub_computations(_hj.construct_params(obj))
      and not scope.as_written()):
    raise UnsupportedPrimitiveError(
        f"mpolicy cannot apply its op rules inside {_hj.name(obj)} (a "
        f"call_hi_primitive construct): it carries a sub-computation, and "
        f"mpolicy knows the constructs {', '.join(sorted(_hj.KINDS))}. Run "
        f"it as written inside `mpolicy.full_precision()`.")
  return _as_traced(scope, eqn, invals)


def rule_for(primitive) -> Optional[Callable[..., list]]:
  """How to rebuild ``primitive`` around interpreted sub-jaxprs, if it has any."""
  return _RULES.get(primitive)


def supported() -> tuple[str, ...]:
  """Names of the higher-order primitives the interpreter enters."""
  return tuple(sorted(p.name for p in _RULES))
