"""Gradient accumulation: one loss-scaled step over k microbatches.

`accumulated_value_and_grad` is `scaled_value_and_grad` (with respect to
the first argument) over microbatches. Per attempt:

1. the batch arguments are split strided into `k` microbatches
   (`microbatches.split`);
2. a `lax.scan` runs them one after another under one loss scale: the
   forward and backward of one microbatch at a time, its gradients unscaled
   into float32 (float64 leaves stay float64, complex leaves their own
   dtype) and added to the accumulator; model state is threaded through;
3. the sum is divided by `k` (or, for a `(sum, count)` loss, by the
   number counted), put in the gradient's dtype, reduced across devices
   once, and checked for inf/NaN once.

With `max_retries` the whole attempt is redone at the lower scale, and the
scale adjusts once per attempt.

Inside `shard_map` with `check_vma=True`, JAX's AD sums a replicated
parameter's gradient over the devices in each backward pass. To sum once
per step instead, the parameters are marked varying over the data axes
before the scan (no value changes), the accumulated gradients are summed
over those axes after it, and values the step returns that did not vary
over a data axis at `k = 1` (a step counter in the model state) are made
invariant again, exactly (their values are the same on every device).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from mpolicy._src import distributed
from mpolicy._src import jax_compat
from mpolicy._src import loss_scale as loss_scale_lib
from mpolicy._src.training import _trees
from mpolicy._src.training import microbatches as microbatches_lib
from mpolicy._src.training import scaling

MEAN, SUM_COUNT = "mean", "sum_count"
LOSS_REDUCTIONS = (MEAN, SUM_COUNT)


def check_loss_reduction(loss_reduction: Any, where: str) -> str:
  if loss_reduction not in LOSS_REDUCTIONS:
    raise ValueError(
        f"{where}: loss_reduction must be 'mean' (loss_fn returns a mean "
        "loss) or 'sum_count' (loss_fn returns `(sum, count)`, e.g. the "
        "summed token losses and the number of tokens), got "
        f"{loss_reduction!r}.")
  return loss_reduction


def _weighted(fun: Callable[..., Any], loss_reduction: str, has_aux: bool):
  """`fun` as `weighted(*args) -> (loss, (weight, aux))`: the loss to
  differentiate (a mean) and what it counts for in the accumulated mean."""

  def weighted(*args, **kwargs):
    out = fun(*args, **kwargs)
    value, aux = out if has_aux else (out, None)
    if loss_reduction == MEAN:
      return value, (jnp.float32(1), aux)
    if not (isinstance(value, (tuple, list)) and len(value) == 2):
      raise TypeError(
          "loss_reduction='sum_count': loss_fn must return `(sum, count)` "
          "(`((sum, count), aux)` with has_aux), the summed loss and how "
          f"many it sums (e.g. tokens), got {type(value).__name__}.")
    total, count = value
    count = lax.stop_gradient(jnp.asarray(count))
    if count.shape != ():
      raise TypeError("loss_reduction='sum_count': the count must be a "
                      f"scalar, got shape {count.shape}.")
    count = count.astype(jnp.float32)
    # The mean of this microbatch, so the loss scale sees a loss of the
    # usual size; its gradient is weighted by the count when accumulated.
    return total / jnp.where(count == 0, 1, count), (count, aux)

  return weighted


def _acc_dtype(x: Any) -> Any:
  """float32 for half and float32 leaves, wider and complex ones as they are."""
  if _trees.is_floating(x):
    return jnp.promote_types(x.dtype, jnp.float32)
  return x.dtype


def _widen(x: Any, axes: frozenset) -> Any:
  return jax_compat.make_varying(x, tuple(sorted(axes, key=str)))


def _narrow(x: Any, axes: frozenset) -> Any:
  """`x`, the same on every device along `axes`, made invariant over them:
  a max over the bits, which are equal, so nothing changes."""
  axes = tuple(sorted(axes & jax_compat.varying_axes(x), key=str))
  if not axes or _trees.is_complex(x):
    return x
  if x.dtype == jnp.bool_:
    return lax.pmax(x.astype(jnp.int32), axes).astype(jnp.bool_)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    return lax.pmax(x, axes)
  bits = jnp.dtype(f"uint{8 * x.dtype.itemsize}")
  return lax.bitcast_convert_type(
      lax.pmax(lax.bitcast_convert_type(x, bits), axes), x.dtype)


def _typed(axes: tuple) -> bool:
  """Whether values carry the axes they vary over (`shard_map` over the data
  axes with `check_vma=True`)."""
  return (bool(axes) and distributed._in_shard_map(axes)  # pylint: disable=protected-access
          and jax_compat.check_vma_enabled())


def accumulated_value_and_grad(
    fun: Callable[..., Any],
    microbatches: int,
    *,
    has_aux: bool = False,
    has_state: bool = False,
    batch_argnums: tuple | None = None,
    arg_names: list[str] | None = None,
    loss_reduction: str = MEAN,
    axis_name: Any = None,
    reduce_dtype: Any = jnp.float32,
    grad_dtype: Any = None,
    max_retries: int = 0,
    attribute_overflow: bool = False,
    where: str = "make_train_step",
) -> Callable[..., tuple[Any, ...]]:
  """`scaled_value_and_grad(fun)` over `microbatches` strided microbatches.

  `fun(params, *args)` returns the loss (`(loss, aux)` with `has_aux`; the
  loss is `(sum, count)` with `loss_reduction="sum_count"`). With
  `has_state` (which needs `has_aux`), `args[0]` is the model state,
  threaded through the microbatches in order, and `fun`'s aux is `(aux,
  new_state)`. The other arguments are the data: their arrays with an axis
  (in the arguments at `batch_argnums`) are split; `arg_names` names them
  in messages.

  Returns:
    `g(loss_scale, params, *args, **kwargs) -> (new_loss_scale,
    grads_finite, value, grads)` (plus the flags with
    `attribute_overflow`), as `scaled_value_and_grad`. `value` holds the
    mean loss (the token mean of the batch with `"sum_count"`), in the
    loss's dtype, and the last microbatch's aux and model state.
  """
  max_retries = scaling._check_max_retries(max_retries)  # pylint: disable=protected-access
  k = microbatches
  weighted = _weighted(fun, loss_reduction, has_aux)
  grad_fn = jax.value_and_grad(scaling._scaled_loss(weighted, True),  # pylint: disable=protected-access
                               argnums=1, has_aux=True)
  n_state = 1 if has_state else 0
  split_aux = (lambda aux: aux) if has_state else (lambda aux: (aux, None))

  def microbatch(loss_scale, params, state, data, kwargs):
    """One microbatch: `(grads, loss, weight, aux, new_state)`, the
    gradients unscaled in the accumulator's dtypes."""
    args = ((state,) if has_state else ()) + tuple(data)
    (_, (loss, (weight, aux))), grads = grad_fn(
        loss_scale, params, *args, **kwargs)
    acc = jax.tree_util.tree_map(lambda g: g.astype(_acc_dtype(g)), grads)
    grads = scaling._unscale(loss_scale, acc, None)  # pylint: disable=protected-access
    return (grads, loss, weight) + tuple(split_aux(aux))

  def attempt(loss_scale, params, *args, **kwargs):
    axes = distributed.data_axes(axis_name)
    data, typed = frozenset(axes), _typed(axes)
    state = jax.tree_util.tree_map(_trees.strong, args[0]) if has_state else None
    xs, rebuild = microbatches_lib.split(
        args[n_state:], k, batch_argnums,
        arg_names[n_state:] if arg_names else None, where)
    vmas = added = None
    if typed:
      vmas = _vmas_at_one(weighted, split_aux, params, state,
                          rebuild([x[0] for x in xs]), kwargs, axis_name,
                          where)
      # AD then leaves each microbatch's gradient unsummed over the data
      # axes; they are summed once, after the scan.
      added = jax.tree_util.tree_map(
          lambda p: data - jax_compat.varying_axes(p), params)
      params = jax.tree_util.tree_map(lambda p: _widen(p, data), params)

    def init(x, vma):
      return _widen(x, vma | data) if typed else x

    no_vmas = lambda tree: jax.tree_util.tree_map(lambda _: frozenset(), tree)
    carry = (
        jax.tree_util.tree_map(
            lambda p: init(jnp.zeros(np.shape(p), _acc_dtype(p)),
                           jax_compat.varying_axes(p)), params),
        init(jnp.float32(0), vmas["loss"] if typed else frozenset()),
        init(jnp.float32(0), vmas["loss"] if typed else frozenset()),
        jax.tree_util.tree_map(init, state,
                               vmas["state"] if typed else no_vmas(state)))
    carry_vmas = [jax_compat.varying_axes(c)
                  for c in jax.tree_util.tree_leaves(carry)]

    def body(carry, leaves):
      acc, total, weight, state = carry
      grads, loss, w, aux, new_state = microbatch(
          loss_scale, params, state, rebuild(leaves), kwargs)
      if loss_reduction == MEAN:
        acc = jax.tree_util.tree_map(jnp.add, acc, grads)
        total = total + loss.astype(jnp.float32)
      else:
        acc = jax.tree_util.tree_map(lambda a, g: a + w.astype(a.dtype) * g,
                                     acc, grads)
        total = total + w * loss.astype(jnp.float32)
      out = (acc, total, weight + w, new_state)
      if typed:  # The carry keeps its types from one microbatch to the next.
        flat, treedef = jax.tree_util.tree_flatten(out)
        out = treedef.unflatten(
            [_widen(x, v) for x, v in zip(flat, carry_vmas)])
      return out, (loss, aux)

    (acc, total, weight, state), (losses, auxes) = lax.scan(
        body, carry, xs, length=k)
    aux = jax.tree_util.tree_map(lambda a: a[-1], auxes)
    if loss_reduction == MEAN:
      weight = jnp.float32(k)
    elif axis_name is not None:
      weight = distributed.average_value(weight, axis_name, jnp.float32)
    weight = jnp.where(weight == 0, 1, weight)
    loss = (total / weight).astype(losses.dtype)
    grads = jax.tree_util.tree_map(lambda a: a / weight.astype(a.dtype), acc)
    grads = _reduce(grads, params, added, axis_name, reduce_dtype, grad_dtype,
                    loss, where)
    if axis_name is not None:
      loss = distributed.average_value(loss, axis_name, reduce_dtype)
    if typed:  # What did not vary over a data axis at k = 1 does not now.
      aux = _narrow_tree(aux, vmas["aux"], data)
      state = _narrow_tree(state, vmas["state"], data)
    if has_state:
      aux = (aux, state)
    grads_finite = distributed.agree_finite(
        loss_scale_lib.all_finite(grads), axis_name)
    return grads, grads_finite, loss, aux

  def g(loss_scale, params, *args, **kwargs):
    scaling._check_differentiable((params,), 0)  # pylint: disable=protected-access
    grads, grads_finite, loss, aux = attempt(loss_scale, params, *args,
                                             **kwargs)
    if max_retries and jax.tree_util.tree_leaves(loss_scale):
      loss_scale, grads, grads_finite = scaling._retry(  # pylint: disable=protected-access
          attempt, max_retries, loss_scale, grads, grads_finite,
          (params, *args), kwargs)
    new_loss_scale = loss_scale.adjust(grads_finite)
    value = (loss, aux) if has_aux else loss
    if not attribute_overflow:
      return new_loss_scale, grads_finite, value, grads
    return (new_loss_scale, grads_finite, value, grads,
            scaling._agreed_flags(grads, axis_name))  # pylint: disable=protected-access

  return g


def _narrow_tree(tree: Any, vmas: Any, data: frozenset) -> Any:
  return jax.tree_util.tree_map(lambda x, v: _narrow(x, data - v), tree, vmas)


def _vmas_at_one(weighted, split_aux, params, state, data, kwargs, axis_name,
                 where) -> dict:
  """The axes the loss, aux and new state of one microbatch vary over with
  the parameters as given (what `k = 1` returns): the forward traced once,
  not run. Checks the loss's axes as `scaled_value_and_grad` does."""
  args = ((state,) if state is not None else ()) + tuple(data)
  structure = []

  def forward(params):
    loss, (_, aux) = weighted(params, *args, **kwargs)
    distributed.check_loss_axes(loss, axis_name, where)
    leaves, treedef = jax.tree_util.tree_flatten(
        (loss,) + tuple(split_aux(aux)))
    structure.append(treedef)
    return leaves

  flat = jax_compat.out_varying_axes(forward, params)
  loss, aux, new_state = structure[0].unflatten(flat)
  return {"loss": loss, "aux": aux, "state": new_state}


def _reduce(grads, params, added, axis_name, reduce_dtype, grad_dtype, loss,
            where):
  """The accumulated mean, in each gradient's dtype, reduced across devices
  once (in `reduce_dtype`, as without accumulation)."""

  def final_dtype(p):
    return p.dtype if grad_dtype is None or not _trees.is_floating(p) else (
        grad_dtype)

  if axis_name is None:
    return jax.tree_util.tree_map(
        lambda g, p: g.astype(final_dtype(p)), grads, params)
  distributed.check_loss_axes(loss, axis_name, where)
  if reduce_dtype is None:  # Reduce in the gradient's own dtype.
    grads = jax.tree_util.tree_map(
        lambda g, p: g.astype(final_dtype(p)), grads, params)
  if added is not None:
    grads = jax.tree_util.tree_map(
        lambda g, axes: _sum_over(g, axes, reduce_dtype), grads, added)
  grads = distributed.average_grads(grads, axis_name, reduce_dtype)
  return jax.tree_util.tree_map(
      lambda g, p: g.astype(final_dtype(p)), grads, params)


def _sum_over(g: Any, axes: frozenset, reduce_dtype: Any) -> Any:
  """`g` summed over `axes` (in `reduce_dtype` for real floating leaves)."""
  if not axes:
    return g
  work = g.dtype if reduce_dtype is None or not _trees.is_floating(g) else (
      reduce_dtype)
  return lax.psum(g.astype(work), tuple(sorted(axes, key=str))).astype(
      g.dtype)
