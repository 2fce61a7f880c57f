"""make_train_step(microbatches=k): gradient accumulation on one device."""

from __future__ import annotations

import functools
import warnings

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpolicy
from mpolicy._src.training.accumulation_check import ulp_distance

from _training_mlp import BF16, clean, data, F32, init_mlp, mlp_loss
from _helpers import poison, same_bits

DynamicLossScale = mpolicy.DynamicLossScale
SGD_MOMENTUM = optax.sgd(0.1, momentum=0.9)  # Its state after one step: grads.
# Sums in another order: float32 results a few ulps (of each leaf's largest
# element) apart. Measured: at most 5 on jax 0.10.2 and 0.12.
FEW_ULPS = 8


def _run(loss_fn, k, *args, tx=SGD_MOMENTUM, params=None, ls=None, **options):
  params = init_mlp() if params is None else params
  step = jax.jit(mpolicy.make_train_step(loss_fn, tx, microbatches=k,
                                         **options))
  ls = DynamicLossScale(2. ** 15) if ls is None else ls
  return step(params, tx.init(params), ls, *args)


def _max_ulps(a, b):
  return max(ulp_distance(x, y) for x, y in zip(
      jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


def _f32_loss(p, x, y, factors):
  return mlp_loss(p, x, y, factors, F32)


def _rows(n, bad_row=None, value=jnp.inf):
  """Per-row gradient factors: 1, and `value` at `bad_row`."""
  f = np.ones((n, 1), np.float32)
  if bad_row is not None:
    f[bad_row] = value
  return jnp.asarray(f)


def _row_poisoned_loss(p, x, y, rows):
  """The float32 MLP loss; `rows` multiplies each row's gradient of w1."""
  h = jnp.tanh(poison(x @ p["w1"], rows) + p["b1"])
  return jnp.mean((h @ p["w2"] + p["b2"] - y) ** 2)


# --- Equal to one batch ---------------------------------------------------------


@pytest.mark.parametrize("k", [2, 8])
def test_k_microbatches_give_the_one_batch_step_in_float32(k):
  x, y = data(n=64)
  one = _run(_f32_loss, 1, x, y, clean())
  acc = _run(_f32_loss, k, x, y, clean())
  assert bool(acc.grads_finite)
  # The momentum trace holds the gradients: a few ulps from the one batch's.
  assert _max_ulps(acc.opt_state, one.opt_state) <= FEW_ULPS
  assert _max_ulps(acc.params, one.params) <= FEW_ULPS
  assert ulp_distance(acc.value, one.value) <= FEW_ULPS  # The mean loss.
  assert acc.value.dtype == one.value.dtype == jnp.float32


@pytest.mark.slow
def test_bf16_compute_stays_within_its_rounding():
  x, y = data(n=64)
  exact = _run(_f32_loss, 1, x, y, clean()).opt_state[0].trace
  bf16 = lambda p, x, y: mlp_loss(p, x, y, clean(), BF16)
  for k in (1, 8):
    grads = _run(bf16, k, x, y).opt_state[0].trace
    for name in exact:
      scale = float(jnp.abs(exact[name]).max())
      err = float(jnp.abs(grads[name] - exact[name]).max())
      assert err <= 2. ** -6 * scale, (k, name, err, scale)


def test_half_gradients_accumulate_in_float32():
  # Eight one-row microbatches: a gradient of 1, then seven of 2 ** -9, each
  # below half a bfloat16 ulp of 1. Summed in bfloat16 they vanish.
  w = {"w": jnp.zeros(1, jnp.bfloat16)}
  rows = jnp.asarray([1.] + [2. ** -9] * 7, jnp.bfloat16)[:, None]
  loss = lambda p, x: jnp.mean(x * p["w"]).astype(jnp.float32)
  out = _run(loss, 8, rows, params=w, tx=optax.sgd(1.))
  grads = [jnp.bfloat16(g) for g in np.asarray(rows[:, 0])]
  in_bf16 = functools.reduce(lambda a, b: jnp.bfloat16(a + b), grads) / 8
  in_f32 = jnp.bfloat16(sum(float(g) for g in grads) / 8)
  assert float(in_bf16) == 0.125 and float(in_f32) == 0.126953125
  assert out.params["w"].dtype == jnp.bfloat16
  assert float(-out.params["w"][0]) == float(in_f32)


# --- One loss scale, one decision ---------------------------------------------


def test_one_bad_microbatch_skips_the_whole_step_bit_for_bit():
  x, y = data(n=64)

  def loss_fn(p, state, x, y, rows):
    return _row_poisoned_loss(p, x, y, rows), {"n": state["n"] + 1,
                                              "m": state["m"] + x.mean()}

  tx, params = optax.adam(1e-2), init_mlp()
  opt_state, state = tx.init(params), {"n": jnp.int32(3), "m": jnp.float32(.5)}
  step = jax.jit(mpolicy.make_train_step(loss_fn, tx, has_state=True,
                                         microbatches=8))
  out = step(params, state, opt_state, DynamicLossScale(2. ** 15), x, y,
             _rows(64, bad_row=13))  # In microbatch 5 (rows 5, 13, ...).
  assert not bool(out.grads_finite)
  assert same_bits(out.params, params) and same_bits(out.opt_state, opt_state)
  assert same_bits(out.model_state, state)
  assert float(out.loss_scale.loss_scale) == 2. ** 14  # Backed off once.
  out = step(params, state, opt_state, DynamicLossScale(2. ** 15), x, y,
             _rows(64))
  assert bool(out.grads_finite) and int(out.model_state["n"]) == 11


def test_the_loss_scale_adjusts_once_per_step():
  x, y = data(n=64)
  ls = DynamicLossScale(2. ** 15, period=2)
  out = _run(_row_poisoned_loss, 8, x, y, _rows(64), ls=ls)
  assert int(out.loss_scale.counter) == 1  # One finite step, not eight.
  assert float(out.loss_scale.loss_scale) == 2. ** 15
  rows = _rows(64, bad_row=2).at[5].set(jnp.nan)  # Two bad microbatches.
  out = _run(_row_poisoned_loss, 8, x, y, rows, ls=ls)
  assert float(out.loss_scale.loss_scale) == 2. ** 14  # Halved once.


def _f16_rows_loss(w, c):
  """d loss / d w = the mean of `c`'s rows, computed in float16."""
  return jnp.mean(w.astype(jnp.float16) * c).astype(jnp.float32) * 3


def test_max_retries_redoes_the_whole_step_at_the_lower_scale():
  # Microbatch 3's scaled float16 gradient, 3 * 2 ** 15, overflows; at
  # 2 ** 14 every microbatch is finite. The batch's mean would not overflow.
  c = jnp.asarray([1.] * 3 + [3.] + [1.] * 4, jnp.float16)[:, None]
  w = jnp.ones((1, 3), jnp.float16)
  ls = DynamicLossScale(jnp.float32(2. ** 15))
  skipped = _run(_f16_rows_loss, 8, c, params=w, tx=optax.sgd(1.), ls=ls)
  assert not bool(skipped.grads_finite) and same_bits(skipped.params, w)
  redone = _run(_f16_rows_loss, 8, c, params=w, tx=optax.sgd(1.), ls=ls,
                max_retries=1)
  assert bool(redone.grads_finite)
  assert float(redone.loss_scale.loss_scale) == 2. ** 14
  assert int(redone.loss_scale.counter) == 1
  # The mean gradient, 3 * (7 + 3) / 8 / 3 = 1.25: w = 1 - 1.25.
  assert redone.params.tolist() == [[-0.25] * 3]


def test_overflow_flags_are_combined_over_microbatches():
  x, y = data(n=16)

  def loss_fn(p, x, y, f1, f2):
    p = dict(p, w1=poison(p["w1"], f1.max()), b2=poison(p["b2"], f2.max()))
    return _f32_loss(p, x, y, clean())

  f1 = jnp.ones(16).at[1].set(jnp.inf)  # Microbatch 1 of 4.
  f2 = jnp.ones(16).at[6].set(jnp.nan)  # Microbatch 2.
  out = _run(loss_fn, 4, x, y, f1, f2, attribute_overflow=True)
  assert not bool(out.grads_finite)
  assert out.nonfinite_paths() == ["b2", "w1"]


# --- State, aux and the split ---------------------------------------------------


def test_model_state_runs_through_the_microbatches_in_order():
  x = jnp.arange(8.)[:, None] * jnp.ones((1, 8))

  def loss_fn(p, state, x):
    seen = state["seen"].at[state["i"]].set(x[0, 0])
    loss = jnp.mean(x @ p["w1"])
    return (loss, x[:, 0]), {"seen": seen, "i": state["i"] + 1}

  tx, params = optax.sgd(0.1), init_mlp()
  step = jax.jit(mpolicy.make_train_step(loss_fn, tx, has_state=True,
                                         has_aux=True, microbatches=4))
  out = step(params, {"seen": jnp.full(4, -1.), "i": jnp.int32(0)},
             tx.init(params), mpolicy.NoOpLossScale(), x)
  # Microbatch j holds rows j and j + 4 (strided), in order.
  assert out.model_state["seen"].tolist() == [0., 1., 2., 3.]
  assert int(out.model_state["i"]) == 4
  assert out.value[1].tolist() == [3., 7.]  # The last microbatch's aux.


def test_batchnorm_statistics_are_those_of_k_smaller_batches():
  model = mpolicy.transform_amp_with_state(
      lambda x: hk.Linear(1)(hk.BatchNorm(True, True, 0.9)(x, True)))
  x, y = data(n=32)
  params, state = model.init(jax.random.PRNGKey(0), x)

  def loss_fn(params, state, x, y):
    out, state = model.apply(params, state, None, x)
    return jnp.mean((out - y) ** 2), state

  tx = optax.sgd(0.1)
  out = jax.jit(mpolicy.make_train_step(loss_fn, tx, has_state=True,
                                        microbatches=4))(
      params, state, tx.init(params), mpolicy.NoOpLossScale(), x, y)
  expected = state
  for i in range(4):
    _, expected = model.apply(params, expected, None, x[i::4])
  assert _max_ulps(out.model_state, expected) <= 2


def test_the_error_names_the_argument_k_does_not_divide():
  x, y = data(n=8)
  weights = jnp.ones(3)

  def loss_fn(p, x, y, class_weights):
    return _f32_loss(p, x, y, clean()) * class_weights.mean()

  with pytest.raises(ValueError, match=r"microbatches=4 does not divide the "
                     r"leading axis of args\[2\] \(loss_fn's `class_weights`"
                     r"\), of size 3.*batch_argnums"):
    _run(loss_fn, 4, x, y, weights)
  with pytest.raises(ValueError, match=r"args\[0\] \(loss_fn's `x`\).*"
                     r"microbatches in \[1, 2, 4, 8\]"):
    _run(loss_fn, 3, x, y, weights, batch_argnums=(0, 1))
  one = _run(loss_fn, 1, x, y, weights)
  acc = _run(loss_fn, 4, x, y, weights, batch_argnums=(0, 1))
  assert _max_ulps(acc.params, one.params) <= FEW_ULPS


def test_scalars_and_typed_keys_are_passed_whole():
  shapes = []

  def loss_fn(p, x, keys, scale, raw):
    shapes.append((x.shape, keys.shape, scale.shape, raw.shape))
    noise = jax.random.normal(keys[0], x.shape) * 0
    return jnp.mean((x + noise) @ p["w1"]) * scale

  x = jnp.ones((8, 8))
  keys = jax.random.split(jax.random.key(0), 2)
  raw = jnp.zeros((8, 2), jnp.uint32)  # Raw key data is data: it is split.
  out = _run(loss_fn, 4, x, keys, jnp.float32(2.), raw)
  assert bool(out.grads_finite)
  assert ((2, 8), (2,), (), (2, 2)) in shapes


def test_arguments_are_checked():
  loss_fn = lambda p, x: jnp.mean(x @ p["w1"])
  make = functools.partial(mpolicy.make_train_step, loss_fn, optax.sgd(0.1))
  with pytest.raises(ValueError, match="microbatches must be a positive int"):
    make(microbatches=0)
  with pytest.raises(TypeError, match="got 2.0"):
    make(microbatches=2.0)
  with pytest.raises(TypeError, match="got True"):
    make(microbatches=True)
  with pytest.raises(TypeError, match="batch_argnums must be None"):
    make(batch_argnums="x")
  with pytest.raises(ValueError, match="'mean'.*'sum_count'.*got 'sum'"):
    make(loss_reduction="sum")
  with pytest.raises(ValueError, match=r"batch_argnums=\(3,\) names position"):
    _run(loss_fn, 2, jnp.ones((4, 8)), batch_argnums=(3,))


def test_keywords_that_would_do_nothing_warn():
  loss_fn = lambda p, x: jnp.mean(x @ p["w1"])
  make = functools.partial(mpolicy.make_train_step, loss_fn, optax.sgd(0.1))
  with pytest.warns(UserWarning, match=r"reduce_dtype=bfloat16 has no effect "
                    r"without axis_name.*Pass axis_name"):
    make(reduce_dtype=jnp.bfloat16)
  with pytest.warns(UserWarning, match=r"average_state=False has no effect "
                    r"without has_state=True"):
    make(average_state=False)
  with pytest.warns(UserWarning, match=r"average_state=True has no effect "
                    r"without axis_name"):
    mpolicy.make_train_step(lambda p, s, x: (jnp.sum(p), s), optax.sgd(.1),
                            has_state=True, average_state=True)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    make()
    make(axis_name="d", reduce_dtype=jnp.bfloat16)


# --- Token means ------------------------------------------------------------------


def _token_losses(p, x, y):
  h = jnp.tanh(x @ p["w1"] + p["b1"])
  return ((h @ p["w2"] + p["b2"] - y) ** 2)[:, 0]


def test_sum_count_gives_the_batch_token_mean_update():
  x, y = data(n=32)
  # Microbatch i of 4 holds rows i, i + 4, ...: microbatch 0 has 8 tokens,
  # the others 1 each.
  mask = jnp.asarray([1.] * 4 + [1., 0., 0., 0.] * 7)

  def token_mean(p, x, y, mask):
    return jnp.sum(_token_losses(p, x, y) * mask) / jnp.sum(mask)

  def sum_count(p, x, y, mask):
    return jnp.sum(_token_losses(p, x, y) * mask), jnp.sum(mask)

  one = _run(token_mean, 1, x, y, mask)
  acc = _run(sum_count, 4, x, y, mask, loss_reduction="sum_count")
  assert _max_ulps(acc.opt_state, one.opt_state) <= FEW_ULPS
  assert ulp_distance(acc.value, one.value) <= FEW_ULPS
  # The mean of the microbatches' token means weighs microbatch 0's eight
  # tokens like each other microbatch's one.
  means = _run(token_mean, 4, x, y, mask)
  trace, exact = means.opt_state[0].trace["w1"], one.opt_state[0].trace["w1"]
  assert float(jnp.abs(trace - exact).max()) > 0.05 * float(
      jnp.abs(exact).max())
  # A microbatch without tokens counts for nothing.
  none = _run(sum_count, 4, x, y, mask.at[1].set(0.),
              loss_reduction="sum_count")
  assert bool(none.grads_finite)


def test_sum_count_names_what_loss_fn_must_return():
  with pytest.raises(TypeError, match=r"must return `\(sum, count\)`"):
    _run(lambda p, x: jnp.sum(x @ p["w1"]), 2, jnp.ones((4, 8)),
         loss_reduction="sum_count")


# --- Composition --------------------------------------------------------------------


@pytest.mark.slow
def test_stochastic_params_and_state_dtypes_update_once():
  x, y = data(n=16)
  params = jax.tree_util.tree_map(lambda p: p.astype(jnp.bfloat16),
                                  init_mlp())
  loss_fn = lambda p, x, y: _f32_loss(
      jax.tree_util.tree_map(lambda v: v.astype(jnp.float32), p), x, y,
      clean())
  tx = mpolicy.with_state_dtypes(optax.adam(1e-2), jnp.bfloat16,
                                 rounding="stochastic")
  runs = []
  for k in (1, 4):
    step = jax.jit(mpolicy.make_train_step(loss_fn, tx, microbatches=k,
                                           param_rounding="stochastic"))
    runs.append(step(params, mpolicy.stochastic_params(tx).init(params),
                     mpolicy.NoOpLossScale(), x, y))
  one, acc = runs
  assert int(acc.opt_state.count) == 1  # One update, not four.
  assert acc.params["w1"].dtype == jnp.bfloat16
  # The same random bits round gradients a few float32 ulps apart.
  assert _max_ulps(acc.params, one.params) <= 1


@pytest.mark.slow
def test_float8_matmuls_scale_each_microbatch():
  x, y = data(n=16)
  f8 = mpolicy.amp(lambda p, x, y: _f32_loss(p, x, y, clean()),
                   "p=f32,c=f8,o=bf16")
  one = _run(f8, 1, x, y).opt_state[0].trace
  acc = _run(f8, 2, x, y).opt_state[0].trace
  for name in one:
    scale = float(jnp.abs(one[name]).max())
    assert float(jnp.abs(acc[name] - one[name]).max()) <= 0.1 * scale
