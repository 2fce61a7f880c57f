"""Under a float32 policy (``full``) the code runs exactly as written.

No op rule applies where ``full`` governs, the ``full`` class's up-cast of
half inputs included: half values the code makes itself stay half. Where a
half policy governs, or none does, that safety net holds.
"""

from __future__ import annotations

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpolicy

from _helpers import all_eqns

BF16, F32 = jnp.bfloat16, jnp.float32
X = jnp.linspace(-3.0, 3.0, 64, dtype=F32)


def hand_cast_exp(x):
  return (jnp.exp(x.astype(BF16)) * 3).astype(F32)


class HandCastAttention(hk.Module):
  """An attention whose scores the code itself holds in bfloat16."""

  def __call__(self, q):
    h = hk.Linear(16)(q).astype(BF16)
    s = jax.nn.softmax(h @ h.T / 4.0)
    return (s @ h).astype(F32)


def _attention(q):
  return HandCastAttention()(q)


def _exp_dtypes(fn, *args):
  return [str(e.invars[0].aval.dtype) for e in all_eqns(fn, *args)
          if e.primitive.name == "exp"]


def test_amp_full_is_bitwise_plain_jax_on_hand_made_half_values():
  f = mpolicy.amp(hand_cast_exp, "full")
  np.testing.assert_array_equal(jax.jit(f)(X), jax.jit(hand_cast_exp)(X))
  assert _exp_dtypes(f, X) == ["bfloat16"]
  # And the jaxpr is the code's own: no up-cast, no rounding made explicit.
  assert ([e.primitive.name for e in all_eqns(f, X)]
          == [e.primitive.name for e in all_eqns(hand_cast_exp, X)])


def test_amp_full_is_bitwise_under_grad():
  loss = lambda x: jnp.sum(hand_cast_exp(x) ** 2)
  g = jax.jit(jax.grad(mpolicy.amp(loss, "full")))(X)
  np.testing.assert_array_equal(g, jax.jit(jax.grad(loss))(X))


def test_transform_amp_full_module_policy_is_bitwise_hk_transform():
  q = jax.random.normal(jax.random.PRNGKey(0), (12, 8))
  plain = hk.transform(_attention)
  params = plain.init(jax.random.PRNGKey(1), q)
  with mpolicy.push_policy(hk.Module, "full"):
    amped = mpolicy.transform_amp(_attention)
    got = jax.jit(amped.apply)(params, None, q)
    report = mpolicy.explain(amped.apply, params, None, q)
  np.testing.assert_array_equal(got, jax.jit(plain.apply)(params, None, q))
  exp_rows = [r for r in report.rows if r.primitive == "exp"]
  assert [(r.ran_in, r.rule) for r in exp_rows] == [("bfloat16", "as written")]
  assert "no op rule applies" in exp_rows[0].decided_by


@pytest.mark.parametrize("policy", [None, "p=f32,c=bf16,o=f32"])
def test_safety_net_upcasts_half_inputs_where_half_or_no_policy_governs(
    policy):
  f = mpolicy.amp(hand_cast_exp, policy)
  assert _exp_dtypes(f, X) == ["float32"]


def test_full_region_reads_half_values_from_outside_as_the_code_had_them():
  def fn(x, w):
    h = x @ w  # bfloat16 under the outer policy.
    with jax.named_scope("head"):
      return jnp.exp(h) + jnp.exp(h.astype(BF16)).astype(F32)
  x, w = jnp.ones((2, 3)), jnp.full((3, 4), 0.3)
  with mpolicy.push_policy("head", "full"):
    f = mpolicy.amp(fn, "p=f32,c=bf16,o=f32")
    # The code's float32 value is read in float32, its own bfloat16 stays.
    assert _exp_dtypes(f, x, w) == ["float32", "bfloat16"]
