"""A whole loss-scaled training step that skips non-finite steps."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from mpolicy._src import arguments
from mpolicy._src import distributed
from mpolicy._src import loss_scale as loss_scale_lib
from mpolicy._src.training import attribution
from mpolicy._src.training import half_params
from mpolicy._src.training import scaling
from mpolicy._src.training import skipping


class TrainStepResult(NamedTuple):
  """What a `make_train_step` step returns.

  Attributes:
    params: the new params (the old ones, bit for bit, if not finite).
    opt_state: the new optimizer state (likewise).
    loss_scale: the adjusted loss scale (backed off if not finite).
    grads_finite: bool scalar, whether the step was applied.
    value: the loss, or `(loss, aux)` with `has_aux=True`.
    model_state: with `has_state=True`, the model state `loss_fn` returned
      (the old one, bit for bit, if not finite); None otherwise.
    nonfinite: with `attribute_overflow=True`, `nonfinite_flags(grads)`: a
      bool scalar per parameter, True where its gradient had inf or NaN
      (agreed over `axis_name`); None otherwise. `nonfinite_paths()` names
      them.
  """
  params: Any
  opt_state: Any
  loss_scale: Any
  grads_finite: jax.Array
  value: Any
  model_state: Any = None
  nonfinite: Any = None

  def nonfinite_paths(self) -> list[str]:
    """The paths of the parameters whose gradients were not finite.

    Reads the flags back to the host: call it on the steps you report
    (`not grads_finite`).

    Returns:
      The '/'-joined paths (see `path_str`), in pytree order.

    Raises:
      ValueError: the step was made without `attribute_overflow=True`.

    >>> import jax, jax.numpy as jnp, optax, mpolicy
    >>> loss_fn = lambda p, x: jnp.sum(p["a"] * x) + jnp.sum(p["b"])
    >>> step = jax.jit(mpolicy.make_train_step(
    ...     loss_fn, optax.sgd(0.1), attribute_overflow=True))
    >>> params = {"a": jnp.ones(2), "b": jnp.ones(2)}
    >>> out = step(params, optax.sgd(0.1).init(params),
    ...            mpolicy.NoOpLossScale(), jnp.array([1., jnp.inf]))
    >>> bool(out.grads_finite), out.nonfinite_paths()
    (False, ['a'])
    """
    if self.nonfinite is None:
      raise ValueError(
          "This step did not record which parameters overflowed: make it "
          "with make_train_step(..., attribute_overflow=True).")
    return attribution.nonfinite_paths(self.nonfinite)


def make_train_step(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    *,
    has_aux: bool = False,
    has_state: bool = False,
    axis_name: Any = None,
    reduce_dtype: Any = jnp.float32,
    grad_dtype: Any = None,
    max_retries: int = 0,
    param_rounding: str = "nearest",
    average_state: bool = True,
    attribute_overflow: bool = False,
) -> Callable[..., TrainStepResult]:
  """A complete loss-scaled training step that skips non-finite steps.

  The step computes `scaled_value_and_grad(loss_fn, ...)` with respect to
  `params` (the first argument of `loss_fn`), then `update_if_finite`: on a
  non-finite step params and every leaf of `opt_state` are returned
  bit-for-bit unchanged and the loss scale backs off. Jit it (or `pmap` /
  `shard_map` it with `axis_name`) yourself.

  Args:
    loss_fn: `loss_fn(params, *args)` returns the loss (`(loss, aux)` with
      `has_aux`). With `has_state`, `loss_fn(params, model_state, *args)`
      returns `(loss, new_model_state)` (`((loss, aux), new_model_state)`
      with `has_aux`).
    optimizer: any optax optimizer; it needs no `skip_nonfinite`.
    has_aux: whether `loss_fn` returns auxiliary outputs.
    has_state: whether the model has state not trained by gradients
      (BatchNorm's moving averages, e.g. from `transform_amp_with_state`).
      The state is not differentiated, so it may hold integers; on a
      non-finite step it comes back bit for bit.
    axis_name, reduce_dtype, grad_dtype, max_retries: passed to
      `scaled_value_and_grad`; `axis_name` names the data axes only.
    average_state: with `has_state` and `axis_name`, average the floating
      leaves of the new model state (BatchNorm's statistics) over the data
      axes, in float32, so every device keeps the same state (and
      `shard_map(out_specs=P())` accepts it). Integer leaves are kept.
    attribute_overflow: also return which parameters' gradients were not
      finite, as flags in `TrainStepResult.nonfinite` (one bool scalar per
      parameter, computed on device; no host sync); the result's
      `nonfinite_paths()` names them.
    param_rounding: `"nearest"`, or `"stochastic"` to write bfloat16 and
      float16 params with stochastic rounding (no float32 copy): the step
      runs `stochastic_params(optimizer)`, so make `opt_state` with
      `stochastic_params(optimizer).init(params)`.

  Returns:
    `step(params, opt_state, loss_scale, *args, **kwargs)`, or with
    `has_state` `step(params, model_state, opt_state, loss_scale, *args,
    **kwargs)`, returning a `TrainStepResult`.

  Raises:
    TypeError: at once, if `loss_fn` is not callable or `optimizer` is not
      an optax transformation; when the step is called, if `loss_scale` is
      not a loss scale (a number, an array, or left out: the message names
      `loss_scale` and the loss-scale classes).

  >>> import jax, jax.numpy as jnp, optax, mpolicy
  >>> loss_fn = lambda p, x: jnp.mean((p["w"] * x - 1.) ** 2)
  >>> tx = optax.sgd(0.1)
  >>> step = jax.jit(make_train_step(loss_fn, tx))
  >>> params = {"w": jnp.zeros(2)}
  >>> out = step(params, tx.init(params), mpolicy.DynamicLossScale(2. ** 15), jnp.ones(2))
  >>> bool(out.grads_finite), float(out.value), out.params["w"].tolist()
  (True, 1.0, [0.10000000149011612, 0.10000000149011612])

  See also: `scaled_value_and_grad`, `update_if_finite`, `skip_nonfinite`.
  """
  arguments.require_callable(loss_fn, "make_train_step", "loss_fn",
                             "the loss function")
  arguments.require_transformation(optimizer, "make_train_step", "optimizer")
  optimizer = half_params.for_param_rounding(optimizer, param_rounding)
  grad_options = dict(
      axis_name=axis_name, reduce_dtype=reduce_dtype, grad_dtype=grad_dtype,
      max_retries=max_retries, attribute_overflow=attribute_overflow)
  if not has_state:
    return _step(loss_fn, optimizer, has_aux, grad_options)
  average_over = axis_name if average_state else None
  return _step_with_state(loss_fn, optimizer, has_aux, average_over,
                          grad_options)


def _step(loss_fn, optimizer, has_aux, grad_options):
  """The step of a model without state."""
  grad_fn = scaling.scaled_value_and_grad(loss_fn, has_aux=has_aux,
                                          **grad_options)

  def step(params, opt_state, loss_scale, *args, **kwargs):
    loss_scale_lib.require_loss_scale(
        loss_scale, "make_train_step",
        "step(params, opt_state, loss_scale, *args)")
    new_loss_scale, finite, value, grads, *flags = grad_fn(
        loss_scale, params, *args, **kwargs)
    new_params, new_opt_state = skipping.update_if_finite(
        optimizer, grads, opt_state, params, finite)
    return TrainStepResult(new_params, new_opt_state, new_loss_scale,
                           finite, value, None, *flags)

  return step


def _with_state_as_aux(loss_fn, has_aux):
  """`loss_fn(params, model_state, *args)` as a loss whose aux carries the
  new model state: `(loss, new_state)`, or `(loss, (aux, new_state))`."""

  def loss_with_state(params, model_state, *args, **kwargs):
    out = loss_fn(params, model_state, *args, **kwargs)
    if not (isinstance(out, tuple) and len(out) == 2):
      raise TypeError(
          "make_train_step(has_state=True): loss_fn must return "
          "`(loss, new_model_state)` (`((loss, aux), new_model_state)` with "
          f"has_aux=True), got {type(out).__name__}.")
    value, new_model_state = out
    if has_aux:
      loss, aux = value
      return loss, (aux, new_model_state)
    return value, new_model_state

  return loss_with_state


def _step_with_state(loss_fn, optimizer, has_aux, average_over, grad_options):
  """The step of a model with state; `average_over` is None or the data axes
  to average the new state over."""
  grad_fn = scaling.scaled_value_and_grad(
      _with_state_as_aux(loss_fn, has_aux), has_aux=True, **grad_options)

  def step_with_state(params, model_state, opt_state, loss_scale, *args,
                      **kwargs):
    loss_scale_lib.require_loss_scale(
        loss_scale, "make_train_step(has_state=True)",
        "step(params, model_state, opt_state, loss_scale, *args)")
    new_loss_scale, finite, (loss, extra), grads, *flags = grad_fn(
        loss_scale, params, model_state, *args, **kwargs)
    if has_aux:
      aux, new_model_state = extra
      value = (loss, aux)
    else:
      value, new_model_state = loss, extra
    if average_over is not None:
      new_model_state = distributed.average_value(
          new_model_state, average_over, jnp.float32)
    new_params, new_opt_state = skipping.update_if_finite(
        optimizer, grads, opt_state, params, finite)
    new_model_state = loss_scale_lib.select_tree(
        finite, new_model_state, model_state)
    return TrainStepResult(new_params, new_opt_state, new_loss_scale, finite,
                           value, new_model_state, *flags)

  return step_with_state
