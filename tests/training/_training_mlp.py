"""A small MLP whose gradients can be poisoned per leaf, for the training tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import mpolicy


from _helpers import poison  # pylint: disable=unused-import

LEAVES = ("b1", "b2", "w1", "w2")


def init_mlp(seed=0, width=32):
  k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
  return {"w1": jax.random.normal(k1, (8, width)) * 0.4,
          "b1": jnp.zeros(width),
          "w2": jax.random.normal(k2, (width, 1)) * 0.2,
          "b2": jnp.zeros(1)}


def data(seed=1, n=256):
  x = jax.random.normal(jax.random.PRNGKey(seed), (n, 8))
  y = jnp.sin(x[:, :1] * 2.0) + 0.5 * x[:, 1:2] * x[:, 2:3]
  return x, y


def mlp_loss(params, x, y, factors, policy):
  params = {k: poison(v, factors[k]) for k, v in params.items()}
  p, x = policy.cast_to_compute((params, x))
  h = jnp.tanh(x @ p["w1"] + p["b1"])
  out = policy.cast_to_output(h @ p["w2"] + p["b2"])
  return jnp.mean((out.astype(jnp.float32) - y) ** 2)


def clean(n=1.0):
  return {k: jnp.float32(n) for k in LEAVES}


F32 = mpolicy.get_policy("p=f32,c=f32,o=f32")
BF16 = mpolicy.get_policy("p=f32,c=bf16,o=f32")
F16 = mpolicy.get_policy("p=f32,c=f16,o=f32")
