"""What the interpreter does once per trace rather than once per layer."""

import jax
import jax.numpy as jnp
import numpy as np

import mpolicy
from mpolicy._src.jax_compat import linearize as linearize_lib
from mpolicy._src.rules import amp_primitive


def _layers(x, ws):
  for w in ws:
    x = jnp.tanh(x @ w)
  return x.sum()


def _misses(depth):
  ws = [jnp.full((16, 16), 0.01 * (i + 1)) for i in range(depth)]
  x = jnp.ones((4, 16))
  f = jax.jit(jax.value_and_grad(mpolicy.amp(_layers, "p=f32,c=bf16,o=f32"),
                                 argnums=1))
  amp_primitive._cached_abstract_eval.cache_clear()
  # Linearizations cached by an earlier test (same shapes) would skip the
  # abstract evaluations counted here.
  linearize_lib._linearization.cache_clear()
  value, grads = f(x, ws)
  # The cached avals give the numbers plain JAX gives, to bf16 accuracy.
  ref_value, ref_grads = jax.value_and_grad(_layers, argnums=1)(x, ws)
  np.testing.assert_allclose(value, ref_value, rtol=2e-2)
  for g, r in zip(grads, ref_grads):
    assert g.dtype == jnp.float32
    np.testing.assert_allclose(g, r, rtol=5e-2, atol=1e-3)
  return amp_primitive._cached_abstract_eval.cache_info()


def test_matmul_avals_are_derived_once_per_shape_not_once_per_layer():
  shallow, deep = _misses(2), _misses(8)
  # The forward dot and its two transposes: traced once whatever the depth.
  assert shallow.misses > 0
  assert deep.misses <= shallow.misses, (shallow, deep)
  # Later layers are served by the stored linearizations (`staged`): the
  # deeper model asks no more often than the shallow one.
  assert deep.hits + deep.misses <= shallow.hits + shallow.misses, (
      shallow, deep)


def test_an_unhashable_param_is_traced_afresh():
  aval = jax.core.ShapedArray((2, 3), jnp.float32)
  calls = []

  def composite(a, b, *, tag):
    calls.append(tag)
    return a + b

  for _ in range(2):
    out = amp_primitive._abstract_eval(composite, aval, aval, tag=["unhashable"])
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


@jax.jit
def _block(x, w):
  return jnp.tanh(x @ w)


def _named_layers(x, w):
  for i in range(4):
    with jax.named_scope(f"layer_{i}"):
      x = _block(x, w)
  return x


def _inner_jaxprs(jaxpr):
  return [e.params["jaxpr"] for e in jaxpr.eqns
          if e.primitive.name in ("pjit", "jit")]


def test_a_nested_jit_is_interpreted_once_for_all_layers_under_one_policy():
  x, w = jnp.ones((2, 8)), jnp.ones((8, 8))
  f = mpolicy.amp(_named_layers, "p=f32,c=bf16,o=f32")
  inner = _inner_jaxprs(jax.make_jaxpr(f)(x, w).jaxpr)
  assert len(inner) == 4
  # Layer 0 reads the float32 input, layers 1-3 bfloat16 activations: one
  # interpretation for each.
  assert inner[1] is inner[2] is inner[3], "each layer re-interpreted"
  assert inner[0] is not inner[1]
  assert "amp_dot_general" in str(inner[1])


def test_a_layer_under_another_policy_gets_its_own_interpretation():
  x, w = jnp.ones((2, 8)), jnp.ones((8, 8))
  f = mpolicy.amp(_named_layers, "p=f32,c=bf16,o=f32")
  with mpolicy.push_policy("layer_2", "full"):
    inner = _inner_jaxprs(jax.make_jaxpr(f)(x, w).jaxpr)
  # Layers 1 and 2 read the same bfloat16 activations; layer 2 runs as
  # written.
  assert inner[2] is not inner[1]
  assert "amp_dot_general" not in str(inner[2])
  assert "amp_dot_general" in str(inner[1])
  # explain sees every call site, shared interpretation or not.
  report = mpolicy.explain(f, x, w)
  scopes = {row.scope for row in report.rows if row.primitive == "tanh"}
  assert scopes == {f"layer_{i}" for i in range(4)}, scopes
