"""Optimizer state stored in chosen dtypes, computed in float32.

`with_state_dtypes` wraps any optax transformation. At `init` it casts the
floating leaves of the state that are laid out like the params (Adam's `mu`
and `nu`, a momentum's `trace`) to the dtypes asked for; counts,
hyperparameters and other state keep theirs. Each `update` reads the state
(and the gradients and params) as float32, runs the wrapped update, and
writes each leaf back in the dtype it was stored in, rounding to nearest or
stochastically.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Optional
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mpolicy._src import arguments
from mpolicy._src import dtypes as dtypes_lib
from mpolicy._src.training import _trees
from mpolicy._src.training import attribution
from mpolicy._src.training import stochastic_rounding

DtypeChoice = Callable[[str, str], Optional[Any]]
_ROUNDINGS = ("nearest", "stochastic")


class StateDtypesState(NamedTuple):
  """State of `with_state_dtypes`.

  Attributes:
    inner_state: the wrapped transformation's state, in the stored dtypes.
    count: int32, the number of updates so far; with stochastic rounding,
      each update's random bits come from it.
  """
  inner_state: Any
  count: jax.Array  # type: ignore[assignment]  # optax's name; hides tuple.count.


def _floating_dtype(dtype: Any, where: str) -> np.dtype:
  try:
    dtype = np.dtype(dtype)
  except TypeError as e:
    raise TypeError(f"with_state_dtypes: {where} must be a floating dtype "
                    f"such as jnp.bfloat16 or 'float32', got {dtype!r}.") from e
  if not dtypes_lib.is_float(dtype):  # A dtype, of the wrong kind.
    raise ValueError(f"with_state_dtypes: {where} must be a floating dtype "
                     f"such as jnp.bfloat16 or 'float32', got {dtype}.")
  return dtype


def _choice(dtypes: Any) -> tuple[DtypeChoice, frozenset[str]]:
  """`(choose(field, param_path) -> dtype or None, field names required)`."""
  if dtypes is None:  # np.dtype(None) is float64: not what None means.
    raise TypeError(
        "with_state_dtypes: dtypes must be a dtype (for all floating state), "
        "a mapping from state field name to dtype (e.g. {'mu': jnp.bfloat16})"
        " or a function (field, param_path) -> dtype or None; got None. To "
        "keep every dtype, do not wrap the transformation.")
  if isinstance(dtypes, Mapping):
    table = {str(k): _floating_dtype(v, f"dtypes[{k!r}]")
             for k, v in dtypes.items()}
    return (lambda field, path: table.get(field)), frozenset(table)
  try:
    single = np.dtype(dtypes)
  except TypeError:
    single = None
  if single is not None:
    single = _floating_dtype(single, "dtypes")
    return (lambda field, path: single), frozenset()
  if callable(dtypes):
    def choose(field, path):
      got = dtypes(field, path)
      return None if got is None else _floating_dtype(
          got, f"dtypes({field!r}, {path!r})")
    return choose, frozenset()
  raise TypeError(
      "with_state_dtypes: dtypes must be a dtype (for all floating state), a "
      "mapping from state field name to dtype (e.g. {'mu': jnp.bfloat16}), or "
      f"a function (field, param_path) -> dtype or None; got {dtypes!r}.")


def _check_seed(seed: Any, rounding: str) -> int:
  """The seed as an int; warns if rounding to nearest would ignore it."""
  if seed is None:
    return 0
  if isinstance(seed, (bool, np.bool_)) or not isinstance(
      seed, (int, np.integer)):
    raise TypeError("with_state_dtypes: seed must be an int (the seed of the "
                    f"stochastic rounding's keys), got {seed!r}.")
  if rounding == "nearest":
    warnings.warn(
        f"with_state_dtypes: seed={seed} has no effect with "
        'rounding="nearest", which draws no random bits. Pass '
        'rounding="stochastic" to round with keys from this seed, or leave '
        "seed out.", stacklevel=3)
  return int(seed)


def _field_name(path) -> str:
  """The last attribute name on a state path: 'mu' for `ScaleByAdamState.mu`."""
  names = [k.name for k in path if isinstance(k, jax.tree_util.GetAttrKey)]
  return names[-1] if names else ""


def _cast_state(state: Any, params: Any, choose: DtypeChoice,
                required: frozenset[str]) -> Any:
  """Casts the floating leaves of the param-shaped subtrees of `state`."""
  param_def = jax.tree_util.tree_structure(params)
  param_shapes = [np.shape(p) for p in jax.tree_util.tree_leaves(params)]

  def param_like(x):
    leaves, treedef = jax.tree_util.tree_flatten(x)
    return (treedef == param_def
            and [np.shape(l) for l in leaves] == param_shapes)

  seen = set()

  def cast_field(path, sub):
    if not param_like(sub):
      return sub
    field = _field_name(path)
    seen.add(field)

    def cast(param_path, leaf):
      dtype = choose(field, attribution.path_str(param_path))
      if dtype is None or not dtypes_lib.is_float(dtypes_lib.dtype_of(leaf)):
        return leaf
      return jnp.asarray(leaf).astype(dtype)
    return jax.tree_util.tree_map_with_path(cast, sub)

  state = jax.tree_util.tree_map_with_path(cast_field, state,
                                           is_leaf=param_like)
  missing = required - seen
  if missing:
    raise ValueError(
        f"with_state_dtypes: no state field named {sorted(missing)}; the "
        f"wrapped transformation's per-parameter state fields are "
        f"{sorted(seen)}.")
  return state


def _wide(x: Any) -> Any:
  """Floating leaves narrower than float32 read as float32."""
  if x is None or not dtypes_lib.is_float(dtypes_lib.dtype_of(x)):
    return x
  x = jnp.asarray(x)
  return x.astype(jnp.float32) if x.dtype.itemsize < 4 else x


def _write_nearest(new: Any, old: Any) -> Any:
  return _trees.cast_like(new, old)


def with_state_dtypes(
    transform: optax.GradientTransformation,
    dtypes: Any,
    *,
    rounding: str = "nearest",
    seed: Optional[int] = None,
    vary_over: Any = None,
) -> optax.GradientTransformationExtraArgs:
  """Stores `transform`'s floating state in chosen dtypes, computes in float32.

  The state that is laid out like the params (Adam's `mu` and `nu`, Lion's
  `mu`, a momentum's `trace`, in chains and under
  `optax.inject_hyperparams` too) is cast at `init` to the dtypes chosen;
  counts, hyperparameters and anything else keep their dtypes. Each
  `update` reads the state, the gradients and the params in float32, runs
  `transform.update`, and writes every state leaf back in the dtype it is
  stored in, so dtypes never change from step to step and a jitted step
  compiles once. Updates come out in float32 where they were computed so;
  `optax.apply_updates` casts them to each param's dtype, or use
  `stochastic_params` to round half params stochastically.

  Which dtype: Adam's `mu` fits bfloat16 well (12 -> 10 bytes per
  parameter with float32 params); `nu`, a running mean of squares, is
  safer in float32 unless writes are stochastic (`rounding="stochastic"`):
  with round-to-nearest, a bfloat16 running average stops moving once each
  step's change is below half its spacing.

  Args:
    transform: any optax transformation (extra args are passed on).
    dtypes: one floating dtype for all per-parameter floating state; or a
      mapping from state field name (`"mu"`, `"nu"`, `"trace"`, ...) to a
      dtype, where fields not named keep their dtype; or a function
      `(field, param_path) -> dtype or None` (`param_path` as
      `"linear/w"`; None keeps the dtype), to choose per parameter.
    rounding: how to write a float32 result into a half-precision leaf:
      `"nearest"`, or `"stochastic"` (`stochastic_round`, with keys drawn
      from `seed` and the update counter kept in the state, so a resumed run
      draws the same bits).
    seed: the seed of the stochastic rounding's keys (0 if None); with
      `rounding="nearest"` nothing is random, and a seed warns.
    vary_over: with `rounding="stochastic"` under `shard_map` with
      `check_vma=False` (or `pmap`), the mesh axes the state is sharded
      over (see `stochastic_round`). With `check_vma=True` sharded state
      rounds independently per device and replicated state identically
      without it.

  Returns:
    An `optax.GradientTransformationExtraArgs` with `StateDtypesState`.

  Raises:
    ValueError: `rounding` is not one of "nearest", "stochastic"; or
      `vary_over` is given with `rounding="nearest"`; or a dtype in
      `dtypes` is not floating (an integer or bool dtype); or (from `init`)
      a field named in `dtypes` is not in the state.
    TypeError: `transform` is not an optax transformation; `dtypes` is not
      a dtype, a mapping or a function; `seed` is not an int; or
      `vary_over` is not an axis name or a tuple of them.

  >>> import jax.numpy as jnp, optax
  >>> tx = with_state_dtypes(optax.adam(1e-3), {"mu": jnp.bfloat16})
  >>> state = tx.init({"w": jnp.ones(3)})
  >>> updates, state = tx.update({"w": jnp.ones(3)}, state)
  >>> state.inner_state[0].mu["w"].dtype, state.inner_state[0].nu["w"].dtype
  (dtype(bfloat16), dtype('float32'))

  See also: `stochastic_round`, `stochastic_params`, `master_weights`.
  """
  arguments.require_transformation(transform, "with_state_dtypes")
  if rounding not in _ROUNDINGS:
    raise ValueError(f"with_state_dtypes: rounding must be one of "
                     f"{_ROUNDINGS}, got {rounding!r}.")
  stochastic_rounding.check_vary_over(vary_over, "with_state_dtypes")
  if vary_over is not None and rounding != "stochastic":
    raise ValueError(
        f"with_state_dtypes: vary_over={vary_over!r} applies to stochastic "
        f"rounding only, but rounding={rounding!r}; pass "
        "rounding='stochastic', or drop vary_over.")
  seed = _check_seed(seed, rounding)
  choose, required = _choice(dtypes)
  inner = optax.with_extra_args_support(transform)

  def init(params):
    state = _cast_state(inner.init(params), params, choose, required)
    state = jax.tree_util.tree_map(_trees.strong, state)
    return StateDtypesState(state, jnp.zeros([], jnp.int32))

  def write(new_state, old_state, count):
    if rounding == "nearest":
      return jax.tree_util.tree_map(_write_nearest, new_state, old_state)
    new_leaves, treedef = jax.tree_util.tree_flatten(new_state)
    old_leaves = treedef.flatten_up_to(old_state)
    keys = stochastic_rounding.leaf_keys(seed, count, len(new_leaves))
    out = []
    for new, old, key in zip(new_leaves, old_leaves, keys):
      if dtypes_lib.dtype_of(old) in stochastic_rounding.TARGETS:
        out.append(stochastic_rounding.stochastic_round(
            jnp.asarray(new).astype(jnp.float32), old.dtype, key,
            vary_over=vary_over))
      else:
        out.append(_write_nearest(new, old))
    return treedef.unflatten(out)

  def update(updates, state, params=None, **extra_args):
    wide = lambda tree: jax.tree_util.tree_map(_wide, tree)
    new_updates, new_inner = inner.update(
        wide(updates), wide(state.inner_state), wide(params), **extra_args)
    new_inner = write(new_inner, state.inner_state, state.count)
    return new_updates, StateDtypesState(
        new_inner, optax.safe_int32_increment(state.count))

  return optax.GradientTransformationExtraArgs(init, update)
