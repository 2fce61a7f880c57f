"""What the backward pass keeps: bfloat16 residuals, float32 only where needed.

Under a bfloat16 policy a `full` op (exp, rsqrt, x ** n, ...) on a bfloat16
value computes in float32 and stores its result, and the derivative the
backward pass keeps, in bfloat16; a bfloat16 value scaled by a float32
statistic (softmax's division by its sum) likewise. Results read only in
float32 (by sums) stay float32, so ``mean(x ** 2) - mean(x) ** 2`` keeps its
small terms. The residuals of a small Haiku GPT are measured with
`jax.ad_checkpoint.print_saved_residuals` against a jmp-style model (the
same Haiku code run on parameters cast to bfloat16).
"""

import collections
import contextlib
import io
import re

import haiku as hk
import jax
import pytest
from jax.ad_checkpoint import print_saved_residuals
import jax.numpy as jnp
import jmp
import numpy as np

import mpolicy
from mpolicy._src.rules import half_storage

from _helpers import walk_eqns

F32 = jnp.dtype(jnp.float32)
BF16 = jnp.dtype(jnp.bfloat16)
HALF = "p=f32,c=bf16,o=bf16"
KEY = jax.random.PRNGKey(0)

_BYTES = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "i64": 8, "i32": 4,
          "u32": 4, "i8": 1, "u8": 1, "bool": 1}


def residual_bytes(fn, *args):
  """Bytes the backward pass of ``fn`` keeps, by dtype name.

  Residuals that are arguments of ``fn`` (the parameters) are left out:
  they are alive anyway, so keeping them costs no memory.
  """
  buf = io.StringIO()
  with contextlib.redirect_stdout(buf):
    print_saved_residuals(fn, *args)
  out = collections.Counter()
  for line in buf.getvalue().splitlines():
    m = re.match(r"\s*(\w+)\[([\d,\s]*)\]\s+(.*)", line)
    if not m or "from the argument" in m.group(3):
      continue
    dims = [int(d) for d in m.group(2).split(",") if d.strip()]
    out[m.group(1)] += int(np.prod(dims)) * _BYTES[m.group(1)]
  return out


# --- A small GPT ---------------------------------------------------------------

V, T, D, HEADS, LAYERS, B = 256, 64, 128, 4, 2, 8


class _Block(hk.Module):

  def __call__(self, x):
    h = hk.LayerNorm(-1, True, True)(x)
    mask = jnp.tril(jnp.ones((T, T)))[None, None]
    h = hk.MultiHeadAttention(
        HEADS, D // HEADS,
        w_init=hk.initializers.VarianceScaling(1.0))(h, h, h, mask=mask)
    x = x + h
    h = hk.LayerNorm(-1, True, True)(x)
    h = jax.nn.gelu(hk.Linear(4 * D)(h))
    return x + hk.Linear(D)(h)


def _gpt(tokens):
  pos = hk.get_parameter("pos", [T, D],
                         init=hk.initializers.TruncatedNormal(0.02))
  x = hk.Embed(V, D)(tokens) + pos
  for _ in range(LAYERS):
    x = _Block()(x)
  return hk.Linear(V)(hk.LayerNorm(-1, True, True)(x))


def _loss_of(apply):
  def loss(params, tokens):
    logits = apply(params, None, tokens).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits)
    return -jnp.take_along_axis(logp, tokens[..., None], -1).mean()
  return loss


def _gpt_losses():
  """(transform_amp loss, jmp-style loss, float32 loss, params, tokens)."""
  tokens = jax.random.randint(jax.random.PRNGKey(1), (B, T), 0, V)
  mpolicy.set_policy(hk.Module, HALF)
  amp_gpt = mpolicy.transform_amp(_gpt)
  # Jitted: eager, transform_amp's init would run the GPT op by op.
  params = jax.jit(amp_gpt.init)(KEY, tokens)
  plain = hk.transform(_gpt)
  policy = jmp.get_policy(HALF)

  def jmp_apply(params, rng, tokens):
    return plain.apply(policy.cast_to_compute(params), rng, tokens)

  return (_loss_of(amp_gpt.apply), _loss_of(jmp_apply),
          _loss_of(plain.apply), params, tokens)


@pytest.mark.ci  # Two GPT traces, 6 s on 2 cores.
def test_gpt_keeps_no_more_residuals_than_jmp():
  amp_loss, jmp_loss, _, params, tokens = _gpt_losses()
  ours = residual_bytes(amp_loss, params, tokens)
  theirs = residual_bytes(jmp_loss, params, tokens)
  # jmp's float32 residuals are jnp.var's centred values (jnp upcasts half
  # inputs) and the float32 log-softmax of the loss: the same for both.
  # Beyond them mpolicy keeps each LayerNorm's per-token statistics in
  # float32 (a float32 result JAX would narrow to half stays float32), a
  # few values per token per norm, where jmp keeps them in bfloat16: far
  # less than one activation (B * T * D values).
  per_token_stats = B * T * (2 * LAYERS + 1)
  assert ours["f32"] <= theirs["f32"] + 8 * per_token_stats, (
      ours, theirs)
  assert 8 * per_token_stats < B * T * D
  assert sum(ours.values()) <= sum(theirs.values()), (ours, theirs)
  nbytes = lambda c: 2 * c["bf16"] + 4 * c["f32"] + c["bool"] + 4 * c["i32"]
  assert nbytes(ours) <= nbytes(theirs), (ours, theirs)
  # The bulk is bfloat16: attention probabilities, GELU, LayerNorm outputs.
  assert ours["bf16"] > 4 * ours["f32"], ours


@pytest.mark.slow
def test_gpt_under_transform_amp_stays_close_to_float32():
  amp_loss, jmp_loss, f32_loss, params, tokens = _gpt_losses()
  want, gw = jax.value_and_grad(f32_loss)(params, tokens)
  got, gh = jax.jit(jax.value_and_grad(amp_loss))(params, tokens)
  _, gj = jax.jit(jax.value_and_grad(jmp_loss))(params, tokens)
  assert abs(float(got) - float(want)) < 2e-3 * abs(float(want))
  flat = lambda g: jnp.concatenate([jnp.ravel(x).astype(jnp.float32)
                                    for x in jax.tree_util.tree_leaves(g)])
  assert all(x.dtype == F32 for x in jax.tree_util.tree_leaves(gh))
  ref = flat(gw)
  ours = float(jnp.linalg.norm(flat(gh) - ref) / jnp.linalg.norm(ref))
  theirs = float(jnp.linalg.norm(flat(gj) - ref) / jnp.linalg.norm(ref))
  # Closer to the float32 gradients than the jmp-style model.
  assert ours < 0.02 and ours <= theirs, (ours, theirs)


# --- Small functions -----------------------------------------------------------


def _w(n=32):
  return jax.random.normal(KEY, (n, n)) / np.sqrt(n)


def test_gelu_and_softmax_keep_bfloat16_residuals():
  def f(x, w):
    h = jax.nn.gelu(x @ w)          # x ** 3 is a `full` op.
    return jnp.sum(jax.nn.softmax(h @ w) @ w)  # exp and the division.
  x = jax.random.normal(KEY, (16, 32))
  res = residual_bytes(mpolicy.amp(f, "p=f32,c=bf16,o=f32"), x, _w())
  # Only per-row softmax sums may stay float32 (16 rows).
  assert res["f32"] <= 16 * 4 * 2, res
  assert res["bf16"] >= 4 * 16 * 32 * 2, res


def test_full_results_stay_float32_under_float16_not_under_bfloat16():
  # exp is a `full` op: computed in float32 under both policies.
  def f(x, w):
    return jnp.sum(jnp.exp(x @ w) * 0.5)
  x = jax.random.normal(KEY, (16, 32)) / 4
  res = residual_bytes(mpolicy.amp(f, "p=f32,c=f16,o=f32"), x, _w())
  # float16: exp's result may overflow it, so it stays float32 (autocast).
  assert res["f32"] >= 16 * 32 * 4, res
  res = residual_bytes(mpolicy.amp(f, "p=f32,c=bf16,o=f32"), x, _w())
  assert res["f32"] == 0, res


def test_variance_from_squares_keeps_its_small_terms():
  # mean(h**2) - mean(h)**2 of a bfloat16 activation near 64 with spread
  # 0.5: the squares are read only in float32 (by the sum), so they stay
  # float32 (exact for bfloat16 values). Run in half (no `integer_pow`
  # rule), each square is a bfloat16 value, rounded by up to 16, which
  # loses the variance wherever the backend stores it (XLA:CPU happens to
  # fuse the rounding away, so only the jaxpr shows it here).
  x = 64 + jax.random.normal(KEY, (4096,)) * 0.5

  def var(x):
    h = x.astype(jnp.bfloat16) * 1.0
    n = h.shape[0]
    mean = jnp.sum(h.astype(jnp.float32)) / n
    return jnp.sum((h ** 2).astype(jnp.float32)) / n - mean ** 2

  want = float(jnp.var(x.astype(jnp.bfloat16).astype(jnp.float32)))
  policy = "p=f32,c=bf16,o=f32"
  got = float(mpolicy.amp(var, policy)(x))
  assert abs(got - want) < 0.05 * want, (got, want)
  pows = lambda rules: [
      (jnp.dtype(e.invars[0].aval.dtype), jnp.dtype(e.outvars[0].aval.dtype))
      for e in walk_eqns(jax.make_jaxpr(mpolicy.amp(var, policy, rules=rules))(
          x)) if e.primitive.name == "integer_pow" and e.invars[0].aval.shape]
  assert pows(None) == [(F32, F32)]
  half = mpolicy.DEFAULT_RULES.without_ops("integer_pow")
  assert pows(half) == [(BF16, BF16)]


def test_float16_squares_do_not_overflow():
  # 300 ** 2 overflows float16 (max 65504); `integer_pow` in `full` runs it
  # in float32 and, under float16, keeps the float32 result.
  x = jnp.full((8,), 300.0, jnp.float16)
  policy = "p=f32,c=f16,o=f32"
  f = lambda x: jnp.sqrt(jnp.mean(x.astype(jnp.float16) ** 2 * 0.5))
  assert np.isfinite(float(mpolicy.amp(f, policy)(x)))
  half = mpolicy.DEFAULT_RULES.without_ops("integer_pow")
  assert not np.isfinite(float(mpolicy.amp(f, policy, rules=half)(x)))


def test_float16_exp_result_stays_float32():
  f = mpolicy.amp(lambda x: jnp.exp(x) * 1.0, "p=f32,c=f16,o=f32")
  out = f(jnp.full((4,), 12.0, jnp.float16))
  assert out.dtype == F32 and np.isfinite(np.asarray(out)).all()


# --- The wrappers ----------------------------------------------------------------


def test_unary_in_float32_values_and_derivatives():
  x = jnp.linspace(-3, 3, 64).astype(jnp.bfloat16)
  f = lambda x: half_storage.unary_in_float32(jnp.exp, x, jnp.bfloat16)
  y = f(x)
  assert y.dtype == BF16
  np.testing.assert_array_equal(
      np.asarray(y), np.asarray(jnp.exp(x.astype(jnp.float32)).astype(BF16)))
  g = jax.grad(lambda x: jnp.sum(f(x).astype(jnp.float32)))(x)
  np.testing.assert_allclose(np.asarray(g, np.float32),
                             np.exp(np.asarray(x, np.float32)), rtol=1e-2)
  # Forward mode and second order work (custom_jvp, not custom_vjp).
  _, t = jax.jvp(f, (x,), (jnp.ones_like(x),))
  np.testing.assert_allclose(np.asarray(t, np.float32),
                             np.exp(np.asarray(x, np.float32)), rtol=1e-2)
  g2 = jax.grad(lambda x: jax.grad(
      lambda x: f(x).astype(jnp.float32).sum())(x).astype(jnp.float32).sum())(x)
  np.testing.assert_allclose(np.asarray(g2, np.float32),
                             np.exp(np.asarray(x, np.float32)), rtol=2e-2)


def test_cast_after_a_broadcast_sums_its_gradient_in_float32():
  b = jax.random.normal(KEY, (1, 8))
  spread = half_storage.broadcaster((16, 8))
  f = lambda b: half_storage.cast_after(spread, b, jnp.bfloat16)
  y = f(b)
  assert y.dtype == BF16
  np.testing.assert_array_equal(y, jnp.broadcast_to(b, (16, 8)).astype(BF16))
  # The forward pass converts the small parameter only.
  converts = [e for e in walk_eqns(jax.make_jaxpr(f)(b))
              if e.primitive.name == "convert_element_type"]
  assert [e.outvars[0].aval.shape for e in converts] == [(1, 8)]
  # Its gradient is a float32 sum of the sixteen rows' cotangents.
  w = (1 + jnp.arange(16.0)[:, None] / 256).astype(BF16) * jnp.ones((16, 8), BF16)
  loss = lambda b: jnp.sum((f(b) * w).astype(jnp.float32))
  grad_jaxpr = jax.make_jaxpr(jax.grad(loss))(b)
  sums = [e for e in walk_eqns(grad_jaxpr)
          if e.primitive.name == "reduce_sum" and e.invars[0].aval.shape == (16, 8)]
  assert sums and all(e.invars[0].aval.dtype == F32 for e in sums), sums
  np.testing.assert_allclose(jax.grad(loss)(b),
                             np.asarray(w, np.float32).sum(0, keepdims=True),
                             rtol=1e-6)
  # Forward mode works too (a custom_jvp).
  _, t = jax.jvp(f, (b,), (jnp.ones_like(b),))
  assert t.dtype == BF16 and bool(jnp.all(t == 1))


@pytest.mark.ci  # Two GPT traces, 6 s on 2 cores.
def test_amp_over_apply_keeps_what_transform_amp_keeps():
  # Code traced in float32 centres and scales its layer norms by float32
  # statistics; under bfloat16 the rules store those values in bfloat16,
  # so the backward pass keeps what transform_amp's keeps (jnp.var's own
  # float32 centring included), not float32 activations per norm.
  ta_loss, _, _, params, tokens = _gpt_losses()
  plain = hk.transform(_gpt)
  amp_loss = _loss_of(mpolicy.amp(plain.apply, HALF))
  ta = residual_bytes(ta_loss, params, tokens)
  # amp honours hk.Module's entry too (then it matches transform_amp by
  # construction): without it, only the op rules act on the plain apply.
  mpolicy.clear_policies()
  ours = residual_bytes(amp_loss, params, tokens)
  assert ours["f32"] <= 1.05 * ta["f32"], (ours, ta)
  assert sum(ours.values()) <= 1.05 * sum(ta.values()), (ours, ta)
