"""c=int8 training and `export_quantized` on every front end.

A two-layer MLP on Haiku (`transform_amp` with `set_policy` on a class,
and `amp` with a name pattern), Flax linen (a class), Flax NNX, Equinox
and plain JAX (`amp`): its dense layers run as int8 matmuls (the plain
layer's product, which tests/rules checks against numpy), and the
exported artifact, whose weights are int8 codes and float32 scales, gives
`jax.jit(fn)(params, x)` bit for bit, before and after serialization.
Bad input is refused with a message saying what would be right.
"""

import re

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpolicy

RULES = mpolicy.DEFAULT_RULES.with_fp8(min_size=0)  # Tiny matmuls too.
INT8 = "p=f32,c=int8,o=f32"


def _data():
  k = jax.random.split(jax.random.PRNGKey(0), 5)
  x = jax.random.normal(k[0], (8, 16)) * 1.3
  w1 = jax.random.normal(k[1], (16, 32)) * 0.3
  b1 = jax.random.normal(k[2], (32,)) * 0.1
  w2 = jax.random.normal(k[3], (32, 4)) * 0.3
  b2 = jax.random.normal(k[4], (4,)) * 0.1
  return x, (w1, b1, w2, b2)


def _plain(policy):
  """The MLP in plain JAX under `amp`: (fn, params, x)."""
  x, (w1, b1, w2, b2) = _data()

  def mlp(p, x):
    h = jax.nn.relu(x @ p["w1"] + p["b1"])
    return h @ p["w2"] + p["b2"]

  return (mpolicy.amp(mlp, policy, rules=RULES),
          {"w1": w1, "b1": b1, "w2": w2, "b2": b2}, x)


def _haiku_params():
  _, (w1, b1, w2, b2) = _data()
  return {"mlp/~/linear_0": {"w": w1, "b": b1},
          "mlp/~/linear_1": {"w": w2, "b": b2}}


def _haiku_mlp(x):
  return hk.nets.MLP([32, 4], name="mlp")(x)


def _haiku_class(policy):
  mpolicy.set_policy(hk.Linear, policy)
  f = mpolicy.transform_amp(_haiku_mlp, rules=RULES)
  x, _ = _data()
  return (lambda p, x: f.apply(p, None, x)), _haiku_params(), x, f.apply


def _haiku_pattern(policy):
  mpolicy.set_policy("mlp/~/linear_*", policy)
  apply = mpolicy.amp(hk.transform(_haiku_mlp).apply, rules=RULES)
  x, _ = _data()
  return (lambda p, x: apply(p, None, x)), _haiku_params(), x, apply


def _linen(policy):
  nn = pytest.importorskip("flax.linen")

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.relu(nn.Dense(32)(x))
      return nn.Dense(4)(h)

  mpolicy.set_policy(nn.Dense, policy)
  x, (w1, b1, w2, b2) = _data()
  params = {"params": {"Dense_0": {"kernel": w1, "bias": b1},
                       "Dense_1": {"kernel": w2, "bias": b2}}}
  fn = mpolicy.amp(MLP().apply, rules=RULES)
  return fn, params, x, fn


def _nnx(policy):
  nnx = pytest.importorskip("flax.nnx")

  class MLP(nnx.Module):
    def __init__(self, rngs):
      self.l1 = nnx.Linear(16, 32, rngs=rngs)
      self.l2 = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
      return self.l2(jax.nn.relu(self.l1(x)))

  x, (w1, b1, w2, b2) = _data()
  graphdef, state = nnx.split(MLP(nnx.Rngs(0)))
  params = {"l1": {"kernel": w1, "bias": b1}, "l2": {"kernel": w2, "bias": b2}}

  def apply(p, x):
    nnx.replace_by_pure_dict(state, p)
    return nnx.merge(graphdef, state)(x)

  fn = mpolicy.amp(apply, policy, rules=RULES)
  return fn, params, x, fn


def _equinox(policy):
  eqx = pytest.importorskip("equinox")
  x, (w1, b1, w2, b2) = _data()
  keys = jax.random.split(jax.random.PRNGKey(1), 2)
  model = [eqx.nn.Linear(16, 32, key=keys[0]), eqx.nn.Linear(32, 4,
                                                             key=keys[1])]
  model = eqx.tree_at(lambda m: (m[0].weight, m[0].bias, m[1].weight,
                                 m[1].bias), model, (w1.T, b1, w2.T, b2))
  leaves, treedef = jax.tree_util.tree_flatten(model)

  def apply(p, x):
    l1, l2 = jax.tree_util.tree_unflatten(treedef, p)
    return jax.vmap(lambda v: l2(jax.nn.relu(l1(v))))(x)

  fn = mpolicy.amp(apply, policy, rules=RULES)
  return fn, leaves, x, fn


FRONT_ENDS = {"haiku_class": _haiku_class, "haiku_pattern": _haiku_pattern,
              "linen": _linen, "nnx": _nnx, "equinox": _equinox}


@pytest.mark.parametrize("front_end", sorted(FRONT_ENDS))
def test_each_front_end_trains_in_int8_as_the_plain_mlp(front_end):
  fn, params, x, _ = FRONT_ENDS[front_end](INT8)
  got = jax.jit(fn)(params, x)
  assert got.dtype == jnp.float32
  pfn, pparams, _ = _plain(INT8)
  np.testing.assert_array_equal(np.asarray(got),
                                np.asarray(pfn(pparams, x)))
  mpolicy.clear_policies()
  bf16, bparams, _, _ = FRONT_ENDS[front_end]("p=f32,c=bf16,o=f32")
  assert not np.array_equal(np.asarray(got), np.asarray(bf16(bparams, x)))
  grads = jax.grad(lambda p: jnp.sum(fn(p, x)))(params)
  assert all(g.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(g)))
             for g in jax.tree_util.tree_leaves(grads))


def _int8_dot_in(module_text: str) -> bool:
  return re.search(r"dot_general.*tensor<[^>]*xi8>, tensor<[^>]*xi8>",
                   module_text) is not None


def _bits(x):
  return np.asarray(x).view(np.uint8).tobytes()


@pytest.mark.parametrize("front_end", ["plain", *sorted(FRONT_ENDS)])
def test_exported_artifact_gives_the_jitted_functions_bits(front_end):
  if front_end == "plain":
    fn, params, x = _plain(INT8)
    export_fn = fn
  else:
    fn, params, x, export_fn = FRONT_ENDS[front_end](INT8)
    if front_end.startswith("haiku"):
      params = (params, None)  # apply(params, rng, x): rng is an argument.
      fn = lambda p, x: export_fn(p[0], p[1], x)
  want = jax.jit(fn)(params, x)
  if front_end.startswith("haiku"):
    exported, serving = mpolicy.export_quantized(export_fn, params[0], None, x)
    call = lambda e: e.call(serving, None, x)
  else:
    exported, serving = mpolicy.export_quantized(export_fn, params, x)
    call = lambda e: e.call(serving, x)
  assert isinstance(exported, jax.export.Exported)
  stored = [l for l in jax.tree_util.tree_leaves(serving)
            if l.dtype == jnp.int8]
  assert sorted(l.size for l in stored) == [4 * 32, 16 * 32]
  assert _int8_dot_in(exported.mlir_module())
  assert _bits(call(exported)) == _bits(want)
  again = jax.export.deserialize(exported.serialize())
  assert _bits(call(again)) == _bits(want)


def test_stored_weights_are_codes_and_per_channel_scales():
  fn, params, x = _plain(INT8)
  _, serving = mpolicy.export_quantized(fn, params, x)
  w1 = serving["w1"]
  assert w1["int8"].dtype == jnp.int8 and w1["int8"].shape == (16, 32)
  assert w1["scale"].dtype == jnp.float32 and w1["scale"].shape == (1, 32)
  amax = np.max(np.abs(np.asarray(params["w1"])), 0, keepdims=True)
  np.testing.assert_array_equal(np.asarray(w1["scale"]),
                                amax * np.float32(1 / 127))
  assert serving["b1"] is params["b1"]  # The rest as in params.


def test_a_weight_also_read_elsewhere_stays_float_and_bits_hold():
  _, params, x = _plain(INT8)

  def f(p, x):  # w2 also feeds a penalty: it cannot be stored as int8.
    h = jax.nn.relu(x @ p["w1"] + p["b1"])
    return h @ p["w2"] + jnp.sum(p["w2"] ** 2)

  fn = mpolicy.amp(f, INT8, rules=RULES)
  exported, serving = mpolicy.export_quantized(fn, params, x)
  assert isinstance(serving["w1"], dict)
  assert serving["w2"] is params["w2"]
  assert _bits(exported.call(serving, x)) == _bits(jax.jit(fn)(params, x))


def test_no_int8_matmul_is_refused():
  fn, params, x = _plain("p=f32,c=bf16,o=f32")
  with pytest.raises(ValueError, match="no int8 matmul of fn reads a leaf of "
                     "params.*c=int8 policy"):
    mpolicy.export_quantized(fn, params, x)


def test_a_function_not_run_under_amp_is_refused():
  _, params, x = _plain(INT8)
  with pytest.raises(TypeError, match="an amp-ed function"):
    mpolicy.export_quantized(lambda p, x: x @ p["w1"], params, x)


def test_example_args_of_the_wrong_shape_are_refused():
  fn, params, x = _plain(INT8)
  with pytest.raises(ValueError, match="cannot be traced with these shapes"
                     ".*give example args of the shapes the params expect"):
    mpolicy.export_quantized(fn, params, jnp.ones((8, 15)))


def test_calling_the_artifact_with_other_shapes_is_refused():
  fn, params, x = _plain(INT8)
  exported, serving = mpolicy.export_quantized(fn, params, x)
  with pytest.raises(ValueError, match=r"8, 16|shape"):
    exported.call(serving, jnp.ones((4, 16)))


def test_a_weight_read_inside_a_checkpoint_stays_float_and_bits_hold():
  _, params, x = _plain(INT8)

  def f(p, x):  # w2's matmul runs inside a jax.checkpoint (hk.remat's).
    h = jax.nn.relu(x @ p["w1"] + p["b1"])
    return jax.checkpoint(lambda h, w: h @ w)(h, p["w2"])

  fn = mpolicy.amp(f, INT8, rules=RULES)
  exported, serving = mpolicy.export_quantized(fn, params, x)
  assert serving["w1"]["int8"].dtype == jnp.int8
  assert serving["w2"] is params["w2"]
  assert _bits(exported.call(serving, x)) == _bits(jax.jit(fn)(params, x))


@pytest.mark.parametrize("wrap", [jax.checkpoint, jax.jit])
def test_weights_read_only_inside_a_sub_computation_are_refused_by_name(wrap):
  _, params, x = _plain(INT8)
  fn = mpolicy.amp(lambda p, x: wrap(lambda p, x: x @ p["w1"])(p, x), INT8,
                   rules=RULES)
  with pytest.raises(ValueError, match=r"inside a sub-computation \(hk.remat"
                     r".*export the same model built without them"):
    mpolicy.export_quantized(fn, params, x)
