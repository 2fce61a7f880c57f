"""Specification: matmuls stay half x half, f32-accumulated, under AD."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _helpers import multiplies_in

from mpolicy._src.rules import conv

from mpolicy._src.rules import matmul
from mpolicy._src.amp import amp

HALF = "p=f32,c=bf16,o=f32"
BF16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
X = jnp.linspace(-1, 1, 24, dtype=F32).reshape(2, 3, 4)
W = jnp.linspace(-0.5, 0.5, 20, dtype=F32).reshape(4, 5)
V = jnp.linspace(-0.5, 0.5, 10, dtype=F32).reshape(5, 2)


def mlp(x, w, v):
  return jnp.sum(jax.nn.log_softmax(jnp.tanh(x @ w) @ v))


def dot_eqns(closed):
  return eqns_named(closed, "dot_general")


def eqns_named(closed, word):
  """Equations (recursively) whose primitive name contains ``word``."""
  out = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if word in eqn.primitive.name:
        out.append(eqn)
      for v in eqn.params.values():
        for sub in (v if isinstance(v, tuple) else (v,)):
          if hasattr(sub, "eqns") or hasattr(sub, "jaxpr"):
            walk(getattr(sub, "jaxpr", sub))

  walk(closed.jaxpr)
  return out


def test_backward_matmuls_are_half_by_half():
  grad = jax.grad(amp(mlp, HALF), argnums=(0, 1, 2))
  dots = dot_eqns(jax.make_jaxpr(grad)(X, W, V))
  assert len(dots) == 6  # 2 forward + 2 x 2 backward.
  for eqn in dots:
    assert list(multiplies_in(eqn)) == [BF16, BF16], eqn


def lowered_text(fn, *args, platform):
  """StableHLO of ``jit(fn)(*args)`` as lowered for ``platform``."""
  traced = jax.jit(fn).trace(*args)
  return traced.lower(lowering_platforms=(platform,)).as_text()


# StableHLO assertions name the lowering they check, so they hold on any
# machine (a CUDA lowering needs no GPU): every lowering multiplies half by
# half; the CPU one asks for a float32 result, the CUDA one for the half
# result (its matrix units accumulate in float32 themselves), except for a
# float32 argument's gradient, handed over in float32.
LOWERINGS = pytest.mark.parametrize("platform", ["cpu", "cuda"])


@LOWERINGS
def test_backward_matmuls_accumulate_in_f32_in_hlo(platform):
  hlo = lowered_text(jax.grad(amp(mlp, HALF), argnums=(0, 1, 2)), X, W, V,
                     platform=platform)
  dots = [line for line in hlo.splitlines() if "dot_general" in line]
  assert len(dots) == 6
  argument_shapes = {"x".join(map(str, a.shape)) for a in (X, W, V)}
  for line in dots:
    operands = re.findall(r"tensor<[^>]*>", line.split("->")[0].split(":")[-1])
    assert operands and all("bf16" in t for t in operands), line
    shape, dtype = re.search(r"tensor<([\dx]+)x(\w+)>$",
                             line.split("->")[-1].strip()).groups()
    if platform == "cpu" or shape in argument_shapes:
      assert dtype == "f32", line
    else:
      assert dtype == "bf16", line


# Values: a loss whose gradients are of order one (the first class's
# log-probability, weights scaled up), so that a relative tolerance of a few
# percent tells a right gradient from a zero, halved or sign-flipped one.
W_BIG, V_BIG = 4 * W, 4 * V


def first_class(x, w, v):
  return jnp.sum(jax.nn.log_softmax(jnp.tanh(x @ w) @ v)[..., 0])


def assert_close_in_norm(got, want, rel=3e-2):
  """``|got - want| <= rel * |want|`` (Frobenius), ``want`` far from zero."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert np.linalg.norm(want) > 0.1, "reference too small to tell anything"
  error = np.linalg.norm(got - want) / np.linalg.norm(want)
  assert error <= rel, f"relative error {error:.3g} > {rel}"


def test_gradient_values_and_dtypes():
  got = jax.grad(amp(first_class, HALF), argnums=(0, 1, 2))(X, W_BIG, V_BIG)
  want = jax.grad(first_class, argnums=(0, 1, 2))(X, W_BIG, V_BIG)
  for a, b in zip(got, want):
    assert a.dtype == F32
    assert_close_in_norm(a, b)


def test_jvp_and_jacfwd_work():
  f = amp(first_class, HALF)
  tangent = jnp.arange(20.0, dtype=F32).reshape(4, 5) / 20
  _, t = jax.jvp(lambda w: f(X, w, V_BIG), (W_BIG,), (tangent,))
  _, t_ref = jax.jvp(lambda w: first_class(X, w, V_BIG), (W_BIG,), (tangent,))
  assert abs(float(t_ref)) > 0.3
  np.testing.assert_allclose(t, t_ref, rtol=3e-2)
  jac = jax.jacfwd(lambda w: f(X, w, V_BIG))(W_BIG)
  assert_close_in_norm(jac, jax.grad(lambda w: first_class(X, w, V_BIG))(W_BIG))


def test_vmap_of_grad_uses_batching_rule():
  f = jax.vmap(jax.grad(amp(first_class, HALF), argnums=1),
               in_axes=(0, None, None))
  got = f(X[:, None], W_BIG, V_BIG)
  want = jax.vmap(jax.grad(first_class, argnums=1), in_axes=(0, None, None))(
      X[:, None], W_BIG, V_BIG)
  assert got.shape == want.shape == (2, 4, 5)
  for a, b in zip(got, want):  # Each example's gradient on its own.
    assert_close_in_norm(a, b)


def test_amp_dot_general_primitive_directly():
  a, b = X[0].astype(BF16), W.astype(BF16)
  dn = (((1,), (0,)), ((), ()))
  out = matmul.amp_dot_general(a, b, dimension_numbers=dn, out_dtype=BF16)
  assert out.dtype == BF16
  ref = jax.lax.dot_general(a, b, dn, preferred_element_type=F32).astype(BF16)
  np.testing.assert_array_equal(out, ref)
  np.testing.assert_array_equal(jax.jit(matmul.amp_dot_general, static_argnames=(
      "dimension_numbers", "precision", "out_dtype"))(
          a, b, dimension_numbers=dn, out_dtype=BF16), ref)


# --- Convolutions ---------------------------------------------------------------

DOT_CASES = [
    ((6, 4), (6, 5), (((0,), (0,)), ((), ()))),
    ((4, 6), (6, 5), (((1,), (0,)), ((), ()))),
    ((4, 6), (5, 6), (((1,), (1,)), ((), ()))),
    ((2, 3, 6), (6, 5), (((2,), (0,)), ((), ()))),
    ((2, 3, 6), (2, 3, 5), (((0, 1), (0, 1)), ((), ()))),
    ((2, 3, 6), (2, 6, 5), (((2,), (1,)), ((0,), (0,)))),
    ((2, 2, 3, 4), (2, 2, 3, 4), (((3,), (3,)), ((0, 1), (0, 1)))),
    ((3, 2, 4), (2, 4, 3), (((2,), (1,)), ((1,), (0,)))),
    ((3, 5, 4, 2), (4, 3, 6, 2), (((2, 0), (0, 1)), ((3,), (3,)))),
    ((5,), (5,), (((0,), (0,)), ((), ()))),
    ((2, 3), (4, 5), (((), ()), ((), ()))),
]


@pytest.mark.parametrize("lhs_shape, rhs_shape, dims", DOT_CASES)
def test_amp_dot_general_matches_dot_general_and_its_gradients(
    lhs_shape, rhs_shape, dims):
  rng = np.random.default_rng(0)
  lhs = jnp.asarray(rng.normal(size=lhs_shape), jnp.bfloat16)
  rhs = jnp.asarray(rng.normal(size=rhs_shape), jnp.bfloat16)
  amp_dot = lambda a, b: matmul.amp_dot_general(
      a, b, dimension_numbers=dims, out_dtype=F32)
  # The reference at full float32 precision: GPUs' default f32 matmul is TF32.
  ref_dot = lambda a, b: jax.lax.dot_general(
      a.astype(F32), b.astype(F32), dims, precision=jax.lax.Precision.HIGHEST)
  out, amp_vjp = jax.vjp(jax.jit(amp_dot), lhs, rhs)
  ref, ref_vjp = jax.vjp(ref_dot, lhs, rhs)
  np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
  ct = jnp.asarray(rng.normal(size=ref.shape), F32)
  for got, want in zip(amp_vjp(ct), ref_vjp(ct)):
    assert got.dtype == jnp.bfloat16 and got.shape == want.shape
    want = np.asarray(want, F32)
    np.testing.assert_allclose(np.asarray(got, F32), want, rtol=2e-2,
                               atol=2e-2 * np.abs(want).max())
  grad = jax.make_jaxpr(jax.grad(lambda a, b: amp_dot(a, b).sum(),
                                 argnums=(0, 1)))(lhs, rhs)
  assert not [e for e in grad.jaxpr.eqns if e.primitive.name == "dot_general"]


def test_weight_gradient_of_a_3d_activation_runs_on_cpu():
  # XLA:CPU cannot execute some bf16 x bf16 -> f32 dots with two contracting
  # dimensions ("Unsupported element type for DotThunk::Execute"): the
  # weight gradient of x[b, t, d] @ w[d, f] was one. On CPU amp_dot_general
  # lowers every dot as one (batched) matrix product whose left operand
  # contracts its last dimension, the form XLA:CPU runs.
  x = jax.random.normal(jax.random.key(1), (4, 32, 128), F32)
  w = jax.random.normal(jax.random.key(2), (128, 64), F32) / 11
  loss = lambda w, x: jnp.mean(amp(lambda x, w: x @ w, HALF)(x, w) ** 2)
  grad = jax.jit(jax.grad(loss))(w, x)
  want = jax.grad(lambda w, x: jnp.mean((x @ w) ** 2))(w, x)
  assert grad.dtype == F32
  np.testing.assert_allclose(grad, want, rtol=0.05,
                             atol=0.02 * float(jnp.abs(want).max()))


DN = ("NHWC", "HWIO", "NHWC")
_K = jax.random.split(jax.random.key(0), 3)
IMG = jax.random.normal(_K[0], (2, 8, 8, 3), F32)
K1 = 0.3 * jax.random.normal(_K[1], (3, 3, 3, 4), F32)
DEPTHWISE = 4  # feature_group_count of the second conv: C (depthwise) or 1.


def conv_kernel2(groups):
  return 0.3 * jax.random.normal(_K[2], (3, 3, 4 // groups, 4), F32)


def convnet(x, k1, k2):
  """Strided SAME conv, tanh, SAME conv (grouped as k2's shape says)."""
  y = jnp.tanh(jax.lax.conv_general_dilated(x, k1, (2, 2), "SAME",
                                            dimension_numbers=DN))
  groups = y.shape[-1] // k2.shape[2]
  y = jax.lax.conv_general_dilated(y, k2, (1, 1), "SAME", dimension_numbers=DN,
                                   feature_group_count=groups)
  return jnp.sum(jax.nn.log_softmax(y))


GROUPS = pytest.mark.parametrize("groups", [1, DEPTHWISE])


def conv_grad(fn):
  return jax.grad(fn, argnums=(0, 1, 2))


def hlo_types(hlo):
  """Element type of every named value in a compiled HLO module's text."""
  return dict(re.findall(r"(%[\w.\-]+) = \(?([a-z]+[0-9]*)\[", hlo))


@GROUPS
def test_backward_convs_are_half_by_half_in_jaxpr(groups):
  k2 = conv_kernel2(groups)
  closed = jax.make_jaxpr(conv_grad(amp(convnet, HALF)))(IMG, K1, k2)
  convs = eqns_named(closed, "conv_general_dilated")
  assert len(convs) == 6  # 2 forward + 2 x 2 backward.
  for eqn in convs:
    assert eqn.primitive is conv.amp_conv_general_dilated_p, eqn
    assert list(multiplies_in(eqn)) == [BF16, BF16], eqn


@GROUPS
@LOWERINGS
def test_backward_convs_accumulate_in_f32_in_hlo(groups, platform):
  k2 = conv_kernel2(groups)
  fn = conv_grad(amp(convnet, HALF))
  text = lowered_text(fn, IMG, K1, k2, platform=platform)
  convs = [line for line in text.splitlines()
           if "stablehlo.convolution" in line]
  assert len(convs) == 6
  for line in convs:  # "... : (tensor<..>, tensor<..>) -> tensor<..>"
    sig = re.search(r": \((tensor<[^>]*>), (tensor<[^>]*>)\) -> (tensor<[^>]*>)$",
                    line)
    assert sig, line
    assert "bf16" in sig.group(1) and "bf16" in sig.group(2), line
    # cuDNN has no half-in, float32-out convolution: half results on CUDA.
    assert ("xf32>" if platform == "cpu" else "xbf16>") in sig.group(3), line


@GROUPS
def test_compiled_backward_convs_multiply_operands_of_one_dtype(groups):
  # Compiled for this machine's backend, whichever it is.
  k2 = conv_kernel2(groups)
  lowered = jax.jit(conv_grad(amp(convnet, HALF))).lower(IMG, K1, k2)
  # After XLA's passes no convolution multiplies operands of two dtypes.
  # XLA:CPU runs bf16 convolutions in f32 (it converts both operands, as it
  # would for the old f32 x bf16 ones); GPUs keep them bf16.
  compiled = lowered.compile().as_text()
  types = hlo_types(compiled)
  operand_types = []
  for line in compiled.splitlines():
    call = re.search(r" convolution\(([^)]*)\)", line)
    if call:
      operand_types.append({types[n.strip()] for n in call.group(1).split(",")})
  assert len(operand_types) == 6
  expected = {"cpu": {"f32"}, "gpu": {"bf16"}}.get(jax.default_backend())
  for found in operand_types:
    assert len(found) == 1 and found == (expected or found), compiled


@GROUPS
def test_conv_gradient_values_and_dtypes(groups):
  k2 = conv_kernel2(groups)
  got = conv_grad(amp(convnet, HALF))(IMG, K1, k2)
  want = conv_grad(convnet)(IMG, K1, k2)
  for a, b in zip(got, want):
    assert a.dtype == F32
    scale = float(jnp.max(jnp.abs(b)))
    np.testing.assert_allclose(a, b, rtol=5e-2, atol=2e-2 * scale)


@GROUPS
def test_conv_jvp_and_jacfwd_work(groups):
  k2 = conv_kernel2(groups)
  f = amp(convnet, HALF)
  ones = jnp.ones_like(K1)
  _, t = jax.jvp(lambda k: f(IMG, k, k2), (K1,), (ones,))
  _, t_ref = jax.jvp(lambda k: convnet(IMG, k, k2), (K1,), (ones,))
  np.testing.assert_allclose(t, t_ref, rtol=5e-2, atol=5e-2)
  jac = jax.jacfwd(lambda k: f(IMG, K1, k))(k2)
  want = jax.grad(lambda k: convnet(IMG, K1, k))(k2)
  np.testing.assert_allclose(jac, want, rtol=5e-2,
                             atol=2e-2 * float(jnp.max(jnp.abs(want))))
  closed = jax.make_jaxpr(jax.jacfwd(lambda k: f(IMG, K1, k)))(k2)
  convs = eqns_named(closed, "conv_general_dilated")
  assert convs and all(e.primitive is conv.amp_conv_general_dilated_p
                       for e in convs)


@GROUPS
@pytest.mark.parametrize("in_axes", [
    # Slow: 9 s by default; (0, 0, 0) batches the image and both kernels
    # through the same batching rules.
    pytest.param((0, None, None), marks=pytest.mark.slow),
    pytest.param((None, 0, 0), marks=pytest.mark.slow),
    (0, 0, 0)])
def test_vmap_of_conv_grad_keeps_the_primitive(groups, in_axes):
  k2 = conv_kernel2(groups)
  args = [jnp.stack([a, 0.5 * a]) if ax == 0 else a
          for a, ax in zip((IMG, K1, k2), in_axes)]
  f = jax.vmap(conv_grad(amp(convnet, HALF)), in_axes=in_axes)
  got = f(*args)
  want = jax.vmap(conv_grad(convnet), in_axes=in_axes)(*args)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=5e-2,
                               atol=2e-2 * float(jnp.max(jnp.abs(b))))
  convs = eqns_named(jax.make_jaxpr(f)(*args), "conv_general_dilated")
  assert len(convs) == 6
  for eqn in convs:
    assert eqn.primitive is conv.amp_conv_general_dilated_p, eqn
    assert list(multiplies_in(eqn)) == [BF16, BF16], eqn


@GROUPS
def test_full_policy_convs_are_bitwise_plain(groups):
  k2 = conv_kernel2(groups)
  plain = conv_grad(convnet)
  for fn, ref in ((conv_grad(amp(convnet, "full")), plain),
                  (jax.jit(conv_grad(amp(convnet, "full"))), jax.jit(plain))):
    for a, b in zip(fn(IMG, K1, k2), ref(IMG, K1, k2)):
      np.testing.assert_array_equal(a, b)
  closed = jax.make_jaxpr(conv_grad(amp(convnet, "full")))(IMG, K1, k2)
  convs = eqns_named(closed, "conv_general_dilated")
  assert convs and all(e.primitive is jax.lax.conv_general_dilated_p
                       for e in convs)


def test_amp_conv_primitive_directly():
  x, k = IMG.astype(BF16), K1.astype(BF16)
  kw = dict(window_strides=(2, 2), padding="SAME", dimension_numbers=DN)
  out = conv.amp_conv_general_dilated(x, k, **kw, out_dtype=BF16)
  assert out.dtype == BF16
  ref = jax.lax.conv_general_dilated(x, k, **kw,
                                     preferred_element_type=F32).astype(BF16)
  np.testing.assert_array_equal(out, ref)
  jitted = jax.jit(lambda x, k: conv.amp_conv_general_dilated(
      x, k, **kw, out_dtype=F32))
  np.testing.assert_array_equal(jitted(x, k), jax.lax.conv_general_dilated(
      x, k, **kw, preferred_element_type=F32))


def test_second_order_conv_grads_stay_half_by_half():
  # The transposes replay JAX's rules with amp convolutions, so the
  # backward-of-backward convolutions are amp ones too.
  k2 = conv_kernel2(DEPTHWISE)
  f = amp(convnet, HALF)
  gnorm = lambda k: jnp.sum(jax.grad(f, argnums=1)(IMG, k, k2) ** 2)
  closed = jax.make_jaxpr(jax.grad(gnorm))(K1)
  convs = eqns_named(closed, "conv_general_dilated")
  assert len(convs) > 6
  for eqn in convs:
    assert eqn.primitive is conv.amp_conv_general_dilated_p, eqn
    assert list(multiplies_in(eqn)) == [BF16, BF16], eqn
  want = jax.grad(lambda k: jnp.sum(
      jax.grad(convnet, argnums=1)(IMG, k, k2) ** 2))(K1)
  np.testing.assert_allclose(jax.grad(gnorm)(K1), want, rtol=1e-1,
                             atol=5e-2 * float(jnp.max(jnp.abs(want))))


def test_weight_gradient_is_not_rounded_to_half():
  # d/dW sum(x @ W) is x's column sums: the primitive accumulates them in
  # float32 from bf16 x, and hands the float32 weight its gradient without
  # rounding it to bf16 and back (jmp's casts would).
  x = jax.random.normal(jax.random.key(3), (64, 8), F32)
  w = jnp.ones((8, 4), F32)
  grad = jax.jit(jax.grad(lambda w: amp(lambda x, w: x @ w, HALF)(x, w).sum()))(w)
  sums = np.asarray(x.astype(jnp.bfloat16).astype(F32)).sum(0)
  np.testing.assert_allclose(grad, np.repeat(sums[:, None], 4, 1), rtol=1e-6)
  rounded = sums.astype(jnp.bfloat16).astype(F32)
  assert not np.allclose(rounded, sums, rtol=1e-6)  # The test can fail.


def test_bias_gradient_sums_in_float32():
  # d/db sum(linear(x)) sums the cotangent over the batch: JAX's AD writes
  # that sum after the interpreter ran. The bridge hands the module a bf16
  # copy of its float32 bias; broadcasting the float32 bias before the cast
  # makes the gradient's sum a float32 one.
  import haiku as hk  # pylint: disable=g-import-not-at-top
  import mpolicy  # pylint: disable=g-import-not-at-top
  mpolicy.set_policy(hk.Linear, HALF)
  model = mpolicy.transform_amp(lambda x: hk.Linear(4)(x))
  x = jnp.ones((4096, 8), F32)
  params = model.init(jax.random.key(0), x)
  loss = lambda p: model.apply(p, None, x).sum()
  sums = eqns_named(jax.make_jaxpr(jax.grad(loss))(params), "reduce_sum")
  assert sums and all(np.dtype(e.invars[0].aval.dtype) == F32 for e in sums)
  grad = jax.jit(jax.grad(loss))(params)
  np.testing.assert_array_equal(grad["linear"]["b"],
                                np.full(4, 4096.0, np.float32))
