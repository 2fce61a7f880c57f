"""Running a function under `jax.grad` with a linearization made once.

Under `jax.grad` (and `jax.vjp`, `jax.linearize`) JAX linearizes each
primitive bound on its own afresh: it traces the primitive's JVP rule into
a small jaxpr and partially evaluates it, at every bind. A deep model
re-bound equation by equation pays that once per equation per layer.

`linearized_call(fn, args)` runs ``fn`` so that JAX's linearizing trace
linearizes it once per signature (``fn``, the input avals, which inputs
carry tangents, JAX's trace context): the first call keeps the forward
equations (the outputs and the residuals) and the tangent equations that
JAX's private `linearize_jaxpr` (autodiff's interpreter module) makes; every later call stages
those equations where a plain bind would stage its own, so the program is
the one plain binds give. The route is a primitive, ``mpolicy_linearized``,
that never reaches a jaxpr: the linearizing trace calls its linearization
rule, and on any other trace (evaluation, `jit`, `vmap`, `jax.jvp`) it runs
``fn`` itself. The cache is one of JAX's, so `jax.clear_caches()` empties
it.

JAX 0.10 and 0.12 differ in what `linearize_jaxpr` returns and in the
signature of a linearization rule (0.12 adds structured residuals); both
are read here.

>>> import jax, jax.numpy as jnp
>>> f = lambda x: linearized_call(lambda a: [jnp.sin(a)], [x])[0]
>>> float(jax.grad(f)(0.0))
1.0
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
from jax.extend import core as jex_core

# Private JAX: autodiff's linearizing trace and its rule table, and JAX's
# own cache (cleared by `jax.clear_caches()`, keyed by the trace context).
from jax._src import util as _util
from jax._src.interpreters import ad as _ad

from mpolicy._src.jax_compat import internals

_typeof = jax.typeof
_eval_jaxpr = jax.core.eval_jaxpr

# JAX 0.12's linearization rules also return structured residuals.
_STRUCTURED = "structured_residuals" in getattr(
    _ad.LinearizeTrace, "__annotations__", {})

# The tracer of a value being linearized (`jax.grad`, `jax.vjp`).
LinearizeTracer = _ad.LinearizeTracer

_linearized_p = jex_core.Primitive("mpolicy_linearized")
_linearized_p.multiple_results = True


def linearized_call(fn: Callable[..., Sequence[Any]], args) -> list:
  """``list(fn(*args))``, linearized once per signature under `jax.grad`.

  Args:
    fn: a hashable function of arrays returning a list of arrays, without
      effects and without named axes (its result depends on its arguments'
      avals only).
    args: its arguments.

  Returns:
    Its outputs, a list.
  """
  return _linearized_p.bind(*args, fn=fn)


def _bind_with_trace(trace, args, avals, params):
  del avals
  if isinstance(trace, _ad.LinearizeTrace):
    return trace.process_primitive(_linearized_p, args, params)
  with jex_core.set_current_trace(trace):
    return list(params["fn"](*args))


_linearized_p.def_bind_with_trace(_bind_with_trace)


class _Linearization(NamedTuple):
  forward: Any  # Jaxpr: outputs, then new residuals, then structured ones.
  forward_consts: list
  n_out: int
  consts: list  # The traced jaxpr's consts (forwarded residuals index them).
  forwarded: tuple  # Per residual: an index into consts + inputs, or None.
  n_structured: int
  tangent: Any  # Jaxpr: (residuals, nonzero tangents, structured) -> tangents.
  tangent_consts: list
  nonzeros_out: tuple
  out_avals: tuple  # Tangent avals of the outputs.


@_util.cache(max_size=8192)
def _linearization(fn, avals: tuple, nonzeros: tuple,
                   is_vjp: bool) -> _Linearization:
  closed = internals.trace_to_closed_jaxpr(fn, avals)
  consts = list(closed.consts)
  fwd, out_info, nonzeros_out, forwarded, tangent = _ad.linearize_jaxpr(
      closed, nonzeros, is_vjp=is_vjp)
  if _STRUCTURED:  # JAX 0.12: (Jaxpr, FlatTree of the outputs, ...).
    primal, _, structured = out_info.unpack()
    n_out, n_structured = len(primal), len(structured)
    fwd_jaxpr, fwd_consts = fwd, list(fwd.consts)
    tangent_jaxpr, tangent_consts = tangent, list(tangent.consts)
  else:  # JAX 0.10: (ClosedJaxpr, number of new residuals, ...).
    n_out, n_structured = len(fwd.out_avals) - out_info, 0  # type: ignore[operator]  # An int before 0.12.
    fwd_jaxpr, fwd_consts = fwd.jaxpr, list(fwd.consts)
    tangent_jaxpr, tangent_consts = tangent.jaxpr, list(tangent.consts)
  return _Linearization(
      fwd_jaxpr, fwd_consts, n_out, consts, tuple(forwarded), n_structured,
      tangent_jaxpr, tangent_consts, tuple(nonzeros_out),
      tuple(internals.tangent_aval(a) for a in closed.out_avals))


def _rule(is_vjp, nonzeros, *primals, fn):
  lin = _linearization(fn, tuple(_typeof(x) for x in primals),
                       tuple(nonzeros), bool(is_vjp))
  outs = _eval_jaxpr(lin.forward, lin.forward_consts, *primals,
                          propagate_source_info=False)
  primal_out, fresh = outs[:lin.n_out], iter(outs[lin.n_out:])
  known = [*lin.consts, *primals]
  residuals = [known[i] if i is not None else next(fresh)
               for i in lin.forwarded]
  residuals += list(fresh)  # The structured residuals, last.

  def linearized(residuals, *tangents):
    split = len(residuals) - lin.n_structured
    nonzero = [t for t, nz in zip(tangents, nonzeros) if nz]
    out = iter(_eval_jaxpr(
        lin.tangent, lin.tangent_consts, *residuals[:split], *nonzero,
        *residuals[split:], propagate_source_info=False))
    return [next(out) if nz else _ad.Zero(aval)
            for aval, nz in zip(lin.out_avals, lin.nonzeros_out)]

  if _STRUCTURED:
    return (primal_out, list(lin.nonzeros_out), residuals, None,
            lambda res, _, *tangents: linearized(res, *tangents))
  return primal_out, list(lin.nonzeros_out), residuals, linearized


_ad.primitive_linearizations[_linearized_p] = _rule

__all__ = ["linearized_call", "LinearizeTracer"]
