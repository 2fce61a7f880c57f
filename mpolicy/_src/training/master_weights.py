"""A float32 master copy of half params, kept in the optimizer state."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from mpolicy._src import arguments
from mpolicy._src.training import _trees

PyTree = Any


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
  in `master_dtype` get `inner`'s updates unchanged, and so do leaves that
  are not real floating point: a complex parameter is its own master (kept
  in its dtype, never cast to `master_dtype` or to a half dtype).

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
    ValueError: at once, if `master_dtype` is not a floating dtype; from
      `update`, if `params` is not given.

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
  arguments.require_transformation(inner, "master_weights", "inner")
  inner = optax.with_extra_args_support(inner)
  master_dtype = arguments.require_float_dtype(master_dtype, "master_weights",
                                              "master_dtype")

  def init(params):
    master = jax.tree_util.tree_map(_trees.strong, _trees.cast_floating(params, master_dtype))
    return MasterWeightsState(master=master, inner_state=inner.init(master))

  def update(updates, state, params=None, **extra_args):
    if params is None:
      raise ValueError(
          "master_weights: update needs `params` (the half-precision params "
          "you compute with) to know which dtype to round the master to; call "
          "`tx.update(grads, state, params)`.")
    grads = _trees.cast_floating(updates, master_dtype)
    inner_updates, inner_state = inner.update(
        grads, state.inner_state, state.master, **extra_args)
    master = optax.apply_updates(state.master, inner_updates)

    def param_update(p, m, u):
      if not _trees.is_floating(p):
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
    `(half_params, opt_state)`: the real floating leaves of `params` cast
    to `param_dtype` (complex and integer leaves as they are), and
    `optimizer.init(params)`.

  Raises:
    ValueError: `param_dtype` is not a floating dtype (an integer one would
      truncate every weight).

  >>> import jax.numpy as jnp, optax
  >>> tx = master_weights(optax.adam(1e-3))
  >>> half, state = init_master_weights(tx, {"w": jnp.ones(2)}, jnp.bfloat16)
  >>> half["w"].dtype, state.master["w"].dtype
  (dtype(bfloat16), dtype('float32'))

  See also: `master_weights`, `params_from_master`.
  """
  param_dtype = arguments.require_float_dtype(param_dtype,
                                             "init_master_weights",
                                             "param_dtype")
  return _trees.cast_floating(params, param_dtype), optimizer.init(params)


def params_from_master(opt_state: PyTree, params: PyTree) -> PyTree:
  """The master copy in `opt_state`, rounded to the dtypes of `params`.

  Exact, always: use it after a restore, or instead of
  `optax.apply_updates`.

  Args:
    opt_state: a state holding exactly one `MasterWeightsState` anywhere
      inside (also under `skip_nonfinite` or `optax.chain`).
    params: params whose real floating leaves give the dtypes to round
      to; other leaves (complex, integer) come back as the master holds them.

  Returns:
    The rounded master, shaped like `params`.

  Raises:
    ValueError: `opt_state` holds no `MasterWeightsState`, or several.

  >>> import jax.numpy as jnp, optax
  >>> import mpolicy
  >>> tx = mpolicy.skip_nonfinite(master_weights(optax.sgd(0.1)))
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
      lambda m, p: m.astype(p.dtype) if _trees.is_floating(p) else m,
      found[0].master, params)

