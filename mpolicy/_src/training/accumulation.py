"""Gradient accumulation: one loss-scaled step over k microbatches.

`accumulated_value_and_grad` is `scaled_value_and_grad` (with respect to
the first argument) over microbatches: the same driver (`scaling.drive`:
check for inf/NaN, retry, adjust the scale), fed an attempt that
accumulates (`_Plan.attempt`):

1. the batch arguments are split strided into `k` microbatches
   (`microbatches.split`, which checks that they line up);
2. a `lax.scan` runs them one after another under one loss scale: the
   forward and backward of one microbatch at a time
   (`scaling.scaled_gradient`), its gradients unscaled into float32
   (float64 leaves stay float64, complex leaves their own dtype) and added
   to the accumulator; model state is threaded through;
3. the sum is divided by `k` (or, for a `(sum, count)` loss, by the
   number counted), put in the gradient's dtype and reduced across devices
   once; the driver checks it for inf/NaN once.

With `max_retries` the whole attempt is redone at the lower scale, and the
scale adjusts once per attempt.

Inside `shard_map` with `check_vma=True`, JAX's AD sums a replicated
parameter's gradient over the devices in each backward pass. To sum once
per step instead, the parameters are marked varying over the data axes
before the scan (no value changes), the accumulated gradients are summed
over those axes after it, and values the step returns that did not vary
over a data axis at `k = 1` (a step counter in the model state) are made
invariant again, exactly (their values are the same on every device):
`_Types`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import contextlib
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from mpolicy._src import distributed
from mpolicy._src import jax_compat
from mpolicy._src.blocks import recipe
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
  ordered = tuple(sorted(axes & jax_compat.varying_axes(x), key=str))
  if not ordered or _trees.is_complex(x):
    return x
  if x.dtype == jnp.bool_:
    return lax.pmax(x.astype(jnp.int32), ordered).astype(jnp.bool_)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    return lax.pmax(x, ordered)
  bits = jnp.dtype(f"uint{8 * x.dtype.itemsize}")
  return lax.bitcast_convert_type(
      lax.pmax(lax.bitcast_convert_type(x, bits), ordered), x.dtype)


def _typed(axes: tuple) -> bool:
  """Whether values carry the axes they vary over (`shard_map` over the data
  axes with `check_vma=True`)."""
  return (bool(axes) and distributed._in_shard_map(axes)  # pylint: disable=protected-access
          and jax_compat.check_vma_enabled())


@contextlib.contextmanager
def _naming(whole: tuple[str, ...], k: int, where: str):
  """Turns a failure of `fun` on one microbatch into a ValueError naming
  the arrays of the batch's size that were passed whole (the likely cause:
  a batched keyword argument, or `batch_argnums` off by one)."""
  try:
    yield
  except (TypeError, ValueError, IndexError) as e:
    if not whole or k == 1:
      raise
    raise ValueError(
        f"{where}: loss_fn failed on one microbatch ({type(e).__name__}: "
        f"{e}). With microbatches={k} only the positional arguments named by "
        "batch_argnums (all, if None) are split, and keyword arguments are "
        f"passed whole, so loss_fn sees 1/{k} of the batch next to these "
        f"arrays of the batch's full size: {'; '.join(whole)}. Pass a "
        "batched array positionally (and name it in batch_argnums, if "
        "given).") from e


class _Types:
  """How one attempt's values vary over the data axes, where values carry
  that (`shard_map` with `check_vma=True`); every method is the identity
  elsewhere.

  AD would sum a replicated parameter's gradient over the devices in each
  microbatch's backward pass. To sum once per step instead, the parameters
  are marked varying over the data axes before the scan (no value
  changes), and `added` says, per parameter, over which axes to sum the
  accumulated gradient after it. `vmas` holds the axes the loss, aux and
  new state vary over at `k = 1`, which the carry keeps and the results get
  back.
  """

  def __init__(self, plan: "_Plan", params, state, first: Callable[[], Any],
               kwargs):
    """`first()` gives the first microbatch's data arguments."""
    axes = distributed.data_axes(plan.axis_name)
    self.data, self.typed = frozenset(axes), _typed(axes)
    self.vmas = self.added = None
    if self.typed:
      self.vmas = _vmas_at_one(plan, params, state, first(), kwargs)
      self.added = jax.tree_util.tree_map(
          lambda p: self.data - jax_compat.varying_axes(p), params)

  def widen(self, x: Any, vma: frozenset = frozenset()) -> Any:
    """`x` varying over `vma` and the data axes."""
    return _widen(x, vma | self.data) if self.typed else x

  def of(self, name: str, tree: Any) -> Any:
    """The axes at `k = 1` of each leaf of the loss, aux or state `tree`."""
    if self.typed:
      return self.vmas[name]  # type: ignore[index]  # Set when typed.
    return jax.tree_util.tree_map(lambda _: frozenset(), tree)

  def narrow(self, name: str, tree: Any) -> Any:
    """What did not vary over a data axis at `k = 1` made so again."""
    if not self.typed:
      return tree
    return _narrow_tree(tree, self.vmas[name], self.data)  # type: ignore[index]  # Set when typed.


class _Plan:
  """One accumulated attempt: `attempt(loss_scale, params, *args, **kwargs)
  -> (grads, loss, aux)`, for the loss-scaled driver."""

  def __init__(self, fun, k, *, has_aux, has_state, batch_argnums, arg_names,
               loss_reduction, axis_name, reduce_dtype, grad_dtype, where):
    self.weighted = _weighted(fun, loss_reduction, has_aux)
    self.grad = scaling.scaled_gradient(self.weighted, 0, True,
                                        unscale_in=_acc_dtype)
    if axis_name is not None:  # JAX's sums in the backward pass too.
      self.grad = distributed.summed_in(self.grad, reduce_dtype, where)
    self.k, self.has_state, self.n_state = k, has_state, int(has_state)
    self.batch_argnums, self.arg_names = batch_argnums, arg_names
    self.loss_reduction, self.axis_name = loss_reduction, axis_name
    self.reduce_dtype, self.grad_dtype = reduce_dtype, grad_dtype
    self.where = where

  def split_aux(self, aux: Any) -> tuple[Any, Any]:
    """`(aux, new_state)` from `fun`'s aux."""
    return tuple(aux) if self.has_state else (aux, None)

  def with_state(self, state: Any, data: Sequence[Any]) -> tuple:
    return ((state,) if self.has_state else ()) + tuple(data)

  def attempt(self, loss_scale, params, *args, **kwargs):
    state = (jax.tree_util.tree_map(_trees.strong, args[0]) if self.has_state
             else None)
    names = self.arg_names[self.n_state:] if self.arg_names else None
    batch = microbatches_lib.split(args[self.n_state:], kwargs, self.k,
                                   self.batch_argnums, names, self.where)
    rebuild = batch.rebuild
    with _naming(batch.whole, self.k, self.where):
      types = _Types(self, params, state,
                     lambda: rebuild([x[0] for x in batch.xs]), kwargs)
      params = jax.tree_util.tree_map(types.widen, params)
      carry = self._start(params, state, types)
      carry_vmas = [jax_compat.varying_axes(c)
                    for c in jax.tree_util.tree_leaves(carry)]

      def body(carry, leaves_and_index):
        leaves, index = leaves_and_index
        with recipe.iteration(index):  # The block formats' keys differ.
          out, ys = self._add(carry, loss_scale, params, rebuild(leaves),
                              kwargs)
        if types.typed:  # The carry keeps its types from one microbatch on.
          flat, treedef = jax.tree_util.tree_flatten(out)
          out = treedef.unflatten(
              [_widen(x, v) for x, v in zip(flat, carry_vmas)])
        return out, ys

      carry, (losses, auxes) = lax.scan(
          body, carry, (batch.xs, jnp.arange(self.k, dtype=jnp.int32)),
          length=self.k)
    return self._finish(carry, losses, auxes, params, types)

  def _start(self, params, state, types):
    """The scan's first carry: `(grads, loss total, weight, state)`, zeros."""
    acc = jax.tree_util.tree_map(
        lambda p: types.widen(jnp.zeros(np.shape(p), _acc_dtype(p)),
                              jax_compat.varying_axes(p)), params)
    loss_vma = types.vmas["loss"] if types.typed else frozenset()
    state = jax.tree_util.tree_map(types.widen, state,
                                   types.of("state", state))
    return (acc, types.widen(jnp.float32(0), loss_vma),
            types.widen(jnp.float32(0), loss_vma), state)

  def _add(self, carry, loss_scale, params, data, kwargs):
    """One microbatch added to the carry; `(carry, (loss, aux))`."""
    acc, total, weight, state = carry
    grads, loss, (w, aux) = self.grad(
        loss_scale, params, *self.with_state(state, data), **kwargs)
    aux, new_state = self.split_aux(aux)
    if self.loss_reduction == MEAN:
      acc = jax.tree_util.tree_map(jnp.add, acc, grads)
      total = total + loss.astype(jnp.float32)
    else:
      acc = jax.tree_util.tree_map(lambda a, g: a + w.astype(a.dtype) * g,
                                   acc, grads)
      total = total + w * loss.astype(jnp.float32)
    return (acc, total, weight + w, new_state), (loss, aux)

  def _finish(self, carry, losses, auxes, params, types):
    """The mean over the microbatches, reduced across devices once."""
    acc, total, weight, state = carry
    aux = jax.tree_util.tree_map(lambda a: a[-1], auxes)
    if self.loss_reduction == MEAN:
      weight = jnp.float32(self.k)
    elif self.axis_name is not None:
      weight = distributed.average_value(weight, self.axis_name, jnp.float32)
    weight = jnp.where(weight == 0, 1, weight)
    loss = (total / weight).astype(losses.dtype)
    grads = jax.tree_util.tree_map(lambda a: a / weight.astype(a.dtype), acc)
    grads = _reduce(grads, params, types.added, self.axis_name,
                    self.reduce_dtype, self.grad_dtype, loss, self.where)
    if self.axis_name is not None:
      loss = distributed.average_value(loss, self.axis_name, self.reduce_dtype)
    aux = types.narrow("aux", aux)
    if self.has_state:
      aux = (aux, types.narrow("state", state))
    return grads, loss, aux


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
    `attribute_overflow`), as `scaled_value_and_grad`: the same driver,
    with an attempt that accumulates. `value` holds the mean loss (the
    token mean of the batch with `"sum_count"`), in the loss's dtype, and
    the last microbatch's aux and model state.
  """
  plan = _Plan(fun, microbatches, has_aux=has_aux, has_state=has_state,
               batch_argnums=batch_argnums, arg_names=arg_names,
               loss_reduction=loss_reduction, axis_name=axis_name,
               reduce_dtype=reduce_dtype, grad_dtype=grad_dtype, where=where)
  return scaling.drive(plan.attempt, 0, has_aux=has_aux, axis_name=axis_name,
                       max_retries=max_retries,
                       attribute_overflow=attribute_overflow)


def _narrow_tree(tree: Any, vmas: Any, data: frozenset) -> Any:
  return jax.tree_util.tree_map(lambda x, v: _narrow(x, data - v), tree, vmas)


def _vmas_at_one(plan: _Plan, params, state, data, kwargs) -> dict:
  """The axes the loss, aux and new state of one microbatch vary over with
  the parameters as given (what `k = 1` returns): the forward traced once,
  not run. Checks the loss's axes as `scaled_value_and_grad` does."""
  args = plan.with_state(state, data)
  structure = []

  def forward(params):
    loss, (_, aux) = plan.weighted(params, *args, **kwargs)
    distributed.check_loss_axes(loss, plan.axis_name, plan.where)
    leaves, treedef = jax.tree_util.tree_flatten(
        (loss,) + tuple(plan.split_aux(aux)))
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
