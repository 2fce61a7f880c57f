"""Specification: matmuls stay half x half, f32-accumulated, under AD."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np

from mpolicy._src import lowp
from mpolicy._src.interpreter import amp

HALF = "p=f32,c=bf16,o=f32"
BF16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
X = jnp.linspace(-1, 1, 24, dtype=F32).reshape(2, 3, 4)
W = jnp.linspace(-0.5, 0.5, 20, dtype=F32).reshape(4, 5)
V = jnp.linspace(-0.5, 0.5, 10, dtype=F32).reshape(5, 2)


def mlp(x, w, v):
  return jnp.sum(jax.nn.log_softmax(jnp.tanh(x @ w) @ v))


def dot_eqns(closed):
  out = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if "dot_general" in eqn.primitive.name:
        out.append(eqn)
      for v in eqn.params.values():
        for sub in (v if isinstance(v, tuple) else (v,)):
          if hasattr(sub, "eqns") or hasattr(sub, "jaxpr"):
            walk(getattr(sub, "jaxpr", sub))

  walk(closed.jaxpr)
  return out


def test_backward_matmuls_are_half_by_half():
  grad = jax.grad(amp(mlp, HALF), argnums=(0, 1, 2))
  dots = dot_eqns(jax.make_jaxpr(grad)(X, W, V))
  assert len(dots) == 6  # 2 forward + 2 x 2 backward.
  for eqn in dots:
    assert [np.dtype(v.aval.dtype) for v in eqn.invars] == [BF16, BF16], eqn


def test_backward_matmuls_accumulate_in_f32_in_hlo():
  grad = jax.jit(jax.grad(amp(mlp, HALF), argnums=(0, 1, 2)))
  hlo = grad.lower(X, W, V).as_text()
  dots = [line for line in hlo.splitlines() if "dot_general" in line]
  assert len(dots) == 6
  for line in dots:
    operands = re.findall(r"tensor<[^>]*>", line.split("->")[0].split(":")[-1])
    assert operands and all("bf16" in t for t in operands), line
    assert "f32" in line.split("->")[-1], line


def test_gradient_values_and_dtypes():
  got = jax.grad(amp(mlp, HALF), argnums=(0, 1, 2))(X, W, V)
  want = jax.grad(mlp, argnums=(0, 1, 2))(X, W, V)
  for a, b in zip(got, want):
    assert a.dtype == F32
    np.testing.assert_allclose(a, b, rtol=5e-2, atol=5e-2)


def test_jvp_and_jacfwd_work():
  f = amp(mlp, HALF)
  _, t = jax.jvp(lambda w: f(X, w, V), (W,), (jnp.ones_like(W),))
  _, t_ref = jax.jvp(lambda w: mlp(X, w, V), (W,), (jnp.ones_like(W),))
  np.testing.assert_allclose(t, t_ref, rtol=5e-2, atol=5e-2)
  jac = jax.jacfwd(lambda w: f(X, w, V))(W)
  np.testing.assert_allclose(jac, jax.grad(lambda w: mlp(X, w, V))(W),
                             rtol=5e-2, atol=5e-2)


def test_vmap_of_grad_uses_batching_rule():
  f = jax.vmap(jax.grad(amp(mlp, HALF), argnums=1), in_axes=(0, None, None))
  got = f(X[:, None], W, V)
  want = jax.vmap(jax.grad(mlp, argnums=1), in_axes=(0, None, None))(X[:, None], W, V)
  np.testing.assert_allclose(got, want, rtol=5e-2, atol=5e-2)


def test_amp_dot_general_primitive_directly():
  a, b = X[0].astype(BF16), W.astype(BF16)
  dn = (((1,), (0,)), ((), ()))
  out = lowp.amp_dot_general(a, b, dimension_numbers=dn, out_dtype=BF16)
  assert out.dtype == BF16
  ref = jax.lax.dot_general(a, b, dn, preferred_element_type=F32).astype(BF16)
  np.testing.assert_array_equal(out, ref)
  np.testing.assert_array_equal(jax.jit(lowp.amp_dot_general, static_argnames=(
      "dimension_numbers", "precision", "out_dtype"))(
          a, b, dimension_numbers=dn, out_dtype=BF16), ref)
