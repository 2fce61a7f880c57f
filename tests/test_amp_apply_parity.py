"""`amp` over code traced in float32 against `transform_amp` on the same model.

Code traced in float32 writes float32 constants (a mask's fill value),
looks up float32 embedding rows and centres and scales layer norms by
float32 statistics; under a half policy none of these should keep the
computation in float32 where the module policies of `transform_amp` (and
jmp) give half values.
"""

import collections
import contextlib
import math
import os
import re
import sys

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpolicy
import _helpers

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "benchmarks"))
import models  # pylint: disable=g-import-not-at-top,wrong-import-position

POLICY = "p=f32,c=bf16,o=f32"
BF16_MIN = float(jnp.finfo(jnp.bfloat16).min)


def _masked(x, w):
  logits = x @ w  # bfloat16 under the policy.
  mask = jnp.tril(jnp.ones(logits.shape, bool))
  return jnp.where(mask, logits, jnp.finfo(jnp.float32).min)


def test_a_float32_mask_fill_follows_half_logits():
  x = jnp.ones((4, 8))
  w = jnp.full((8, 4), 0.5)
  f = mpolicy.amp(_masked, "p=f32,c=bf16,o=bf16")
  (select,) = [e for e in _helpers.all_eqns(f, x, w)
               if e.primitive.name == "select_n"
               and e.outvars[0].aval.dtype != jnp.bool_]
  assert select.outvars[0].aval.dtype == jnp.bfloat16, select
  out = np.asarray(f(x, w).astype(jnp.float32))
  # float32's lowest becomes bfloat16's lowest, not -inf.
  assert out[0, 1] == BF16_MIN, out
  np.testing.assert_array_equal(out[np.tril_indices(4)], 4.0)


def test_a_fully_masked_row_stays_finite():
  def f(x, w):
    logits = x @ w
    mask = jnp.zeros(logits.shape, bool).at[1:].set(True)  # Row 0: all out.
    return jax.nn.softmax(jnp.where(mask, logits, jnp.finfo(jnp.float32).min))

  out = np.asarray(mpolicy.amp(f, POLICY)(jnp.ones((3, 8)), jnp.ones((8, 4))))
  assert np.isfinite(out).all(), out
  np.testing.assert_allclose(out, 0.25)


def test_a_constant_in_a_promote_op_follows_the_arrays():
  def f(x, w):
    y = x @ w
    return jax.lax.select(y > 0, y, jnp.full(y.shape, -1e30, jnp.float32))

  f = mpolicy.amp(f, "p=f32,c=bf16,o=bf16")
  x = jnp.ones((2, 4)).at[0].set(-1.0)
  (select,) = [e for e in _helpers.all_eqns(f, x, jnp.ones((4, 3)))
               if e.primitive.name == "select_n"]
  assert select.outvars[0].aval.dtype == jnp.bfloat16
  out = np.asarray(f(x, jnp.ones((4, 3))).astype(jnp.float32))
  fill = float(jnp.asarray(-1e30, jnp.bfloat16).astype(jnp.float32))
  np.testing.assert_array_equal(out, [[fill] * 3, [4.0] * 3])


def test_an_embedding_lookup_gives_compute_dtype_rows():
  def f(table, pos, idx):
    return table[idx] + pos  # The residual stream of a transformer.

  table = jnp.arange(40.0).reshape(10, 4) / 7
  pos = jnp.full((3, 4), 0.25)
  idx = jnp.array([1, 1, 7])
  g = mpolicy.amp(f, "p=f32,c=bf16,o=bf16")
  eqns = _helpers.all_eqns(g, table, pos, idx)
  (gather,) = [e for e in eqns if e.primitive.name == "gather"]
  (add,) = [e for e in eqns if e.primitive.name == "add"
            and len(e.outvars[0].aval.shape) == 2]
  assert gather.invars[0].aval.dtype == jnp.float32  # Gathers in float32,
  assert add.outvars[0].aval.dtype == jnp.bfloat16  # the rows are half.
  want = (table.astype(jnp.bfloat16)[idx] + pos.astype(jnp.bfloat16))
  np.testing.assert_array_equal(np.asarray(g(table, pos, idx)),
                                np.asarray(want))
  # The gradient still sums into the float32 table, exactly.
  grad = jax.grad(lambda t: g(t, pos, idx).astype(jnp.float32).sum())(table)
  assert grad.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(grad)[:, 0],
                                [0, 2, 0, 0, 0, 0, 0, 1, 0, 0])


def _layer_norm(x, w):
  return hk.LayerNorm(-1, True, True)(x @ w)  # x @ w: a bfloat16 activation.


def test_a_layer_norm_stores_its_centred_and_scaled_values_in_bfloat16():
  f = hk.without_apply_rng(hk.transform(_layer_norm))
  x = jax.random.normal(jax.random.PRNGKey(0), (4, 16, 32)) * 3 + 40
  w = jnp.eye(32) + 0.01
  params = f.init(jax.random.PRNGKey(1), x, w)
  params = jax.tree_util.tree_map(lambda p: p + 0.25, params)
  g = mpolicy.amp(f.apply, "p=f32,c=bf16,o=bf16")
  eqns = _helpers.all_eqns(g, params, x, w)
  big = lambda e: e.outvars and e.outvars[0].aval.shape == (4, 16, 32)
  subs = [e for e in eqns if e.primitive.name == "sub" and big(e)]
  # ``x - mean`` is two bfloat16 subtractions of the statistic's bfloat16
  # parts (exact where the digits cancel): no activation-sized convert.
  # jnp.var's own centred values, read only by its float32 square and sum,
  # stay float32.
  dtypes_ = [(np.dtype(e.invars[0].aval.dtype).name,
              np.dtype(e.outvars[0].aval.dtype).name) for e in subs]
  assert sorted(dtypes_) == sorted([("float32", "float32")]
                                   + [("bfloat16", "bfloat16")] * 2), subs
  # ``scale * rsqrt(var)``, its product with the centred values and the
  # output are bfloat16 too (jnp.var centres again inside its own jit: read
  # only by its float32 square and sum, those centred values stay float32).
  outer = [e for e in jax.make_jaxpr(g)(params, x, w).jaxpr.eqns
           if big(e) and e.primitive.name in ("mul", "add")]
  assert outer and all(e.outvars[0].aval.dtype == jnp.bfloat16
                       for e in outer), outer
  # Values: the centring is exact before its one rounding; the output is
  # within bfloat16 rounding of the float32 norm.
  bf16 = lambda a: a.astype(jnp.bfloat16)
  xb = jnp.dot(bf16(x), bf16(w), preferred_element_type=jnp.float32)
  xb = bf16(xb).astype(jnp.float32)  # The bfloat16 activation normed.
  want = f.apply(params, xb, jnp.eye(32))
  got = g(params, x, w)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want),
                             rtol=2e-2, atol=2e-2)
  explained = str(mpolicy.explain(g, params, x, w))
  assert "offset by a float32 statistic spread along it" in explained
  assert "scaled by a float32 statistic" in explained


def _centred(explicit):
  """Code traced in float32: a matmul's result (bfloat16 under the rules)
  minus its row means, broadcast implicitly or with ``jnp.broadcast_to``."""
  def f(x, w):
    h = x @ w
    m = jnp.mean(h, -1, keepdims=True)
    return h - (jnp.broadcast_to(m, h.shape) if explicit else m)
  return f


_X = 100 + jax.random.normal(jax.random.PRNGKey(0), (8, 64))
_EYE = jnp.eye(64)


def _is_bfloat16(a):
  a = np.asarray(a, np.float32)
  return np.array_equal(a, a.astype(jnp.bfloat16).astype(np.float32))


@pytest.mark.parametrize("explicit", [False, True],
                         ids=["implicit", "broadcast_to"])
def test_centring_by_a_spread_statistic_is_stored_in_bfloat16(explicit):
  g = mpolicy.amp(_centred(explicit), "p=f32,c=bf16,o=f32")
  subs = [np.dtype(e.outvars[0].aval.dtype).name
          for e in _helpers.all_eqns(g, _X, _EYE)
          if e.primitive.name == "sub" and e.outvars[0].aval.shape == (8, 64)]
  if explicit:  # A statistic as large as the array: in float32, rounded.
    assert subs == ["float32"], subs
  else:  # Two bfloat16 subtractions of the statistic's bfloat16 parts.
    assert subs == ["bfloat16", "bfloat16"], subs
  y = g(_X, _EYE)
  assert y.dtype == jnp.float32 and _is_bfloat16(y)  # stored in bfloat16.
  # Exact to a bfloat16 rounding of the centred values, though the mean
  # (about 100) is 400 times their bfloat16 resolution: a mean rounded to
  # bfloat16 would be off by up to 0.25.
  xb = np.asarray(_X.astype(jnp.bfloat16), np.float32)  # The matmul's result.
  want = xb - xb.mean(-1, keepdims=True)
  np.testing.assert_allclose(np.asarray(y), want, atol=1.5e-2)
  assert np.max(np.abs(np.asarray(y) - want) / (np.abs(want) + 0.1)) < 2e-2


def test_centring_under_grad_sums_the_statistics_gradient_in_float32():
  g = mpolicy.amp(_centred(False), "p=f32,c=bf16,o=f32")
  # d/dh sum((h - mean(h)) * v) = v - mean(v): the statistic's cotangent is
  # a sum of the bfloat16 cotangents, in float32.
  v = jax.random.normal(jax.random.PRNGKey(1), (8, 64))
  grad = jax.grad(lambda x: jnp.sum(g(x, _EYE) * v))(_X)
  vb = np.asarray(v.astype(jnp.bfloat16), np.float32)
  np.testing.assert_allclose(np.asarray(grad), vb - vb.mean(-1, keepdims=True),
                             atol=2e-2)


def test_a_difference_of_same_shaped_values_keeps_float32():
  # The per-token loss ``logsumexp(logits) - logits[label]`` subtracts two
  # values of one shape: no statistic is spread, so the widest dtype wins
  # and the loss keeps float32.
  def f(x, w):
    logits = x @ w
    return jax.nn.logsumexp(logits, -1) - logits[:, 0]
  x = jax.random.normal(jax.random.PRNGKey(0), (8, 16))
  out = mpolicy.amp(f, "p=f32,c=bf16,o=f32")(x, jnp.eye(16))
  subs = [e for e in _helpers.all_eqns(mpolicy.amp(f, "p=f32,c=bf16,o=f32"),
                                       x, jnp.eye(16))
          if e.primitive.name == "sub" and e.outvars[0].aval.shape == (8,)]
  assert subs and all(e.outvars[0].aval.dtype == jnp.float32 for e in subs)
  assert out.dtype == jnp.float32


def test_centring_under_float16_stays_float32():
  # float16 lacks float32's range: a statistic's offset keeps float32.
  def f(x):
    h = x.astype(jnp.float16) * 1.0
    return h - jnp.mean(h.astype(jnp.float32), -1, keepdims=True)
  out = mpolicy.amp(f, "p=f32,c=f16,o=f16")(jnp.ones((4, 8)))
  eqns = _helpers.all_eqns(mpolicy.amp(f, "p=f32,c=f16,o=f16"),
                           jnp.ones((4, 8)))
  (sub,) = [e for e in eqns if e.primitive.name == "sub"]
  assert sub.outvars[0].aval.dtype == jnp.float32
  assert out.dtype == jnp.float16  # The output policy's cast.


def _grad(variant, layers):
  """``(jax.grad of the loss, params' shapes, tokens)`` of a small GPT, under
  transform_amp (``"ta"``) or amp over a plain transform's apply."""
  vocab, d, heads, seq = 64, 32, 2, 16
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, seq + 1), 0, vocab)

  def forward(t):
    logits = models.GPT(vocab, d, heads, layers, name="gpt")(t[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), t[:, 1:]).mean()

  context = (mpolicy.push_policy(hk.Module, POLICY) if variant == "ta"
             else contextlib.nullcontext())
  with context:
    if variant == "ta":
      model = mpolicy.transform_amp(forward)
      loss = lambda p, t: model.apply(p, None, t)
    else:
      model = hk.transform(forward)
      loss = mpolicy.amp(lambda p, t: model.apply(p, None, t), POLICY)
    # Lowered and compiled only, never run: shapes and dtypes suffice (an
    # eager transform_amp init of the GPT would run op by op).
    params = jax.eval_shape(model.init, jax.random.PRNGKey(0), tokens)
  return jax.grad(loss), params, tokens


def _compiled_grad(variant, layers):
  grad, params, tokens = _grad(variant, layers)
  with (mpolicy.push_policy(hk.Module, POLICY) if variant == "ta"
        else contextlib.nullcontext()):
    return jax.jit(grad).lower(params, tokens).compile().as_text()


@pytest.mark.slow  # Compiles two 6-layer models: about 10 s on 2 cores.
def test_amp_over_apply_compiles_no_bigger_than_transform_amp():
  """A deep model's HLO grows with its depth alike under both.

  Code traced in float32 centres a norm by a float32 mean: amp subtracts
  the mean's two half parts (no float32 copy of the activation) where
  transform_amp's code already made the mean half, a few instructions more
  per norm. Measured on CPU, 2026-11-26: 8,220 against 7,745 (jax 0.12),
  8,087 against 7,677 (jax 0.10.2), +5-6%.
  """
  count = lambda text: len(re.findall(r"\n\s+(?:ROOT )?%\S+ = ", text))
  ta, amp = count(_compiled_grad("ta", 6)), count(_compiled_grad("amp", 6))
  assert amp <= 1.08 * ta, (amp, ta)


_FUNC = re.compile(r"func\.func (?:public |private )?@([\w.$-]+)")
_CONVERT = re.compile(r"stablehlo\.convert .*:\s*\(tensor<([0-9x]*)(\w+)>\)"
                      r"\s*->\s*tensor<[0-9x]*(\w+)>")
_CALL = re.compile(r"call @([\w.$-]+)")


def converted_elements(text: str) -> collections.Counter:
  """Elements a StableHLO module converts, by (from, to) element type; a
  function's converts count once per call of it."""
  own, calls, name = {}, {}, None
  for line in text.splitlines():
    m = _FUNC.search(line)
    if m:
      name = m.group(1)
      own[name], calls[name] = collections.Counter(), collections.Counter()
      continue
    m = _CONVERT.search(line)
    if m and name is not None:
      dims, src, dst = m.groups()
      own[name][src, dst] += math.prod(int(n) for n in dims.split("x") if n)
    elif name is not None:
      calls[name].update(_CALL.findall(line))

  def total(fn):
    out = collections.Counter(own[fn])
    for callee, n in calls[fn].items():
      for k, v in total(callee).items():
        out[k] += n * v
    return out
  return total("main")


def _cuda_converts(variant):
  grad, params, tokens = _grad(variant, layers=2)
  with (mpolicy.push_policy(hk.Module, POLICY) if variant == "ta"
        else contextlib.nullcontext()):
    text = jax.jit(grad).trace(params, tokens).lower(
        lowering_platforms=("cuda",)).as_text()
  return converted_elements(text)


def _logsumexp_recomputes_softmax() -> bool:
  """Whether JAX's `logsumexp` derivative takes a second exp (a softmax)."""
  grad = jax.grad(lambda a: jax.nn.logsumexp(a, -1).sum())
  return sum(e.primitive.name == "exp"
             for e in _helpers.all_eqns(grad, jnp.ones((2, 4)))) > 1


def test_amp_over_apply_converts_no_more_than_transform_amp_on_cuda():
  # Read from the CUDA lowering (no GPU needed). Code traced in float32
  # divides softmax's exponentials by a float32 sum and centres layer norms
  # by float32 means; done in float32 from bfloat16 storage, each converted
  # attention- or activation-sized arrays up and back down (30% more than
  # transform_amp on this model, 2026-11-25).
  ta, amp = _cuda_converts("ta"), _cuda_converts("amp")
  assert ta[("f32", "bf16")] > 0 and amp[("f32", "bf16")] > 0, (ta, amp)
  # The loss's `logits.astype(float32)` is no cast in code traced in
  # float32: under amp the loss reads the bfloat16 logits, under
  # transform_amp float32 ones. From JAX 0.12.1 `logsumexp` has a custom
  # JVP that computes `softmax(logits)` again: under amp one more exp of
  # the bfloat16 logits (read in float32, stored in bfloat16) and its sum
  # rounded to bfloat16, two logits-sized converts and a row-sized one
  # that transform_amp's float32 loss does not make (146,405 against
  # 142,405 on jax 0.12.1; 144,197 against 144,325 on 0.10.2).
  batch, seq, vocab = 2, 16, 64
  extra = (2 * batch * seq * vocab + batch * seq
           if _logsumexp_recomputes_softmax() else 0)
  assert sum(amp.values()) <= sum(ta.values()) + extra, (amp, ta)
