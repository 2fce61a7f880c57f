"""Specification of with_state_dtypes: stored in chosen dtypes, computed in f32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpolicy

BF16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float32)


def _params():
  return {"linear": {"w": jnp.linspace(-1, 1, 12).reshape(3, 4),
                     "b": jnp.zeros(4)}}


def _grads(i):
  k = jax.random.PRNGKey(i)
  return {"linear": {"w": jax.random.normal(k, (3, 4)),
                     "b": jax.random.normal(jax.random.fold_in(k, 1), (4,))}}


def _dtypes_by_path(tree):
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {jax.tree_util.keystr(p): np.dtype(jnp.asarray(x).dtype)
          for p, x in flat}


def _field(state, field):
  """The dtypes of every leaf under attribute `field`."""
  return {d for k, d in _dtypes_by_path(state).items() if f".{field}" in k}


def _run(tx, steps=30, params=None):
  params = _params() if params is None else params
  state = tx.init(params)
  step = jax.jit(lambda p, s, g: tx.update(g, s, p))
  for i in range(steps):
    updates, state = step(params, state, _grads(i))
    params = optax.apply_updates(params, updates)
  return params, state


def test_adam_mu_in_bfloat16_nu_in_float32_count_unchanged():
  tx = mpolicy.with_state_dtypes(optax.adam(1e-2), {"mu": jnp.bfloat16})
  _, state = _run(tx, steps=3)
  assert _field(state, "mu") == {BF16}
  assert _field(state, "nu") == {F32}
  assert _field(state, "count") == {np.dtype(jnp.int32)}


@pytest.mark.parametrize("name,make,fields", [
    ("adam", lambda: optax.adam(1e-2), ["mu", "nu"]),
    ("adamw", lambda: optax.adamw(1e-2, weight_decay=0.1), ["mu", "nu"]),
    ("lion", lambda: optax.lion(1e-3), ["mu"]),
    ("sgd momentum", lambda: optax.sgd(1e-2, momentum=0.9), ["trace"]),
    ("chain", lambda: optax.chain(optax.clip_by_global_norm(1.0),
                                  optax.adam(1e-2)), ["mu", "nu"]),
])
def test_one_dtype_stores_every_per_parameter_field(name, make, fields):
  tx = mpolicy.with_state_dtypes(make(), jnp.bfloat16)
  _, state = _run(tx, steps=3)
  for field in fields:
    assert _field(state, field) == {BF16}, (name, field)
  # Nothing outside the per-parameter fields changed dtype.
  reference = _dtypes_by_path(make().init(_params()))
  for key, dtype in _dtypes_by_path(state.inner_state).items():
    if not any(f".{f}" in key for f in fields):
      assert dtype == reference[key.replace(".inner_state", "", 1)], key


def test_inject_hyperparams_keeps_its_hyperparameters_in_float32():
  inner = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)
  tx = mpolicy.with_state_dtypes(inner, jnp.bfloat16)
  params, state = _run(tx, steps=3)
  assert state.inner_state.hyperparams["learning_rate"].dtype == F32
  assert _field(state, "mu") == {BF16} and _field(state, "nu") == {BF16}
  assert params["linear"]["w"].dtype == F32


def test_a_function_chooses_by_field_and_parameter_path():
  choose = lambda field, path: (jnp.bfloat16 if path.endswith("/w") else None)
  tx = mpolicy.with_state_dtypes(optax.adam(1e-2), choose)
  _, state = _run(tx, steps=2)
  adam = state.inner_state[0]
  assert adam.mu["linear"]["w"].dtype == BF16
  assert adam.nu["linear"]["w"].dtype == BF16
  assert adam.mu["linear"]["b"].dtype == F32


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_jitted_step_compiles_once_and_dtypes_never_drift(rounding):
  traces = []
  tx = mpolicy.with_state_dtypes(optax.adam(1e-2), jnp.bfloat16,
                                 rounding=rounding)
  # bfloat16 params and gradients: the mixed case that promotes.
  params = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), _params())
  state = tx.init(params)
  before = _dtypes_by_path(state)

  @jax.jit
  def step(params, state, grads):
    traces.append(1)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  for i in range(5):
    grads = jax.tree_util.tree_map(lambda g: g.astype(jnp.bfloat16), _grads(i))
    params, state = step(params, state, grads)
    assert _dtypes_by_path(state) == before
  assert len(traces) == 1
  assert int(state.count) == 5


@pytest.mark.parametrize("dtypes,rounding,rtol", [
    ({"mu": jnp.bfloat16}, "nearest", 0.02),
    (jnp.bfloat16, "stochastic", 0.05),
])
def test_trains_close_to_float32_adam(dtypes, rounding, rtol):
  reference, _ = _run(optax.adam(1e-2), steps=50)
  params, _ = _run(mpolicy.with_state_dtypes(
      optax.adam(1e-2), dtypes, rounding=rounding), steps=50)
  for got, want in zip(jax.tree_util.tree_leaves(params),
                       jax.tree_util.tree_leaves(reference)):
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * 0.1)


def test_stochastic_writes_keep_a_small_moment_moving_where_nearest_stalls():
  # nu's running mean of a constant g**2 = 1 from 1: each step's change is
  # 1e-3 * (1.5**2 - 1), far below half a bfloat16 spacing at 1.
  inner = optax.scale_by_adam(b2=0.999)
  grads = {"w": jnp.full(10_000, 1.5)}
  finals = {}
  for rounding in ("nearest", "stochastic"):
    tx = mpolicy.with_state_dtypes(inner, {"nu": jnp.bfloat16},
                                   rounding=rounding)
    state = tx.init({"w": jnp.zeros(10_000)})
    state = state._replace(inner_state=state.inner_state._replace(
        nu={"w": jnp.ones(10_000, jnp.bfloat16)}))
    update = jax.jit(lambda s: tx.update(grads, s)[1])
    for _ in range(100):
      state = update(state)
    finals[rounding] = float(state.inner_state.nu["w"].astype(F32).mean())
  exact = 1.5**2 - (1.5**2 - 1) * 0.999**100
  assert finals["nearest"] == 1.0  # Stalled.
  assert finals["stochastic"] == pytest.approx(exact, rel=2e-3)


def test_resumed_run_draws_the_same_bits_through_a_numpy_round_trip():
  tx = mpolicy.with_state_dtypes(optax.adam(1e-2), jnp.bfloat16,
                                 rounding="stochastic")
  params = _params()
  state = tx.init(params)
  step = jax.jit(lambda p, s, g: tx.update(g, s, p))
  trajectory = []
  for i in range(6):
    if i == 3:  # Save and restore, as a checkpoint would: numpy leaves.
      leaves, treedef = jax.tree_util.tree_flatten(state)
      saved = [np.array(x) for x in leaves]
      saved_params = jax.tree_util.tree_map(np.array, params)
    updates, state = step(params, state, _grads(i))
    params = optax.apply_updates(params, updates)
    trajectory.append(state)
  restored = jax.tree_util.tree_unflatten(
      treedef, [jnp.asarray(x) for x in saved])
  assert _dtypes_by_path(restored) == _dtypes_by_path(trajectory[2])
  params = jax.tree_util.tree_map(jnp.asarray, saved_params)
  for i in range(3, 6):
    updates, restored = step(params, restored, _grads(i))
    params = optax.apply_updates(params, updates)
    for a, b in zip(jax.tree_util.tree_leaves(restored),
                    jax.tree_util.tree_leaves(trajectory[i])):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_unknown_field_lists_the_fields_there_are():
  tx = mpolicy.with_state_dtypes(optax.adam(1e-2), {"momentum": jnp.bfloat16})
  with pytest.raises(ValueError, match=r"\['momentum'\].*\['mu', 'nu'\]"):
    tx.init(_params())


@pytest.mark.parametrize("dtypes,error,message", [
    # A dtype of the wrong kind is a ValueError, as everywhere a floating
    # dtype is asked for; what is no dtype at all is a TypeError.
    (jnp.int8, ValueError, "floating dtype such as .* got int8"),
    ({"mu": "int32"}, ValueError, r"dtypes\['mu'\] must be a floating dtype"),
    ({"mu": "nonsense"}, TypeError, r"dtypes\['mu'\] must be a floating"),
    (3.5, TypeError, "a dtype .*, a mapping .*, or a function"),
])
def test_bad_dtypes_say_what_is_accepted(dtypes, error, message):
  with pytest.raises(error, match=message):
    mpolicy.with_state_dtypes(optax.adam(1e-2), dtypes)


def test_bad_rounding_lists_the_choices():
  with pytest.raises(ValueError, match=r"\('nearest', 'stochastic'\), got 'sr'"):
    mpolicy.with_state_dtypes(optax.adam(1e-2), jnp.bfloat16, rounding="sr")
