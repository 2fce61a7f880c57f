"""Specification of float8 compute (`c=f8`): grammar, graph, values, rules."""

from __future__ import annotations

import haiku as hk
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest

import mpolicy
from mpolicy._src.rules import fp8_scaling
from mpolicy._src.rules import matmul
from mpolicy._src import policy as policy_lib

F8 = "p=f32,c=f8,o=bf16"
E4M3, E5M2 = np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)
BF16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
DOT = (((1,), (0,)), ((), ()))


def _normal(seed, shape):
  return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32)


def _rel(a, b):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _hlo(fn, *args):
  return jax.jit(fn).lower(*args).as_text()


def _dot_lines(text):
  return [l for l in text.splitlines() if "stablehlo.dot_general" in l]


# --- Grammar -----------------------------------------------------------------


@pytest.mark.parametrize("name", ["f8", "float8", "e4m3", "float8_e4m3fn"])
def test_f8_names_parse_as_the_fp8_format(name):
  policy = mpolicy.get_policy(f"p=f32,c={name},o=bf16")
  assert np.dtype(policy.compute_dtype) == BF16
  assert policy.matmul_format == "fp8"
  assert str(policy) == F8


def test_f8_str_round_trips():
  policy = mpolicy.get_policy("params=float32,compute=e4m3,output=float32")
  assert str(policy) == "p=f32,c=f8,o=f32"
  assert mpolicy.get_policy(str(policy)) == policy


def test_unset_output_under_f8_is_bfloat16_not_float8():
  assert str(mpolicy.get_policy("c=f8")) == "p=f32,c=f8,o=bf16"


@pytest.mark.parametrize("spec", ["f8", "p=f8", "o=f8", "p=f32,c=f8,o=e4m3"])
def test_float8_params_or_outputs_are_rejected(spec):
  with pytest.raises(ValueError, match="only a compute dtype") as info:
    mpolicy.get_policy(spec)
  assert "f8|float8|e4m3|float8_e4m3fn" in str(info.value)
  assert "'p=f32,c=f8,o=bf16'" in str(info.value)


def test_other_float8_compute_dtypes_are_rejected():
  with pytest.raises(ValueError, match="float8_e5m2"):
    mpolicy.Policy(jnp.float32, jnp.float8_e5m2, jnp.bfloat16)
  with pytest.raises(ValueError, match="Unknown dtype 'e5m2'"):
    mpolicy.get_policy("c=e5m2")


def test_error_messages_list_f8_names():
  with pytest.raises(ValueError) as info:
    mpolicy.get_policy("c=f4")
  assert "f8|float8|e4m3|float8_e4m3fn, mxfp8" in str(info.value)
  assert "(quantized matmul formats, compute only)" in str(info.value)


def test_half_dtype_is_not_float8():
  assert not policy_lib.is_fp8(mpolicy.half_dtype())


def test_cast_to_compute_under_f8_casts_to_bfloat16():
  policy = mpolicy.get_policy(F8)
  out = policy.cast_to_compute({"x": jnp.ones(3), "n": jnp.ones(3, jnp.int32)})
  assert out["x"].dtype == BF16 and out["n"].dtype == jnp.int32
  assert policy_lib.elementwise_dtype(policy) == BF16
  assert policy_lib.elementwise_dtype(mpolicy.get_policy("c=f16")) == np.float16


# --- Quantization ------------------------------------------------------------


def test_scale_is_amax_over_448():
  x = jnp.array([[0.5, -3.0], [2.0, 1.0]])
  q, scale = fp8_scaling.quantize(x)
  assert q.dtype == E4M3
  assert float(scale) == pytest.approx(3.0 / 448)
  assert float(jnp.max(jnp.abs(q.astype(jnp.float32)))) == 448.0
  np.testing.assert_allclose(q.astype(jnp.float32) * scale, x, rtol=2 ** -4)


def test_cotangent_scale_is_amax_over_57344():
  q, scale = fp8_scaling.quantize(jnp.array([1.0, -7.0]), jnp.float8_e5m2)
  assert q.dtype == E5M2
  assert float(scale) == pytest.approx(7.0 / 57344)


def test_zero_input_scale_is_one_and_output_zero():
  q, scale = fp8_scaling.quantize(jnp.zeros((4, 4)))
  assert float(scale) == 1.0 and not np.any(np.asarray(q, np.float32))
  out = matmul.fp8_dot_general(jnp.zeros((4, 8)), _normal(0, (8, 2)), DOT)
  assert np.all(np.asarray(out, np.float32) == 0)
  grads = jax.grad(lambda a, b: jnp.sum(matmul.fp8_dot_general(a, b, DOT)
                                        .astype(jnp.float32)), (0, 1))(
                                            jnp.zeros((4, 8)), _normal(0, (8, 2)))
  assert all(np.all(np.isfinite(g)) for g in grads)
  assert not np.any(grads[1])  # d w = x^T g with x = 0.


def test_non_finite_input_gives_non_finite_output():
  x = _normal(0, (4, 8)).at[0, 0].set(jnp.inf)
  out = matmul.fp8_dot_general(x, _normal(1, (8, 3)), DOT)
  assert not np.all(np.isfinite(np.asarray(out, np.float32)))


def test_non_finite_cotangent_gives_non_finite_gradients():
  # An overflowed loss-scaled cotangent must stay visible to `all_finite`.
  x, w = _normal(0, (4, 8)), _normal(1, (8, 3))
  _, vjp = jax.vjp(lambda x, w: matmul.fp8_dot_general(x, w, DOT), x, w)
  ct = jnp.ones((4, 3), jnp.bfloat16).at[1, 1].set(jnp.inf)
  gx, gw = vjp(ct)
  assert not bool(mpolicy.all_finite((gx,))) and not bool(mpolicy.all_finite((gw,)))


# --- The graph -----------------------------------------------------------------


def test_forward_dot_has_e4m3_operands_and_f32_accumulation():
  f = mpolicy.amp(lambda x, w: x @ w, F8)
  dots = _dot_lines(_hlo(f, _normal(0, (8, 16)), _normal(1, (16, 4))))
  assert len(dots) == 1
  assert "(tensor<8x16xf8E4M3FN>, tensor<16x4xf8E4M3FN>) -> tensor<8x4xf32>" in dots[0]


def test_backward_dots_take_e5m2_cotangent_and_forward_e4m3_operand():
  f = mpolicy.amp(lambda x, w: x @ w, F8)
  loss = lambda x, w: jnp.sum(f(x, w).astype(jnp.float32) ** 2)
  dots = _dot_lines(_hlo(jax.grad(loss, (0, 1)), _normal(0, (8, 16)),
                         _normal(1, (16, 4))))
  assert len(dots) == 3
  backward = [d for d in dots if "f8E5M2" in d]
  assert len(backward) == 2
  assert all("f8E4M3FN" in d and "-> tensor" in d and "xf32>" in d
             for d in backward)


def test_result_is_bfloat16_and_f32_param_gradient_is_f32():
  f = mpolicy.amp(lambda x, w: x @ w, F8)
  x, w = _normal(0, (8, 16)), _normal(1, (16, 4))
  assert f(x, w).dtype == BF16
  g = jax.grad(lambda w: jnp.sum(f(x, w).astype(jnp.float32)))(w)
  assert g.dtype == F32


def test_wider_preferred_element_type_is_kept():
  f = mpolicy.amp(lambda x, w: jnp.matmul(x.astype(jnp.bfloat16),
                                          w.astype(jnp.bfloat16),
                                          preferred_element_type=jnp.float32),
                  "p=f32,c=f8,o=f32")
  jaxpr = jax.make_jaxpr(f)(_normal(0, (2, 3)), _normal(1, (3, 4)))
  (call,) = [e for e in jaxpr.eqns if e.primitive.name == "custom_vjp_call"]
  assert call.outvars[0].aval.dtype == F32


# --- Accuracy ------------------------------------------------------------------

# float8_e4m3fn keeps 3 mantissa bits: round to nearest leaves a relative
# error of at most 2**-4 per element, about 2.5% RMS over the values of a
# normal sample. Two quantized operands give about sqrt(2) * 2.5% = 3.6% on
# the product (errors of independent terms average out relative to the
# sum), so 5% is a bound with margin that a wrong scale (or no scaling:
# values above 448 become NaN) fails by far. The backward pass quantizes the
# cotangent to float8_e5m2 (2 mantissa bits, about 5% RMS): 10%.


@pytest.mark.parametrize("shape", [(64, 128, 32), (16, 512, 256)])
def test_matmul_relative_error_below_5_percent(shape):
  m, k, n = shape
  x, w = _normal(0, (m, k)) * 30.0, _normal(1, (k, n)) * 1e-3
  err = _rel(mpolicy.amp(lambda x, w: x @ w, F8)(x, w), x @ w)
  assert 0.01 < err < 0.05  # Also not accidentally exact (not float8).


def test_gradients_relative_error_below_10_percent():
  x, w = _normal(0, (64, 128)), _normal(1, (128, 32))
  t = _normal(2, (64, 32))
  f = mpolicy.amp(lambda x, w: x @ w, F8)
  grads = jax.grad(lambda x, w: jnp.sum(f(x, w).astype(jnp.float32) * t),
                   (0, 1))(x, w)
  ref = jax.grad(lambda x, w: jnp.sum((x @ w) * t), (0, 1))(x, w)
  for g, r in zip(grads, ref):
    assert _rel(g, r) < 0.10


def test_batched_dot_general_matches_shape_and_values():
  a, b = _normal(0, (3, 5, 7, 16)), _normal(1, (3, 16, 9, 5))
  dims = (((3,), (1,)), ((0,), (0,)))
  ref = lax.dot_general(a, b, dims)
  # Jitted: one compile each, not one per eager op.
  out = jax.jit(lambda a, b: matmul.fp8_dot_general(a, b, dims))(a, b)
  assert out.shape == ref.shape
  assert _rel(out, ref) < 0.05
  grads = jax.jit(jax.grad(
      lambda a, b: jnp.sum(matmul.fp8_dot_general(a, b, dims)
                           .astype(jnp.float32) * ref), (0, 1)))(a, b)
  refs = jax.jit(jax.grad(
      lambda a, b: jnp.sum(lax.dot_general(a, b, dims) * ref), (0, 1)))(a, b)
  for g, r in zip(grads, refs):
    assert g.shape == r.shape and _rel(g, r) < 0.10


def _conv(x, k):
  return lax.conv_general_dilated(x, k, (2, 1), ((1, 1), (0, 2)),
                                  rhs_dilation=(1, 2), feature_group_count=2,
                                  dimension_numbers=("NHWC", "HWIO", "NHWC"))


def test_convolution_in_float8_forward_and_backward():
  x, k = _normal(0, (2, 9, 9, 4)), _normal(1, (3, 3, 2, 6))
  f = mpolicy.amp(_conv, F8)
  y = jax.jit(f)(x, k)  # Jitted: one compile, not one per eager op.
  assert y.dtype == BF16
  assert _rel(y, _conv(x, k)) < 0.05
  text = _hlo(f, x, k)
  convs = [l for l in text.splitlines() if "stablehlo.convolution" in l]
  assert len(convs) == 1 and convs[0].count("f8E4M3FN") == 2
  t = _conv(x, k)
  grads = jax.jit(jax.grad(
      lambda x, k: jnp.sum(f(x, k).astype(jnp.float32) * t), (0, 1)))(x, k)
  refs = jax.jit(jax.grad(lambda x, k: jnp.sum(_conv(x, k) * t), (0, 1)))(
      x, k)
  for g, r in zip(grads, refs):
    assert g.dtype == F32 and _rel(g, r) < 0.10
  # The backward quantizes the cotangent to e5m2 before its convolutions.
  backward = _hlo(jax.grad(lambda x, k: jnp.sum(f(x, k).astype(jnp.float32)),
                           (0, 1)), x, k)
  assert "f8E5M2" in backward


# --- Under transformations ------------------------------------------------------


def _mlp(params, x):
  for w in params:
    x = jnp.tanh(x @ w)
  return x


def test_under_jit_grad_vmap():
  params = [_normal(i, (64, 64)) * 0.125 for i in range(2)]
  x = _normal(9, (4, 32, 64))
  f = mpolicy.amp(_mlp, F8)
  out = jax.jit(jax.vmap(f, in_axes=(None, 0)))(params, x)
  assert out.dtype == BF16 and _rel(out, jax.vmap(_mlp, (None, 0))(params, x)) < 0.1
  grads = jax.jit(jax.grad(lambda p: jnp.sum(
      f(p, x[0]).astype(jnp.float32))))(params)
  ref = jax.grad(lambda p: jnp.sum(_mlp(p, x[0])))(params)
  for g, r in zip(grads, ref):
    assert g.dtype == F32 and _rel(g, r) < 0.15


def test_inside_scan_and_remat():
  ws = jnp.stack([_normal(i, (16, 16)) * 0.25 for i in range(3)])

  def net(ws, x):
    @jax.checkpoint
    def layer(x, w):
      return jnp.tanh(x @ w), None
    return jax.lax.scan(layer, x, ws)[0]

  x = _normal(7, (8, 16))
  f = mpolicy.amp(net, F8)
  loss = lambda ws: jnp.sum(f(ws, x).astype(jnp.float32))
  text = _hlo(jax.grad(loss), ws)
  dots = _dot_lines(text)
  assert any("f8E4M3FN" in d and "f8E5M2" not in d for d in dots)
  assert any("f8E5M2" in d for d in dots)
  g = jax.grad(loss)(ws)
  ref = jax.grad(lambda ws: jnp.sum(net(ws, x)))(ws)
  assert g.dtype == F32 and _rel(g, ref) < 0.15


def test_forward_mode_is_refused_with_jax_error():
  f = mpolicy.amp(lambda x, w: x @ w, F8)
  with pytest.raises(TypeError, match="custom_vjp"):
    jax.jvp(lambda w: f(jnp.ones((2, 3)), w), (jnp.ones((3, 2)),),
            (jnp.ones((3, 2)),))


# --- Policies per module, explain -------------------------------------------------


class _Block(hk.Module):
  """Attention-like block: projections in hk.Linear, softmax in the block."""

  def __call__(self, x):
    q, k, v = (hk.Linear(16, name=n)(x) for n in ("q", "k", "v"))
    logits = jnp.einsum("btd,bsd->bts", q, k) / 4.0
    attn = jax.nn.softmax(logits, axis=-1)
    h = jnp.einsum("bts,bsd->btd", attn, v)
    return hk.Linear(16, name="out")(h) + x


def _transformer(x):
  x = hk.Linear(16, name="embed")(x)
  x = _Block(name="block")(x)
  return hk.Linear(4, name="head")(x)


def _explain_block():
  mpolicy.set_policy(hk.Module, "p=f32,c=bf16,o=f32")
  mpolicy.set_policy(hk.Linear, F8)
  model = mpolicy.transform_amp(_transformer)
  x = _normal(0, (2, 5, 8))
  params = jax.jit(model.init)(jax.random.PRNGKey(0), x)  # Not op by op.
  return model, params, x, mpolicy.explain(model.apply, params, None, x)


def test_per_module_fp8_linears_and_bf16_attention():
  _, params, _, report = _explain_block()
  assert {np.dtype(p.dtype) for p in jax.tree.leaves(params)} == {F32}
  dots = [r for r in report.rows if r.primitive == "dot_general"]
  linear = [r for r in dots if r.module_class == "hk.Linear"]
  attention = [r for r in dots if r.module_class != "hk.Linear"]
  assert len(linear) == 6 and len(attention) == 2
  assert {r.ran_in for r in linear} == {"float8_e4m3fn"}
  assert all("float8_e5m2" in r.decided_by and "hk.Linear" in r.decided_by
             for r in linear)
  assert {r.ran_in for r in attention} == {"bfloat16"}
  exp = [r for r in report.rows if r.primitive == "exp"]
  assert exp and {r.ran_in for r in exp} == {"float32"}
  # Inside the float8 Linears the bias add runs in bfloat16, not float8.
  adds = [r for r in report.rows
          if r.primitive == "add" and r.module_class == "hk.Linear"]
  assert adds and {r.ran_in for r in adds} == {"bfloat16"}


def test_per_module_fp8_trains_under_jit_grad():
  model, params, x, _ = _explain_block()
  y = _normal(1, (2, 5, 4))

  def loss(p):
    return jnp.mean((model.apply(p, None, x).astype(jnp.float32) - y) ** 2)

  text = _hlo(jax.grad(loss), params)
  assert "f8E4M3FN" in text and "f8E5M2" in text
  grads = jax.jit(jax.grad(loss))(params)
  assert {np.dtype(g.dtype) for g in jax.tree.leaves(grads)} == {F32}
  assert bool(mpolicy.all_finite(grads))


@pytest.mark.ci  # A transformer step, 6 s on 2 cores.
def test_example_flag_value_runs_a_transformer_step():
  # The value `--mp_policy=p=f32,c=f8,o=bf16` passes `get_policy`, and a
  # transformer-like model's optimizer step runs under it as the default.
  policy = mpolicy.get_policy("p=f32,c=f8,o=bf16")
  mpolicy.set_policy(hk.Module, policy)
  model = mpolicy.transform_amp(_transformer)
  x, y = _normal(0, (2, 5, 8)), _normal(1, (2, 5, 4))
  params = jax.jit(model.init)(jax.random.PRNGKey(0), x)  # Not op by op.

  @jax.jit
  def step(p):
    loss, g = jax.value_and_grad(lambda p: jnp.mean(
        (model.apply(p, None, x).astype(jnp.float32) - y) ** 2))(p)
    return loss, jax.tree.map(lambda a, b: a - 0.1 * b, p, g)

  loss0, params = step(params)
  for _ in range(20):
    loss, params = step(params)
  assert model.apply(params, None, x).dtype == BF16
  assert float(loss) < float(loss0)
  report = mpolicy.explain(model.apply, params, None, x)
  # The six Linear matmuls in float8; the two attention matmuls (two
  # activations) in bfloat16.
  assert report.ops_per_dtype.get("float8_e4m3fn") == 6
  attention = [r for r in report.rows if r.primitive == "dot_general"
               and r.module_class != "hk.Linear"]
  assert len(attention) == 2 and {r.ran_in for r in attention} == {"bfloat16"}


# --- Training --------------------------------------------------------------------


def _digits_accuracy(policy, steps=300):
  sklearn = pytest.importorskip("sklearn.datasets")
  data = sklearn.load_digits()
  x = (data.data / 16.0).astype(np.float32)
  y = data.target.astype(np.int32)
  perm = np.random.RandomState(0).permutation(len(x))
  x, y = x[perm], y[perm]
  xtr, ytr, xte, yte = x[:1400], y[:1400], x[1400:], y[1400:]
  mpolicy.set_policy(hk.Module, policy)
  model = mpolicy.transform_amp(lambda x: hk.nets.MLP([128, 128, 10])(x))
  params = model.init(jax.random.PRNGKey(0), xtr[:1])
  import optax  # pylint: disable=import-outside-toplevel
  opt = optax.adam(3e-3)
  state = opt.init(params)

  @jax.jit
  def step(params, state, xb, yb):
    def loss(p):
      logits = model.apply(p, None, xb).astype(jnp.float32)
      return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()
    g = jax.grad(loss)(params)
    updates, state = opt.update(g, state, params)
    return optax.apply_updates(params, updates), state

  rng = np.random.RandomState(1)
  for _ in range(steps):
    idx = rng.randint(0, len(xtr), 128)
    params, state = step(params, state, xtr[idx], ytr[idx])
  pred = np.argmax(np.asarray(model.apply(params, None, xte), np.float32), -1)
  mpolicy.clear_policies()
  return float(np.mean(pred == yte))


@pytest.mark.slow
def test_digits_mlp_fp8_within_one_point_of_bf16():
  bf16 = _digits_accuracy("p=f32,c=bf16,o=bf16")
  f8 = _digits_accuracy(F8)
  print(f"digits test accuracy: bf16 {bf16:.4f}, fp8 {f8:.4f}")
  assert bf16 > 0.9
  assert f8 >= bf16 - 0.01, (f8, bf16)
