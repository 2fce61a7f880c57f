"""Optimizer state and updates that keep their dtypes from step to step."""

from __future__ import annotations

import jax
import optax

from mpolicy._src import arguments
from mpolicy._src.training import _trees


def keep_dtypes(
    inner: optax.GradientTransformation,
) -> optax.GradientTransformationExtraArgs:
  """Wraps `inner` so its state and updates keep their dtypes between steps.

  Keeps a jitted step from compiling twice when optimizer state made from
  half params (e.g. Adam's moments) meets float32 gradients and promotes:

  * State: each leaf of the state `inner.init` returns keeps that dtype (and
    is strongly typed) after every update; so `keep_dtypes(inner).init(params)`
    picks the state dtypes from `params`.
  * Updates: each floating leaf is cast to the dtype of its parameter (or,
    without `params`, of the incoming gradient), so `optax.apply_updates`
    never promotes.

  Wrap `master_weights` the other way round
  (`master_weights(keep_dtypes(inner))`): its updates are float32 on
  purpose.

  Args:
    inner: the optimizer to wrap.

  Returns:
    An `optax.GradientTransformationExtraArgs` with `inner`'s state.

  >>> import jax.numpy as jnp, optax
  >>> tx = keep_dtypes(optax.adam(1e-3))
  >>> params = {"w": jnp.ones(2, jnp.bfloat16)}
  >>> state = tx.init(params)
  >>> updates, state = tx.update({"w": jnp.ones(2, jnp.float32)}, state, params)
  >>> updates["w"].dtype, state[0].mu["w"].dtype
  (dtype(bfloat16), dtype(bfloat16))

  See also: `master_weights`, `make_train_step`.
  """
  arguments.require_transformation(inner, "keep_dtypes", "inner")
  inner = optax.with_extra_args_support(inner)

  def init(params):
    return jax.tree_util.tree_map(_trees.strong, inner.init(params))

  def update(updates, state, params=None, **extra_args):
    like = updates if params is None else params
    new_updates, new_state = inner.update(updates, state, params, **extra_args)
    new_updates = jax.tree_util.tree_map(
        _trees.cast_like, new_updates, like, is_leaf=lambda x: x is None)
    new_state = jax.tree_util.tree_map(
        _trees.cast_like, new_state, state, is_leaf=lambda x: x is None)
    return new_updates, new_state

  return optax.GradientTransformationExtraArgs(init, update)

