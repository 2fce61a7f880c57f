"""Training helpers for mixed precision with optax.

Small pieces that compose:

* `scaled_value_and_grad`: one call for scale -> grad -> unscale ->
  finiteness check (all-reduced across devices when given an `axis_name`)
  -> loss scale adjustment, optionally redoing an overflowing step at a
  lower scale (`max_retries`).
* `skip_nonfinite`: an optax transformation that leaves the inner optimizer
  state exactly as it was and returns updates that leave params exactly as
  they were, when gradients are not finite. `update_if_finite` does the same
  for any optimizer by selecting the old params and state.
* `master_weights`: params live in a half dtype for compute; the
  transformation keeps a float32 master copy in its state.
* `keep_dtypes`: optimizer state and updates keep their dtypes from step to
  step, so a jitted step compiles once.
* `make_train_step`: all of the above in one step function.
* `nonfinite_flags` / `nonfinite_paths`: which gradient leaves overflowed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import optax

from mpolicy._src import distributed
from mpolicy._src import half_params
from mpolicy._src import loss_scale as loss_scale_lib

PyTree = Any
LossScale = loss_scale_lib.LossScale


# --- Small utilities ---------------------------------------------------------


def _is_floating(x: Any) -> bool:
  dtype = getattr(x, "dtype", None)
  return dtype is not None and jnp.issubdtype(dtype, jnp.inexact)


def _cast_floating(tree: PyTree, dtype: Any) -> PyTree:
  return jax.tree_util.tree_map(
      lambda x: x.astype(dtype) if _is_floating(x) else x, tree)


def _key_name(key: Any) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def path_str(path: Sequence[Any]) -> str:
  """A pytree key path as a '/'-joined string.

  Dict keys, attribute names and sequence indices are joined with '/', so a
  Haiku parameter `params["encoder/~/linear_1"]["w"]` reads
  `encoder/~/linear_1/w`, the same as Haiku's own module names.

  Args:
    path: a key path, as from `jax.tree_util.tree_flatten_with_path`.

  Returns:
    The joined string.

  >>> import jax
  >>> params = {"encoder/~/linear_1": {"w": 0, "b": 0}}
  >>> [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  ['encoder/~/linear_1/b', 'encoder/~/linear_1/w']

  See also: `nonfinite_paths`, `jax.tree_util.keystr` (the checkpoint keys).
  """
  return "/".join(_key_name(k) for k in path)


# --- Overflow attribution ------------------------------------------------------


def nonfinite_flags(tree: PyTree) -> PyTree:
  """Per-leaf flags: a boolean scalar array per leaf, True where it has inf/NaN.

  Runs on device (no host sync) and works under `jit`, `pmap` and
  `shard_map`; turn it into names on the host with `nonfinite_paths`.

  Args:
    tree: a pytree of arrays (e.g. gradients).

  Returns:
    A pytree of the same structure with a boolean scalar per leaf. Integer
    and bool leaves are always finite.

  >>> import jax.numpy as jnp
  >>> flags = nonfinite_flags({"a": jnp.ones(2), "b": jnp.array([jnp.inf])})
  >>> bool(flags["a"]), bool(flags["b"])
  (False, True)

  See also: `nonfinite_paths`, `scaled_value_and_grad(attribute_overflow=True)`.
  """
  return jax.tree_util.tree_map(lambda x: ~jnp.isfinite(x).all(), tree)


def nonfinite_paths(flags: PyTree) -> list[str]:
  """The '/'-joined paths of the leaves flagged True, on the host.

  This reads the flags back to the host (a device sync): call it only on
  steps you want to report, e.g. when `grads_finite` is False.

  Args:
    flags: the output of `nonfinite_flags`, or any pytree of boolean arrays
      (a leaf counts as flagged if any of its elements is True).

  Returns:
    A list of paths (see `path_str`), in pytree order.

  >>> import jax.numpy as jnp
  >>> grads = {"encoder/~/linear_1": {"w": jnp.array([jnp.nan]),
  ...                                 "b": jnp.zeros(1)}}
  >>> nonfinite_paths(nonfinite_flags(grads))
  ['encoder/~/linear_1/w']

  See also: `nonfinite_flags`, `path_str`.
  """
  leaves = jax.tree_util.tree_flatten_with_path(flags)[0]
  return [path_str(p) for p, flag in leaves if bool(np.any(np.asarray(flag)))]


# --- Loss-scaled gradients -----------------------------------------------------


def _leaf_desc(x: Any) -> str:
  dtype = getattr(x, "dtype", None)
  if dtype is None:
    return type(x).__name__
  return f"{np.dtype(dtype).name}{list(np.shape(x))}"


def _check_differentiable(args: tuple[Any, ...], argnums: int | Sequence[int]):
  """Raises TypeError naming every non-floating leaf we would differentiate."""
  nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
  bad = []
  for i in nums:
    if i >= len(args) or i < -len(args):
      raise ValueError(f"scaled_value_and_grad: argnums={argnums!r} refers to "
                       f"positional argument {i}, but only {len(args)} were "
                       "passed (after the loss scale).")
    for path, leaf in jax.tree_util.tree_flatten_with_path(args[i])[0]:
      if isinstance(leaf, bool) or not (
          isinstance(leaf, float) or _is_floating(leaf)):
        bad.append(f"args[{i}]{jax.tree_util.keystr(path)}: {_leaf_desc(leaf)}")
  if bad:
    raise TypeError(
        "scaled_value_and_grad: cannot differentiate with respect to "
        "non-floating leaves: " + ", ".join(bad) + ". Only floating-point "
        "leaves (float16, bfloat16, float32, float64, complex) are accepted "
        "in the arguments named by argnums; pass integer data (step counts, "
        "token ids) through another argument, or cast it to a float dtype.")


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

  `axis_name` names the data axes only. Under `pmap` the per-device
  gradients are `pmean`-ed; inside `shard_map` (with `check_vma=True`) JAX
  has already summed each gradient over the devices sharing its parameter
  (replicated, FSDP-sharded or tensor-parallel), so the sum is divided by
  the number of data-parallel devices: the result is the gradient of the
  loss averaged over the data axes either way, never averaged across a
  parameter's shards. The finiteness flag is agreed over every bound axis.

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

  Args:
    fun: returns a real floating scalar loss, or `(loss, aux)` if `has_aux`.
    argnums: which positional arguments of `fun` to differentiate, as in
      `jax.value_and_grad`. Their leaves must all be floating point.
    has_aux: whether `fun` returns `(loss, aux)`.
    axis_name: the data axes of `pmap` / `shard_map` (those the batch is
      split over) to average the gradients and the loss over; the flag is
      agreed over every axis. None for one device, or for plain `jit` over
      sharded arrays, where reductions are global. Naming a model axis
      inside `shard_map` raises a `ValueError` saying what to pass.
    reduce_dtype: dtype the helper's cross-device mean is computed in
      (float32 by default, so a sum of half gradients cannot overflow;
      inside `shard_map` JAX's own sum runs in the gradient's dtype and
      only the division uses it); pass
      `policy.param_dtype` to follow a policy, None for each leaf's dtype.
    grad_dtype: dtype to return the floating gradients in; None keeps each
      leaf's own dtype. float32 keeps tiny unscaled gradients of float16
      params from underflowing (see `master_weights`).
    attribute_overflow: also return `nonfinite_flags(grads)` (all-reduced
      over `axis_name`) as a fifth element, for `nonfinite_paths`.
    max_retries: how many times to back off and recompute a non-finite
      gradient in the same call; 0 (the default) computes once.

  Returns:
    `g(loss_scale, *args, **kwargs) -> (new_loss_scale, grads_finite, value,
    grads)`, plus the flags with `attribute_overflow=True`. `value` is the
    unscaled loss, or `(loss, aux)` with `has_aux=True`.

  Raises:
    TypeError, ValueError: at once, if `max_retries` is not an int >= 0.
    TypeError: when `g` is called or traced, if `fun` returns a non-scalar
      or non-floating loss, or if a leaf of a differentiated argument is not
      floating point (the message names each offending leaf).

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

  if (isinstance(max_retries, (bool, np.bool_))
      or not isinstance(max_retries, (int, np.integer)) or max_retries < 0):
    error = (TypeError if isinstance(max_retries, (bool, np.bool_))
             or not isinstance(max_retries, (int, np.integer)) else ValueError)
    raise error(
        "scaled_value_and_grad: max_retries must be a non-negative int (how "
        "many times to back off and recompute a non-finite gradient in the "
        f"same call; 0 for never), got {max_retries!r}.")
  max_retries = int(max_retries)

  def scaled_fun(loss_scale, *args, **kwargs):
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

  nums = (argnums + 1 if isinstance(argnums, int)
          else tuple(i + 1 for i in argnums))

  def attempt(loss_scale, *args, **kwargs):
    """One scaled forward and backward: `(grads, grads_finite, loss, aux)`."""
    grad_fn = jax.value_and_grad(scaled_fun, argnums=nums, has_aux=True)
    (_, (loss, aux)), grads = grad_fn(loss_scale, *args, **kwargs)

    unscaled = loss_scale.unscale(grads)
    # Loss scales following the contract return each leaf in its own dtype;
    # cast anyway, so a loss scale whose `unscale` promotes half leaves to
    # float32 (such as jmp's) works here too.
    grads = jax.tree_util.tree_map(
        lambda u, g_: u.astype(g_.dtype if grad_dtype is None else grad_dtype)
        if _is_floating(g_) else u, unscaled, grads)

    if axis_name is not None:
      distributed.check_loss_axes(loss, axis_name, "scaled_value_and_grad")
      grads = distributed.average_grads(grads, axis_name, reduce_dtype)
      loss = distributed.average_value(loss, axis_name, reduce_dtype)
    grads_finite = distributed.agree_finite(
        loss_scale_lib.all_finite(grads), axis_name)
    return grads, grads_finite, loss, aux

  def retry(loss_scale, grads, grads_finite, args, kwargs):
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

  def g(loss_scale: LossScale, *args, **kwargs):
    _check_differentiable(args, argnums)
    grads, grads_finite, loss, aux = attempt(loss_scale, *args, **kwargs)
    # A loss scale without array leaves (NoOp, Static) cannot back off inside
    # a traced call: a retry would recompute the very same overflow.
    if max_retries and jax.tree_util.tree_leaves(loss_scale):
      loss_scale, grads, grads_finite = retry(
          loss_scale, grads, grads_finite, args, kwargs)
    new_loss_scale = loss_scale.adjust(grads_finite)

    value = (loss, aux) if has_aux else loss
    if not attribute_overflow:
      return new_loss_scale, grads_finite, value, grads
    flags = nonfinite_flags(grads)
    leaves, treedef = jax.tree_util.tree_flatten(flags)
    if axis_name is not None and leaves:  # One collective for all flags.
      agreed = ~distributed.agree_finite(~jnp.stack(leaves), axis_name)
      flags = jax.tree_util.tree_unflatten(treedef, list(agreed))
    return new_loss_scale, grads_finite, value, grads, flags

  return g


# --- Skipping non-finite steps ---------------------------------------------------


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


def _identity_update(shape_dtype: Any) -> jax.Array:
  # x + (-0.0) == x bit for bit for every x, -0.0 and NaN included, while
  # x + 0.0 turns -0.0 into +0.0. Integer leaves get plain zeros.
  if jnp.issubdtype(shape_dtype.dtype, jnp.inexact):
    return jnp.full(shape_dtype.shape, -0.0, shape_dtype.dtype)
  return jnp.zeros(shape_dtype.shape, shape_dtype.dtype)


def skip_nonfinite(
    inner: optax.GradientTransformation,
) -> optax.GradientTransformationExtraArgs:
  """Wraps `inner` to skip steps whose gradients are not finite.

  On a non-finite step the inner state is returned bit-for-bit as it was
  (its step count does not advance) and the updates are `-0.0`, so
  `optax.apply_updates(params, updates)` returns params bit-for-bit as they
  were (adding `-0.0` is the exact identity; `+0.0` would turn `-0.0` into
  `+0.0`). Only this wrapper's counters (`SkipNonFiniteState`) change. A
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
      identity = jax.tree_util.tree_map(_identity_update, shapes)
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
  optimizer = optax.with_extra_args_support(optimizer)
  grads_finite = jnp.asarray(grads_finite, jnp.bool_)
  updates, new_state = optimizer.update(
      grads, opt_state, params, grads_finite=grads_finite, **extra_args)
  new_params = optax.apply_updates(params, updates)
  return (loss_scale_lib.select_tree(grads_finite, new_params, params),
          loss_scale_lib.select_tree(grads_finite, new_state, opt_state))


# --- Stable dtypes -------------------------------------------------------------


def _strong(x: Any) -> Any:
  if getattr(x, "weak_type", False):
    return lax.convert_element_type(x, x.dtype)  # Drops the weak type.
  return x


def _cast_like(new: Any, old: Any) -> Any:
  if new is None or old is None:
    return new
  dtype = getattr(old, "dtype", None)
  if dtype is None:
    return new
  new = jnp.asarray(new)
  return _strong(new) if new.dtype == dtype else new.astype(dtype)


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
  inner = optax.with_extra_args_support(inner)

  def init(params):
    return jax.tree_util.tree_map(_strong, inner.init(params))

  def update(updates, state, params=None, **extra_args):
    like = updates if params is None else params
    new_updates, new_state = inner.update(updates, state, params, **extra_args)
    new_updates = jax.tree_util.tree_map(
        _cast_like, new_updates, like, is_leaf=lambda x: x is None)
    new_state = jax.tree_util.tree_map(
        _cast_like, new_state, state, is_leaf=lambda x: x is None)
    return new_updates, new_state

  return optax.GradientTransformationExtraArgs(init, update)


# --- Master weights ------------------------------------------------------------


class MasterWeightsState(NamedTuple):
  """State of `master_weights`.

  Attributes:
    master: the master copy of the params, floating leaves in the master
      dtype (float32 by default); the source of truth for the weights.
    inner_state: the wrapped optimizer's state, built from `master`.
  """
  master: Any
  inner_state: Any


def master_weights(
    inner: optax.GradientTransformation,
    master_dtype: Any = jnp.float32,
) -> optax.GradientTransformationExtraArgs:
  """Keeps a float32 master copy of half-precision params in the optimizer.

  The params you compute with are half precision (e.g. bfloat16); the
  state's `master` holds them in `master_dtype`, so updates too small to
  change a half weight still move the master and reach the weight once they
  add up. Each update casts the gradients to `master_dtype`, runs `inner`
  on the master (so its moments are float32 too), adds its updates to the
  master, and returns `updates = new_master.astype(half) - params`,
  computed in `master_dtype`. `optax.apply_updates(params, updates)` then
  gives the new master rounded to the params' dtype, bit for bit, except
  for a weight that shrinks by a factor over 2**14 in one step without
  reaching zero (float32 cannot hold that difference exactly); the next
  step corrects it, and `params_from_master` is always exact. Leaves already
  in `master_dtype` get `inner`'s updates unchanged.

  Start from float32 params with `init_master_weights` (they become the
  master), or from half params with `tx.init(params)`, which casts the
  floating leaves to `master_dtype` (pass a float32 copy if you have one).

  Args:
    inner: the optimizer to run on the master; extra args are passed on.
    master_dtype: the dtype of the master copy.

  Returns:
    An `optax.GradientTransformationExtraArgs` with `MasterWeightsState`.
    Its `update` needs `params` (their dtypes say what to round to).

  Raises:
    ValueError: from `update`, if `params` is not given.

  >>> import jax.numpy as jnp, optax
  >>> tx = master_weights(optax.sgd(1e-4))
  >>> half, state = init_master_weights(tx, {"w": jnp.ones(2)}, jnp.bfloat16)
  >>> for _ in range(100):
  ...   updates, state = tx.update({"w": -jnp.ones(2, jnp.bfloat16)}, state, half)
  ...   half = optax.apply_updates(half, updates)
  >>> round(float(state.master["w"][0]), 4), float(half["w"][0])
  (1.01, 1.0078125)

  See also: `init_master_weights`, `params_from_master`, `skip_nonfinite`
  (wrap it around `master_weights` to keep the master on bad steps).
  """
  inner = optax.with_extra_args_support(inner)
  master_dtype = np.dtype(master_dtype)

  def init(params):
    master = jax.tree_util.tree_map(_strong, _cast_floating(params, master_dtype))
    return MasterWeightsState(master=master, inner_state=inner.init(master))

  def update(updates, state, params=None, **extra_args):
    if params is None:
      raise ValueError(
          "master_weights: update needs `params` (the half-precision params "
          "you compute with) to know which dtype to round the master to; call "
          "`tx.update(grads, state, params)`.")
    grads = _cast_floating(updates, master_dtype)
    inner_updates, inner_state = inner.update(
        grads, state.inner_state, state.master, **extra_args)
    master = optax.apply_updates(state.master, inner_updates)

    def param_update(p, m, u):
      if not _is_floating(p):
        return u
      if p.dtype == master_dtype:
        return u  # p == m: p + u is exactly what the master got.
      return m.astype(p.dtype).astype(master_dtype) - p.astype(master_dtype)

    new_updates = jax.tree_util.tree_map(
        param_update, params, master, inner_updates)
    return new_updates, MasterWeightsState(master=master,
                                           inner_state=inner_state)

  return optax.GradientTransformationExtraArgs(init, update)


def init_master_weights(
    optimizer: optax.GradientTransformation,
    params: PyTree,
    param_dtype: Any,
) -> tuple[PyTree, PyTree]:
  """Starts master-weight training from full-precision params.

  Args:
    optimizer: a transformation containing `master_weights`.
    params: the full-precision params; they become the master copy.
    param_dtype: the dtype to compute in, e.g. `jnp.bfloat16`.

  Returns:
    `(half_params, opt_state)`: the floating leaves of `params` cast to
    `param_dtype`, and `optimizer.init(params)`.

  >>> import jax.numpy as jnp, optax
  >>> tx = master_weights(optax.adam(1e-3))
  >>> half, state = init_master_weights(tx, {"w": jnp.ones(2)}, jnp.bfloat16)
  >>> half["w"].dtype, state.master["w"].dtype
  (dtype(bfloat16), dtype('float32'))

  See also: `master_weights`, `params_from_master`.
  """
  return _cast_floating(params, param_dtype), optimizer.init(params)


def params_from_master(opt_state: PyTree, params: PyTree) -> PyTree:
  """The master copy in `opt_state`, rounded to the dtypes of `params`.

  Exact, always: use it after a restore, or instead of
  `optax.apply_updates`.

  Args:
    opt_state: a state holding exactly one `MasterWeightsState` anywhere
      inside (also under `skip_nonfinite` or `optax.chain`).
    params: params whose floating leaves give the dtypes to round to.

  Returns:
    The rounded master, shaped like `params`.

  Raises:
    ValueError: `opt_state` holds no `MasterWeightsState`, or several.

  >>> import jax.numpy as jnp, optax
  >>> tx = skip_nonfinite(master_weights(optax.sgd(0.1)))
  >>> state = tx.init({"w": jnp.full(2, 1.001)})
  >>> params_from_master(state, {"w": jnp.ones(2, jnp.bfloat16)})["w"].tolist()
  [1.0, 1.0]

  See also: `master_weights`.
  """
  found = [s for s in jax.tree_util.tree_leaves(
      opt_state, is_leaf=lambda x: isinstance(x, MasterWeightsState))
           if isinstance(s, MasterWeightsState)]
  if len(found) != 1:
    raise ValueError("params_from_master: expected exactly one "
                     f"MasterWeightsState in opt_state, found {len(found)}.")
  return jax.tree_util.tree_map(
      lambda m, p: m.astype(p.dtype) if _is_floating(p) else m,
      found[0].master, params)


# --- A whole step --------------------------------------------------------------


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
    return nonfinite_paths(self.nonfinite)


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
  optimizer = half_params.for_param_rounding(optimizer, param_rounding)
  if not has_state:
    grad_fn = scaled_value_and_grad(
        loss_fn, has_aux=has_aux, axis_name=axis_name,
        reduce_dtype=reduce_dtype, grad_dtype=grad_dtype,
        max_retries=max_retries, attribute_overflow=attribute_overflow)

    def step(params, opt_state, loss_scale, *args, **kwargs):
      new_loss_scale, finite, value, grads, *flags = grad_fn(
          loss_scale, params, *args, **kwargs)
      new_params, new_opt_state = update_if_finite(
          optimizer, grads, opt_state, params, finite)
      return TrainStepResult(new_params, new_opt_state, new_loss_scale,
                             finite, value, None, *flags)

    return step

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

  grad_fn = scaled_value_and_grad(
      loss_with_state, has_aux=True, axis_name=axis_name,
      reduce_dtype=reduce_dtype, grad_dtype=grad_dtype,
      max_retries=max_retries, attribute_overflow=attribute_overflow)

  def step_with_state(params, model_state, opt_state, loss_scale, *args,
                      **kwargs):
    new_loss_scale, finite, (loss, extra), grads, *flags = grad_fn(
        loss_scale, params, model_state, *args, **kwargs)
    if has_aux:
      aux, new_model_state = extra
      value = (loss, aux)
    else:
      value, new_model_state = loss, extra
    if axis_name is not None and average_state:
      new_model_state = distributed.average_value(
          new_model_state, axis_name, jnp.float32)
    new_params, new_opt_state = update_if_finite(
        optimizer, grads, opt_state, params, finite)
    new_model_state = loss_scale_lib.select_tree(
        finite, new_model_state, model_state)
    return TrainStepResult(new_params, new_opt_state, new_loss_scale, finite,
                           value, new_model_state, *flags)

  return step_with_state
