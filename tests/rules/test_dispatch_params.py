"""Every parameter of an equation survives its rule.

For each primitive a rule rewrites (the matmul and convolution families'
half primitives, the ``full`` and ``promote`` classes re-typing operands,
the special rules of casts, broadcasts and gathers), the rewritten
equation holds every parameter of the original with the value it had,
except the one the rule decides (a matmul's result dtype). A family
without a sample here fails the test that lists them.
"""

import inspect

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest

import mpolicy
from mpolicy._src.rules import facts

from _helpers import all_eqns, walk_eqns

HALF = "p=f32,c=bf16,o=f32"
KEYS = jax.random.split(jax.random.PRNGKey(0), 4)
X = jax.random.normal(KEYS[0], (4, 8))
W = jax.random.normal(KEYS[1], (8, 8))
DIMS = (((1,), (0,)), ((), ()))
_ORDERS = "reduction_order" in inspect.signature(lax.dot_general).parameters
_ORDER = {"reduction_order": "linear"} if _ORDERS else {}
_HIGHEST = lax.Precision.HIGHEST


def _conv(x, w):
  img = (x @ w).reshape(1, 1, 4, 8)
  kernel = w[:3, :3].reshape(1, 1, 3, 3)
  return lax.conv_general_dilated(img, kernel, (1, 2), ((1, 1), (0, 2)),
                                  rhs_dilation=(2, 1), precision=_HIGHEST)


def _ragged(x, w):
  return lax.ragged_dot(x @ w, jnp.stack([w, -w]), jnp.array([1, 3]),
                        precision=_HIGHEST)


# Primitive -> (program, the params its rule decides).
SAMPLES = {
    "dot_general": (lambda x, w: lax.dot_general(
        x, w, DIMS, precision=_HIGHEST, **_ORDER), {"preferred_element_type"}),
    "ragged_dot_general": (_ragged, {"preferred_element_type"}),
    "conv_general_dilated": (_conv, {"preferred_element_type"}),
    "reduce_sum": (lambda x, w: jnp.sum(x @ w, axis=1, **_ORDER), set()),
    "cumsum": (lambda x, w: lax.cumsum(x @ w, axis=1, reverse=True), set()),
    "integer_pow": (lambda x, w: lax.integer_pow(x @ w, 3), set()),
    "exp": (lambda x, w: lax.exp(x @ w), set()),
    "concatenate": (lambda x, w: jnp.concatenate(
        [x @ w, jnp.exp(x)], axis=1), set()),
    "pad": (lambda x, w: lax.pad(x @ w, jnp.exp(x[0, 0]),
                                 ((1, 0, 1), (0, 2, 0))), set()),
    "convert_element_type": (lambda x, w: (x @ w).astype(jnp.bfloat16), set()),
    "broadcast_in_dim": (lambda x, w: x @ w + jnp.broadcast_to(
        w[0], (4, 8)), set()),
    "gather": (lambda x, w: jnp.take(w, jnp.array([2, 0]), axis=0) @ x.T,
               set()),
}


def _first(eqns, names):
  found = [e for e in eqns if e.primitive.name in names]
  assert found, names
  return found[0]


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_the_rewritten_equation_keeps_every_param(name):
  fn, decided = SAMPLES[name]
  original = _first(all_eqns(fn, X, W), {name})
  f = mpolicy.amp(fn, HALF)
  rewritten = _first(all_eqns(f, X, W), {name, f"amp_{name}"})
  for key, value in original.params.items():
    if key in decided:
      continue
    got = rewritten.params.get(key)  # amp's primitives bind None as absent.
    assert str(got) == str(value), (name, key, got, value)
  np.testing.assert_allclose(np.asarray(f(X, W), np.float32),
                             np.asarray(fn(X, W), np.float32), rtol=0.1,
                             atol=0.1 * float(jnp.abs(fn(X, W)).max()))


def test_every_rewriting_family_has_a_sample():
  # A family's lower rule makes its own primitive: each is sampled above.
  assert set(facts.names_with("lower")) <= set(SAMPLES)
  for name in ("convert_element_type", "broadcast_in_dim", "gather"):
    assert facts.of(_first_primitive(name)).special is not None


def _first_primitive(name):
  for e in walk_eqns(jax.make_jaxpr(SAMPLES[name][0])(X, W)):
    if e.primitive.name == name:
      return e.primitive
  raise AssertionError(name)
