"""Gathers of down-cast values (embedding tables) and their gradients.

A gather's transpose is a scatter-add into the table. When the table is a
float32 parameter seen in half, the gather runs on the float32 table and its
result is cast, so the scatter-add of the backward pass sums in float32:
exact where half would round, and fast on GPUs, where a half scatter-add
into a small table contends on atomics.
"""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpolicy
import _helpers


def _prims(jaxpr, name):
  return [e for e in jaxpr.eqns if e.primitive.name == name]


@pytest.mark.parametrize("half", ["f16", "bf16"])
def test_embedding_gradient_scatters_in_float32_under_transform_amp(half):
  def forward(tokens):
    return hk.Embed(98, 16, name="embed")(tokens)

  tokens = jnp.arange(32, dtype=jnp.int32).reshape(4, 8) % 98
  with mpolicy.push_policy(hk.Module, f"p=f32,c={half},o={half}"):
    model = mpolicy.transform_amp(forward)
    params = model.init(jax.random.PRNGKey(0), tokens)
    out = model.apply(params, None, tokens)
    grad = jax.grad(lambda p: model.apply(p, None, tokens)
                    .astype(jnp.float32).sum())
    jaxpr = jax.make_jaxpr(grad)(params).jaxpr
    grads = grad(params)
  half_dtype = jnp.dtype(mpolicy.get_policy(half).compute_dtype)
  assert out.dtype == half_dtype
  (gather,) = _prims(jaxpr, "gather")
  assert gather.invars[0].aval.dtype == jnp.float32
  (scatter,) = _prims(jaxpr, "scatter-add")
  assert scatter.outvars[0].aval.dtype == jnp.float32
  assert [v.aval.dtype for v in scatter.invars if hasattr(v, "aval")][2] == (
      jnp.float32)
  # The values are the half gather's: rounding then gathering is the same
  # as gathering then rounding.
  table = params["embed"]["embeddings"]
  np.testing.assert_array_equal(np.asarray(out),
                                np.asarray(table.astype(half_dtype)[tokens]))
  # Each row's gradient counts how often the token occurs, exactly.
  counts = np.bincount(np.asarray(tokens).ravel(), minlength=98)
  np.testing.assert_array_equal(np.asarray(grads["embed"]["embeddings"]),
                                np.repeat(counts[:, None], 16, 1))


def test_gather_of_float32_argument_under_amp_scatters_in_float32():
  def loss(table, x, idx):
    emb = jnp.take(table, idx, axis=0)  # [n, d]
    return (emb @ x).sum()

  table = jnp.ones((50, 8), jnp.float32)
  x = jnp.ones((8, 4), jnp.float32)
  idx = jnp.array([1, 1, 3, 7], jnp.int32)
  f = mpolicy.amp(loss, "p=f32,c=bf16,o=f32")
  eqns = _helpers.all_eqns(jax.grad(f), table, x, idx)
  scatters = [e for e in eqns if e.primitive.name.startswith("scatter")]
  assert scatters and all(e.outvars[0].aval.dtype == jnp.float32
                          for e in scatters)


def test_gather_of_an_activation_stays_in_half():
  """Only values cast down from a wider source take the float32 route."""

  def f(x, idx):
    h = jnp.tanh(x.astype(jnp.bfloat16))  # A half activation.
    return jnp.take(h, idx, axis=0)

  eqns = _helpers.all_eqns(mpolicy.amp(f, "p=f32,c=bf16,o=bf16"),
                           jnp.ones((10, 4)), jnp.array([0, 2]))
  (gather,) = [e for e in eqns if e.primitive.name == "gather"]
  assert gather.invars[0].aval.dtype == jnp.bfloat16
