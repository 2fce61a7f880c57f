"""Specification of scaled_value_and_grad: scale, grad, unscale, check, adjust."""

from __future__ import annotations

import haiku as hk
import jax
import jax.numpy as jnp
import pytest

import mpolicy

from _training_mlp import clean, data, F32, init_mlp, mlp_loss, poison
from _helpers import same_bits

DynamicLossScale = mpolicy.DynamicLossScale


def _dtypes(tree):
  return jax.tree_util.tree_map(lambda x: jnp.asarray(x).dtype, tree)


# --- scaled_value_and_grad -----------------------------------------------------


def test_scaled_grads_equal_plain_grads_for_power_of_two_scale():
  params, (x, y) = init_mlp(), data()
  loss, grads = jax.value_and_grad(mlp_loss)(params, x, y, clean(), F32)
  grad_fn = mpolicy.scaled_value_and_grad(mlp_loss)
  ls, finite, value, sgrads = grad_fn(
      DynamicLossScale(2. ** 15), params, x, y, clean(), F32)
  assert bool(finite)
  assert float(value) == float(loss)
  # Scaling by a power of two is exact: the unscaled grads are bit-identical.
  assert same_bits(sgrads, grads)
  assert float(ls.loss_scale) == 2. ** 15 and int(ls.counter) == 1


def test_grads_come_back_in_each_params_dtype_or_grad_dtype():
  params = {"h": jnp.ones(3, jnp.bfloat16), "f": jnp.ones(3, jnp.float32)}
  loss_fn = lambda p: jnp.sum(p["h"].astype(jnp.float32) * p["f"])
  ls = DynamicLossScale(2. ** 10)
  _, _, _, grads = mpolicy.scaled_value_and_grad(loss_fn)(ls, params)
  assert _dtypes(grads) == {"h": jnp.bfloat16, "f": jnp.float32}
  _, _, _, grads = mpolicy.scaled_value_and_grad(
      loss_fn, grad_dtype=jnp.float32)(ls, params)
  assert _dtypes(grads) == {"h": jnp.float32, "f": jnp.float32}


@pytest.mark.parametrize("dtype, fitting_scale", [
    (jnp.float8_e4m3fn, 2. ** 4), (jnp.float8_e5m2, 2. ** 11)])
def test_float8_params_get_float8_grads_and_overflow_backs_off(dtype,
                                                               fitting_scale):
  params = {"f8": jnp.array([1., 2., 3.], dtype), "f32": jnp.ones(3)}
  # d/d f8 = 0.375 * f32 (exact in float8); d/d f32 = 0.375 * f8.
  loss_fn = lambda p, c: c * jnp.sum(p["f8"].astype(jnp.float32) * p["f32"])
  grad_fn = jax.jit(mpolicy.scaled_value_and_grad(loss_fn, max_retries=12))
  ls, finite, loss, grads = grad_fn(DynamicLossScale(2. ** 6), params,
                                    jnp.float32(0.375))
  assert bool(finite) and float(loss) == 0.375 * 6
  assert _dtypes(grads) == {"f8": dtype, "f32": jnp.float32}
  assert jnp.asarray(grads["f8"], jnp.float32).tolist() == [0.375] * 3
  assert grads["f32"].tolist() == [0.375, 0.75, 1.125]
  assert float(ls.loss_scale) == 2. ** 6
  # A scaled float8 gradient past its largest value (448 / 57344) is not
  # finite, never saturated: the retries back off until 16 times the scale
  # fits.
  ls, finite, _, grads = grad_fn(DynamicLossScale(2. ** 15), params,
                                 jnp.float32(16.))
  assert bool(finite) and grads["f8"].dtype == dtype
  assert jnp.asarray(grads["f8"], jnp.float32).tolist() == [16.] * 3
  assert float(ls.loss_scale) == fitting_scale
  _, finite, _, grads = jax.jit(mpolicy.scaled_value_and_grad(loss_fn))(
      DynamicLossScale(2. ** 15), params, jnp.float32(16.))
  assert not bool(finite)


def test_argnums_and_has_aux_follow_value_and_grad():
  def loss_fn(a, b, c):
    return jnp.sum(a * b * c), {"n": 3}
  a, b, c = jnp.ones(2), jnp.full(2, 2.), jnp.full(2, 3.)
  grad_fn = mpolicy.scaled_value_and_grad(loss_fn, argnums=(0, 2),
                                           has_aux=True)
  _, finite, (loss, aux), (ga, gc) = grad_fn(DynamicLossScale(4.), a, b, c)
  assert bool(finite) and float(loss) == 12. and aux == {"n": 3}
  assert ga.tolist() == [6., 6.] and gc.tolist() == [2., 2.]


def test_negative_argnums_count_from_the_last_argument_not_the_loss_scale():
  loss_fn = lambda a, b: jnp.sum(a * b)
  a, b = jnp.ones(2), jnp.full(2, 3.)
  for argnums, want in ((-1, [1., 1.]), ((-2, -1), ([3., 3.], [1., 1.]))):
    *_, grads = mpolicy.scaled_value_and_grad(loss_fn, argnums=argnums)(
        DynamicLossScale(4.), a, b)
    assert jax.tree_util.tree_map(lambda g: g.tolist(), grads) == (
        want if isinstance(argnums, int) else tuple(want))


def test_overflowing_float16_backward_is_flagged_and_scale_backs_off():
  loss_fn = lambda w: jnp.sum((w.astype(jnp.float16) * 1000.) ** 2
                              ).astype(jnp.float32)
  grad_fn = mpolicy.scaled_value_and_grad(loss_fn)
  ls, finite, _, grads = grad_fn(DynamicLossScale(2. ** 15), jnp.ones(2))
  assert not bool(finite)
  assert float(ls.loss_scale) == 2. ** 14 and int(ls.counter) == 0
  assert grads.dtype == jnp.float32


def test_a_float16_loss_is_scaled_without_overflowing():
  # The scaled loss 8 * 2**15 overflows float16, but AD only uses the
  # cotangent, and each gradient element (2**15) fits.
  loss_fn = lambda w: jnp.sum(w.astype(jnp.float16))
  ls, finite, loss, grads = mpolicy.scaled_value_and_grad(loss_fn)(
      DynamicLossScale(2. ** 15), jnp.ones(8))
  assert bool(finite) and loss.dtype == jnp.float16 and float(loss) == 8.
  assert grads.tolist() == [1.] * 8 and float(ls.loss_scale) == 2. ** 15


def test_non_scalar_loss_is_rejected_with_what_is_accepted():
  grad_fn = mpolicy.scaled_value_and_grad(lambda w: w * 2.)
  with pytest.raises(TypeError) as e:
    grad_fn(DynamicLossScale(2.), jnp.ones(3))
  msg = str(e.value)
  assert "scalar" in msg and "shape (3,)" in msg and "float32" in msg
  assert "has_aux=True" in msg and ".mean()" in msg


def test_integer_loss_is_rejected():
  grad_fn = mpolicy.scaled_value_and_grad(lambda w: jnp.int32(1))
  with pytest.raises(TypeError, match="floating-point scalar.*int32"):
    grad_fn(DynamicLossScale(2.), jnp.ones(3))


def test_integer_params_are_rejected_naming_the_leaves():
  params = {"w": jnp.ones(2), "step": jnp.zeros([], jnp.int32),
            "mask": jnp.ones(2, bool)}
  grad_fn = mpolicy.scaled_value_and_grad(lambda p: jnp.sum(p["w"]))
  with pytest.raises(TypeError) as e:
    grad_fn(DynamicLossScale(2.), params)
  msg = str(e.value)
  assert "args[0]['step']: int32[]" in msg
  assert "args[0]['mask']: bool[2]" in msg
  assert "['w']" not in msg
  assert "Only floating-point leaves" in msg and "another argument" in msg


def test_has_aux_without_a_pair_is_rejected():
  grad_fn = mpolicy.scaled_value_and_grad(lambda w: jnp.sum(w), has_aux=True)
  with pytest.raises(TypeError, match=r"pair \(loss, aux\)"):
    grad_fn(DynamicLossScale(2.), jnp.ones(2))


def test_overflow_attribution_names_haiku_param_paths():
  def forward(x):
    h = hk.nets.MLP([4, 4], name="encoder")(x)  # encoder/~/linear_{0,1}
    return hk.Linear(1, name="head")(h)

  net = hk.without_apply_rng(hk.transform(forward))
  x = jnp.ones((2, 3))
  params = net.init(jax.random.PRNGKey(0), x)
  target = ("encoder/~/linear_1", "w")

  def loss_fn(params, factor):
    params = {m: {n: poison(v, factor if (m, n) == target else
                             jnp.float32(1.)) for n, v in d.items()}
              for m, d in params.items()}
    return jnp.mean(net.apply(params, x) ** 2)

  grad_fn = jax.jit(mpolicy.scaled_value_and_grad(
      loss_fn, attribute_overflow=True))
  _, finite, _, _, flags = grad_fn(DynamicLossScale(2. ** 8), params,
                                   jnp.float32(jnp.inf))
  assert not bool(finite)
  assert isinstance(flags["encoder/~/linear_1"]["w"], jax.Array)
  assert mpolicy.nonfinite_paths(flags) == ["encoder/~/linear_1/w"]
  _, finite, _, _, flags = grad_fn(DynamicLossScale(2. ** 8), params,
                                   jnp.float32(1.))
  assert bool(finite) and mpolicy.nonfinite_paths(flags) == []
