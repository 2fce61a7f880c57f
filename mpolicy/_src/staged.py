"""Binding a primitive so that JAX differentiates it once per signature.

Under `jax.grad` JAX linearizes a primitive bound on its own afresh at
every bind: it traces the primitive's JVP rule into a small jaxpr and
partially evaluates it. The interpreter re-binds every equation of a deep
model, so it would pay that once per equation per layer. `bind` and `call`
go through `jax_compat.linearized_call` instead where an operand is being
linearized: the linearization is made once per (primitive, params, avals)
and every later bind stages the stored forward and tangent equations, the
same equations a plain bind gives. Elsewhere they bind plainly, and so does
`bind` for params that name mesh axes (a collective's) or cannot be hashed.
The rules decide which primitives never come here (host callbacks,
references, placement: the ``binds_plainly`` fact): `rules.base.bind` binds
those as they are.

Measured on a 12-layer GPT's jitted Adam step under `transform_amp`
(JAX 0.12, 2026-11-25): 1,238 fresh linearizations per trace bound
plainly, 92 with this route. An earlier route, a cached inline `jax.jit`
per bind, did the same on JAX 0.10 but left a `jit` equation per bind on
JAX 0.12, and spent a third of the interpreter's time in `jit`'s own
linearization rule.

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

from mpolicy._src import jax_compat


def _linearizing(args) -> bool:
  return any(isinstance(a, jax_compat.LinearizeTracer) for a in args)


def bind(primitive, *args, **params) -> Any:
  """``primitive.bind(*args, **params)``, linearized once per signature
  where an operand is being linearized (`jax.grad`).

  Args:
    primitive: a first-order primitive (no sub-jaxprs in ``params``) that
      may be linearized so (not one whose facts say it binds plainly).
    *args: its operands.
    **params: its params.

  Returns:
    What ``primitive.bind`` returns.
  """
  fn = _bound(primitive, params) if _linearizing(args) else None
  if fn is None:
    return primitive.bind(*args, **params)
  outs = jax_compat.linearized_call(fn, args)
  return outs if primitive.multiple_results else outs[0]


def _bound(primitive, params: dict):
  """A function binding ``primitive`` with ``params`` (one per pair), or
  ``None`` where it must be bound plainly."""
  if any(_named(v) for v in params.values()):
    return None
  try:
    return _cached_bound(primitive, tuple(sorted(params.items())))
  except TypeError:  # An unhashable param.
    return None


def _named(value) -> bool:
  """Whether a param names mesh axes (a collective's ``axes``)."""
  if isinstance(value, str):
    return True
  return isinstance(value, tuple) and any(isinstance(v, str) for v in value)


@functools.lru_cache(maxsize=8192)
def _cached_bound(primitive, params: tuple):
  kwargs = dict(params)
  if primitive.multiple_results:
    return lambda *args: primitive.bind(*args, **kwargs)
  return lambda *args: [primitive.bind(*args, **kwargs)]


@functools.lru_cache(maxsize=1024)
def bound_one(primitive, params: tuple):
  """``lambda x: primitive.bind(x, **dict(params))``, one per pair."""
  kwargs = dict(params)
  return lambda x: primitive.bind(x, **kwargs)


def call(fn, *args) -> Any:
  """``fn(*args)``, linearized once per signature where an operand is being
  linearized (``fn`` must be hashable, take arrays and return one)."""
  if not _linearizing(args):
    return fn(*args)
  return jax_compat.linearized_call(_listed(fn), args)[0]


@functools.lru_cache(maxsize=1024)
def _listed(fn):
  return lambda *args: [fn(*args)]
