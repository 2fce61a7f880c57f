"""Binds under `jax.grad` are linearized once per signature (`staged`): the
same program as plain binds, linearized once rather than once per layer."""

import jax
import jax.numpy as jnp
import numpy as np

import mpolicy
from mpolicy._src import staged
from mpolicy._src.jax_compat import linearize as linearize_lib
import _helpers


def _layers(x, ws):
  for w in ws:
    h = x @ w
    x = jax.nn.gelu(h - h.mean(-1, keepdims=True))
  return jnp.exp(x).sum()


def _grad_fn(depth):
  ws = [jnp.full((16, 16), 0.01 * (i + 1)) for i in range(depth)]
  x = jnp.linspace(-1, 1, 64).reshape(4, 16)
  g = jax.grad(mpolicy.amp(_layers, "p=f32,c=bf16,o=f32"), argnums=1)
  return g, (x, ws)


def _plain(monkeypatch):
  monkeypatch.setattr(staged, "_bound", lambda primitive, params: None)
  monkeypatch.setattr(staged, "call", lambda fn, *a: fn(*a))


def test_the_program_and_its_values_are_those_of_plain_binds(monkeypatch):
  g, args = _grad_fn(3)
  staged_jaxpr = jax.make_jaxpr(g)(*args)
  staged_grads = g(*args)
  _plain(monkeypatch)
  plain_jaxpr = jax.make_jaxpr(g)(*args)
  # The same equations, in the same order, from the same lines of code.
  assert _printed(staged_jaxpr) == _printed(plain_jaxpr)
  assert _helpers.same_bits(staged_grads, g(*args))


def _printed(jaxpr) -> str:
  return jaxpr.pretty_print(source_info=True, name_stack=True,
                            use_color=False)


def _linearizations():
  return linearize_lib._linearization.cache_info()


def _clear_linearizations():
  # Only mpolicy's cache: `jax.clear_caches()` would make every later test
  # in this process compile its programs again.
  linearize_lib._linearization.cache_clear()
  assert _linearizations().currsize == 0


def test_a_deeper_model_reuses_the_same_linearizations():
  _clear_linearizations()
  base = _linearizations()
  g, args = _grad_fn(2)
  jax.make_jaxpr(g)(*args)
  shallow = _linearizations()
  g, args = _grad_fn(6)
  jax.make_jaxpr(g)(*args)
  deep = _linearizations()
  # Counted from `base` (a cleared cache may keep counting).
  assert shallow.misses > base.misses
  assert deep.misses == shallow.misses, (base, shallow, deep)
  assert deep.hits - shallow.hits > 2 * (shallow.hits - base.hits), (
      base, shallow, deep)


def test_without_linearization_primitives_bind_plainly():
  _clear_linearizations()
  g, (x, ws) = _grad_fn(2)
  f = mpolicy.amp(_layers, "p=f32,c=bf16,o=f32")
  jax.make_jaxpr(f)(x, ws)
  jax.jit(f)(x, ws)
  jax.jvp(lambda x: f(x, ws), (x,), (x,))  # Forward mode: plain binds.
  assert _linearizations().currsize == 0


def test_under_vmap_and_forward_mode_values_are_plain_binds(monkeypatch):
  g, (x, ws) = _grad_fn(2)
  f = mpolicy.amp(_layers, "p=f32,c=bf16,o=f32")
  xs = jnp.stack([x, 2 * x])
  batched = jax.vmap(lambda x: g(x, ws))(xs)
  # A Hessian-vector product: forward mode over the linearized binds.
  hessian_vector = jax.jvp(lambda x: jax.grad(f)(x, ws), (x,), (x,))
  with monkeypatch.context() as m:
    _plain(m)
    want_batched = jax.vmap(lambda x: g(x, ws))(xs)
    want_hv = jax.jvp(lambda x: jax.grad(f)(x, ws), (x,), (x,))
  assert _helpers.same_bits(batched, want_batched)
  assert _helpers.same_bits(hessian_vector, want_hv)


def test_collectives_and_unhashable_params_bind_plainly():
  assert staged._bound(jax.lax.add_p, {}) is not None
  psum = jax.make_jaxpr(lambda x: jax.lax.psum(x, "i"), axis_env=[("i", 2)])(
      1.0).eqns[0]
  assert staged._bound(psum.primitive, psum.params) is None
  assert staged._bound(jax.lax.add_p, {"p": [1]}) is None
  # Under grad, in a vmap with a named axis: as plain JAX computes it.
  out = jax.vmap(jax.grad(lambda x: staged.bind(psum.primitive, x * x,
                                                **psum.params)),
                 axis_name="i")(jnp.arange(2.0))
  want = jax.vmap(jax.grad(lambda x: jax.lax.psum(x * x, "i")),
                  axis_name="i")(jnp.arange(2.0))
  np.testing.assert_array_equal(out, want)
