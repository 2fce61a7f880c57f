"""float8 matmuls at the edges: empty operands, tiny magnitudes, vmap."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpolicy
from mpolicy._src.rules import fp8_scaling

F8 = "p=f32,c=f8,o=f32"
BF16 = "p=f32,c=bf16,o=f32"


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("shapes", [((0, 8), (8, 4)), ((4, 0), (0, 3)),
                                    ((2, 0, 8), (8, 4))])
def test_a_zero_size_matmul_runs_and_its_gradients_too(shapes):
  x, w = jnp.ones(shapes[0]), jnp.ones(shapes[1])
  f = mpolicy.amp(lambda x, w: x @ w, F8)
  out = jax.jit(f)(x, w)
  np.testing.assert_array_equal(out, x @ w)  # empty, or all zeros
  gx, gw = jax.grad(lambda x, w: f(x, w).sum(), argnums=(0, 1))(x, w)
  assert gx.shape == x.shape and gw.shape == w.shape
  assert not np.any(np.asarray(gw)) and not np.any(np.asarray(gx))
  assert fp8_scaling.quantize(jnp.ones((0, 3)))[1] == 1.0


@pytest.mark.parametrize("magnitude", [1e-17, 3e-18])
def test_tiny_operands_are_as_accurate_as_bf16(magnitude):
  # amax(x) * amax(w) = magnitude ** 2 < 2e-33: the product of the two
  # scales underflows float32; applied one at a time they do not.
  kx, kw = jax.random.split(jax.random.PRNGKey(0))
  x = jax.random.normal(kx, (16, 32)) * magnitude
  w = jax.random.normal(kw, (32, 8)) * magnitude
  exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  got = mpolicy.amp(lambda x, w: x @ w, F8)(x, w)
  bf16 = mpolicy.amp(lambda x, w: x @ w, BF16)(x, w)
  assert np.all(np.isfinite(got)) and np.any(np.asarray(got) != 0)
  assert _rel(got, exact) < 0.1, _rel(got, exact)
  assert _rel(bf16, exact) < 0.02
  g = jax.grad(lambda w: mpolicy.amp(lambda x, w: x @ w, F8)(x, w).sum())(w)
  g_exact = np.broadcast_to(np.asarray(x, np.float64).sum(0)[:, None],
                            w.shape)
  assert _rel(g, g_exact) < 0.1


def _examples():
  kx, kw = jax.random.split(jax.random.PRNGKey(1))
  xs = jax.random.normal(kx, (4, 8, 32))
  xs = xs.at[1].multiply(1e-6)  # one example a million times smaller
  w = jax.random.normal(kw, (32, 16))
  return xs, w


def test_amp_of_vmap_keeps_a_small_example_like_vmap_of_amp():
  xs, w = _examples()
  f = lambda x, w: jnp.tanh(x @ w) * 1e6
  outer = mpolicy.amp(jax.vmap(f, in_axes=(0, None)), F8)(xs, w)
  inner = jax.vmap(mpolicy.amp(f, F8), in_axes=(0, None))(xs, w)
  exact = jax.vmap(f, in_axes=(0, None))(xs, w)
  small = np.asarray(outer[1])
  assert np.any(small != 0), "the small example came back as zeros"
  assert _rel(outer[1], exact[1]) < 0.1, _rel(outer[1], exact[1])
  assert _rel(inner[1], exact[1]) < 0.1
  np.testing.assert_allclose(outer, inner, rtol=0.02, atol=1e-3 * 1e6 * 1e-6)


def test_a_batched_matmul_scales_each_batch_element():
  kx, ky = jax.random.split(jax.random.PRNGKey(2))
  a = jax.random.normal(kx, (3, 8, 16)).at[0].multiply(1e-7)
  b = jax.random.normal(ky, (3, 16, 4)).at[2].multiply(1e-7)
  f = mpolicy.amp(lambda a, b: jnp.einsum("bmk,bkn->bmn", a, b), F8)
  got, exact = f(a, b), jnp.einsum("bmk,bkn->bmn", a, b)
  for i in range(3):
    assert _rel(got[i], exact[i]) < 0.1, (i, _rel(got[i], exact[i]))
  ga = jax.grad(lambda a: f(a, b).sum())(a)
  ga_exact = jax.grad(lambda a: jnp.einsum("bmk,bkn->bmn", a, b).sum())(a)
  for i in range(3):
    assert _rel(ga[i], ga_exact[i]) < 0.1, i
