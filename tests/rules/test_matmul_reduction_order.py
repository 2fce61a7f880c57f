"""The half matmul carries `dot_general`'s ``reduction_order`` (JAX 0.12.1).

A bfloat16 `dot_general` with float32 accumulation accepts an order, so
under ``c=bf16`` the half matmul sums its (exact) products in that order:
the result is the plain bfloat16 dot's with the same order, not XLA's
default order. A row of 4096 products, the first 2**24 and the rest 1,
shows the difference: summed left to right in float32 each 1 is lost.
"""

import importlib
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpolicy
from mpolicy._src.rules import matmul

from _helpers import all_eqns

HALF = "p=f32,c=bf16,o=f32"
DIMS = (((1,), (0,)), ((), ()))
X = jnp.ones((8, 4096), jnp.float32).at[:, 0].set(2.0 ** 24)
W = jnp.ones((4096, 8), jnp.float32)

pytestmark = pytest.mark.skipif(
    "reduction_order" not in inspect.signature(jax.lax.dot_general).parameters,
    reason=f"JAX {jax.__version__}'s dot_general takes no reduction_order")


def _dot(order):
  return lambda x, w: jax.lax.dot_general(
      x, w, DIMS, preferred_element_type=jnp.float32, reduction_order=order)


def _bf16_dot(order):
  """The plain bfloat16 dot with float32 accumulation in ``order``."""
  return _dot(order)(X.astype(jnp.bfloat16), W.astype(jnp.bfloat16))


def _tile():
  # Composite orders have no public constructor yet.
  ro = importlib.import_module("jax._src.reduction_order")
  return ro.Tile(64, inner="linear", outer="linear")


def test_the_linear_order_sums_left_to_right_in_float32():
  f = mpolicy.amp(_dot("linear"), HALF)
  got = f(X, W)
  want = _bf16_dot("linear")
  assert got.dtype == want.dtype == jnp.float32
  np.testing.assert_array_equal(got, want)
  assert float(got[0, 0]) == 2.0 ** 24  # Each 1 is lost, in order.
  assert float(_bf16_dot(None)[0, 0]) != 2.0 ** 24  # XLA's order differs.
  (eqn,) = [e for e in all_eqns(f, X, W)
            if e.primitive is matmul.amp_dot_general_p]
  assert str(eqn.params["reduction_order"]) == str(
      jax.make_jaxpr(_dot("linear"))(X, W).eqns[0].params["reduction_order"])
  assert [v.aval.dtype for v in eqn.invars] == [jnp.float32] * 2  # Params.
  assert eqn.params["compute_dtype"] == jnp.bfloat16


def test_a_composite_order_is_carried_under_jit_and_vmap():
  f = mpolicy.amp(_dot(_tile()), HALF)
  want = _bf16_dot(_tile())
  np.testing.assert_array_equal(jax.jit(f)(X, W), want)
  batched = jax.vmap(f, in_axes=(0, None))(jnp.stack([X, 2 * X]), W)
  np.testing.assert_array_equal(batched[0], want)
  np.testing.assert_array_equal(batched[1], _dot(_tile())(
      (2 * X).astype(jnp.bfloat16), W.astype(jnp.bfloat16)))


def test_the_order_is_carried_under_grad_and_the_backward_takes_none():
  # As in JAX's transposes, the backward products sum over other dims.
  loss = lambda order: lambda x, w: mpolicy.amp(_dot(order), HALF)(x, w).sum()
  got = jax.grad(loss("linear"), argnums=(0, 1))(X, W)
  want = jax.grad(loss(None), argnums=(0, 1))(X, W)
  for a, b in zip(got, want):
    assert a.dtype == jnp.float32
    np.testing.assert_array_equal(a, b)
  jaxpr = jax.make_jaxpr(jax.grad(loss("linear")))(X, W)
  orders = [e.params.get("reduction_order") for e in jaxpr.eqns
            if e.primitive is matmul.amp_dot_general_p]
  assert len(orders) == 2 and orders[0] is not None and orders[1] is None


def test_explain_shows_the_order():
  text = str(mpolicy.explain(mpolicy.amp(_dot("linear"), HALF), X, W))
  assert "reduction_order=linear kept" in text


def test_float8_declines_a_dot_with_an_order():
  rules = mpolicy.DEFAULT_RULES.with_fp8(matmuls="all", min_size=0)
  f = mpolicy.amp(_dot("linear"), "p=f32,c=f8,o=f32", rules=rules)
  np.testing.assert_array_equal(f(X, W), _bf16_dot("linear"))


def test_a_param_the_half_matmul_does_not_carry_is_refused_by_name(
    monkeypatch):
  monkeypatch.setattr(matmul, "DOT_PARAMS", tuple(
      p for p in matmul.DOT_PARAMS if p != "reduction_order"))
  with pytest.raises(mpolicy.UnsupportedPrimitiveError,
                     match="'reduction_order' of 'dot_general'"):
    mpolicy.amp(_dot("linear"), HALF)(X, W)
