"""`amp` on Flax (linen and NNX) and Equinox models.

Each test is skipped where its package is not installed; the `test` extra
installs both.
"""

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpolicy

from _helpers import all_eqns, multiplies_in

BF16 = "p=f32,c=bf16,o=f32"


def bf16_dots(fn, *args) -> int:
  return sum(1 for e in all_eqns(fn, *args)
             if "dot_general" in e.primitive.name
             and multiplies_in(e) == (np.dtype(jnp.bfloat16),) * 2)


def test_flax_linen_apply_multiplies_in_bfloat16():
  nn = pytest.importorskip("flax.linen")

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(4)(nn.relu(nn.Dense(16)(x)))

  model, x = MLP(), jnp.ones((2, 8))
  variables = model.init(jax.random.PRNGKey(0), x)
  apply = mpolicy.amp(model.apply, BF16)
  assert apply(variables, x).dtype == jnp.float32
  assert bf16_dots(apply, variables, x) == 2
  grads = jax.grad(lambda v: apply(v, x).sum())(variables)
  assert all(g.dtype == jnp.float32 for g in jax.tree_util.tree_leaves(grads))


def _nnx_model():
  nnx = pytest.importorskip("flax.nnx")

  class Net(nnx.Module):

    def __init__(self, rngs):
      self.linear = nnx.Linear(4, 8, rngs=rngs)
      self.norm = nnx.BatchNorm(8, rngs=rngs)

    def __call__(self, x):
      return self.norm(self.linear(x))

  return nnx, Net(nnx.Rngs(0))


def test_nnx_batchnorm_closed_over_inside_nnx_jit_raises_a_clear_error():
  nnx, model = _nnx_model()

  @nnx.jit
  def forward(model, x):
    return mpolicy.amp(lambda x: model(x), BF16)(x)

  with pytest.raises(TypeError) as info:
    forward(model, jnp.ones((2, 4)))
  message = str(info.value)
  assert "Flax NNX variable" in message
  assert "nnx.split(model, nnx.Param, nnx.BatchStat)" in message
  assert "nnx.merge(graphdef, params, stats)" in message
  assert type(info.value.__cause__).__name__ == "TraceContextError"


def test_nnx_batchnorm_closed_over_outside_jit_raises_the_same_error():
  _, model = _nnx_model()
  with pytest.raises(TypeError, match="nnx.split"):
    mpolicy.amp(lambda x: model(x), BF16)(jnp.ones((2, 4)))


def test_the_split_merge_form_the_error_shows_updates_the_statistics():
  nnx, model = _nnx_model()
  x = jnp.arange(8.).reshape(2, 4)
  try:
    mpolicy.amp(lambda x: model(x), BF16)(x)
  except TypeError as e:
    code = textwrap.dedent(str(e).split("\n\n", 1)[1])
  namespace = dict(nnx=nnx, mpolicy=mpolicy, model=model, x=x, policy=BF16)
  exec(code, namespace)  # pylint: disable=exec-used
  mean = model.norm.mean[...]
  assert mean.dtype == jnp.float32 and float(jnp.abs(mean).max()) > 0
  assert namespace["y"].dtype == jnp.float32


def test_nnx_module_without_state_closed_over_runs_in_bfloat16():
  nnx = pytest.importorskip("flax.nnx")
  linear = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
  f = mpolicy.amp(lambda x: linear(x), BF16)
  assert f(jnp.ones((2, 4))).dtype == jnp.float32
  assert bf16_dots(f, jnp.ones((2, 4))) == 1


def test_equinox_filter_jit_and_filter_grad_through_amp():
  eqx = pytest.importorskip("equinox")
  model = eqx.nn.MLP(8, 4, width_size=16, depth=1, activation=jax.nn.gelu,
                     key=jax.random.PRNGKey(0))
  forward = mpolicy.amp(lambda m, x: jax.vmap(m)(x), BF16)
  x = jnp.ones((2, 8))

  @eqx.filter_jit
  @eqx.filter_grad
  def grads(model, x):
    return forward(model, x).sum()

  g = grads(model, x)
  assert g.layers[0].weight.dtype == jnp.float32
  assert float(jnp.abs(g.layers[0].weight).max()) > 0
  params, static = eqx.partition(model, eqx.is_array)
  assert bf16_dots(lambda p, x: forward(eqx.combine(p, static), x),
                   params, x) == 2


@pytest.mark.parametrize("spec", ["p=f32,c=f8,o=bf16", "p=f32,c=mxfp8,o=bf16",
                                  "p=f32,c=nvfp4,o=bf16"])
def test_layers_given_the_compute_dtype_compute_in_bfloat16(spec):
  """User code outside `amp` hands ``policy.compute_dtype`` to a layer: under
  a matmul format that is bfloat16, never an unscaled float8."""
  nn = pytest.importorskip("flax.linen")
  hk = pytest.importorskip("haiku")
  compute = mpolicy.get_policy(spec).compute_dtype
  key = jax.random.PRNGKey(0)
  x = jax.random.normal(key, (2, 8)) * 300

  dense = nn.Dense(4, dtype=compute)
  variables = dense.init(key, x)
  y = dense.apply(variables, x)
  want = nn.Dense(4).apply(variables, x)
  assert y.dtype == jnp.bfloat16
  assert bf16_dots(dense.apply, variables, x) == 1
  np.testing.assert_allclose(np.float32(y), want, rtol=0.02, atol=1.0)

  linear = hk.without_apply_rng(hk.transform(
      lambda x: hk.Linear(4)(x.astype(compute))))
  params = linear.init(key, x)
  assert {p.dtype for p in jax.tree_util.tree_leaves(params)} == {
      np.dtype(jnp.bfloat16)}
  assert linear.apply(params, x).dtype == jnp.bfloat16
  assert bf16_dots(linear.apply, params, x) == 1
