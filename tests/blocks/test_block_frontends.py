"""c=mxfp8, c=mxfp4 and c=nvfp4 on every front end: a Haiku, Flax linen,
Flax NNX and Equinox dense layer under `amp` (and Haiku's under
`transform_amp`) gives bit for bit the block-format product that the same
layer written in plain JAX gives under `amp`, which tests/rules checks
against the independent quantizer reading; placement options apply."""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpolicy

FORMATS = ("mxfp8", "mxfp4", "nvfp4")
RULES = mpolicy.DEFAULT_RULES.with_fp8(min_size=0)  # Every matmul: tiny ones.


def _data():
  k = jax.random.split(jax.random.PRNGKey(0), 3)
  x = jax.random.normal(k[0], (8, 64)) * jnp.exp2(
      jax.random.randint(k[1], (8, 1), -4, 4).astype(jnp.float32))
  w = jax.random.normal(k[2], (64, 32)) * 0.2
  b = jnp.linspace(-1., 1., 32)
  return x, w, b


def _plain(fmt, rules=RULES):
  """The layer in plain JAX, under amp: the reference."""
  x, w, b = _data()
  return mpolicy.amp(lambda x, w, b: x @ w + b, f"p=f32,c={fmt},o=f32",
                     rules=rules)(x, w, b)


def _haiku(fmt, rules=RULES):
  x, w, b = _data()
  f = hk.transform(lambda x: hk.Linear(32, name="dense")(x))
  params = {"dense": {"w": w, "b": b}}
  return mpolicy.amp(f.apply, f"p=f32,c={fmt},o=f32", rules=rules)(
      params, None, x)


def _haiku_transform_amp(fmt, rules=RULES):
  x, w, b = _data()
  mpolicy.set_policy(hk.Linear, f"p=f32,c={fmt},o=f32")
  f = mpolicy.transform_amp(lambda x: hk.Linear(32, name="dense")(x),
                            rules=rules)
  return f.apply({"dense": {"w": w, "b": b}}, None, x)


def _linen(fmt, rules=RULES):
  nn = pytest.importorskip("flax.linen")
  x, w, b = _data()
  params = {"params": {"kernel": w, "bias": b}}
  return mpolicy.amp(nn.Dense(32).apply, f"p=f32,c={fmt},o=f32",
                     rules=rules)(params, x)


def _nnx(fmt, rules=RULES):
  nnx = pytest.importorskip("flax.nnx")
  x, w, b = _data()
  layer = nnx.Linear(64, 32, rngs=nnx.Rngs(0))
  layer.kernel.value, layer.bias.value = w, b
  return mpolicy.amp(layer, f"p=f32,c={fmt},o=f32", rules=rules)(x)


def _equinox(fmt, rules=RULES):
  eqx = pytest.importorskip("equinox")
  x, w, b = _data()
  layer = eqx.nn.Linear(64, 32, key=jax.random.PRNGKey(0))
  layer = eqx.tree_at(lambda l: (l.weight, l.bias), layer, (w.T, b))
  return mpolicy.amp(jax.vmap(layer), f"p=f32,c={fmt},o=f32",
                     rules=rules)(x)


FRONT_ENDS = {"haiku": _haiku, "haiku_transform_amp": _haiku_transform_amp,
              "linen": _linen, "nnx": _nnx, "equinox": _equinox}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("front_end", sorted(FRONT_ENDS))
def test_each_front_end_gives_the_plain_layers_block_product(front_end, fmt):
  got = FRONT_ENDS[front_end](fmt)
  assert got.dtype == jnp.float32
  want = _plain(fmt)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  # The quantization is visible: bfloat16 compute gives other numbers.
  assert not np.array_equal(np.asarray(got),
                            np.asarray(FRONT_ENDS[front_end]("bf16")))


@pytest.mark.parametrize("front_end", ["haiku_transform_amp", "nnx"])
def test_the_size_threshold_keeps_a_small_matmul_in_bfloat16(front_end):
  # The default placement leaves a matmul under its size threshold in bf16.
  big = mpolicy.DEFAULT_RULES.with_fp8(min_size=10**9)
  np.testing.assert_array_equal(
      np.asarray(FRONT_ENDS[front_end]("mxfp8", big)),
      np.asarray(FRONT_ENDS[front_end]("bf16", big)))


def test_a_kept_layer_runs_in_bfloat16_and_explain_names_the_format():
  x, w, b = _data()
  params = {"dense": {"w": w, "b": b}, "head": {"w": w[:32], "b": b}}

  def net(x):
    return hk.Linear(32, name="head")(hk.Linear(32, name="dense")(x))

  f = mpolicy.transform_amp(net, rules=RULES)
  mpolicy.set_policy(hk.Module, "p=f32,c=mxfp8,o=f32")
  text = str(mpolicy.explain(f.apply, params, None, x))
  assert "mxfp8" in text, text
  mpolicy.set_policy("head", "p=f32,c=bf16,o=f32")  # Keep the last layer.
  kept = str(mpolicy.explain(f.apply, params, None, x))
  head_rows = [l for l in kept.splitlines() if "head" in l and "dot" in l]
  dense_rows = [l for l in kept.splitlines() if "dense" in l and "dot" in l]
  assert head_rows and all("mxfp8" not in l for l in head_rows), kept
  assert dense_rows and all("mxfp8" in l for l in dense_rows), kept
