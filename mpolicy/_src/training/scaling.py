"""Loss-scaled gradients: scale, grad, unscale, check, adjust, in one call.

`scaled_value_and_grad` wraps a loss function so that one traced call
scales the loss, differentiates it, unscales the gradients, checks them for
inf/NaN (all-reduced across devices when given an `axis_name`) and adjusts
the loss scale, optionally redoing an overflowing step at a lower scale.

Those steps are the one driver every gradient function of the training
helpers runs on: `scaled_gradient` scales, differentiates and unscales one
loss; `drive` checks, retries and adjusts around an attempt. Here the
attempt is the whole batch averaged over the devices; gradient
accumulation (`accumulation.py`) feeds the driver an attempt over
microbatches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from mpolicy._src import arguments
from mpolicy._src import distributed
from mpolicy._src import loss_scale as loss_scale_lib
from mpolicy._src.training import _trees
from mpolicy._src.training import attribution

LossScale = loss_scale_lib.LossScale


# --- Checks on what is passed -----------------------------------------------


def check_max_retries(max_retries: Any) -> int:
  """`max_retries` as an int >= 0, or a TypeError / ValueError."""
  is_int = (isinstance(max_retries, (int, np.integer))
            and not isinstance(max_retries, (bool, np.bool_)))
  if not is_int or max_retries < 0:
    raise (ValueError if is_int else TypeError)(
        "scaled_value_and_grad: max_retries must be a non-negative int (how "
        "many times to back off and recompute a non-finite gradient in the "
        f"same call; 0 for never), got {max_retries!r}.")
  return int(max_retries)


def _leaf_desc(x: Any) -> str:
  dtype = getattr(x, "dtype", None)
  if dtype is None:
    return type(x).__name__
  return f"{np.dtype(dtype).name}{list(np.shape(x))}"


def check_differentiable(args: tuple[Any, ...], argnums: int | Sequence[int]):
  """Raises TypeError naming every non-floating leaf we would differentiate."""
  nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
  bad = []
  for i in nums:
    if i >= len(args) or i < -len(args):
      raise ValueError(f"scaled_value_and_grad: argnums={argnums!r} refers to "
                       f"positional argument {i}, but only {len(args)} were "
                       "passed (after the loss scale).")
    for path, leaf in jax.tree_util.tree_flatten_with_path(args[i])[0]:
      if isinstance(leaf, bool) or not (isinstance(leaf, float)
                                        or _trees.is_floating(leaf)
                                        or _trees.is_complex(leaf)):
        bad.append(f"args[{i}]{jax.tree_util.keystr(path)}: {_leaf_desc(leaf)}")
  if bad:
    raise TypeError(
        "scaled_value_and_grad: cannot differentiate with respect to "
        "non-floating leaves: " + ", ".join(bad) + ". Only floating-point "
        "leaves (float8, float16, bfloat16, float32, float64) and complex "
        "ones are "
        "accepted in the arguments named by argnums; pass integer data (step "
        "counts, token ids) through another argument, or cast it to a float "
        "dtype.")


def _check_loss(loss: Any) -> None:
  shape, dtype = np.shape(loss), getattr(loss, "dtype", None)
  if dtype is None:
    dtype = np.result_type(loss)
  if shape != () or not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(
        "scaled_value_and_grad: fun must return a real floating-point scalar "
        f"loss (shape ()), got {np.dtype(dtype).name} of shape {shape}. "
        "Reduce it to a scalar (e.g. `.mean()` or `.sum()`), or, to return "
        "extra outputs, return `(loss, aux)` and pass has_aux=True.")



# --- The pieces of one call --------------------------------------------------


def _scaled_loss(fun: Callable[..., Any], has_aux: bool) -> Callable[..., Any]:
  """`scaled(loss_scale, *args)`: `(loss_scale.scale(loss), (loss, aux))`."""

  def scaled(loss_scale, *args, **kwargs):
    out = fun(*args, **kwargs)
    if has_aux:
      if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise TypeError(
            "scaled_value_and_grad: with has_aux=True, fun must return a pair "
            f"(loss, aux), got {type(out).__name__}.")
      loss, aux = out
    else:
      loss, aux = out, None
    _check_loss(loss)
    # Only the cotangent matters: the scaled loss's value is never used, so
    # it may overflow (e.g. a float16 loss of 8 times 2**15) harmlessly.
    return loss_scale.scale(loss), (loss, aux)

  return scaled


def _unscale(loss_scale: LossScale, grads: Any, grad_dtype: Any) -> Any:
  """The unscaled gradients, each in its parameter's dtype or `grad_dtype`."""
  # Loss scales unscale real floating leaves: complex ones go through as
  # their real and imaginary parts.
  unscaled = _trees.join_complex(
      loss_scale.unscale(_trees.split_complex(grads)), grads)
  # Loss scales following the contract return each leaf in its own dtype;
  # cast anyway, so a loss scale whose `unscale` promotes half leaves to
  # float32 (such as jmp's) works here too.
  return jax.tree_util.tree_map(
      lambda u, g: u.astype(g.dtype if grad_dtype is None else grad_dtype)
      if _trees.is_floating(g) else u, unscaled, grads)


def scaled_gradient(fun: Callable[..., Any], argnums: int | Sequence[int],
                    has_aux: bool, *, unscale_in: Any = None,
                    grad_dtype: Any = None) -> Callable[..., tuple[Any, ...]]:
  """`grad(loss_scale, *args, **kwargs) -> (grads, loss, aux)`: scale `fun`'s
  loss, differentiate it with respect to `args[argnums]`, unscale.

  The gradients are unscaled in their own dtypes, or in `unscale_in(leaf)`
  where given (an accumulator's float32: a half gradient divided by the
  scale in half would flush to zero), and returned in their parameters'
  dtypes or, for real floating leaves, in `grad_dtype`. `aux` is None
  without `has_aux`.
  """
  # Positions in (loss_scale, *args): one further on, or the same from the end.
  shift = lambda i: i + 1 if i >= 0 else i
  nums = (shift(argnums) if isinstance(argnums, int)
          else tuple(map(shift, argnums)))
  grad_fn = jax.value_and_grad(_scaled_loss(fun, has_aux), argnums=nums,
                               has_aux=True)

  def grad(loss_scale, *args, **kwargs):
    (_, (loss, aux)), grads = grad_fn(loss_scale, *args, **kwargs)
    if unscale_in is not None:
      grads = jax.tree_util.tree_map(lambda g: g.astype(unscale_in(g)), grads)
    return _unscale(loss_scale, grads, grad_dtype), loss, aux

  return grad


def _device_mean(fun, argnums, has_aux, grad_dtype, axis_name, reduce_dtype):
  """`attempt(loss_scale, *args) -> (grads, loss, aux)`: the scaled gradient
  of the whole batch, averaged over `axis_name` in `reduce_dtype`."""
  grad = scaled_gradient(fun, argnums, has_aux, grad_dtype=grad_dtype)
  if axis_name is not None:  # JAX's sums in the backward pass too.
    grad = distributed.summed_in(grad, reduce_dtype, "scaled_value_and_grad")

  def attempt(loss_scale, *args, **kwargs):
    # Replicated params' gradients stay per device, to be summed in
    # reduce_dtype (inside shard_map, JAX's own sum is in their dtype).
    args, per_device = distributed.vary_replicated(args, argnums, axis_name)
    grads, loss, aux = grad(loss_scale, *args, **kwargs)
    if axis_name is not None:
      distributed.check_loss_axes(loss, axis_name, "scaled_value_and_grad")
      grads = distributed.average_grads(grads, axis_name, reduce_dtype,
                                        per_device)
      loss = distributed.average_value(loss, axis_name, reduce_dtype)
    return grads, loss, aux

  return attempt


def _retry(attempt, max_retries: int, loss_scale, grads, grads_finite, args,
           kwargs):
  """Backs off and recomputes while not finite, up to `max_retries` times."""

  def lowers(ls):
    return jnp.all(ls.adjust(jnp.bool_(False)).loss_scale < ls.loss_scale)

  def cond(carry):
    ls, _, finite, tries = carry
    return ~finite & (tries < max_retries) & lowers(ls)

  def body(carry):
    ls, _, _, tries = carry
    ls = ls.adjust(jnp.bool_(False))
    grads, finite, _, _ = attempt(ls, *args, **kwargs)
    return ls, grads, finite, tries + 1

  loss_scale, grads, grads_finite, _ = lax.while_loop(
      cond, body, (loss_scale, grads, grads_finite, jnp.zeros([], jnp.int32)))
  return loss_scale, grads, grads_finite


def _agreed_flags(grads: Any, axis_name: Any) -> Any:
  """`nonfinite_flags(grads)`, each True on every device if on any."""
  flags = attribution.nonfinite_flags(grads)
  leaves, treedef = jax.tree_util.tree_flatten(flags)
  if axis_name is not None and leaves:  # One collective for all flags.
    agreed = ~distributed.agree_finite(~jnp.stack(leaves), axis_name)
    flags = jax.tree_util.tree_unflatten(treedef, list(agreed))
  return flags


def drive(attempt: Callable[..., tuple[Any, Any, Any]],
          argnums: int | Sequence[int], *, has_aux: bool, axis_name: Any,
          max_retries: Any, attribute_overflow: bool,
          call: str | None = None) -> Callable[..., tuple[Any, ...]]:
  """The loss-scaled driver every gradient function here runs on.

  `attempt(loss_scale, *args, **kwargs) -> (grads, loss, aux)` says how one
  attempt's gradients are computed (scaled, differentiated, unscaled and
  reduced over `axis_name`: the whole batch, or microbatches). The driver
  checks the arguments, checks the gradients for inf/NaN (agreed over
  `axis_name`), redoes the attempt at a backed-off scale up to
  `max_retries` times, and adjusts the scale once. `call`, if given, is how
  the result is called, for the message when the loss scale is wrong.

  Returns:
    `g(loss_scale, *args, **kwargs) -> (new_loss_scale, grads_finite, value,
    grads)` (plus the agreed `nonfinite_flags` with `attribute_overflow`),
    as `scaled_value_and_grad` documents.
  """
  max_retries = check_max_retries(max_retries)

  def checked(loss_scale, *args, **kwargs):
    grads, loss, aux = attempt(loss_scale, *args, **kwargs)
    grads_finite = distributed.agree_finite(
        loss_scale_lib.all_finite(grads), axis_name)
    return grads, grads_finite, loss, aux

  def g(loss_scale: LossScale, *args, **kwargs):
    if call is not None:
      loss_scale_lib.require_loss_scale(loss_scale, "scaled_value_and_grad",
                                        call)
    check_differentiable(args, argnums)
    grads, grads_finite, loss, aux = checked(loss_scale, *args, **kwargs)
    # A loss scale without array leaves (NoOp, Static) cannot back off inside
    # a traced call: a retry would recompute the very same overflow.
    if max_retries and jax.tree_util.tree_leaves(loss_scale):
      loss_scale, grads, grads_finite = _retry(
          checked, max_retries, loss_scale, grads, grads_finite, args, kwargs)
    out = (loss_scale.adjust(grads_finite), grads_finite,
           (loss, aux) if has_aux else loss, grads)
    if not attribute_overflow:
      return out
    return out + (_agreed_flags(grads, axis_name),)

  return g


def scaled_value_and_grad(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    *,
    axis_name: Any = None,
    reduce_dtype: Any = jnp.float32,
    grad_dtype: Any = None,
    attribute_overflow: bool = False,
    max_retries: int = 0,
) -> Callable[..., tuple[Any, ...]]:
  """Loss-scaled `jax.value_and_grad`, with the finiteness check and adjustment.

  Returns `g(loss_scale, *args, **kwargs)` which, in one traced call:

  1. evaluates `fun(*args, **kwargs)` and differentiates
     `loss_scale.scale(loss)` with respect to `args[argnums]` (the loss
     scale is not counted in `argnums`);
  2. unscales the gradients, each back in its parameter's dtype (or in
     `grad_dtype`);
  3. with `axis_name`: averages the gradients and the loss over the devices
     in `reduce_dtype`;
  4. computes `grads_finite = all_finite(grads)`, all-reduced over
     `axis_name` so every device sees the same flag;
  5. returns `loss_scale.adjust(grads_finite)` as the new loss scale, the
     same on every device too.

  Nothing here syncs with the host, and nothing skips the update: pass
  `grads_finite` to `skip_nonfinite` or `update_if_finite` for that.

  `axis_name` names the data axes only. Under `pmap` (and `shard_map`
  with `check_vma=False`) the per-device gradients are `pmean`-ed in
  `reduce_dtype`. Inside `shard_map` with `check_vma=True` the
  differentiated parameters are marked varying over the data axes they are
  replicated over before `fun` runs, so JAX's AD leaves their gradients per
  device (it would sum them in their own dtype) and they are summed here in
  `reduce_dtype`; over a data axis a parameter is sharded over (FSDP),
  JAX's AD sums (the reduce-scatter of the `all_gather`), in
  `reduce_dtype` too: collectives run by `amp` transpose in it wherever
  they are, and the backward sums at the loss's own level (a plain
  `all_gather` around the amp-ed model) are cast to it. The sum is divided by the number of data-parallel devices: the
  result is the gradient of the loss averaged over the data axes in every
  mode, never averaged across a parameter's shards. The finiteness flag is
  agreed over every bound axis.

  With `max_retries=N > 0`, a non-finite step is redone in the same call:
  the scale backs off (`loss_scale.adjust(False)`) and the forward and
  backward run again (a `lax.while_loop` whose body runs only while the
  gradients are not finite), up to N times, stopping early once the scale
  cannot go lower. The flag and grads returned are the last attempt's;
  after a success on retry k the scale is `factor ** k` lower (and counts
  one finite step), and if every attempt overflows it is
  `factor ** (N + 1)` lower and the flag is False. `value` is the first
  attempt's (the forward does not depend on the scale). Retries all-reduce
  their flags, so every device loops the same number of times. A
  `NoOpLossScale` or `StaticLossScale` cannot back off, so for them
  `max_retries` has no effect. On a finite step the cost is, on GPU, a
  read-back of the loop condition, and a program that holds the backward
  twice (longer compiles): use it where overflows are frequent enough that
  skipped steps cost more.

  Float8 parameters (float8_e4m3fn, float8_e5m2) get float8 gradients,
  unscaled in float32 and rounded back to float8 (the loss scales' own
  casts never saturate: past the largest finite value is inf, or nan in
  float8_e4m3fn). JAX's differentiation makes the scaled float8 gradient;
  where it overflows (inf or nan on CPU) the step is flagged and the scale
  backs off.

  Complex parameters are differentiated, unscaled, averaged and checked
  for inf/NaN like real ones, but their gradients always come back in their
  own dtype: `grad_dtype` and `reduce_dtype` apply to real floating leaves.

  Args:
    fun: returns a real floating scalar loss, or `(loss, aux)` if `has_aux`.
    argnums: which positional arguments of `fun` to differentiate, as in
      `jax.value_and_grad`. Their leaves must all be floating point (real
      or complex).
    has_aux: whether `fun` returns `(loss, aux)`.
    axis_name: the data axes of `pmap` / `shard_map` (those the batch is
      split over) to average the gradients and the loss over; the flag is
      agreed over every axis. None for one device, or for plain `jit` over
      sharded arrays, where reductions are global. Naming a model axis
      inside `shard_map` raises a `ValueError` saying what to pass.
    reduce_dtype: dtype the gradients are summed and averaged across
      devices in (float32 by default, so a sum of half gradients neither
      overflows nor loses bits; `jnp.bfloat16` halves the traffic); pass
      `policy.param_dtype` to follow a policy, None for each leaf's dtype.
      With `axis_name`, it holds for the sums JAX's AD derives in the
      backward pass too (FSDP's reduce-scatter; see above).
    grad_dtype: dtype to return the real floating gradients in; None keeps
      each leaf's own dtype. float32 keeps tiny unscaled gradients of
      float16 params from underflowing (see `master_weights`).
    attribute_overflow: also return `nonfinite_flags(grads)` (all-reduced
      over `axis_name`) as a fifth element, for `nonfinite_paths`.
    max_retries: how many times to back off and recompute a non-finite
      gradient in the same call; 0 (the default) computes once.

  Returns:
    `g(loss_scale, *args, **kwargs) -> (new_loss_scale, grads_finite, value,
    grads)`, plus the flags with `attribute_overflow=True`. `value` is the
    unscaled loss, or `(loss, aux)` with `has_aux=True`.

  Raises:
    TypeError, ValueError: at once, if `fun` is not callable,
      `max_retries` is not an int >= 0, or `grad_dtype` or `reduce_dtype`
      is neither None nor a floating dtype (an integer or bool one would
      truncate the gradients).
    TypeError: when `g` is called or traced, if its first argument is not a
      loss scale (a number, an array, or a forgotten loss scale: the message
      names `loss_scale` and the classes), if `fun` returns a non-scalar
      or non-floating loss, or if a leaf of a differentiated argument is not
      floating point (the message names each offending leaf).
    ValueError: when traced, if a backward sum narrower than
      `reduce_dtype` lies inside a `jit`, `scan` or other construct of
      `fun` that `amp` did not run (the message names the construct and
      what works).

  >>> import jax.numpy as jnp, mpolicy
  >>> loss_fn = lambda w, x: jnp.sum((w * x) ** 2)
  >>> grad_fn = scaled_value_and_grad(loss_fn)
  >>> ls = mpolicy.DynamicLossScale(jnp.float32(2. ** 15))
  >>> ls, finite, loss, grads = grad_fn(ls, jnp.ones(2), jnp.full(2, 3.))
  >>> bool(finite), float(loss), grads.tolist()
  (True, 18.0, [18.0, 18.0])

  See also: `skip_nonfinite`, `update_if_finite`, `make_train_step`,
  `DynamicLossScale`.
  """
  arguments.require_callable(fun, "scaled_value_and_grad", "fun",
                             "the loss function")
  reduce_dtype = arguments.require_float_dtype(
      reduce_dtype, "scaled_value_and_grad", "reduce_dtype", none_ok=True,
      none_means="each gradient averaged in its own dtype")
  grad_dtype = arguments.require_float_dtype(
      grad_dtype, "scaled_value_and_grad", "grad_dtype", none_ok=True,
      none_means="each gradient in its parameter's dtype")
  attempt = _device_mean(fun, argnums, has_aux, grad_dtype, axis_name,
                         reduce_dtype)
  return drive(attempt, argnums, has_aux=has_aux, axis_name=axis_name,
               max_retries=max_retries, attribute_overflow=attribute_overflow,
               call="scaled_value_and_grad(fun)(loss_scale, *args)")
