"""Half-precision params updated with stochastic rounding, no float32 copy.

`master_weights` keeps a float32 copy of the params in the optimizer state
(4 more bytes per parameter) so that small updates are not lost in
bfloat16. Stochastic rounding reaches the same end without the copy: each
write `round(p + u)` is unbiased, so updates far below a bfloat16 weight's
spacing still move it in expectation. With Adam's moments in bfloat16 too
(`with_state_dtypes(..., rounding="stochastic")`), that is 6 bytes per
parameter instead of 14 (or 12 for float32 params and Adam).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from mpolicy._src import arguments
from mpolicy._src import dtypes as dtypes_lib
from mpolicy._src.training import master_weights
from mpolicy._src.training import stochastic_rounding

PyTree = Any
_PARAM_STREAM = 0x5EED  # Keeps these keys apart from the state's (same seed).


def _rounds(p: Any) -> bool:
  return (p is not None
          and dtypes_lib.dtype_of(p) in stochastic_rounding.TARGETS)


def apply_updates_stochastic(params: PyTree, updates: PyTree,
                             key: jax.Array, *,
                             vary_over: Any = None) -> PyTree:
  """`params + updates`, rounded stochastically to each param's dtype.

  bfloat16 and float16 leaves are summed in float32 and written with
  `stochastic_round` (a key per leaf, folded from `key`); other leaves are
  `optax.apply_updates`'s `p + u` in their own dtype. Inside `shard_map`,
  sharded (FSDP) params round independently on each device and replicated
  ones identically (see `stochastic_round`; `vary_over` names the sharded
  axes where `check_vma=False`).

  Args:
    params: the params.
    updates: updates shaped like `params` (None leaves leave a param as is).
    key: a JAX PRNG key; use a new one each step.
    vary_over: passed to `stochastic_round` for every half leaf.

  Returns:
    The new params, each leaf in its old dtype.

  >>> import jax, jax.numpy as jnp
  >>> params = {"w": jnp.ones(10_000, jnp.bfloat16)}
  >>> updates = {"w": jnp.full(10_000, 1e-3)}  # An eighth of a bfloat16 step.
  >>> new = apply_updates_stochastic(params, updates, jax.random.PRNGKey(0))
  >>> round(float(new["w"].astype(jnp.float32).mean()), 3)
  1.001

  See also: `stochastic_params`, `stochastic_round`.
  """
  leaves, treedef = jax.tree_util.tree_flatten(params)
  update_leaves = treedef.flatten_up_to(updates)  # type: ignore[attr-defined]  # jaxlib: no stubs.
  out = []
  for i, (p, u) in enumerate(zip(leaves, update_leaves)):
    if u is None:
      out.append(p)
    elif _rounds(p):
      exact = jnp.asarray(p).astype(jnp.float32) + jnp.asarray(u).astype(
          jnp.float32)
      out.append(stochastic_rounding.stochastic_round(
          exact, p.dtype, jax.random.fold_in(key, i), vary_over=vary_over))
    else:
      out.append(jnp.asarray(p + u).astype(dtypes_lib.dtype_of(p)))
  return treedef.unflatten(out)  # type: ignore[attr-defined]  # jaxlib: no stubs.



class StochasticParamsState(NamedTuple):
  """State of `stochastic_params`.

  Attributes:
    inner_state: the wrapped optimizer's state.
    count: int32, the number of updates so far; each update's random bits
      come from it.
  """
  inner_state: Any
  count: jax.Array  # type: ignore[assignment]  # optax's name; hides tuple.count.


def stochastic_params(
    inner: optax.GradientTransformation,
    seed: int = 0,
    *,
    vary_over: Any = None,
) -> optax.GradientTransformationExtraArgs:
  """Makes `optax.apply_updates` round half params stochastically.

  Runs `inner`, then turns its update `u` of each bfloat16 or float16 param
  `p` into `stochastic_round(p + u) - p` (computed in float32), so that
  `optax.apply_updates(params, updates)` writes the stochastically rounded
  sum: small updates move half params in expectation instead of being lost
  to round-to-nearest. Keys come from `seed` and a counter in the state (a
  resumed run draws the same bits). Float32 params get `inner`'s updates
  unchanged.

  The difference of two half values is exact in float32 unless a weight
  shrinks by a factor over 2**13 in one step without reaching zero; then
  `apply_updates` rounds that weight to nearest instead.
  `apply_updates_stochastic` is exact always.

  With `with_state_dtypes(adam, jnp.bfloat16, rounding="stochastic")` as
  `inner` and bfloat16 params, this is Adam in 6 bytes per parameter.
  `master_weights` (14 bytes: half params, a float32 copy and float32
  moments) stays the safe choice when memory allows; this one fits when
  the optimizer state is what does not fit.

  Across devices (inside `shard_map` with `check_vma=True`) FSDP-sharded
  params round independently on each device and replicated params
  identically, so replicas never drift apart; with `check_vma=False`
  name the axes sharded params are split over with `vary_over` (then
  every half param rounds per device: keep replicated half params out of
  such a step, or use `check_vma=True`).

  Args:
    inner: the optimizer (extra args are passed on).
    seed: the seed of the rounding's keys.
    vary_over: the mesh axes the params are sharded over, for
      `stochastic_round` under `check_vma=False` or `pmap`.

  Returns:
    An `optax.GradientTransformationExtraArgs` with `StochasticParamsState`.
    Its `update` needs `params`.

  Raises:
    TypeError: `vary_over` is not an axis name or a tuple of them; from
      `update`, if the state was not made by this `init`.
    ValueError: from `update`, if `params` is not given.

  >>> import jax.numpy as jnp, optax
  >>> tx = stochastic_params(optax.sgd(1e-3))
  >>> params = {"w": jnp.ones(10_000, jnp.bfloat16)}
  >>> state = tx.init(params)
  >>> for _ in range(10):
  ...   updates, state = tx.update({"w": -jnp.ones(10_000)}, state, params)
  ...   params = optax.apply_updates(params, updates)
  >>> round(float(params["w"].astype(jnp.float32).mean()), 2)  # 1 + 10 * 1e-3
  1.01

  See also: `apply_updates_stochastic`, `with_state_dtypes`,
  `master_weights`.
  """
  arguments.require_transformation(inner, "stochastic_params", "inner")
  inner = optax.with_extra_args_support(inner)
  stochastic_rounding.check_vary_over(vary_over, "stochastic_params")

  def init(params):
    return StochasticParamsState(inner.init(params), jnp.zeros([], jnp.int32))

  def update(updates, state, params=None, **extra_args):
    if params is None:
      raise ValueError(
          "stochastic_params: update needs `params` (the half-precision "
          "params the updates are added to); call "
          "`tx.update(grads, state, params)`.")
    if not isinstance(state, StochasticParamsState):
      raise TypeError(
          f"stochastic_params: state is a {type(state).__name__}, not a "
          "StochasticParamsState; make it with this transformation's init, "
          "`stochastic_params(optimizer).init(params)` (so too for "
          "make_train_step(param_rounding='stochastic')).")
    inner_updates, inner_state = inner.update(
        updates, state.inner_state, params, **extra_args)
    key = jax.random.fold_in(
        stochastic_rounding.leaf_keys(seed, state.count, 1)[0], _PARAM_STREAM)
    new_params = apply_updates_stochastic(params, inner_updates, key,
                                          vary_over=vary_over)

    def param_update(p, new, u):
      if u is None or not _rounds(p):
        return u
      return new.astype(jnp.float32) - p.astype(jnp.float32)

    new_updates = jax.tree_util.tree_map(
        param_update, params, new_params, inner_updates)
    return new_updates, StochasticParamsState(
        inner_state, optax.safe_int32_increment(state.count))

  return optax.GradientTransformationExtraArgs(init, update)


def for_param_rounding(optimizer: optax.GradientTransformation,
                       param_rounding: str) -> optax.GradientTransformation:
  """The optimizer a train step runs for `param_rounding`."""
  if param_rounding == "nearest":
    return optimizer
  if param_rounding == "stochastic":
    return stochastic_params(optimizer)
  if param_rounding == "low_bits":
    return master_weights.master_weights(optimizer, storage="low_bits")
  raise ValueError("param_rounding must be 'nearest', 'stochastic' or "
                   f"'low_bits', got {param_rounding!r}.")
