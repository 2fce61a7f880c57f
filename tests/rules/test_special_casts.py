"""special._convert: a float32 statistic JAX narrows to float16 stays float32.

``jnp.var`` of a float16 array computes in float32 and returns float16; a
variance past 65504 is inf there, and a float16 LayerNorm then hands on its
offset alone with every value finite. Under `amp` the statistic stays
float32, as a ``full`` op's result does under float16.
"""

from __future__ import annotations

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

import mpolicy

F16 = "p=f32,c=f16,o=f32"


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
