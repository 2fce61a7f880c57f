"""What the interpreter does once per trace rather than once per layer."""

import jax
import jax.numpy as jnp
import numpy as np

import mpolicy
from mpolicy._src import lowp


def _layers(x, ws):
  for w in ws:
    x = jnp.tanh(x @ w)
  return x.sum()


def _misses(depth):
  ws = [jnp.full((16, 16), 0.01 * (i + 1)) for i in range(depth)]
  x = jnp.ones((4, 16))
  f = jax.jit(jax.value_and_grad(mpolicy.amp(_layers, "p=f32,c=bf16,o=f32"),
                                 argnums=1))
  lowp._cached_abstract_eval.cache_clear()
  value, grads = f(x, ws)
  # The cached avals give the numbers plain JAX gives, to bf16 accuracy.
  ref_value, ref_grads = jax.value_and_grad(_layers, argnums=1)(x, ws)
  np.testing.assert_allclose(value, ref_value, rtol=2e-2)
  for g, r in zip(grads, ref_grads):
    assert g.dtype == jnp.float32
    np.testing.assert_allclose(g, r, rtol=5e-2, atol=1e-3)
  return lowp._cached_abstract_eval.cache_info()


def test_matmul_avals_are_derived_once_per_shape_not_once_per_layer():
  shallow, deep = _misses(2), _misses(8)
  # The forward dot and its two transposes: traced once whatever the depth.
  assert deep.misses <= shallow.misses, (shallow, deep)
  assert deep.hits > shallow.hits, (shallow, deep)


def test_an_unhashable_param_is_traced_afresh():
  aval = jax.core.ShapedArray((2, 3), jnp.float32)
  calls = []

  def composite(a, b, *, tag):
    calls.append(tag)
    return a + b

  for _ in range(2):
    out = lowp._abstract_eval(composite, aval, aval, tag=["unhashable"])
    assert out.shape == (2, 3) and out.dtype == jnp.float32
  assert len(calls) == 2


def _scan_body_dots(jaxpr):
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "scan":
      body = eqn.params["jaxpr"].jaxpr
      return [e for e in body.eqns if e.primitive.name == "amp_dot_general"]
  raise AssertionError(f"no scan in {jaxpr}")


def test_a_scan_carry_is_not_a_parameter_on_every_jax_version():
  # A parameter goes into the matmul in float32 (the primitive casts it);
  # a scan's carry changes every iteration and goes in as bfloat16. Read
  # through jax_compat.scan_counts, so JAX 0.10's num_carry and JAX 0.11's
  # ft_in both mark it.
  def f(x, w):
    step = lambda h, _: (jnp.tanh(h @ w), None)
    return jax.lax.scan(step, x, None, length=3)[0]

  x, w = jnp.ones((2, 8)), jnp.ones((8, 8))
  jaxpr = jax.make_jaxpr(mpolicy.amp(f, "p=f32,c=bf16,o=f32"))(x, w).jaxpr
  dots = _scan_body_dots(jaxpr)
  assert len(dots) == 1
  carry, weight = (v.aval.dtype for v in dots[0].invars)
  assert carry == jnp.bfloat16, dots[0]
  assert weight == jnp.float32, dots[0]
