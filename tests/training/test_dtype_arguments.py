"""Dtype arguments of the training helpers accept floating dtypes only.

An integer or bool `grad_dtype` turned every gradient into 0 and an integer
`reduce_dtype` truncated the averaged gradients; an integer master or
param dtype truncated every weight. Each is refused when the helper is
built, naming the function, the argument and what is allowed.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpolicy

FLOATING = ("a floating dtype (float16, bfloat16, float32, float64 or a "
            "float8 dtype)")


def _loss(p, x):
  return jnp.sum(p["w"] * x)


@pytest.mark.parametrize("bad", [jnp.int32, jnp.bool_, "int8", np.uint16])
@pytest.mark.parametrize("arg", ["grad_dtype", "reduce_dtype"])
def test_scaled_value_and_grad_refuses_non_floating_dtypes(arg, bad):
  with pytest.raises(ValueError, match=re.escape(
      f"scaled_value_and_grad: {arg} must be {FLOATING}, or None (")) as e:
    mpolicy.scaled_value_and_grad(_loss, **{arg: bad})
  assert f"got {np.dtype(bad).name}, which is not floating" in str(e.value)


@pytest.mark.parametrize("bad", [jnp.int32, jnp.bool_])
@pytest.mark.parametrize("arg", ["grad_dtype", "reduce_dtype"])
@pytest.mark.parametrize("k", [1, 2])
def test_make_train_step_refuses_non_floating_dtypes(arg, bad, k):
  with pytest.raises(ValueError, match=re.escape(
      f"make_train_step: {arg} must be {FLOATING}, or None (")) as e:
    mpolicy.make_train_step(_loss, optax.sgd(0.1), axis_name="batch",
                            microbatches=k, **{arg: bad})
  assert "truncated (a gradient of 0.001 becomes 0)" in str(e.value)


def test_a_complex_grad_dtype_is_refused_too():
  with pytest.raises(ValueError, match="got complex64, which is not floating:"
                     " a complex dtype is not a precision"):
    mpolicy.scaled_value_and_grad(_loss, grad_dtype=jnp.complex64)


def test_a_non_dtype_is_a_type_error():
  with pytest.raises(TypeError, match=re.escape(
      "make_train_step: grad_dtype must be a floating dtype")) as e:
    mpolicy.make_train_step(_loss, optax.sgd(0.1), grad_dtype="flaot")
  assert "got 'flaot' (str)" in str(e.value)


@pytest.mark.parametrize("grad_dtype", [None, jnp.float32, "bfloat16"])
def test_floating_grad_dtypes_still_give_the_gradients(grad_dtype):
  params = {"w": jnp.ones(3, jnp.float16)}
  x = jnp.array([1e-3, 2., -3.], jnp.float16)
  grad_fn = mpolicy.scaled_value_and_grad(_loss, grad_dtype=grad_dtype)
  _, finite, _, grads = grad_fn(mpolicy.DynamicLossScale(2. ** 10), params, x)
  want = np.dtype(jnp.float16 if grad_dtype is None else grad_dtype)
  assert bool(finite) and grads["w"].dtype == want
  np.testing.assert_array_equal(np.asarray(grads["w"], np.float32),
                                np.asarray(x.astype(want), np.float32))


def test_make_train_step_with_a_floating_grad_dtype_moves_the_params():
  tx = optax.sgd(1.)
  params = {"w": jnp.zeros(2, jnp.float16)}
  step = jax.jit(mpolicy.make_train_step(_loss, tx, grad_dtype=jnp.float32,
                                         microbatches=2))
  out = step(params, tx.init(params), mpolicy.NoOpLossScale(),
             jnp.array([[1e-3, 2.], [3e-3, 4.]], jnp.float16))
  np.testing.assert_allclose(np.asarray(out.params["w"], np.float32),
                             [-2e-3, -3.], rtol=1e-3)


@pytest.mark.parametrize("bad", [jnp.int32, jnp.bool_])
def test_master_weights_refuses_a_non_floating_master_dtype(bad):
  with pytest.raises(ValueError, match=re.escape(
      f"master_weights: master_dtype must be {FLOATING}; got "
      f"{np.dtype(bad).name}, which is not floating")):
    mpolicy.master_weights(optax.sgd(0.1), master_dtype=bad)


def test_init_master_weights_refuses_a_non_floating_param_dtype():
  tx = mpolicy.master_weights(optax.sgd(0.1))
  with pytest.raises(ValueError, match=re.escape(
      f"init_master_weights: param_dtype must be {FLOATING}; got int8")):
    mpolicy.init_master_weights(tx, {"w": jnp.full(2, 0.7)}, jnp.int8)
  half, state = mpolicy.init_master_weights(tx, {"w": jnp.full(2, 0.7)},
                                            jnp.bfloat16)
  assert half["w"].dtype == jnp.bfloat16
  assert float(half["w"][0]) == float(jnp.bfloat16(0.7))
  assert state.master["w"].dtype == jnp.float32
