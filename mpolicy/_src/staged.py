"""Binding a primitive so that JAX differentiates it once per signature.

Under `jax.grad` JAX linearizes a primitive bound on its own afresh at
every bind: it traces the primitive's JVP rule into a small jaxpr and
partially evaluates it. A deep model re-bound by the interpreter pays that
once per equation per layer. A ``jax.jit(..., inline=True)`` call of the
same primitive is linearized once per signature instead: JAX caches the
linearization of a jit's jaxpr (as it does for the `jax.numpy` functions
that are jits), and inlines the call where it is staged, so the program is
the same equations as a plain bind. `bind` takes that route where an
operand carries an autodiff tracer, and binds plainly elsewhere.

Where JAX keeps an inline jit's call in the jaxpr until it lowers it (JAX
0.12), the route would leave a `jit` equation per bind in every jaxpr and
saves no time (measured on a 12-layer GPT's `amp(apply)` trace, JAX 0.12,
2026-11-24: 1.28 s staged, 1.18 s plain): there `active()` is ``False``
and every bind is plain.

>>> import jax, jax.numpy as jnp
>>> eqn = jax.make_jaxpr(jnp.sin)(0.0).eqns[0]
>>> f = lambda x: bind(eqn.primitive, x, **eqn.params)
>>> float(jax.grad(f)(0.0))
1.0
>>> "cos" in str(jax.make_jaxpr(jax.grad(f))(0.0))
True
"""

from __future__ import annotations

import functools
from typing import Any

import jax

from mpolicy._src import jax_compat

# Primitives bound plainly: those with effects or named (mesh) axes, those
# that place or shard values, and those that make or touch mutable
# references (a jit may not return one).
_PLAIN = frozenset({"device_put", "sharding_constraint", "mesh_cast",
                    "reshard", "pvary", "pcast", "axis_index",
                    "random_seed", "random_wrap", "random_unwrap",
                    "new_ref", "empty_ref", "get", "swap", "addupdate",
                    "freeze"})


def bind(primitive, *args, **params) -> Any:
  """``primitive.bind(*args, **params)``, through a cached inline `jax.jit`
  where an operand is an autodiff tracer.

  Args:
    primitive: a first-order primitive (no sub-jaxprs in ``params``).
    *args: its operands.
    **params: its params.

  Returns:
    What ``primitive.bind`` returns.
  """
  if not (active() and any(isinstance(a, jax_compat.AUTODIFF_TRACERS)
                           for a in args)):
    return primitive.bind(*args, **params)
  fn = _jitted(primitive, params)
  return primitive.bind(*args, **params) if fn is None else fn(*args)


@functools.lru_cache(maxsize=None)
def active() -> bool:
  """Whether this JAX inlines an inline jit's call where it is staged (then
  `bind` and `call` stage under autodiff)."""
  jaxpr = jax.make_jaxpr(jax.jit(lambda x: x + 1, inline=True))(1.0)
  return all(e.primitive.name != "jit" for e in jaxpr.eqns)


def _jitted(primitive, params: dict):
  if (primitive.name in _PLAIN or primitive in jax_compat.CALLBACK_PRIMITIVES
      or any(_named(v) for v in params.values())):
    return None
  try:
    return _cached_jit(primitive, tuple(sorted(params.items())))
  except TypeError:  # An unhashable param.
    return None


def _named(value) -> bool:
  """Whether a param names mesh axes (a collective's ``axes``)."""
  if isinstance(value, str):
    return True
  return isinstance(value, tuple) and any(isinstance(v, str) for v in value)


@functools.lru_cache(maxsize=8192)
def _cached_jit(primitive, params: tuple):
  kwargs = dict(params)
  return jax.jit(lambda *args: primitive.bind(*args, **kwargs), inline=True)


def call(fn, *args) -> Any:
  """``fn(*args)`` through a cached inline `jax.jit` where an operand is an
  autodiff tracer (``fn`` must be hashable and take only arrays)."""
  if not (active() and any(isinstance(a, jax_compat.AUTODIFF_TRACERS)
                           for a in args)):
    return fn(*args)
  return _cached_fn_jit(fn)(*args)


@functools.lru_cache(maxsize=1024)
def _cached_fn_jit(fn):
  return jax.jit(fn, inline=True)
