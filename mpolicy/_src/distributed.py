"""The cross-device contract of the training helpers.

`axis_name` names the *data* axes: the mesh axes (or the `pmap` axis) the
batch is split over. The helpers keep three promises across devices:

* Gradients are the gradients of the loss averaged over the data axes, and
  are never averaged across the shards of a parameter. The sum across
  devices runs in `reduce_dtype` wherever the helpers make it: under `pmap`
  and `shard_map` with `check_vma=False` each device has its own gradient
  and they are averaged with a `pmean` in `reduce_dtype`. Inside
  `shard_map` with `check_vma=True`, JAX's AD would sum a replicated
  parameter's gradient itself, in the gradient's dtype (the transpose of
  the implicit `pvary`): `vary_replicated` marks the differentiated
  parameters varying over the data axes before the loss, so their
  gradients stay per device, and `average_grads` sums them in
  `reduce_dtype`. Over a data axis that some parameter is sharded over
  (FSDP), JAX's AD sums (the transpose of the user's `all_gather` is a
  reduce-scatter, in `reduce_dtype` by `summed_in`) and the sum is only
  divided.
  With `check_vma=False` JAX does not record which gradients it summed:
  FSDP needs `check_vma=True`, and a mesh with axes besides the data axes
  is refused. Real floating leaves are averaged in `reduce_dtype`, complex
  ones in their own dtype, other leaves not at all.
* The sums JAX's AD places in the backward pass (the reduce-scatter of an
  `all_gather`, the `psum` of a `pvary`) run in `reduce_dtype` too
  (`summed_in`): amp-ed collectives transpose in it wherever they are,
  and the others where the loss itself holds them; one inside a `jit`,
  `scan` or other construct of the loss that amp did not run is refused.
* The finiteness flag is agreed over *every* axis bound where the step is
  traced (data and model axes alike), so all devices skip together and the
  loss scale stays the same everywhere.
* Module state (BatchNorm statistics) is averaged over the data axes.
"""

from __future__ import annotations

from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from mpolicy._src import dtypes
from mpolicy._src import jax_compat
from mpolicy._src.rules import collectives

PyTree = Any


def _work_dtype(x: Any, reduce_dtype: Any) -> Any:
  """The dtype to average `x` in: `reduce_dtype` for a real floating leaf
  (its own dtype if None), its own dtype for a complex one (a real
  `reduce_dtype` would drop the imaginary part), None to leave it alone."""
  dtype = getattr(x, "dtype", None)
  if dtypes.is_float(dtype):
    return dtype if reduce_dtype is None else reduce_dtype
  if dtype is not None and jnp.issubdtype(dtype, jnp.complexfloating):
    return dtype
  return None


def data_axes(axis_name: Any) -> tuple:
  """`axis_name` (an axis name or a sequence of them) as a tuple."""
  if axis_name is None:
    return ()
  if isinstance(axis_name, (tuple, list)):
    return tuple(axis_name)
  return (axis_name,)


def unbound_axes(axes: tuple) -> tuple[list, list]:
  """`(the axes no enclosing pmap or shard_map binds, the bound names)`."""
  bound = jax_compat.bound_axis_names()
  return [a for a in axes if a not in bound], sorted(map(str, bound))


def _check_bound(axes: tuple, where: str) -> None:
  missing, bound = unbound_axes(axes)
  if missing:
    raise ValueError(
        f"{where}: axis_name={axes if len(axes) != 1 else axes[0]!r} names "
        f"{missing!r}, which no enclosing pmap or shard_map binds (bound "
        f"here: {bound}). Pass the axes the batch is "
        "split over, and call the step inside the pmap / shard_map; under "
        "plain jax.jit with sharded arrays pass axis_name=None.")


def _in_shard_map(axes: tuple) -> bool:
  manual = jax_compat.manual_axes()
  return bool(axes) and all(a in manual for a in axes)


def _typed(axes: tuple) -> bool:
  """Inside `shard_map` over `axes` with varying-axes types (`check_vma`)."""
  return _in_shard_map(axes) and jax_compat.check_vma_enabled()


def _mean_over(x: Any, axes: tuple, reduce_dtype: Any) -> Any:
  work = _work_dtype(x, reduce_dtype)
  if work is None or not axes:
    return x
  return lax.pmean(x.astype(work), axes).astype(x.dtype)


def _varying_data_axes(x: Any, axes: tuple) -> tuple:
  """The data axes to average ``x`` over: those it varies over when its
  type says so, all of them when it cannot (pmap, ``check_vma=False``)."""
  if _typed(axes):
    vma = jax_compat.varying_axes(x)
    return tuple(a for a in axes if a in vma)
  return axes


def average_value(tree: PyTree, axis_name: Any, reduce_dtype: Any) -> PyTree:
  """Floating leaves averaged over the data axes they differ across (the
  loss, module state)."""
  axes = data_axes(axis_name)
  return jax.tree_util.tree_map(
      lambda x: _mean_over(x, _varying_data_axes(x, axes), reduce_dtype),
      tree)


def check_loss_axes(loss: Any, axis_name: Any, where: str) -> None:
  """Raises if a named data axis is one the loss does not vary over.

  Inside `shard_map` with `check_vma=True` a loss that is the same on every
  device of an axis (after a `psum` over a tensor-parallel axis) says that
  axis does not split the batch: averaging gradients over it would mix the
  shards of the parameters split over it.
  """
  axes = data_axes(axis_name)
  _check_bound(axes, where)
  if not _in_shard_map(axes):
    return
  if not jax_compat.check_vma_enabled():
    others = sorted(map(str, jax_compat.manual_axes() - set(axes)))
    if others:
      raise ValueError(
          f"{where}: inside a shard_map with check_vma=False over mesh axes "
          f"{others} besides the data axes {list(axes)}: without varying-axes "
          "types JAX's AD sums the gradients of tensor-parallel collectives "
          "once per device along those axes and does not record which "
          "gradients it summed, so no averaging can be right. Use "
          "check_vma=True (the default), or a mesh of the data axes only.")
    return
  vma = jax_compat.varying_axes(loss)
  if not vma:
    return  # A loss made the same everywhere (e.g. pmean-ed by the user).
  wrong = [a for a in axes if a not in vma]
  if wrong:
    right = tuple(a for a in axes if a in vma)
    raise ValueError(
        f"{where}: axis_name names {wrong!r}, but the loss is the same on "
        f"every device along {wrong!r}, so the batch is not split over it "
        "(a tensor-parallel or model axis). axis_name lists the data axes "
        f"only: pass axis_name={right[0] if len(right) == 1 else right!r}. "
        "The finiteness flag and the loss scale are agreed over every "
        "mesh axis whatever axis_name says.")


def vary_replicated(args: tuple, argnums: Any, axis_name: Any
                    ) -> tuple[tuple, Any]:
  """`args` with the differentiated parameters marked varying over the data
  axes they are replicated over, and those axes per gradient leaf.

  Inside `shard_map` with `check_vma=True`, JAX's AD sums the gradient of a
  replicated parameter over the devices itself, in the gradient's dtype
  (bfloat16 for bfloat16 parameters), where the parameter meets the
  batch. Marked varying first, the parameter's gradient stays per device
  and `average_grads` sums it in `reduce_dtype`. Only the data axes that no
  differentiated leaf is sharded over are marked: over an FSDP axis JAX's
  AD sums (it derives the reduce-scatter from the user's `all_gather`),
  and the loss must keep the axes it varies over by itself there, so that
  `check_loss_axes` can tell a model axis from a data axis.

  Returns:
    `(args, per_device)`: `per_device` is shaped like the gradients
    `jax.grad(..., argnums)` returns, with, for each leaf, the axes its
    gradient still has to be summed over (`()` for none).
  """
  nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
  axes = data_axes(axis_name)
  trees = [args[i] for i in nums]
  leaves = jax.tree_util.tree_leaves(trees)
  if _typed(axes):
    sharded = frozenset().union(*map(jax_compat.varying_axes, leaves))
    axes = tuple(a for a in axes if a not in sharded)
  else:
    axes = ()

  new_args = list(args)
  per_device = []
  for i, tree in zip(nums, trees):
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    marked = [bool(axes) and _work_dtype(x, None) is not None for x in leaves]
    new_args[i] = treedef.unflatten([  # type: ignore[attr-defined]  # jaxlib: no stubs.
        jax_compat.make_varying(x, axes) if m else x
        for x, m in zip(leaves, marked)])
    per_device.append(treedef.unflatten([axes if m else () for m in marked]))  # type: ignore[attr-defined]  # jaxlib: no stubs.
  return tuple(new_args), (per_device[0] if isinstance(argnums, int)
                       else tuple(per_device))


def average_grads(grads: PyTree, axis_name: Any, reduce_dtype: Any,
                  per_device: PyTree = None) -> PyTree:
  """The gradients of the loss averaged over the data axes.

  Under `pmap` (and `shard_map` with `check_vma=False`) a `pmean` over the
  data axes in `reduce_dtype`. Inside `shard_map` with `check_vma=True`,
  each gradient is summed over its `per_device` axes (from
  `vary_replicated`) in `reduce_dtype`; JAX has summed it over the others
  already; the sum is divided by the number of devices along the data
  axes, in `reduce_dtype`.
  """
  axes = data_axes(axis_name)
  if not axes:
    return grads
  if not _typed(axes):
    return jax.tree_util.tree_map(
        lambda g: _mean_over(g, axes, reduce_dtype), grads)
  count = int(np.prod([lax.axis_size(a) for a in axes]))

  def average(g, sum_over):
    work = _work_dtype(g, reduce_dtype)
    if work is None:
      return g
    total = g.astype(work)
    if sum_over:
      total = lax.psum(total, sum_over)
    return (total / count).astype(g.dtype)

  if per_device is None:
    per_device = jax.tree_util.tree_map(lambda _: (), grads)
  return jax.tree_util.tree_map(average, grads, per_device)


def agree_finite(finite: jax.Array, axis_name: Any) -> jax.Array:
  """The flag, True on every device only if it is True on all of them.

  Agreed over every bound axis it may differ across, not only the data
  axes: a tensor-parallel shard's overflow skips the step everywhere.
  """
  if not data_axes(axis_name):
    return finite
  return agree_everywhere(finite)


def agree_everywhere(finite: jax.Array) -> jax.Array:
  """`finite` made the same on every device: True only where it is True on
  all devices along the bound axes it may differ across (with varying-axes
  types, the axes it varies over: none for a replicated value, so no
  collective; else every bound axis). Unchanged outside `pmap` and
  `shard_map`."""
  if jax_compat.check_vma_enabled() and jax_compat.manual_axes():
    # Typed: reduce over the axes the flag varies over, plus any non-manual
    # (pmap) axes bound around it.
    axes = (jax_compat.varying_axes(finite)
            | (jax_compat.bound_axis_names() - jax_compat.manual_axes()))
  else:
    axes = jax_compat.bound_axis_names()
  ordered = tuple(sorted(axes, key=str))
  if not ordered:
    return finite
  # pmin over an int: integers reduce exactly; bools are not reducible
  # everywhere.
  return lax.pmin(finite.astype(jnp.int32), ordered).astype(jnp.bool_)


def vary_like(tree: PyTree, fn: Any, *args: Any) -> PyTree:
  """``tree`` with each leaf marked varying over the mesh axes the matching
  output leaf of ``fn(*args)`` varies over (traced, not run).

  Both branches of a `lax.cond` inside `shard_map` must vary over the same
  axes: an identity built from constants is made to vary like the outputs
  of the branch it stands in for.
  """
  if not (jax_compat.check_vma_enabled() and jax_compat.manual_axes()):
    return tree
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  vmas = jax_compat.out_varying_axes(fn, *args)
  return jax.tree_util.tree_unflatten(treedef, [
      jax_compat.make_varying(x, tuple(sorted(v, key=str)))
      for x, v in zip(leaves, vmas)])


# What each sum of the backward pass transposes (JAX's AD writes them).
_SUMMED = {"reduce_scatter": "a reduce-scatter (the transpose of an "
                             "all_gather)",
           "psum_invariant": "a psum (the transpose of the pvary JAX puts "
                             "where a replicated value meets varying ones)",
           "psum": "a psum (the transpose of a psum)"}


def summed_in(grad: Any, reduce_dtype: Any, where: str) -> Any:
  """`grad` (`(loss_scale, *args, **kwargs) -> (grads, loss, aux)`) with
  the sums across devices of its backward pass in `reduce_dtype`.

  It is differentiated inside `collectives.gradient_sums_in`, so amp-ed
  collectives transpose in `reduce_dtype`, and traced to a jaxpr that is
  run here with each narrower backward sum left cast up, summed and cast
  back. One inside a sub-computation (a `jit`, `scan`, ... of the loss
  that amp did not run) cannot be changed: a ValueError says so.
  """
  if reduce_dtype is None:
    return grad
  wide = np.dtype(reduce_dtype)

  def narrower(dtype) -> bool:
    return dtypes.is_float(dtype) and dtype.itemsize < wide.itemsize

  def narrow_sum(eqn, transforms) -> bool:
    return ("transpose" in transforms and eqn.primitive.name in _SUMMED
            and any(narrower(dtypes.aval_dtype(v.aval)) for v in eqn.invars))

  def refuse_nested(closed) -> None:
    nested = jax_compat.hijax.find_nested(closed, narrow_sum)
    if nested is not None:
      eqn, found = nested
      raise ValueError(
          f"{where}: reduce_dtype={wide.name} cannot be honoured for "
          f"{_SUMMED[found.primitive.name]} of "
          f"{dtypes.aval_dtype(found.invars[0].aval).name} gradients that "
          "JAX's differentiation places inside the loss's "
          f"{eqn.primitive.name!r}, which mpolicy.amp did not run. Run the "
          "code holding the collective under mpolicy.amp (its transposes "
          "then sum in reduce_dtype wherever they are) or outside the "
          f"{eqn.primitive.name!r}; or pass reduce_dtype=None (each sum in "
          "the gradient's dtype).")

  def rebind(eqn, invals):
    """Outside the loss's constructs, a narrower backward sum in `wide`."""
    if not narrow_sum(eqn, jax_compat.eqn_transforms(eqn)):
      return None
    outs = jax_compat.bind(eqn.primitive, [
        x.astype(wide) if narrower(dtypes.dtype_of(x)) else x
        for x in invals], eqn.params)
    outs = outs if eqn.primitive.multiple_results else [outs]
    return [o.astype(dtypes.aval_dtype(v.aval))
            for o, v in zip(outs, eqn.outvars)]

  def summed(*args, **kwargs):
    with collectives.gradient_sums_in(wide):
      closed, arrays, finish = jax_compat.hijax.trace_rule(
          lambda a, k: grad(*a, **k), (args, kwargs))
    refuse_nested(closed)
    return finish(jax_compat.hijax.eval_rebinding(closed, arrays, rebind))

  return summed
