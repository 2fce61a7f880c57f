"""transform_amp: module policies on params, state, inputs and outputs."""

import haiku as hk
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import pytest

import mpolicy

from _helpers import multiplies_in, walk_eqns

F32 = jnp.dtype(jnp.float32)
BF16 = jnp.dtype(jnp.bfloat16)
F16 = jnp.dtype(jnp.float16)
HALF = "p=f32,c=bf16,o=f32"
FULL = "full"

KEY = jax.random.PRNGKey(0)


def _dtypes(tree):
  return jax.tree_util.tree_map(lambda a: jnp.dtype(a.dtype), tree)


def _leaf_dtypes(tree):
  return {jnp.dtype(a.dtype) for a in jax.tree_util.tree_leaves(tree)
          if jnp.issubdtype(a.dtype, jnp.floating)}


def _eqns(jaxpr, name):
  """All equations with primitive ``name``, recursing into sub-jaxprs.

  The interpreter runs lowered matmuls as its own ``amp_<name>`` primitive
  (half inputs, float32 accumulation), which counts as ``name`` here.
  """
  return [e for e in walk_eqns(jaxpr)
          if e.primitive.name in (name, "amp_" + name)]


def _operand_dtypes(closed_jaxpr, name):
  return [multiplies_in(e) for e in _eqns(closed_jaxpr.jaxpr, name)]


class Probe(hk.Module):
  """Records the dtypes a module sees inside its call."""

  seen = []

  def __call__(self, x):
    w = hk.get_parameter("w", [x.shape[-1], 3], init=jnp.ones)
    Probe.seen.append({"input": jnp.dtype(x.dtype), "w": jnp.dtype(w.dtype),
                       "policy": mpolicy.current_policy()})
    return x @ w


@pytest.fixture(autouse=True)
def _reset_probe():
  Probe.seen = []


def test_params_stored_in_param_dtype_seen_in_compute_dtype():
  mpolicy.set_policy(Probe, "p=f32,c=bf16,o=f16")
  f = mpolicy.transform_amp(lambda x: Probe()(x))
  params = f.init(KEY, jnp.ones([2, 4]))
  assert params["probe"]["w"].dtype == F32
  out = f.apply(params, None, jnp.ones([2, 4]))
  assert out.dtype == F16
  assert Probe.seen[-1]["input"] == BF16
  assert Probe.seen[-1]["w"] == BF16
  assert Probe.seen[-1]["policy"] == mpolicy.get_policy("p=f32,c=bf16,o=f16")


def test_param_dtype_may_be_half():
  mpolicy.set_policy(hk.Linear, "p=bf16,c=bf16,o=bf16")
  f = mpolicy.transform_amp(lambda x: hk.Linear(3)(x))
  params = f.init(KEY, jnp.ones([2, 4]))
  assert _leaf_dtypes(params) == {BF16}
  assert f.apply(params, None, jnp.ones([2, 4])).dtype == BF16


def test_no_policy_runs_as_written():
  f = mpolicy.transform_amp(lambda x: Probe()(x))
  params = f.init(KEY, jnp.ones([2, 4]))
  out = f.apply(params, None, jnp.ones([2, 4]))
  assert params["probe"]["w"].dtype == F32 and out.dtype == F32
  assert Probe.seen[-1]["policy"] is None
  assert mpolicy.current_policy() is None


def test_non_float_inputs_untouched():
  mpolicy.set_policy(hk.Module, HALF)

  class Mixed(hk.Module):

    def __call__(self, x, ids, flag, scale):
      assert ids.dtype == jnp.int32
      assert isinstance(flag, bool) and isinstance(scale, float)
      return x * scale if flag else x

  f = mpolicy.transform_amp(lambda *a: Mixed()(*a))
  ids = jnp.arange(3)
  params = f.init(KEY, jnp.ones([3]), ids, True, 2.0)
  assert f.apply(params, None, jnp.ones([3]), ids, True, 2.0).dtype == F32


def test_matmul_operands_in_jaxpr_are_half():
  mpolicy.set_policy(hk.Module, HALF)
  f = mpolicy.transform_amp(lambda x: hk.nets.MLP([16, 4])(x))
  x = jnp.ones([8, 5])
  params = f.init(KEY, x)
  jaxpr = jax.make_jaxpr(f.apply)(params, None, x)
  dots = _operand_dtypes(jaxpr, "dot_general")
  assert len(dots) == 2
  assert all(d == (BF16, BF16) for d in dots), dots
  assert jaxpr.out_avals[0].dtype == F32


def test_conv_operands_in_jaxpr_are_half():
  mpolicy.set_policy(hk.Conv2D, HALF)
  f = mpolicy.transform_amp(lambda x: hk.Conv2D(4, 3)(x))
  x = jnp.ones([2, 6, 6, 3])
  params = f.init(KEY, x)
  jaxpr = jax.make_jaxpr(f.apply)(params, None, x)
  convs = _operand_dtypes(jaxpr, "conv_general_dilated")
  assert convs == [(BF16, BF16)]
  assert f.apply(params, None, x).dtype == F32


def test_nested_modules_with_different_policies():
  mpolicy.set_policy("outer", "p=f32,c=f16,o=f32")
  mpolicy.set_policy("outer/inner", "p=f32,c=bf16,o=bf16")  # made in a call

  class Inner(hk.Module):

    def __call__(self, x):
      return Probe()(x)

  class Outer(hk.Module):

    def __call__(self, x):
      y = Probe(name="first")(x)
      Outer.mid = jnp.dtype(y.dtype)
      return Inner(name="inner")(y)

  f = mpolicy.transform_amp(lambda x: Outer(name="outer")(x))
  x = jnp.ones([2, 3])
  params = f.init(KEY, x)
  Probe.seen = []
  out = f.apply(params, None, x)
  first, inner_probe = Probe.seen
  assert first["input"] == F16 and first["w"] == F16
  # The probe inside `inner` inherits bf16 from it.
  assert inner_probe["input"] == BF16 and inner_probe["w"] == BF16
  # Inherited calls leave casting to the enclosing call: no f32 round trip.
  assert Outer.mid == F16
  assert out.dtype == F32  # outer casts its output.
  assert _leaf_dtypes(params) == {F32}


def test_batchnorm_full_inside_half_model_and_state_dtypes():
  mpolicy.set_policy(hk.Module, HALF)
  mpolicy.set_policy(hk.BatchNorm, FULL)
  seen = {}

  class Net(hk.Module):

    def __call__(self, x, is_training):
      x = hk.Linear(8)(x)
      seen["linear_out"] = jnp.dtype(x.dtype)
      x = hk.BatchNorm(True, True, 0.9)(x, is_training)
      seen["bn_out"] = jnp.dtype(x.dtype)
      return hk.Linear(2)(x)

  f = mpolicy.transform_amp_with_state(lambda x, t: Net()(x, t))
  x = jnp.ones([4, 3])
  params, state = f.init(KEY, x, True)
  assert _leaf_dtypes(params) == {F32}
  assert _leaf_dtypes(state) == {F32}
  out, new_state = f.apply(params, state, None, x, True)
  assert out.dtype == F32
  assert seen == {"linear_out": BF16, "bn_out": F32}
  assert _dtypes(new_state) == _dtypes(state)
  jaxpr = jax.make_jaxpr(lambda p, s, x: f.apply(p, s, None, x, True))(
      params, state, x)
  assert [d for d in _operand_dtypes(jaxpr, "dot_general")] == [
      (BF16, BF16), (BF16, BF16)]


def test_batchnorm_state_stays_in_param_dtype_under_half_bn():
  # Haiku's own mechanism would store these averages in bf16.
  mpolicy.set_policy(hk.BatchNorm, "p=f32,c=bf16,o=bf16")
  f = mpolicy.transform_amp_with_state(
      lambda x: hk.BatchNorm(True, True, 0.9)(x, is_training=True))
  x = jax.random.normal(KEY, [8, 4])
  params, state = f.init(KEY, x)
  out, state2 = f.apply(params, state, None, x)
  assert out.dtype == BF16
  assert _leaf_dtypes(state2) == {F32}
  _, state3 = jax.jit(lambda p, s, x: f.apply(p, s, None, x))(params, state2, x)
  assert _dtypes(state3) == _dtypes(state)
  assert not np.allclose(state3["batch_norm/~/mean_ema"]["average"], 0.0)


def test_works_under_jit_grad_and_vmap():
  mpolicy.set_policy(hk.Module, HALF)
  f = mpolicy.transform_amp(lambda x: hk.nets.MLP([8, 1])(x))
  x = jax.random.normal(KEY, [4, 3])
  params = f.init(KEY, x)
  out = jax.jit(f.apply)(params, None, x)
  assert out.dtype == F32
  np.testing.assert_allclose(out, f.apply(params, None, x), rtol=1e-6)

  loss = lambda p, x: jnp.mean(f.apply(p, None, x) ** 2)
  grads = jax.jit(jax.grad(loss))(params, x)
  assert _dtypes(grads) == _dtypes(params)
  assert all(np.all(np.isfinite(g)) for g in jax.tree_util.tree_leaves(grads))

  batched = jax.vmap(lambda x: f.apply(params, None, x))(x[:, None, :])
  assert batched.shape == (4, 1, 1) and batched.dtype == F32


def test_hk_scan_body_runs_in_compute_dtype():
  mpolicy.set_policy(hk.Module, HALF)

  class Stack(hk.Module):

    def __call__(self, x):
      linear = hk.Linear(x.shape[-1])

      def body(carry, _):
        return jnp.tanh(linear(carry)), None

      y, _ = hk.scan(body, x, None, length=3)
      return y

  f = mpolicy.transform_amp(lambda x: Stack()(x))
  x = jnp.ones([2, 4])
  params = f.init(KEY, x)
  assert _leaf_dtypes(params) == {F32}
  jaxpr = jax.make_jaxpr(f.apply)(params, None, x)
  assert _operand_dtypes(jaxpr, "dot_general") == [(BF16, BF16)]
  scans = _eqns(jaxpr.jaxpr, "scan")
  assert scans, "expected a scan in the jaxpr"
  assert f.apply(params, None, x).dtype == F32


def test_hk_remat_body_runs_in_compute_dtype():
  mpolicy.set_policy(hk.Module, HALF)

  class Block(hk.Module):

    def __call__(self, x):
      return hk.remat(lambda y: jax.nn.gelu(hk.Linear(4)(y)))(x)

  f = mpolicy.transform_amp(lambda x: Block()(x))
  x = jnp.ones([2, 4])
  params = f.init(KEY, x)
  loss = lambda p, x: jnp.sum(f.apply(p, None, x))
  jaxpr = jax.make_jaxpr(jax.grad(loss))(params, x)
  assert _eqns(jaxpr.jaxpr, "checkpoint") or _eqns(jaxpr.jaxpr, "remat2") or (
      _eqns(jaxpr.jaxpr, "remat"))
  for operands in _operand_dtypes(jaxpr, "dot_general"):
    assert BF16 in operands, operands
  grads = jax.grad(loss)(params, x)
  assert _dtypes(grads) == _dtypes(params)


def test_hk_vmap_inside_module():
  mpolicy.set_policy(hk.Module, HALF)

  class PerExample(hk.Module):

    def __call__(self, x):
      return hk.vmap(lambda r: hk.Linear(2)(r), split_rng=False)(x)

  f = mpolicy.transform_amp(lambda x: PerExample()(x))
  x = jnp.ones([5, 3])
  params = f.init(KEY, x)
  jaxpr = jax.make_jaxpr(f.apply)(params, None, x)
  assert all(d == (BF16, BF16) for d in _operand_dtypes(jaxpr, "dot_general"))
  assert f.apply(params, None, x).shape == (5, 2)


def test_named_scope_pattern_governs_modules_inside_it():
  mpolicy.set_policy("encoder", HALF)

  def forward(x):
    with jax.named_scope("encoder"):
      y = Probe(name="a")(x)
    return Probe(name="b")(y)

  f = mpolicy.transform_amp(forward)
  x = jnp.ones([2, 3])
  params = f.init(KEY, x)
  Probe.seen = []
  f.apply(params, None, x)
  assert Probe.seen[0]["input"] == BF16
  assert Probe.seen[1]["policy"] is None


def test_registry_changes_take_effect_at_next_trace():
  f = mpolicy.transform_amp(lambda x: hk.Linear(2)(x))
  x = jnp.ones([1, 3])
  params = f.init(KEY, x)
  assert f.apply(params, None, x).dtype == F32
  mpolicy.set_policy(hk.Linear, "p=f32,c=bf16,o=bf16")
  assert f.apply(params, None, x).dtype == BF16


def test_full_policy_is_bitwise_identical_to_haiku():
  mpolicy.set_policy(hk.Module, FULL)

  def forward(x):
    x = hk.Conv2D(4, 3)(x)
    x = hk.LayerNorm(-1, True, True)(x)
    x = jax.nn.softmax(x)
    return hk.Linear(3)(x.reshape(x.shape[0], -1))

  x = jax.random.normal(KEY, [2, 5, 5, 3])
  plain = hk.transform(forward)
  amp = mpolicy.transform_amp(forward)
  params = plain.init(KEY, x)
  assert _dtypes(amp.init(KEY, x)) == _dtypes(params)
  np.testing.assert_array_equal(amp.apply(params, None, x),
                                plain.apply(params, None, x))


def test_same_dtypes_as_haiku_mixed_precision():
  """A jmp + hk.mixed_precision script ported by changing three lines."""
  policy = jmp.get_policy("p=f32,c=bf16,o=f32")
  bn_policy = jmp.get_policy("p=f32,c=f32,o=bf16")

  def forward(x, is_training):
    net = hk.nets.ResNet18(num_classes=4, resnet_v2=False)
    return net(x, is_training=is_training)

  x = jax.random.normal(KEY, [2, 16, 16, 3])

  def run(transform, set_policy, clear):
    set_policy(hk.nets.ResNet18, policy)
    set_policy(hk.BatchNorm, bn_policy)
    try:
      f = transform(forward)  # Shapes and dtypes only: traced, not run.
      params, state = jax.eval_shape(lambda k, x: f.init(k, x, True), KEY, x)
      out, new_state = jax.eval_shape(
          lambda p, s, x: f.apply(p, s, None, x, True), params, state, x)
      return _dtypes(params), _dtypes(state), out.dtype, _dtypes(new_state)
    finally:
      clear()

  def hk_clear():
    hk.mixed_precision.clear_policy(hk.nets.ResNet18)
    hk.mixed_precision.clear_policy(hk.BatchNorm)

  theirs = run(hk.transform_with_state, hk.mixed_precision.set_policy, hk_clear)
  ours = run(mpolicy.transform_amp_with_state, mpolicy.set_policy,
             mpolicy.clear_policies)
  assert ours[0] == theirs[0]  # params
  assert ours[1] == theirs[1]  # initial state
  assert ours[2] == theirs[2] == F32  # output
  # Haiku stores the moving averages in the compute dtype of the BatchNorm
  # policy (f32 here); we store them in its param dtype (also f32).
  assert ours[3] == theirs[3]


def test_patterns_inside_layer_stack_match_lift_relative_names():
  # Inside a lifted transform (layer_stack, hk.lift) Haiku names modules
  # relative to the lift: params stored under `layers/block/attention` come
  # from a module named `block/attention`. Patterns match that name, the
  # same at init and at apply.
  mpolicy.set_policy("block/attention", HALF)
  seen = []

  class Block(hk.Module):

    def __call__(self, x):
      y = hk.Linear(4, name="attention")(x)
      seen.append(mpolicy.current_policy())
      return y

  def forward(x):
    return hk.experimental.layer_stack(2, name="layers")(
        lambda x: Block(name="block")(x))(x)

  f = mpolicy.transform_amp(forward)
  x = jnp.ones([2, 4])
  params = f.init(KEY, x)
  assert list(params) == ["layers/block/attention"]
  assert _leaf_dtypes(params) == {F32}
  jaxpr = jax.make_jaxpr(f.apply)(params, None, x)
  assert _operand_dtypes(jaxpr, "dot_general") == [(BF16, BF16)]
  assert f.apply(params, None, x).dtype == F32


def test_full_precision_block_inside_a_haiku_forward():
  mpolicy.set_policy(hk.Module, HALF)

  def forward(x):
    y = Probe(name="half")(x)
    with mpolicy.full_precision():
      z = Probe(name="exact")(x)
    return y, z

  f = mpolicy.transform_amp(forward)
  x = jnp.ones([2, 3])
  params = f.init(KEY, x)
  Probe.seen = []
  y, z = f.apply(params, None, x)
  half, exact = Probe.seen
  assert half["input"] == BF16 and half["policy"] is not None
  assert exact["input"] == F32 and exact["w"] == F32
  assert exact["policy"] is None
  assert y.dtype == F32 and z.dtype == F32
  jaxpr = jax.make_jaxpr(f.apply)(params, None, x)
  assert sorted(_operand_dtypes(jaxpr, "dot_general")) == sorted(
      [(BF16, BF16), (F32, F32)])
