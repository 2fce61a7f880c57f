"""Skipping non-finite steps: params and optimizer state kept bit for bit.

`skip_nonfinite` is an optax transformation that leaves the inner state as
it was and returns updates that leave params as they were, when the
gradients are not finite; `update_if_finite` does the same for any
optimizer by selecting the old params and state.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
import optax

from mpolicy._src import arguments
from mpolicy._src import distributed
from mpolicy._src import loss_scale as loss_scale_lib
from mpolicy._src.training import _trees

PyTree = Any


class SkipNonFiniteState(NamedTuple):
  """State of `skip_nonfinite`.

  Attributes:
    inner_state: the wrapped optimizer's state; bit-for-bit unchanged by a
      skipped step (so its step count does not advance either).
    notfinite_count: int32, non-finite steps in a row (0 after a finite one).
    last_finite: bool, whether the last step was finite.
    total_notfinite: int32, non-finite (skipped) steps since `init`.
  """
  inner_state: Any
  notfinite_count: jax.Array
  last_finite: jax.Array
  total_notfinite: jax.Array


def skip_nonfinite(
    inner: optax.GradientTransformation,
) -> optax.GradientTransformationExtraArgs:
  """Wraps `inner` to skip steps whose gradients are not finite.

  On a non-finite step the inner state is returned bit-for-bit as it was
  (its step count does not advance) and the updates are `-0.0`, so
  `optax.apply_updates(params, updates)` returns params bit-for-bit as they
  were (adding `-0.0` is the exact identity; `+0.0` would turn `-0.0` into
  `+0.0`; complex leaves get `-0.0` in both parts). Only this wrapper's counters (`SkipNonFiniteState`) change. A
  non-finite update is never applied, however many come in a row.

  Whether the step is finite is read from the `grads_finite` extra argument
  when given: pass the all-reduced flag from `scaled_value_and_grad`, so
  every device skips together. Without it, `all_finite(updates)` is used.

  For gradient accumulation, use `optax.MultiSteps(tx, k,
  should_skip_update_fn=optax.skip_not_finite)`, which drops a non-finite
  mini-batch before it reaches the accumulator.

  Args:
    inner: the optimizer to wrap; extra args other than `grads_finite` are
      passed on to it.

  Returns:
    An `optax.GradientTransformationExtraArgs` with `SkipNonFiniteState`.

  Raises:
    ValueError: from `update`, if `grads_finite` is not a scalar.

  >>> import jax.numpy as jnp, optax
  >>> tx = skip_nonfinite(optax.sgd(0.1))
  >>> params = {"w": jnp.ones(2)}
  >>> state = tx.init(params)
  >>> updates, state = tx.update({"w": jnp.array([1., jnp.nan])}, state, params)
  >>> optax.apply_updates(params, updates)["w"].tolist(), int(state.total_notfinite)
  ([1.0, 1.0], 1)

  See also: `update_if_finite`, `scaled_value_and_grad`.
  """
  arguments.require_transformation(inner, "skip_nonfinite", "inner")
  inner = optax.with_extra_args_support(inner)

  def init(params):
    return SkipNonFiniteState(
        inner_state=inner.init(params),
        notfinite_count=jnp.zeros([], jnp.int32),
        last_finite=jnp.array(True),
        total_notfinite=jnp.zeros([], jnp.int32))

  def update(updates, state, params=None, *, grads_finite=None, **extra_args):
    if grads_finite is None:
      grads_finite = loss_scale_lib.all_finite(updates)
    grads_finite = jnp.asarray(grads_finite, jnp.bool_)
    if grads_finite.shape != ():
      raise ValueError("skip_nonfinite: grads_finite must be a boolean scalar, "
                       f"got shape {grads_finite.shape}.")

    def do_update(operands):
      u, s, p = operands
      return inner.update(u, s, p, **extra_args)

    def skip_update(operands):
      u, s, _ = operands
      shapes, _ = jax.eval_shape(do_update, operands)
      identity = jax.tree_util.tree_map(_trees.signed_zeros, shapes)
      return distributed.vary_like(
          identity, lambda o: do_update(o)[0], operands), s

    new_updates, inner_state = lax.cond(
        grads_finite, do_update, skip_update,
        (updates, state.inner_state, params))
    return new_updates, SkipNonFiniteState(
        inner_state=inner_state,
        notfinite_count=jnp.where(
            grads_finite, jnp.zeros([], jnp.int32),
            optax.safe_increment(state.notfinite_count)),
        last_finite=grads_finite,
        total_notfinite=jnp.where(
            grads_finite, state.total_notfinite,
            optax.safe_increment(state.total_notfinite)))

  return optax.GradientTransformationExtraArgs(init, update)


def update_if_finite(
    optimizer: optax.GradientTransformation,
    grads: PyTree,
    opt_state: PyTree,
    params: PyTree,
    grads_finite: jax.Array,
    **extra_args,
) -> tuple[PyTree, PyTree]:
  """One optimizer step, applied only if `grads_finite`; else nothing changes.

  Computes the update with any optax `optimizer`, applies it, then selects
  (`select_tree`) the new params and state if `grads_finite`, else the old
  ones: on a non-finite step params and every leaf of `opt_state` come back
  bit-for-bit as they went in, whatever the optimizer. Since the whole state
  is kept, the counters of a `skip_nonfinite` inside `optimizer` do not
  count skipped steps: use either this or `skip_nonfinite`, not both.

  Args:
    optimizer: any optax `GradientTransformation`.
    grads: the gradients.
    opt_state: the optimizer state.
    params: the params the gradients belong to.
    grads_finite: a boolean scalar, e.g. from `scaled_value_and_grad`; also
      passed to `optimizer` as an extra argument.
    **extra_args: passed on to `optimizer.update`.

  Returns:
    `(new_params, new_opt_state)`.

  >>> import jax.numpy as jnp, optax, mpolicy
  >>> tx = optax.adam(0.1)
  >>> params = {"w": jnp.ones(2)}
  >>> state = tx.init(params)
  >>> grads = {"w": jnp.array([jnp.inf, 1.])}
  >>> new_params, new_state = update_if_finite(
  ...     tx, grads, state, params, mpolicy.all_finite(grads))
  >>> new_params["w"].tolist(), int(new_state[0].count)
  ([1.0, 1.0], 0)

  See also: `skip_nonfinite` (the same as a transformation),
  `make_train_step`.
  """
  arguments.require_transformation(optimizer, "update_if_finite", "optimizer")
  optimizer = optax.with_extra_args_support(optimizer)
  grads_finite = jnp.asarray(grads_finite, jnp.bool_)
  updates, new_state = optimizer.update(
      grads, opt_state, params, grads_finite=grads_finite, **extra_args)
  new_params = optax.apply_updates(params, updates)
  return (loss_scale_lib.select_tree(grads_finite, new_params, params),
          loss_scale_lib.select_tree(grads_finite, new_state, opt_state))
