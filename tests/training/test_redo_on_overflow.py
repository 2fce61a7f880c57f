"""scaled_value_and_grad(max_retries=N): back off and recompute in one call."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpolicy
from mpolicy._src import loss_scale as ls_lib

from _helpers import same_bits, walk_eqns

DynamicLossScale = ls_lib.DynamicLossScale


def _loss(w, c):
  """d loss / d w = c, computed in float16: it overflows when c * scale does.

  With c = 4 the scaled float16 gradient is 2 ** 17 (inf) at a scale of
  2 ** 15, 2 ** 16 (inf, > 65504) at 2 ** 14, and 2 ** 15 (fine) at 2 ** 13.
  """
  return jnp.sum(w.astype(jnp.float16) * c).astype(jnp.float32)


W = jnp.ones(3, jnp.float16)
C = jnp.float16(4.)


@jax.custom_vjp
def _poison(x):
  return x


_poison.defvjp(lambda x: (x, None), lambda _, ct: (ct * jnp.inf,))


def _always_inf(w, c):
  return _loss(_poison(w), c)


def _primitives(fn, *args):
  return [e.primitive.name for e in walk_eqns(jax.make_jaxpr(fn)(*args))]


# --- The retry itself ---------------------------------------------------------


def test_without_retries_the_overflow_is_only_reported():
  ls, finite, value, grads = mpolicy.scaled_value_and_grad(_loss)(
      DynamicLossScale(2. ** 15), W, C)
  assert not bool(finite) and float(ls.loss_scale) == 2. ** 14
  assert float(value) == 12. and bool(jnp.isinf(grads).all())


@pytest.mark.parametrize("retries", [2, 3, 10])
def test_the_same_call_backs_off_and_returns_finite_grads(retries):
  grad_fn = jax.jit(mpolicy.scaled_value_and_grad(_loss, max_retries=retries))
  ls, finite, value, grads = grad_fn(DynamicLossScale(2. ** 15), W, C)
  assert bool(finite)
  assert grads.dtype == jnp.float16 and grads.tolist() == [4., 4., 4.]
  # Two back-offs (2**15 -> 2**13), then one finite step counted.
  assert ls.loss_scale.dtype == jnp.float32
  assert float(ls.loss_scale) == 2. ** 13 and int(ls.counter) == 1
  assert float(value) == 12.


def test_it_gives_up_after_max_retries_and_the_step_is_skipped():
  grad_fn = jax.jit(mpolicy.scaled_value_and_grad(_loss, max_retries=1))
  ls, finite, _, grads = grad_fn(DynamicLossScale(2. ** 15), W, C)
  # Attempts at 2**15 and 2**14 both overflow; the scale after the last
  # attempt is 2**13: reduced max_retries + 1 times.
  assert not bool(finite) and bool(jnp.isinf(grads).all())
  assert float(ls.loss_scale) == 2. ** 13 and int(ls.counter) == 0

  tx = optax.adam(1e-2)
  params = jnp.ones(3, jnp.float32)
  state = tx.init(params)
  new_params, new_state = mpolicy.update_if_finite(tx, grads, state, params,
                                                    finite)
  assert same_bits(new_params, params) and same_bits(new_state, state)


@pytest.mark.parametrize("retries", [1, 3])
def test_a_gradient_that_is_never_finite_backs_off_retries_plus_one_times(
    retries):
  grad_fn = mpolicy.scaled_value_and_grad(_always_inf, max_retries=retries)
  ls, finite, _, grads = grad_fn(DynamicLossScale(2. ** 15), W, C)
  assert not bool(finite) and not bool(jnp.isfinite(grads).any())
  assert float(ls.loss_scale) == 2. ** (15 - retries - 1)


def test_the_forward_and_backward_run_once_when_finite_and_once_per_retry():
  runs = []

  def loss(w, c):
    jax.debug.callback(lambda: runs.append(1))
    return _loss(w, c)

  grad_fn = jax.jit(mpolicy.scaled_value_and_grad(loss, max_retries=5))
  _, finite, _, _ = grad_fn(DynamicLossScale(2. ** 12), W, C)
  jax.effects_barrier()
  assert bool(finite) and len(runs) == 1
  runs.clear()
  _, finite, _, _ = grad_fn(DynamicLossScale(2. ** 15), W, C)
  jax.effects_barrier()
  assert bool(finite) and len(runs) == 3


def test_retrying_stops_once_the_scale_is_at_its_floor():
  runs = []

  def loss(w, c):
    jax.debug.callback(lambda: runs.append(1))
    return _always_inf(w, c)

  grad_fn = mpolicy.scaled_value_and_grad(loss, max_retries=10)
  ls, finite, _, _ = grad_fn(DynamicLossScale(16., min_loss_scale=4.), W, C)
  jax.effects_barrier()
  # 16 -> 8 -> 4; at 4 another back-off would not lower it, so 3 attempts.
  assert not bool(finite) and float(ls.loss_scale) == 4.
  assert len(runs) == 3


@pytest.mark.parametrize("ls", [ls_lib.NoOpLossScale(),
                                ls_lib.StaticLossScale(2. ** 15)],
                         ids=["noop", "static"])
def test_a_scale_that_cannot_back_off_makes_retries_a_no_op(ls):
  plain = mpolicy.scaled_value_and_grad(_loss)
  retrying = mpolicy.scaled_value_and_grad(_loss, max_retries=4)
  assert "while" not in _primitives(retrying, ls, W, C)
  assert same_bits(retrying(ls, W, C), plain(ls, W, C))


def test_zero_retries_traces_exactly_as_before():
  ls = DynamicLossScale(2. ** 15)
  default = jax.make_jaxpr(mpolicy.scaled_value_and_grad(_loss))(ls, W, C)
  zero = jax.make_jaxpr(mpolicy.scaled_value_and_grad(_loss, max_retries=0))(
      ls, W, C)
  assert str(default) == str(zero)
  assert "while" not in _primitives(
      mpolicy.scaled_value_and_grad(_loss), ls, W, C)
  whiles = [p for p in _primitives(
      mpolicy.scaled_value_and_grad(_loss, max_retries=3), ls, W, C)
            if p == "while"]
  assert len(whiles) == 1


def test_a_jitted_step_traces_once_across_overflowing_and_finite_steps():
  traces = []
  grad_fn = mpolicy.scaled_value_and_grad(_loss, max_retries=3)

  @jax.jit
  def step(ls, w, c):
    traces.append(1)
    return grad_fn(ls, w, c)

  ls = DynamicLossScale(2. ** 15, period=2)
  seen = []
  for c in (C, jnp.float16(1.), jnp.float16(1.), C, jnp.float16(0.5)):
    ls, finite, _, _ = step(ls, W, c)
    seen.append((bool(finite), float(ls.loss_scale)))
  assert len(traces) == 1
  # 2**15 overflows twice -> 2**13 (counter 1); the next finite step grows
  # it (period 2); 4 * 2**14 overflows once -> 2**13 (counter 1); grows.
  assert seen == [(True, 2. ** 13), (True, 2. ** 14), (True, 2. ** 14),
                  (True, 2. ** 13), (True, 2. ** 14)]


def test_has_aux_grad_dtype_and_attribution_come_from_the_last_attempt():
  def loss(w, c):
    return _loss(w, c), {"n": 3, "half": w * 2}

  grad_fn = mpolicy.scaled_value_and_grad(
      loss, has_aux=True, grad_dtype=jnp.float32, attribute_overflow=True,
      max_retries=2)
  ls, finite, (value, aux), grads, flags = grad_fn(
      DynamicLossScale(2. ** 15), W, C)
  assert bool(finite) and float(value) == 12.
  assert aux["n"] == 3 and aux["half"].tolist() == [2., 2., 2.]
  assert grads.dtype == jnp.float32 and grads.tolist() == [4., 4., 4.]
  assert not bool(flags) and float(ls.loss_scale) == 2. ** 13


def test_vmapped_loss_scales_retry_independently():
  scales = DynamicLossScale(jnp.array([2. ** 15, 2. ** 12]),
                            jnp.zeros(2, jnp.int32))
  grad_fn = mpolicy.scaled_value_and_grad(_loss, max_retries=3)
  ls, finite, _, grads = jax.vmap(grad_fn, in_axes=(0, None, None))(
      scales, W, C)
  np.testing.assert_array_equal(finite, [True, True])
  np.testing.assert_array_equal(ls.loss_scale, [2. ** 13, 2. ** 12])
  np.testing.assert_array_equal(ls.counter, [1, 1])
  np.testing.assert_array_equal(grads, np.full((2, 3), 4.))


def test_with_an_axis_name_every_replica_retries_together():
  # Replica 1 overflows down to 2**13; replica 0 would be fine at 2**15.
  grad_fn = mpolicy.scaled_value_and_grad(_loss, axis_name="r",
                                           max_retries=3)
  cs = jnp.array([1., 4.], jnp.float16)
  ls, finite, _, grads = jax.vmap(
      grad_fn, in_axes=(None, None, 0), axis_name="r")(
          DynamicLossScale(2. ** 15), W, cs)
  np.testing.assert_array_equal(finite, [True, True])
  np.testing.assert_array_equal(ls.loss_scale, [2. ** 13] * 2)
  np.testing.assert_array_equal(grads, np.full((2, 3), 2.5))  # Mean of 1, 4.


@pytest.mark.parametrize("bad,error", [(-1, ValueError), (1.5, TypeError),
                                       (True, TypeError), ("2", TypeError),
                                       (None, TypeError)])
def test_max_retries_must_be_a_non_negative_int(bad, error):
  with pytest.raises(error, match=r"max_retries must be a non-negative int"):
    mpolicy.scaled_value_and_grad(_loss, max_retries=bad)


EIGHT_DEVICES = r'''
import json
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

import mpolicy
from mpolicy._src import loss_scale as ls_lib

N = jax.device_count()
facts = {}


def loss(w, c):
  return jnp.sum(w.astype(jnp.float16) * c).astype(jnp.float32)


grad_fn = mpolicy.scaled_value_and_grad(loss, axis_name="d", max_retries=3)
w = jnp.ones(3, jnp.float16)
cs = jnp.ones(N, jnp.float16).at[5].set(4.)  # Only device 5 overflows.
ls = ls_lib.DynamicLossScale(2. ** 15)


def record(name, out):
  ls, finite, _, grads = out
  facts[name] = {"finite": np.asarray(finite).reshape(-1).tolist(),
                 "scale": np.asarray(ls.loss_scale).reshape(-1).tolist(),
                 "counter": np.asarray(ls.counter).reshape(-1).tolist(),
                 "grads": np.asarray(grads, np.float32).reshape(-1).tolist()}


record("pmap", jax.pmap(grad_fn, axis_name="d", in_axes=(None, None, 0))(
    ls, w, cs))

mesh = Mesh(np.array(jax.devices()), ("d",))


def per_device(ls, w, c):
  out = grad_fn(ls, w, c[0])
  return jax.tree_util.tree_map(lambda a: jnp.asarray(a)[None], out)


record("shard_map", jax.jit(jax.shard_map(
    per_device, mesh=mesh, in_specs=(P(), P(), P("d")),
    out_specs=P("d")))(ls, w, cs))
print("FACTS=" + json.dumps(facts))
'''


def test_pmap_and_shard_map_devices_retry_together(eight_devices):
  facts = eight_devices
  # Device 5's own float16 gradient 4 * scale fits from 2**13 on (2
  # retries); the per-device gradients are then unscaled and averaged in
  # float32: (7 * 1 + 4) / 8. Under shard_map too: a float16 sum of the
  # scaled gradients (JAX's own, 11 * scale) would fit only from 2**12 on.
  for name, scale, grad in (("pmap", 2. ** 13, 11. / 8),
                            ("shard_map", 2. ** 13, 11. / 8)):
    got = facts[name]
    assert got["finite"] == [True] * 8, name
    assert got["scale"] == [scale] * 8, name
    assert got["counter"] == [1] * 8, name
    assert got["grads"] == [grad] * 24, name


def test_make_train_step_passes_max_retries_on():
  """An overflow at the first scale is redone inside the same step."""
  loss_fn = lambda p, x: jnp.sum((p["w"] * x) ** 2)
  tx = optax.sgd(0.0)
  params = {"w": jnp.ones(2, jnp.float16)}
  x = jnp.full(2, 8., jnp.float16)
  ls = mpolicy.DynamicLossScale(jnp.float32(2. ** 15))
  step = jax.jit(mpolicy.make_train_step(loss_fn, tx, max_retries=8))
  out = step(params, tx.init(params), ls, x)
  assert bool(out.grads_finite)
  assert float(out.loss_scale.loss_scale) < 2. ** 15
  plain = jax.jit(mpolicy.make_train_step(loss_fn, tx))(
      params, tx.init(params), ls, x)
  assert not bool(plain.grads_finite)
