"""Shortcuts compute what the long way computes.

Identical layers bound as calls of one shared body (`repeats`) and the
interpretation of an unnamed sub-jaxpr reused at its next call site give
the bits that interpreting every equation where it stands gives
(``DEFAULT_RULES.with_sharing(False)``). Each program is evaluated one
primitive at a time both ways, so no XLA fusion keeps excess precision
around a call (or compiled, where both ways are the same program).
"""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpolicy
from mpolicy._src import jax_compat

import test_repeats as models

HALF = "p=f32,c=bf16,o=f32"
UNSHARED = mpolicy.DEFAULT_RULES.with_sharing(False)
_KEYS = jax.random.split(jax.random.PRNGKey(0), 8)
_WS = [(0.3 * jax.random.normal(_KEYS[i], (8, 8)),
        0.3 * jax.random.normal(_KEYS[i + 4], (8, 8))) for i in range(4)]
_X = jax.random.normal(jax.random.PRNGKey(1), (5, 8))


def _haiku_blocks(rules):
  f = mpolicy.transform_amp(models._forward, rules=rules)
  params = jax.jit(f.init)(jax.random.PRNGKey(0), models.X)

  def step(params, x):
    with mpolicy.push_policy(hk.Module, HALF):
      return f.apply(params, None, x)

  return step, (params, models.X)


def _named_layers(rules):
  f = mpolicy.amp(models._named_layers, HALF, rules=rules)
  return jax.value_and_grad(f, argnums=1), (_X, _WS)


def _pattern_inside_a_checkpoint(rules):
  f = mpolicy.amp(models._checkpointed_layers, "p=f32,c=f16,o=f32",
                  rules=rules)

  def run(x, ws):
    with mpolicy.push_policy("layer2/mm", "full"):
      return f(x, ws)

  return run, (models._X, models._WS)


def _one_jit_at_two_places(rules):
  mm = jax.jit(lambda a, b: a @ b)
  f = mpolicy.amp(lambda x, w1, w2: jnp.sum(jnp.tanh(mm(x, w1)) * mm(x, w2)),
                  HALF, rules=rules)
  return jax.value_and_grad(f, argnums=(1, 2)), (_X, *_WS[0])


def _scanned_named_layers(rules):
  def body(x, w):
    with jax.named_scope("layer"):
      return models._layer(x, w[0], w[1]), None

  f = mpolicy.amp(lambda x, ws: jnp.sum(jax.lax.scan(body, x, ws)[0]), HALF,
                  rules=rules)
  stacked = jnp.stack([jnp.stack(w) for w in _WS])
  return jax.grad(f, argnums=(0, 1)), (_X, stacked)


def _block_format_at_two_places(rules):
  mm = jax.jit(lambda a, b: a @ b)
  x = jax.random.normal(jax.random.PRNGKey(2), (32, 32))
  w = jax.random.normal(jax.random.PRNGKey(3), (32, 32))
  f = mpolicy.amp(lambda w1, w2, x: jnp.sum(mm(x, w1) * mm(x, w2)),
                  "p=f32,c=nvfp4,o=f32",
                  rules=rules.with_fp8(min_size=0, hadamard=False))
  return jax.grad(f, argnums=(0, 1)), (w, w, x)


PROGRAMS = {
    "haiku_blocks": _haiku_blocks,
    "named_layers": _named_layers,
    "pattern_inside_a_checkpoint": _pattern_inside_a_checkpoint,
    "one_jit_at_two_places": _one_jit_at_two_places,
    "scanned_named_layers": _scanned_named_layers,
}
# Programs whose two ways are the same program (block formats are never
# shared): compiled, since evaluating them one primitive at a time is slow.
COMPILED = {"block_format_at_two_places": _block_format_at_two_places}


def _values(make, rules, eager: bool) -> list:
  fn, args = make(rules)
  jax.clear_caches()
  closed = jax.make_jaxpr(fn)(*args)
  leaves = jax.tree_util.tree_leaves(args)
  if eager:
    with jax.disable_jit():
      return [np.asarray(v) for v in jax_compat.eval_eagerly(closed, *leaves)]
  return [np.asarray(v) for v in jax.jit(
      jax_compat.eval_eagerly, static_argnums=0)(closed, *leaves)]


# The Haiku model (10 s on 2 cores) runs once, in CI's newest job (-m ci),
# as tests/test_repeats.py's bit-for-bit check of Haiku blocks does; the
# plain-JAX programs run in every default run.
_ONCE = {"haiku_blocks"}


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.ci) if n in _ONCE else n
    for n in [*PROGRAMS, *COMPILED]])
def test_sharing_on_and_off_give_the_same_bits(name):
  make = PROGRAMS.get(name) or COMPILED[name]
  eager = name in PROGRAMS
  shared = _values(make, mpolicy.DEFAULT_RULES, eager)
  inline = _values(make, UNSHARED, eager)
  assert len(shared) == len(inline)
  for a, b in zip(shared, inline):
    assert a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True), name


def test_without_sharing_no_layer_is_a_call_and_explain_says_which_share():
  fn, args = _named_layers(mpolicy.DEFAULT_RULES)
  off, _ = _named_layers(UNSHARED)
  assert models._layer_calls(jax.make_jaxpr(fn)(*args).jaxpr) >= 3
  assert models._layer_calls(jax.make_jaxpr(off)(*args).jaxpr) == 0
  f = mpolicy.amp(models._named_layers, HALF)
  report = mpolicy.explain(f, *args)
  # layer_0 reads the call's input (a mark of its own): its own body.
  assert report.shared == (("layer_1", "layer_2", "layer_3"),)
  assert "one shared body: layer_1, layer_2, layer_3" in str(report)
  assert report.to_dict()["shared"] == [["layer_1", "layer_2", "layer_3"]]
  unshared = mpolicy.explain(mpolicy.amp(models._named_layers, HALF,
                                         rules=UNSHARED), *args)
  assert unshared.shared == () and unshared.rows == report.rows


def test_with_sharing_is_a_table_option():
  assert mpolicy.DEFAULT_RULES.sharing and not UNSHARED.sharing
  assert UNSHARED != mpolicy.DEFAULT_RULES
  assert UNSHARED == mpolicy.DEFAULT_RULES.with_sharing(False)
  assert hash(UNSHARED) == hash(mpolicy.DEFAULT_RULES.with_sharing(False))
  assert UNSHARED.with_sharing(True) == mpolicy.DEFAULT_RULES
  assert not UNSHARED.with_ops(full=["tanh"]).sharing
  assert not UNSHARED.with_fp8(seed=3).without_ops("exp").sharing
  assert "sharing=False" in repr(UNSHARED)
  with pytest.raises(TypeError, match=r"with_sharing\(on='no'\).*True"):
    mpolicy.DEFAULT_RULES.with_sharing("no")
