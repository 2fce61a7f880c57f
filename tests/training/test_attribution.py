"""make_train_step(attribute_overflow=True): which parameters overflowed."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest

import mpolicy

from _helpers import all_eqns
from _helpers import poison
from _helpers import same_bits


_poison = poison


def _loss(params, x, factor):
  h = jnp.tanh(x @ _poison(params["enc"]["w"], factor))
  return jnp.mean((h @ params["dec"]["w"]) ** 2)


def _setup():
  params = {"enc": {"w": jnp.full((4, 8), 0.1, jnp.bfloat16)},
            "dec": {"w": jnp.full((8, 1), 0.2, jnp.bfloat16)}}
  tx = optax.adam(1e-2)
  x = jnp.ones((16, 4), jnp.bfloat16)
  return params, tx, x


def test_flags_and_paths_name_the_overflowing_parameter():
  params, tx, x = _setup()
  step = jax.jit(mpolicy.make_train_step(_loss, tx, attribute_overflow=True))
  opt_state = tx.init(params)
  ls = mpolicy.DynamicLossScale(2. ** 15)
  out = step(params, opt_state, ls, x, jnp.float32(jnp.inf))
  assert not bool(out.grads_finite)
  assert jax.tree_util.tree_structure(out.nonfinite) == (
      jax.tree_util.tree_structure(params))
  assert bool(out.nonfinite["enc"]["w"]) and not bool(out.nonfinite["dec"]["w"])
  assert out.nonfinite["enc"]["w"].dtype == jnp.bool_
  assert out.nonfinite["enc"]["w"].shape == ()
  assert out.nonfinite_paths() == ["enc/w"]
  assert same_bits(out.params, params)  # Skipped, as without attribution.
  assert same_bits(out.opt_state, opt_state)
  clean = step(params, opt_state, ls, x, jnp.float32(1.))
  assert bool(clean.grads_finite) and clean.nonfinite_paths() == []


def test_with_state_the_flags_come_after_the_model_state():
  params, tx, x = _setup()

  def loss_fn(params, state, x, factor):
    return _loss(params, x, factor), {"n": state["n"] + 1}

  step = jax.jit(mpolicy.make_train_step(
      loss_fn, tx, has_state=True, attribute_overflow=True))
  out = step(params, {"n": jnp.int32(0)}, tx.init(params),
             mpolicy.NoOpLossScale(), x, jnp.float32(jnp.nan))
  assert int(out.model_state["n"]) == 0  # Skipped: the old state.
  assert out.nonfinite_paths() == ["enc/w"]


def test_without_attribution_the_result_says_how_to_ask():
  params, tx, x = _setup()
  out = mpolicy.make_train_step(_loss, tx)(
      params, tx.init(params), mpolicy.NoOpLossScale(), x, jnp.float32(1.))
  assert out.nonfinite is None
  with pytest.raises(ValueError, match=r"attribute_overflow=True"):
    out.nonfinite_paths()


def test_attribution_adds_no_backward_pass_and_no_host_transfer():
  params, tx, x = _setup()
  args = (params, tx.init(params), mpolicy.DynamicLossScale(2. ** 15), x,
          jnp.float32(1.))
  plain = all_eqns(mpolicy.make_train_step(_loss, tx), *args)
  flagged = all_eqns(
      mpolicy.make_train_step(_loss, tx, attribute_overflow=True), *args)
  count = lambda eqns, word: sum(word in e.primitive.name for e in eqns)
  for word in ("dot", "custom_vjp", "tanh"):
    assert count(flagged, word) == count(plain, word), word
  assert count(flagged, "callback") == 0
  # Two parameters: at most a finiteness test and a reduction for each.
  assert len(flagged) - len(plain) <= 3 * 2 * 2


EIGHT_DEVICES = r"""
import json
import jax, jax.numpy as jnp, optax
import mpolicy

from _helpers import poison

def loss_fn(params, x, factor):
  h = jnp.tanh(x @ params["a"]) @ poison(params["b"], factor)
  return jnp.mean(h ** 2)

tx = optax.sgd(0.1)
step = jax.pmap(mpolicy.make_train_step(loss_fn, tx, axis_name="d",
                                        attribute_overflow=True),
                axis_name="d")
n = jax.local_device_count()
params = {"a": jnp.full((4, 8), .1), "b": jnp.full((8, 2), .1)}
rep = lambda t: jax.tree_util.tree_map(lambda v: jnp.stack([v] * n), t)
factor = jnp.ones(n).at[3].set(jnp.inf)  # Only device 3 overflows.
out = step(rep(params), rep(tx.init(params)), rep(mpolicy.NoOpLossScale()),
           jnp.ones((n, 2, 4)), factor)
pmins = lambda flag: str(jax.make_jaxpr(jax.pmap(mpolicy.make_train_step(
    loss_fn, tx, axis_name="d", attribute_overflow=flag), axis_name="d"))(
        rep(params), rep(tx.init(params)), rep(mpolicy.NoOpLossScale()),
        jnp.ones((n, 2, 4)), factor)).count("pmin")
print("FACTS=" + json.dumps({
    "devices": n,
    "pmins": [pmins(False), pmins(True)],
    "finite": [bool(f) for f in out.grads_finite],
    "b_flags": [bool(f) for f in out.nonfinite["b"]],
    "a_flags": [bool(f) for f in out.nonfinite["a"]],
    "paths": out.nonfinite_paths(),
}))
"""


def test_under_pmap_every_device_reports_the_overflow_of_one(eight_devices):
  facts = eight_devices
  assert facts["devices"] == 8
  assert facts["finite"] == [False] * 8
  assert facts["b_flags"] == [True] * 8
  assert facts["a_flags"] == [False] * 8
  assert facts["paths"] == ["b"]
  plain, flagged = facts["pmins"]
  assert plain >= 1 and flagged == plain + 1  # One collective for all flags.
