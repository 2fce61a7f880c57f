"""A whole loss-scaled training step that skips non-finite steps."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mpolicy._src import amp
from mpolicy._src import arguments
from mpolicy._src import distributed
from mpolicy._src import loss_scale as loss_scale_lib
from mpolicy._src import observe
from mpolicy._src.training import accumulation
from mpolicy._src.training import attribution
from mpolicy._src.training import half_params
from mpolicy._src.training import microbatches as microbatches_lib
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


class _Default:
  """A keyword's default, told apart from the same value passed."""

  def __init__(self, value: Any):
    self.value = value

  def __repr__(self) -> str:
    return _show(self.value)


def _show(value: Any) -> str:
  """A keyword's value as written: a dtype by its name."""
  try:
    return np.dtype(value).name if value is not None else "None"
  except TypeError:
    return repr(value)


def make_train_step(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    *,
    has_aux: bool = False,
    has_state: bool = False,
    axis_name: Any = None,
    reduce_dtype: Any = _Default(jnp.float32),
    grad_dtype: Any = None,
    max_retries: int = 0,
    param_rounding: str = "nearest",
    average_state: bool = _Default(True),  # type: ignore[assignment]  # Told apart from True passed.
    attribute_overflow: bool = False,
    microbatches: int = 1,
    batch_argnums: int | Sequence[int] | None = None,
    loss_reduction: str = "mean",
) -> Callable[..., TrainStepResult]:
  """A complete loss-scaled training step that skips non-finite steps.

  The step computes `scaled_value_and_grad(loss_fn, ...)` with respect to
  `params` (the first argument of `loss_fn`), then `update_if_finite`: on a
  non-finite step params and every leaf of `opt_state` are returned
  bit-for-bit unchanged and the loss scale backs off. Jit it (or `pmap` /
  `shard_map` it with `axis_name`) yourself, donating params and optimizer
  state (`jax.jit(step, donate_argnums=(0, 1))`): the update then writes in
  place and the step holds the gradients beyond its inputs, about what a
  hand-written step without skipping holds.

  With `microbatches=k` the step accumulates gradients: the batch
  arguments are split along their leading axis into `k` microbatches,
  strided (microbatch `i` holds rows `i, i + k, ...`, so a batch sharded
  along that axis splits without communication), which run one after
  another in a `lax.scan` under one loss scale (the step holds one
  microbatch's activations). Their unscaled gradients are summed in float32
  (half gradients never accumulate in half), the mean is reduced across
  devices once (with `axis_name`) and the optimizer applied once. The loss
  scale adjusts once per attempt; a non-finite gradient in any microbatch
  skips the whole step (params, optimizer state and model state come back
  bit for bit); with `max_retries` the whole step is redone at the lower
  scale. `value` is the mean of the microbatches' losses, aux that of the
  last microbatch; model state is threaded through the microbatches in
  order (BatchNorm's statistics are those of `k` batches `k` times
  smaller). With a mean loss the update equals the one-batch update up to
  rounding; `check_accumulation` measures it on your model.

  Args:
    loss_fn: `loss_fn(params, *args)` returns the loss (`(loss, aux)` with
      `has_aux`). With `has_state`, `loss_fn(params, model_state, *args)`
      returns `(loss, new_model_state)` (`((loss, aux), new_model_state)`
      with `has_aux`). The optimizer's step count reaches the keys of
      block matmuls that draw random numbers (the NVFP4 recipe): an
      `amp`-ed `loss_fn` is called as `loss_fn.at_step(count)`; a
      `loss_fn` with a keyword-only `step` parameter gets `step=count`
      (to call its models as `model.apply.at_step(step)`); any other
      `loss_fn` whose models draw random numbers gets a warning.
    optimizer: any optax optimizer; it needs no `skip_nonfinite`.
    has_aux: whether `loss_fn` returns auxiliary outputs.
    has_state: whether the model has state not trained by gradients
      (BatchNorm's moving averages, e.g. from `transform_amp_with_state`).
      The state is not differentiated, so it may hold integers; on a
      non-finite step it comes back bit for bit.
    axis_name, reduce_dtype, grad_dtype, max_retries: passed to
      `scaled_value_and_grad`; `axis_name` names the data axes only.
      `reduce_dtype` (float32 by default) holds for the sums JAX's AD
      places in the backward pass too (FSDP's reduce-scatter, see
      `scaled_value_and_grad`); passed without `axis_name` it does nothing
      and warns.
    average_state: with `has_state` and `axis_name`, average the floating
      leaves of the new model state (BatchNorm's statistics) over the data
      axes, in float32, so every device keeps the same state (and
      `shard_map(out_specs=P())` accepts it). Integer leaves are kept.
      Passed without `has_state` and `axis_name`, it warns.
    attribute_overflow: also return which parameters' gradients were not
      finite, as flags in `TrainStepResult.nonfinite` (one bool scalar per
      parameter, computed on device; no host sync); the result's
      `nonfinite_paths()` names them.
    param_rounding: `"nearest"`, or `"stochastic"` to write bfloat16 and
      float16 params with stochastic rounding (no float32 copy): the step
      runs `stochastic_params(optimizer)`, so make `opt_state` with
      `stochastic_params(optimizer).init(params)`; or `"low_bits"` for
      bfloat16 params that truncate an exact float32 master kept in 16
      bits per parameter: the step runs `master_weights(optimizer,
      storage="low_bits")`, so make `params, opt_state` with
      `init_master_weights(master_weights(optimizer, storage="low_bits"),
      params_f32, jnp.bfloat16)`.
    microbatches: how many microbatches to split the batch into (1: no
      accumulation, the step as it was). It must divide the leading axis of
      every batched array (of the local batch inside `pmap` /
      `shard_map`); a `ValueError` names the argument it does not divide.
    batch_argnums: which of `*args` (the data arguments after params and
      model state) are batched; None for all of them. In those, every
      array with an axis is split; 0-d arrays and typed PRNG keys are
      passed whole (every microbatch gets the same key), as are keyword
      arguments: pass batched arrays positionally.
    loss_reduction: `"mean"` (`loss_fn` returns a mean over the batch), or
      `"sum_count"`: `loss_fn` returns `(sum, count)` (e.g. the summed
      token losses and the number of tokens; `((sum, count), aux)` with
      `has_aux`) and the step's gradient is that of the batch's
      `sum / count` over all microbatches (and devices), however the
      tokens fall into microbatches. Use it for token-mean losses with
      padding or masks, where the mean of microbatch means is not the
      batch's token mean. `value` is then the batch's `sum / count`.

  Returns:
    `step(params, opt_state, loss_scale, *args, **kwargs)`, or with
    `has_state` `step(params, model_state, opt_state, loss_scale, *args,
    **kwargs)`, returning a `TrainStepResult`.

  Raises:
    TypeError: at once, if `loss_fn` is not callable or `optimizer` is not
      an optax transformation; when the step is called, if `loss_scale` is
      not a loss scale (a number, an array, or left out: the message names
      `loss_scale` and the loss-scale classes).
    ValueError: at once, if `grad_dtype` or `reduce_dtype` is neither None
      nor a floating dtype; with `microbatches`, when the step is traced, if
      `microbatches` does not divide the batch, the batched arrays do not
      share one leading axis, `batch_argnums` names an argument with no
      array to split, nothing is split at all, or `loss_fn` fails on a
      microbatch while an array of the batch's size was passed whole (a
      keyword argument, or one left out of `batch_argnums`): the message
      names the argument.

  >>> import jax, jax.numpy as jnp, optax, mpolicy
  >>> loss_fn = lambda p, x: jnp.mean((p["w"] * x - 1.) ** 2)
  >>> tx = optax.sgd(0.1)
  >>> step = jax.jit(make_train_step(loss_fn, tx))
  >>> params = {"w": jnp.zeros(2)}
  >>> out = step(params, tx.init(params), mpolicy.DynamicLossScale(2. ** 15), jnp.ones(2))
  >>> bool(out.grads_finite), float(out.value), out.params["w"].tolist()
  (True, 1.0, [0.10000000149011612, 0.10000000149011612])

  Four microbatches, the inputs donated:

  >>> step = jax.jit(make_train_step(loss_fn, tx, microbatches=4),
  ...                donate_argnums=(0, 1))
  >>> out = step({"w": jnp.zeros(2)}, tx.init(params),
  ...            mpolicy.DynamicLossScale(2. ** 15), jnp.ones((8, 2)))
  >>> float(out.value), out.params["w"].tolist()
  (1.0, [0.10000000149011612, 0.10000000149011612])

  See also: `scaled_value_and_grad`, `update_if_finite`,
  `check_accumulation`, `skip_nonfinite`.
  """
  arguments.require_callable(loss_fn, "make_train_step", "loss_fn",
                             "the loss function")
  arguments.require_transformation(optimizer, "make_train_step", "optimizer")
  where = "make_train_step"
  reduce_dtype, average_state = _warn_if_ignored(
      reduce_dtype, average_state, axis_name, has_state)
  reduce_dtype = arguments.require_float_dtype(
      reduce_dtype, where, "reduce_dtype", none_ok=True,
      none_means="each gradient averaged in its own dtype")
  grad_dtype = arguments.require_float_dtype(
      grad_dtype, where, "grad_dtype", none_ok=True,
      none_means="each gradient in its parameter's dtype")
  optimizer = half_params.for_param_rounding(optimizer, param_rounding)
  k = microbatches_lib.check_microbatches(microbatches, where)
  batch_argnums = microbatches_lib.check_batch_argnums(batch_argnums, where)
  loss_reduction = accumulation.check_loss_reduction(loss_reduction, where)
  grad_options = dict(
      has_aux=has_aux or has_state, axis_name=axis_name,
      reduce_dtype=reduce_dtype, grad_dtype=grad_dtype,
      max_retries=max_retries, attribute_overflow=attribute_overflow)

  def grad_for(fun):
    fun = _with_state_as_aux(fun, has_aux) if has_state else fun
    if k == 1 and loss_reduction == accumulation.MEAN:
      return scaling.scaled_value_and_grad(fun, **grad_options)
    return accumulation.accumulated_value_and_grad(
        fun, k, has_state=has_state, batch_argnums=batch_argnums,
        arg_names=microbatches_lib.arg_names(loss_fn, 1),
        loss_reduction=loss_reduction, **grad_options)

  grad_fn = grad_for(loss_fn)

  def grad_at(step):
    """The gradient of ``loss_fn`` called at ``step`` (`amp.with_step`)."""
    stepped = amp.with_step(loss_fn, step)
    if stepped is not loss_fn:
      return grad_for(stepped)
    return grad_fn if step is None else _warning_if_unstepped(grad_fn)

  if not has_state:
    return _step(grad_at, optimizer)
  average_over = axis_name if average_state else None
  return _step_with_state(grad_at, optimizer, has_aux, average_over)


def _warning_if_unstepped(grad_fn):
  """``grad_fn``, warning where the loss it traces runs random block
  matmuls (the NVFP4 recipe) that the step count does not reach: a loss
  that calls an `amp`-ed model inside, without a ``step`` parameter."""

  def run(*args, **kwargs):
    before = observe.unstepped()
    out = grad_fn(*args, **kwargs)
    if observe.unstepped() > before:
      warnings.warn(
          "make_train_step: loss_fn calls an amp-ed function whose block "
          "matmuls draw random numbers (stochastic rounding or the Hadamard "
          "transform), but the step count does not reach them: they draw the "
          "same numbers at every step. Give loss_fn a keyword-only `step` "
          "parameter (def loss_fn(params, batch, *, step)) and call the model "
          "as model.at_step(step)(...) (model.apply.at_step(step) for "
          "transform_amp), or pass an amp-ed loss_fn.", stacklevel=3)
    return out

  return run


def _warn_if_ignored(reduce_dtype, average_state, axis_name, has_state):
  """The two keywords' values, warning for one passed where it does nothing."""
  if not isinstance(reduce_dtype, _Default) and axis_name is None:
    warnings.warn(
        f"make_train_step: reduce_dtype={_show(reduce_dtype)} has no effect "
        "without axis_name: it sets the dtype of the cross-device mean that "
        "runs inside pmap / shard_map over the data axes. Pass axis_name "
        "(the axes the batch is split over), or drop reduce_dtype (under "
        "jax.jit with sharded arrays XLA places the reductions).",
        UserWarning, stacklevel=3)
  if not isinstance(average_state, _Default) and not (
      has_state and axis_name is not None):
    missing = "has_state=True" if not has_state else "axis_name"
    warnings.warn(
        f"make_train_step: average_state={average_state!r} has no effect "
        f"without {missing}: it averages the model state (BatchNorm's "
        "statistics) that loss_fn returns with has_state=True over the data "
        "axes named by axis_name. Pass both, or drop average_state.",
        UserWarning, stacklevel=3)
  unset = lambda x: x.value if isinstance(x, _Default) else x
  return unset(reduce_dtype), unset(average_state)


def step_count(opt_state: Any) -> Any:
  """The optimizer's update count: the first integer scalar named ``count``
  in ``opt_state`` (optax's Adam, schedules, ...), else ``None``. A skipped
  step leaves it as it was, so a retried step draws the same keys.

  >>> import jax.numpy as jnp, optax
  >>> int(step_count(optax.adam(1e-3).init({"w": jnp.zeros(2)})))
  0
  >>> step_count(optax.sgd(1e-3).init({"w": jnp.zeros(2)})) is None
  True
  """
  for _, v in optax.tree_utils.tree_get_all_with_path(opt_state, "count"):
    if jnp.ndim(v) == 0 and jnp.issubdtype(jnp.result_type(v), jnp.integer):
      return v
  return None


def _step(grad_at, optimizer):
  """The step of a model without state; ``grad_at(step)`` its gradient."""

  def step(params, opt_state, loss_scale, *args, **kwargs):
    loss_scale_lib.require_loss_scale(
        loss_scale, "make_train_step",
        "step(params, opt_state, loss_scale, *args)")
    grad_fn = grad_at(step_count(opt_state))  # The block formats' keys.
    new_loss_scale, finite, value, grads, *flags = grad_fn(
        loss_scale, params, *args, **kwargs)
    new_params, new_opt_state = skipping.update_if_finite(
        optimizer, grads, opt_state, params, finite)
    return TrainStepResult(new_params, new_opt_state, new_loss_scale,
                           finite, value, None, *flags)

  return step


def _with_state_as_aux(loss_fn, has_aux):
  """`loss_fn(params, model_state, *args)` as a loss whose aux carries the
  new model state: `(loss, (aux, new_state))`, aux None without has_aux."""

  def loss_with_state(params, model_state, *args, **kwargs):
    out = loss_fn(params, model_state, *args, **kwargs)
    if not (isinstance(out, tuple) and len(out) == 2):
      raise TypeError(
          "make_train_step(has_state=True): loss_fn must return "
          "`(loss, new_model_state)` (`((loss, aux), new_model_state)` with "
          f"has_aux=True), got {type(out).__name__}.")
    value, new_model_state = out
    loss, aux = value if has_aux else (value, None)
    return loss, (aux, new_model_state)

  return loss_with_state


def _step_with_state(grad_at, optimizer, has_aux, average_over):
  """The step of a model with state; `average_over` is None or the data axes
  to average the new state over."""

  def step_with_state(params, model_state, opt_state, loss_scale, *args,
                      **kwargs):
    loss_scale_lib.require_loss_scale(
        loss_scale, "make_train_step(has_state=True)",
        "step(params, model_state, opt_state, loss_scale, *args)")
    grad_fn = grad_at(step_count(opt_state))  # The block formats' keys.
    new_loss_scale, finite, (loss, (aux, new_model_state)), grads, *flags = (
        grad_fn(loss_scale, params, model_state, *args, **kwargs))
    value = (loss, aux) if has_aux else loss
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
