"""special._convert: a float32 statistic JAX narrows to float16 stays float32.

``jnp.var`` of a float16 array computes in float32 and returns float16; a
variance past 65504 is inf there, and a float16 LayerNorm then hands on its
offset alone with every value finite. Under `amp` the statistic stays
float32, as a ``full`` op's result does under float16.
"""

from __future__ import annotations

import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

import mpolicy

F16 = "p=f32,c=f16,o=f32"
HALF = "p=f32,c=bf16,o=f32"


def _layer_norm():
  return lambda x: hk.LayerNorm(-1, create_scale=True, create_offset=True)(x)


def test_a_float16_layer_norm_of_a_wide_input_matches_float32():
  x = (jnp.linspace(-1.0, 1.0, 128) * 600.0)[None]  # Variance 1.2e5.
  plain = hk.transform(_layer_norm())
  params = plain.init(None, x)
  want = plain.apply(params, None, x)
  # Plain JAX in float16: the variance overflows and the output is the
  # offset (zeros): the failure this rule removes.
  half = plain.apply(params, None, x.astype(jnp.float16))
  assert float(jnp.max(jnp.abs(half))) == 0.0
  model = mpolicy.transform_amp(_layer_norm())
  with mpolicy.push_policy(hk.Module, F16):
    got = model.apply(params, None, x)
    grads = jax.grad(lambda p: jnp.sum(model.apply(p, None, x) ** 2))(params)
  np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=2e-3)
  want_grads = jax.grad(lambda p: jnp.sum(plain.apply(p, None, x) ** 2))(
      params)
  for g, w in zip(jax.tree_util.tree_leaves(grads),
                  jax.tree_util.tree_leaves(want_grads)):
    assert g.dtype == jnp.float32
    np.testing.assert_allclose(g, w, rtol=2e-3, atol=2e-2)


def test_explain_says_the_statistic_stays_float32():
  f = mpolicy.amp(lambda x: jnp.var(x.astype(jnp.float16)), F16)
  x = jnp.linspace(-1.0, 1.0, 64) * 600.0
  assert f(x).dtype == jnp.float32 and np.isfinite(float(f(x)))
  text = str(mpolicy.explain(f, x))
  assert "kept in float32" in text and "overflow" in text


def test_a_float16_mean_past_65504_stays_finite():
  # exp runs in float32; jnp.mean sums in float32 and JAX casts the mean
  # back to float16: kept in float32, 1.6e5 is no inf.
  f = mpolicy.amp(lambda x: jnp.mean(jnp.exp(x)), F16)
  y = f(jnp.full(4, 12.0, jnp.float16))
  np.testing.assert_allclose(float(y), np.exp(12.0), rtol=1e-3)


def test_a_written_cast_to_float16_stays_as_written():
  # The code's own cast is the code's choice: it overflows as written (the
  # float32 sum, 2.3e7, would not).
  f = mpolicy.amp(lambda x: jnp.sum(x * x).astype(jnp.float16), F16)
  assert np.isinf(float(f(jnp.full((64,), 600.0))))


def test_a_bfloat16_statistic_is_narrowed_as_written():
  # bfloat16 has float32's range: the statistic is rounded as JAX rounds it.
  x = jnp.linspace(-1.0, 1.0, 64) * 600.0
  f = mpolicy.amp(lambda x: jnp.var(x.astype(jnp.bfloat16)),
                  "p=f32,c=bf16,o=f32")
  rounded = float(jnp.var(x.astype(jnp.bfloat16)))
  assert float(f(x)) == rounded != float(jnp.var(x.astype(jnp.bfloat16)
                                                  .astype(jnp.float32)))


class _LossModel(nn.Module):
  """A linen model that computes its own mean per-token loss."""

  @nn.compact
  def __call__(self, x, labels):
    z = nn.Dense(100)(jnp.tanh(nn.Dense(64)(x)))
    lse = jax.nn.logsumexp(z, axis=-1)
    picked = jnp.take_along_axis(z, labels[:, None], axis=-1)[:, 0]
    return jnp.mean(lse - picked)


def test_a_loss_inside_a_module_under_a_bf16_class_policy_stays_float32():
  """Under a bfloat16 class policy the module's code is traced on bfloat16
  values (the policy casts its inputs); `mean` and `logsumexp` compute in
  float32 and JAX rounds their results back to bfloat16. Kept in float32,
  the loss is what `amp(fn, policy)` gives, not a bfloat16 rounding of
  it."""
  x = jax.random.normal(jax.random.PRNGKey(0), (16, 32))
  labels = jax.random.randint(jax.random.PRNGKey(1), (16,), 0, 100)
  model = _LossModel()
  variables = model.init(jax.random.PRNGKey(2), x, labels)
  fn = lambda v, x, l: model.apply(v, x, l)
  want = mpolicy.amp(fn, HALF)(variables, x, labels)
  with mpolicy.push_policy(_LossModel, HALF):
    got = mpolicy.amp(fn)(variables, x, labels)
    rows = mpolicy.explain(mpolicy.amp(fn), variables, x, labels).rows
  assert got.dtype == jnp.float32
  assert float(got) == float(want)
  assert float(got) != float(jnp.asarray(got, jnp.bfloat16))  # Not rounded.
  (sub,) = [r for r in rows if r.primitive == "sub"
            and r.module_class is not None and r.ran_in == "float32"][-1:]
  assert "bfloat16" in sub.in_dtypes  # lse (float32) - z[label] (bfloat16).
