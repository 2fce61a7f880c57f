"""Binds under autodiff go through cached inline jits (`staged`): the same
program, linearized once per signature rather than once per layer."""

import collections

import jax
import jax.numpy as jnp
import numpy as np

import mpolicy
from mpolicy._src import staged
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


def _prims(jaxpr):
  """The first-order equations, sub-jaxprs included (JAX 0.12 keeps the
  calls of inline jits in the jaxpr until it lowers them)."""
  return collections.Counter(
      (e.primitive.name, tuple(str(v.aval) for v in e.outvars))
      for e in _helpers.walk_eqns(jaxpr) if e.primitive.name != "jit")


def test_the_program_and_its_values_are_those_of_plain_binds(monkeypatch):
  g, args = _grad_fn(3)
  staged_jaxpr = jax.make_jaxpr(g)(*args)
  staged_grads = g(*args)
  monkeypatch.setattr(staged, "_jitted", lambda primitive, params: None)
  monkeypatch.setattr(staged, "call", lambda fn, *a: fn(*a))
  plain_jaxpr = jax.make_jaxpr(g)(*args)
  assert _prims(staged_jaxpr) == _prims(plain_jaxpr)
  assert _helpers.same_bits(staged_grads, g(*args))


def test_binds_are_staged_only_where_jax_inlines_inline_jits_when_staging():
  jaxpr = jax.make_jaxpr(jax.jit(lambda x: x * 2, inline=True))(1.0)
  inlines = "jit" not in {e.primitive.name for e in jaxpr.eqns}
  assert staged.active() == inlines
  staged._cached_jit.cache_clear()
  g, args = _grad_fn(2)
  top = [e.primitive.name for e in jax.make_jaxpr(g)(*args).jaxpr.eqns]
  used = staged._cached_jit.cache_info().currsize
  if inlines:  # Staged, and inlined: no jit equation per bind.
    assert used > 0 and "jit" not in top, (used, top)
  else:  # A jit equation per bind would stay in the jaxpr: not staged.
    assert used == 0


def test_a_deeper_model_reuses_the_same_staged_binds():
  staged._cached_jit.cache_clear()
  g, args = _grad_fn(2)
  jax.make_jaxpr(g)(*args)
  shallow = staged._cached_jit.cache_info()
  g, args = _grad_fn(6)
  jax.make_jaxpr(g)(*args)
  deep = staged._cached_jit.cache_info()
  if not staged.active():
    assert deep.currsize == 0
    return
  assert shallow.misses > 0
  assert deep.misses == shallow.misses, (shallow, deep)
  assert deep.hits > 2 * shallow.hits, (shallow, deep)


def test_without_autodiff_primitives_bind_plainly():
  staged._cached_jit.cache_clear()
  g, (x, ws) = _grad_fn(2)
  f = mpolicy.amp(_layers, "p=f32,c=bf16,o=f32")
  jax.make_jaxpr(f)(x, ws)
  jax.jit(f)(x, ws)
  assert staged._cached_jit.cache_info().currsize == 0


def test_collectives_and_unhashable_params_bind_plainly():
  assert staged._jitted(jax.lax.add_p, {}) is not None
  psum = jax.make_jaxpr(lambda x: jax.lax.psum(x, "i"), axis_env=[("i", 2)])(
      1.0).eqns[0]
  assert staged._jitted(psum.primitive, psum.params) is None
  assert staged._jitted(jax.lax.add_p, {"p": [1]}) is None
  # Under grad, in a vmap with a named axis: as plain JAX computes it.
  out = jax.vmap(jax.grad(lambda x: staged.bind(psum.primitive, x * x,
                                                **psum.params)),
                 axis_name="i")(jnp.arange(2.0))
  want = jax.vmap(jax.grad(lambda x: jax.lax.psum(x * x, "i")),
                  axis_name="i")(jnp.arange(2.0))
  np.testing.assert_array_equal(out, want)
