"""A float32 master copy of half params, kept in the optimizer state."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mpolicy._src import arguments
from mpolicy._src.training import _trees
from mpolicy._src.training import low_bits as low_bits_lib
from mpolicy._src.training.low_bits import LowBitsMasterState

STORAGES = ("full", "low_bits")

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
    *,
    storage: str = "full",
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

  `storage="low_bits"` keeps the same float32 master in 2 bytes per
  bfloat16 parameter instead of 4: the params are the master's top 16 bits
  (truncated toward zero, not rounded to nearest) and the state
  (`LowBitsMasterState`) keeps the other 16 bits, so `update` rebuilds the
  master exactly from the params it is given. Under the same gradients the
  master follows `storage="full"`'s bit for bit; with bfloat16 Adam moments
  (`with_state_dtypes(optax.adam(...), jnp.bfloat16)`) training holds 8
  bytes per parameter. It needs the params written exactly as the updates
  say (`optax.apply_updates`, `make_train_step(param_rounding="low_bits")`)
  and bfloat16 or float32 params. One case float32 arithmetic cannot write:
  a weight that shrinks by a factor over 2**15 in one step without
  reaching zero is written within float32's spacing at its old size of the
  master, and the master kept is the nearest one to it that 16 bits give.

  Args:
    inner: the optimizer to run on the master; extra args are passed on.
    master_dtype: the dtype of the master copy (float32 for `"low_bits"`).
    storage: `"full"` (a copy of the params in `master_dtype`) or
      `"low_bits"` (16 bits per bfloat16 parameter; see above).

  Returns:
    An `optax.GradientTransformationExtraArgs` with `MasterWeightsState`
    (`LowBitsMasterState` for `"low_bits"`). Its `update` needs `params`
    (their dtypes say what to round to).

  Raises:
    ValueError: at once, if `master_dtype` is not a floating dtype,
      `storage` is neither `"full"` nor `"low_bits"`, or `"low_bits"` is
      asked with a `master_dtype` other than float32; from `update`, if
      `params` is not given; with `"low_bits"`, from `init` or `update`, if
      a param is real floating but neither bfloat16 nor float32.

  >>> import jax.numpy as jnp, optax
  >>> tx = master_weights(optax.sgd(1e-4))
  >>> half, state = init_master_weights(tx, {"w": jnp.ones(2)}, jnp.bfloat16)
  >>> for _ in range(100):
  ...   updates, state = tx.update({"w": -jnp.ones(2, jnp.bfloat16)}, state, half)
  ...   half = optax.apply_updates(half, updates)
  >>> round(float(state.master["w"][0]), 4), float(half["w"][0])
  (1.01, 1.0078125)

  The same master in 16 bits per parameter (the params truncate it):

  >>> tx = master_weights(optax.sgd(1e-4), storage="low_bits")
  >>> half, state = init_master_weights(tx, {"w": jnp.ones(2)}, jnp.bfloat16)
  >>> for _ in range(100):
  ...   updates, state = tx.update({"w": -jnp.ones(2, jnp.bfloat16)}, state, half)
  ...   half = optax.apply_updates(half, updates)
  >>> master = params_from_master(state, {"w": half["w"].astype(jnp.float32)})
  >>> state.low_bits["w"].dtype, round(float(master["w"][0]), 4), float(half["w"][0])
  (dtype('uint16'), 1.01, 1.0078125)

  See also: `init_master_weights`, `params_from_master`, `skip_nonfinite`
  (wrap it around `master_weights` to keep the master on bad steps).
  """
  arguments.require_transformation(inner, "master_weights", "inner")
  inner = optax.with_extra_args_support(inner)
  master_dtype = arguments.require_float_dtype(master_dtype, "master_weights",
                                              "master_dtype")
  if storage not in STORAGES:
    raise ValueError(
        f"master_weights: storage must be one of {STORAGES} ('full': a "
        "float32 copy of the params; 'low_bits': 16 bits per bfloat16 "
        f"parameter), got {storage!r}.")
  if storage == "low_bits":
    if master_dtype != np.dtype(jnp.float32):
      raise ValueError(
          "master_weights: storage='low_bits' keeps the 16 bits a float32 "
          "master has beyond bfloat16, so master_dtype must be float32; got "
          f"{master_dtype.name}. Use storage='full' for another master dtype.")
    return _low_bits_master(inner)

  def init(params):
    master = jax.tree_util.tree_map(_trees.strong, _trees.cast_floating(params, master_dtype))
    return MasterWeightsState(master=master, inner_state=inner.init(master))

  def update(updates, state, params=None, **extra_args):
    _need_params(params)
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


def _need_params(params):
  if params is None:
    raise ValueError(
        "master_weights: update needs `params` (the half-precision params "
        "you compute with) to know which dtype to round the master to; call "
        "`tx.update(grads, state, params)`.")


def _low_bits_master(inner):
  """`master_weights(inner, storage="low_bits")`."""
  who = "master_weights(storage='low_bits')"

  def init(params):
    low = low_bits_lib.init_low_bits(params, who)
    master = jax.tree_util.tree_map(
        _trees.strong, _trees.cast_floating(params, jnp.float32))
    return LowBitsMasterState(low_bits=low, inner_state=inner.init(master))

  def update(updates, state, params=None, **extra_args):
    _need_params(params)
    if not isinstance(state, LowBitsMasterState):
      raise TypeError(
          f"{who}: state is a {type(state).__name__}, not a "
          "LowBitsMasterState; make it with this transformation's init "
          "(or init_master_weights).")
    jax.tree_util.tree_map(lambda p: low_bits_lib.check_leaf(p, who), params)
    master = low_bits_lib.masters(params, state.low_bits)
    grads = _trees.cast_floating(updates, jnp.float32)
    inner_updates, inner_state = inner.update(
        grads, state.inner_state, master, **extra_args)
    new_master = optax.apply_updates(master, inner_updates)

    def written(p, m, u, old_low):
      if not _trees.is_floating(p):
        return u, old_low
      if p.dtype == jnp.float32:
        return u, low_bits_lib.split(m)[1]  # p + u is exactly m.
      return low_bits_lib.written(p, m)

    pairs = jax.tree_util.tree_map(written, params, new_master, inner_updates,
                                   state.low_bits)
    new_updates, new_low = jax.tree_util.tree_transpose(
        jax.tree_util.tree_structure(params),
        jax.tree_util.tree_structure((0, 0)), pairs)
    return new_updates, LowBitsMasterState(low_bits=new_low,
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
    to `param_dtype` (truncated toward zero under
    `master_weights(storage="low_bits")`, rounded to nearest otherwise;
    complex and integer leaves as they are), and `optimizer.init(params)`.

  Raises:
    ValueError: `param_dtype` is not a floating dtype (an integer one would
      truncate every weight), or is not bfloat16 (or float32) for an
      optimizer with `storage="low_bits"`.

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
  opt_state = optimizer.init(params)
  if not _find_states(opt_state, LowBitsMasterState):
    return _trees.cast_floating(params, param_dtype), opt_state
  if param_dtype == np.dtype(jnp.float32):
    return params, opt_state
  if param_dtype != np.dtype(jnp.bfloat16):
    raise ValueError(
        "init_master_weights: master_weights(storage='low_bits') keeps the "
        "params as the master's top 16 bits, bfloat16; param_dtype "
        f"{param_dtype.name} is not. Pass jnp.bfloat16, or use "
        "storage='full'.")
  truncate = lambda x: (low_bits_lib.split(x)[0] if _trees.is_floating(x)
                        else x)
  return jax.tree_util.tree_map(truncate, params), opt_state


def _find_states(opt_state, kind):
  return [s for s in jax.tree_util.tree_leaves(
      opt_state, is_leaf=lambda x: isinstance(x, kind)) if isinstance(s, kind)]


def params_from_master(opt_state: PyTree, params: PyTree) -> PyTree:
  """The master copy in `opt_state`, rounded to the dtypes of `params`.

  Exact, always: use it after a restore, or instead of
  `optax.apply_updates`.

  A `storage="low_bits"` state holds only the master's low 16 bits: its
  top bits are the current bfloat16 params, so pass them as `params`, cast
  to float32, to get the float32 master (`params` in bfloat16 give the
  master truncated, i.e. themselves).

  Args:
    opt_state: a state holding exactly one `MasterWeightsState` or
      `LowBitsMasterState` anywhere inside (also under `skip_nonfinite` or
      `optax.chain`).
    params: params whose real floating leaves give the dtypes to round
      to; other leaves (complex, integer) come back as the master holds them
      (for `"low_bits"`, as `params` hold them).

  Returns:
    The rounded master, shaped like `params`.

  Raises:
    ValueError: `opt_state` holds no master state, or several.

  >>> import jax.numpy as jnp, optax
  >>> import mpolicy
  >>> tx = mpolicy.skip_nonfinite(master_weights(optax.sgd(0.1)))
  >>> state = tx.init({"w": jnp.full(2, 1.001)})
  >>> params_from_master(state, {"w": jnp.ones(2, jnp.bfloat16)})["w"].tolist()
  [1.0, 1.0]

  See also: `master_weights`.
  """
  found = _find_states(opt_state, (MasterWeightsState, LowBitsMasterState))
  if len(found) != 1:
    raise ValueError(
        "params_from_master: expected exactly one MasterWeightsState or "
        f"LowBitsMasterState in opt_state, found {len(found)}.")
  if isinstance(found[0], LowBitsMasterState):
    master = low_bits_lib.masters(params, found[0].low_bits)
    return jax.tree_util.tree_map(
        lambda m, p: (low_bits_lib.split(m)[0] if _trees.is_floating(p)
                      and p.dtype != jnp.float32 else m), master, params)
  return jax.tree_util.tree_map(
      lambda m, p: m.astype(p.dtype) if _trees.is_floating(p) else m,
      found[0].master, params)

