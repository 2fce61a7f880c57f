"""Skipping non-finite steps: params and optimizer state kept bit for bit.

`skip_nonfinite` is an optax transformation that leaves the inner state as
it was and returns updates that leave params as they were, when the
gradients are not finite; `update_if_finite` does the same for any
optimizer by selecting the old params and state.

With `optax.MultiSteps`, the skip goes outside:
`skip_nonfinite(optax.MultiSteps(tx, k))` drops a non-finite mini-batch
before MultiSteps accumulates it. Inside, MultiSteps would have added it to
its accumulator already, where it stays (MultiSteps resets the accumulator
by multiplying it by 0, and 0 * NaN is NaN): that placement is refused.
"""

from __future__ import annotations

import sys
import types
from typing import Any, NamedTuple, Optional

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
  when given (pass the flag from `scaled_value_and_grad`, agreed across
  devices), and from the updates themselves: a step is applied only if
  the flag is True and every update is finite, on every device (the
  check is agreed over the bound axes it may differ across; for
  replicated updates under `shard_map` that takes no collective). So a
  flag that belongs to other gradients (the last mini-batch's, while the
  updates are an accumulated sum) cannot let a non-finite update through.

  Gradient accumulation: `skip_nonfinite(optax.MultiSteps(tx, k))`. A
  mini-batch whose flag is False is dropped: MultiSteps' state (its
  accumulator, mini-step count and inner state) comes back bit for bit and
  params do not move, and the accumulation goes on, so an update is
  applied once `k` finite mini-batches have been added (their mean). The
  other way round, `optax.MultiSteps(skip_nonfinite(tx), k)`, MultiSteps
  adds a non-finite mini-batch to its accumulator before this wrapper
  sees it, and it stays there: that raises a `ValueError` unless the
  MultiSteps drops mini-batches itself (`should_skip_update_fn`).

  Args:
    inner: the optimizer to wrap; extra args other than `grads_finite` are
      passed on to it.

  Returns:
    An `optax.GradientTransformationExtraArgs` with `SkipNonFiniteState`.

  Raises:
    ValueError: from `update`, if `grads_finite` is not a scalar, or if
      it is called by an `optax.MultiSteps` that accumulates every
      mini-batch (the message says how to compose them).

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
    _check_not_inside_multisteps()
    finite = distributed.agree_everywhere(loss_scale_lib.all_finite(updates))
    if grads_finite is not None:
      grads_finite = jnp.asarray(grads_finite, jnp.bool_)
      if grads_finite.shape != ():
        raise ValueError("skip_nonfinite: grads_finite must be a boolean "
                         f"scalar, got shape {grads_finite.shape}.")
      finite = grads_finite & finite
    grads_finite = finite

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


def _check_not_inside_multisteps() -> None:
  """Raises if an `optax.MultiSteps` that accumulates every mini-batch is
  calling (read from the call stack when `update` is traced)."""
  code = getattr(getattr(optax.MultiSteps, "update", None), "__code__", None)
  frame: Optional[types.FrameType] = sys._getframe(2)  # pylint: disable=protected-access
  while frame is not None and frame.f_code is not code:
    frame = frame.f_back
  if frame is None:
    return
  skip_fn = getattr(frame.f_locals.get("self"), "_should_skip_update_fn", None)
  skip_code = getattr(skip_fn, "__code__", None)
  if skip_code is not None and skip_code not in (
      optax.MultiSteps.__init__.__code__.co_consts):
    return  # The caller's own should_skip_update_fn decides what it adds.
  raise ValueError(
      "skip_nonfinite inside optax.MultiSteps: MultiSteps adds each "
      "mini-batch's gradients to its accumulator before skip_nonfinite sees "
      "them, so a non-finite mini-batch would stay there (MultiSteps resets "
      "the accumulator by multiplying it by 0, and 0 * NaN is NaN) and skip "
      "every later step. Put the skip outside: "
      "skip_nonfinite(optax.MultiSteps(tx, k)) drops a mini-batch whose "
      "grads_finite is False and leaves MultiSteps' state as it was; or use "
      "make_train_step(..., microbatches=k), which accumulates and skips "
      "whole steps.")


def update_if_finite(
    optimizer: optax.GradientTransformation,
    grads: PyTree,
    opt_state: PyTree,
    params: PyTree,
    grads_finite: jax.Array,
    **extra_args: Any,
) -> tuple[PyTree, PyTree]:
  """One optimizer step, applied only if `grads_finite`; else nothing changes.

  Computes the update with any optax `optimizer` and applies it if
  `grads_finite` (a `lax.cond`), else returns the old params and state: on
  a non-finite step params and every leaf of `opt_state` come back
  bit-for-bit as they went in, whatever the optimizer. With the params and
  state donated (`jax.jit(step, donate_argnums=...)`), the update writes in
  place: the step holds the gradients, not a second copy of the params and
  state (a select of the new and old trees would). Since the whole state
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

  def update(operands):
    grads, opt_state, params = operands
    updates, new_state = optimizer.update(
        grads, opt_state, params, grads_finite=grads_finite, **extra_args)
    return optax.apply_updates(params, updates), new_state

  def keep(operands):
    _, opt_state, params = operands
    return distributed.vary_like((params, opt_state), update, operands)

  # A cond, not a select of old and new: with the inputs donated, the update
  # then writes in place, and the step holds no second copy of the params
  # and state.
  return lax.cond(grads_finite, update, keep, (grads, opt_state, params))
