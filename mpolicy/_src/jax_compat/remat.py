"""Remat policies, seeing mpolicy's own primitives as JAX's.

A checkpoint policy (`jax.checkpoint_policies`) decides per primitive what
the backward pass keeps: ``dots_saveable`` keeps what ``dot_general`` and
``conv_general_dilated`` compute, ``dots_with_no_batch_dims_saveable``
those without batch dimensions, and so on. Under the op rules a matmul is
``amp_dot_general``, which no policy names. A primitive of mpolicy's
registers its *view*: the JAX primitive and params it stands for. Then:

* under the classic ``remat2``, the interpreter binds the checkpoint with
  `policy_seeing_views(policy)`, which hands the policy the view;
* under ``jax_remat3``, JAX asks a per-primitive rule what to keep: the one
  registered here asks the policy about the view, as JAX's own rule for
  ``dot_general`` asks about a ``dot_general``.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import functools
from typing import Any

import jax

# Private JAX (each listed, with what it is for, in `private`).
from jax._src import ad_checkpoint as _ad_checkpoint
from jax._src import core as _core
from jax._src.interpreters import partial_eval as _pe

try:  # The remat3 transform (JAX 0.10 and later).
  from jax._src.interpreters import remat as _remat  # pylint: disable=g-import-not-at-top
except ImportError:
  _remat = None  # type: ignore[assignment]  # Absent before JAX 0.10.

# Primitive -> ``view(**params) -> (JAX primitive, its params)``.
_VIEWS: dict[Any, Callable[..., tuple[Any, dict]]] = {}

# Policies that decide nothing per primitive (JAX special-cases them).
_WHOLESALE = (None, jax.checkpoint_policies.everything_saveable,
              jax.checkpoint_policies.nothing_saveable)


def define_remat_view(primitive, view) -> None:
  """Remat policies see ``primitive`` as ``view(**params)`` says: a pair
  (JAX primitive, its params), e.g. ``(dot_general_p, {...})``."""
  _VIEWS[primitive] = view
  if _remat is not None:
    _remat.rules[primitive] = functools.partial(_RULE, primitive, view)


@dataclasses.dataclass(frozen=True)
class _SeeingViews:
  """A policy that asks ``policy`` about the views of mpolicy's primitives."""
  policy: Any

  def __call__(self, prim, *avals, **params):
    view = _VIEWS.get(prim)
    if view is not None:
      prim, params = view(**params)
    return self.policy(prim, *avals, **params)

  def __repr__(self):
    name = getattr(self.policy, "__name__", None) or repr(self.policy)
    return f"seeing_mpolicy_primitives({name})"


def policy_seeing_views(policy):
  """``policy``, asking about mpolicy's primitives by their views (the
  wholesale policies, and a policy already seeing them, as they are)."""
  if (any(policy is p for p in _WHOLESALE) or not callable(policy)
      or isinstance(policy, _SeeingViews)):
    return policy
  return _SeeingViews(policy)


def _keep_and_recompute(bind, out, *args):
  """What recomputing ``bind(*args)`` gives the backward pass once ``out``
  is kept: ``out`` (its tangent flows through the recomputed value)."""
  return _ad_checkpoint.primal_left_tangent_right(out, bind(*args))


def _remat3_rule(primitive, view, trace, *args, **params):
  """JAX 0.12's remat rule: ``(out, residuals, recompute)``."""
  bind = functools.partial(primitive.bind, **params)
  out = bind(*args)
  recompute = lambda _, *a: bind(*a)
  if trace.policy is None:
    return out, (), recompute
  prim, plain = view(**params)
  case = _pe.ensure_enum(
      trace.policy(prim, *(jax.typeof(a) for a in args), **plain))
  if isinstance(case, _pe.SaveableType):
    out = _remat.reduce_precision(out)
    return out, out, functools.partial(_keep_and_recompute, bind)
  if isinstance(case, _pe.Offloadable):
    out = _remat.reduce_precision(out)
    host = jax.device_put(out, _core.mem_kind_to_space(case.dst),
                          may_alias=False)
    src = _core.mem_kind_to_space(case.src)
    return out, host, lambda h, *a: _keep_and_recompute(
        bind, jax.device_put(h, src, may_alias=False), *a)
  return out, (), recompute


def _remat3_rule_v10(primitive, view, policy, *args, **params):
  """JAX 0.10's remat rule: ``(out, recompute)``. As JAX 0.10's own rule
  for ``dot_general``, only its dots policies (``DotsSaveable``) keep a
  result, and only for a view JAX has such a rule for."""
  bind = functools.partial(primitive.bind, **params)
  out = bind(*args)
  prim, plain = view(**params)
  dots = getattr(_ad_checkpoint, "DotsSaveable", None)
  if (prim in _remat.rules and dots is not None and isinstance(policy, dots)
      and policy(prim, *(jax.typeof(a) for a in args), **plain)):
    return out, functools.partial(_keep_and_recompute, bind, out)
  return out, bind


_RULE = (_remat3_rule if _remat is not None
         and hasattr(_remat, "remat_subtrace") else _remat3_rule_v10)


__all__ = ["define_remat_view", "policy_seeing_views"]
