"""Where float8 runs under `c=f8`: weight matmuls, size thresholds, options."""

from __future__ import annotations

import copy
import dataclasses
import pickle
import warnings

import haiku as hk
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest

import mpolicy
from mpolicy._src.rules import fp8_placement

from _helpers import all_eqns

F8 = "p=f32,c=f8,o=bf16"
E4M3 = np.dtype(jnp.float8_e4m3fn)
RULES = mpolicy.DEFAULT_RULES
ACTIVATIONS = ("both operands are activations (fp8 covers weight matmuls; "
               "OpRules.with_fp8(matmuls='all') for all)")


def _normal(seed, shape):
  return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32)


def _dots(report):
  return [r for r in report.rows
          if r.primitive in ("dot_general", "conv_general_dilated")]


def _attention_like(x, w):
  h = x @ w                 # a weight matmul
  return jnp.tanh(h) @ h.T  # two activations


# --- Weight matmuls by default --------------------------------------------------


def test_weight_matmul_in_float8_activation_matmul_in_bfloat16():
  x, w = _normal(0, (16, 32)), _normal(1, (32, 8))
  weight, act = _dots(mpolicy.explain(mpolicy.amp(_attention_like, F8), x, w))
  assert weight.ran_in == "float8_e4m3fn"
  assert act.ran_in == "bfloat16"
  assert ACTIVATIONS in act.decided_by and "not float8_e4m3fn" in act.decided_by
  # In the traced program: one float8 dot, one bfloat16 amp dot.
  eqns = all_eqns(mpolicy.amp(_attention_like, F8), x, w)
  f8 = [e for e in eqns if e.primitive.name == "dot_general"
        and {np.dtype(v.aval.dtype) for v in e.invars} == {E4M3}]
  half = [e for e in eqns if e.primitive.name == "amp_dot_general"]
  assert len(f8) == 1 and len(half) == 1
  assert np.dtype(half[0].params["compute_dtype"]) == jnp.bfloat16


def test_matmuls_all_puts_activation_matmuls_in_float8():
  x, w = _normal(0, (16, 32)), _normal(1, (32, 8))
  rules = RULES.with_fp8(matmuls="all")
  f = mpolicy.amp(_attention_like, F8, rules=rules)
  assert [r.ran_in for r in _dots(mpolicy.explain(f, x, w))] == [
      "float8_e4m3fn"] * 2
  assert not [e for e in all_eqns(f, x, w)
              if e.primitive.name == "amp_dot_general"]


def test_convolution_of_two_activations_runs_in_bfloat16():
  x, k = _normal(0, (2, 8, 8, 4)), _normal(1, (3, 3, 4, 4))
  conv = lambda x, k: lax.conv_general_dilated(
      x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
  f = mpolicy.amp(lambda x, k: conv(jnp.tanh(conv(x, k)), jnp.tanh(k)), F8)
  first, second = _dots(mpolicy.explain(f, x, k))
  assert first.ran_in == "float8_e4m3fn"   # the kernel is an input
  assert second.ran_in == "bfloat16" and ACTIVATIONS in second.decided_by


# --- Size threshold ------------------------------------------------------------------


def test_user_threshold_keeps_small_matmuls_in_bfloat16():
  x, w = _normal(0, (16, 32)), _normal(1, (32, 8))
  f = lambda rules: mpolicy.amp(lambda x, w: x @ w, F8, rules=rules)
  (row,) = _dots(mpolicy.explain(f(RULES.with_fp8(min_size=4097)), x, w))
  assert row.ran_in == "bfloat16"
  assert ("fp8 skipped: MxKxN = 16x32x8 = 4,096 below the fp8 threshold "
          "4,097 set by OpRules.with_fp8(min_size=)") in row.decided_by
  (row,) = _dots(mpolicy.explain(f(RULES.with_fp8(min_size=4096)), x, w))
  assert row.ran_in == "float8_e4m3fn"  # At the threshold: float8.


def test_threshold_counts_the_batch():
  a, b = _normal(0, (3, 8, 16)), _normal(1, (3, 16, 4))
  f = mpolicy.amp(lambda a, b: jnp.einsum("bmk,bkn->bmn", a, b), F8,
                  rules=RULES.with_fp8(min_size=3 * 8 * 16 * 4 + 1))
  (row,) = _dots(mpolicy.explain(f, a, b))
  assert "BxMxKxN = 3x8x16x4 = 1,536 below" in row.decided_by


def test_convolution_size_is_its_matmul_size():
  x, k = _normal(0, (2, 8, 8, 4)), _normal(1, (3, 3, 2, 6))
  conv = lambda x, k: lax.conv_general_dilated(
      x, k, (2, 2), "SAME", feature_group_count=2,
      dimension_numbers=("NHWC", "HWIO", "NHWC"))
  f = mpolicy.amp(conv, F8, rules=RULES.with_fp8(min_size=10**6))
  (row,) = _dots(mpolicy.explain(f, x, k))
  # 2*4*4 output positions, 3*3*2 multiply-adds each, 6 features.
  assert "MxKxN = 32x18x6 = 3,456 below" in row.decided_by
  assert row.ran_in == "bfloat16"


@dataclasses.dataclass
class _Device:
  platform: str
  device_kind: str


@pytest.mark.parametrize("kind, platform, size, text", [
    ("NVIDIA H100 80GB HBM3", "gpu", 8192 ** 3,
     "8192^3 for NVIDIA H100 80GB HBM3 (per-row unmeasured: the H200's)"),
    ("NVIDIA H200", "gpu", 8192 ** 3, "8192^3 for NVIDIA H200"),
    ("TPU v5 lite", "tpu", 8192 ** 3,
     "8192^3 for TPU v5 lite (unmeasured: the H100's)"),
])
def test_threshold_follows_the_device_kind(monkeypatch, kind, platform, size,
                                           text):
  monkeypatch.setattr(fp8_placement, "default_device",
                      lambda: _Device(platform, kind))
  assert fp8_placement.device_threshold()[0] == size
  x, w = _normal(0, (16, 32)), _normal(1, (32, 8))
  (row,) = _dots(mpolicy.explain(mpolicy.amp(lambda x, w: x @ w, F8), x, w))
  assert row.ran_in == "bfloat16"
  assert f"below the fp8 threshold {text}" in row.decided_by
  # The user's threshold wins over the device kind's.
  f = mpolicy.amp(lambda x, w: x @ w, F8, rules=RULES.with_fp8(min_size=0))
  assert _dots(mpolicy.explain(f, x, w))[0].ran_in == "float8_e4m3fn"


@pytest.mark.parametrize("kind, scaling, text", [
    ("NVIDIA H100 80GB HBM3", "per_tensor", "NVIDIA H100 80GB HBM3"),
    ("NVIDIA H200", "per_tensor",
     "NVIDIA H200 (per-tensor unmeasured: the H100's)"),
    ("NVIDIA H200", "per_row", "NVIDIA H200"),
])
def test_threshold_follows_the_scaling(monkeypatch, kind, scaling, text):
  monkeypatch.setattr(fp8_placement, "default_device",
                      lambda: _Device("gpu", kind))
  assert fp8_placement.device_threshold(scaling) == (8192 ** 3, text)
  # 4096^3 per row was 0.94x bfloat16's speed forward on an H200: bf16.
  assert fp8_placement.device_threshold(scaling)[0] > 4096 ** 3


def test_cpu_threshold_is_zero():
  assert jax.default_backend() == "cpu"
  assert fp8_placement.device_threshold() == (0, "cpu")


# --- The options on OpRules ------------------------------------------------------------


def test_with_fp8_returns_a_new_table_and_keeps_the_old():
  rules = RULES.with_fp8(matmuls="all", min_size=8, scaling="per_tensor")
  assert RULES.fp8 == fp8_placement.Fp8Options()
  assert (rules.fp8.matmuls, rules.fp8.min_size, rules.fp8.scaling) == (
      "all", 8, "per_tensor")
  assert rules.with_fp8(matmuls="weights").fp8.min_size == 8
  assert rules.with_fp8(min_size=None).fp8.min_size is None
  assert rules != RULES and rules.with_ops(full="tanh").fp8 == rules.fp8
  assert rules.without_ops("exp").fp8 == rules.fp8
  assert rules.with_rule("exp", lambda p, x: x).fp8 == rules.fp8


def test_with_fp8_tables_copy_pickle_hash_and_print():
  rules = RULES.with_fp8(matmuls="all", min_size=8)
  assert pickle.loads(pickle.dumps(rules)) == rules == copy.deepcopy(rules)
  assert hash(rules) == hash(RULES.with_fp8(min_size=8, matmuls="all"))
  assert hash(rules) != hash(RULES)
  assert ("fp8=Fp8Options(matmuls='all', min_size=8, scaling='per_row', "
          "stochastic_rounding=True, hadamard=True, weight_tiles=True, "
          "seed=0)") in repr(rules)
  assert "fp8=" not in repr(RULES)
  with pytest.raises(dataclasses.FrozenInstanceError):
    rules.fp8.matmuls = "weights"


@pytest.mark.parametrize("kwargs, match", [
    ({"matmuls": "every"}, "matmuls='every'.*'weights'.*'all'"),
    ({"scaling": "per_column"}, "scaling='per_column'.*'per_row'.*'per_tensor'"),
    ({"min_size": -1}, r"min_size=-1.*int >= 0"),
    ({"min_size": 1.5}, r"min_size=1.5.*int >= 0"),
    ({"min_size": True}, r"min_size=True.*int >= 0"),
])
def test_with_fp8_rejects_bad_options(kwargs, match):
  with pytest.raises(ValueError, match=match):
    RULES.with_fp8(**kwargs)


# --- A GPT-like model ------------------------------------------------------------------


class _Attention(hk.Module):

  def __call__(self, x):
    t, d = x.shape[-2], x.shape[-1]
    q, k, v = (hk.Linear(d, name=n)(x).reshape(*x.shape[:-1], 2, d // 2)
               for n in "qkv")
    logits = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(d // 2)
    mask = jnp.tril(jnp.ones((t, t), bool))
    attn = jax.nn.softmax(jnp.where(mask, logits, -1e9), axis=-1)
    h = jnp.einsum("bhts,bshd->bthd", attn, v).reshape(x.shape)
    return hk.Linear(d, name="o")(h)


def _gpt(tokens):
  x = hk.Embed(32, 16)(tokens)
  for i in range(2):
    x = x + _Attention(name=f"attn{i}")(hk.LayerNorm(-1, True, True)(x))
    h = hk.LayerNorm(-1, True, True)(x)
    x = x + hk.Linear(16)(jax.nn.gelu(hk.Linear(64)(h)))
  return hk.Linear(32, name="head")(hk.LayerNorm(-1, True, True)(x))


@pytest.mark.ci  # A GPT in float8, 5 s on 2 cores.
def test_gpt_attention_in_bfloat16_linears_in_float8():
  mpolicy.set_policy(hk.Module, F8)
  model = mpolicy.transform_amp(_gpt)
  tokens = jnp.arange(16).reshape(2, 8) % 32
  # Jitted: eager, transform_amp's init would run the GPT op by op.
  params = jax.jit(model.init)(jax.random.PRNGKey(0), tokens)
  eqns = all_eqns(lambda p: model.apply(p, None, tokens), params)
  f8 = [e for e in eqns if e.primitive.name == "dot_general"
        and {np.dtype(v.aval.dtype) for v in e.invars} == {E4M3}]
  half = [e for e in eqns if e.primitive.name == "amp_dot_general"]
  # 2 blocks x (q, k, v, o, two MLP layers) + head: 13 Linears in float8;
  # QK^T and PV of each block in bfloat16.
  assert len(f8) == 13
  assert len(half) == 4
  assert {np.dtype(e.params["compute_dtype"]) for e in half} == {
      np.dtype(jnp.bfloat16)}
  assert not [e for e in eqns if e.primitive.name == "dot_general"
              and np.dtype(e.invars[0].aval.dtype) != E4M3]
  rows = _dots(mpolicy.explain(model.apply, params, None, tokens))
  attention = [r for r in rows if r.module_class != "hk.Linear"]
  assert len(attention) == 4
  assert all(r.ran_in == "bfloat16" and ACTIVATIONS in r.decided_by
             for r in attention)
  assert {r.ran_in for r in rows if r.module_class == "hk.Linear"} == {
      "float8_e4m3fn"}


@pytest.mark.parametrize("fmt, ran_in", [("f8", "float8_e4m3fn"),
                                         ("mxfp8", "mxfp8"),
                                         ("nvfp4", "nvfp4")])
def test_a_tied_head_of_a_table_cast_by_the_code_is_a_weight_matmul(fmt,
                                                                   ran_in):
  nn = pytest.importorskip("flax.linen")

  class Tied(nn.Module):

    @nn.compact
    def __call__(self, ids):
      embed = nn.Embed(64, 32, dtype=jnp.bfloat16)  # Casts the table.
      return embed.attend(embed(ids))  # x @ table.T

  ids = jnp.arange(8).reshape(2, 4)
  params = Tied().init(jax.random.PRNGKey(0), ids)
  policy = f"p=f32,c={fmt},o=f32"
  tied = mpolicy.amp(Tied().apply, policy)
  (head,) = _dots(mpolicy.explain(tied, params, ids))
  assert head.ran_in == ran_in and ACTIVATIONS not in head.decided_by
  # The numbers of the head on the float32 table itself (its result in
  # float32, rounded to the tied head's bfloat16).
  table = params["params"]["Embed_0"]["embedding"]
  rows = jnp.take(table.astype(jnp.bfloat16), ids, axis=0)
  plain = mpolicy.amp(lambda t: rows.astype(jnp.float32) @ t.T, policy)
  np.testing.assert_array_equal(tied(params, ids),
                                plain(table).astype(jnp.bfloat16))


def test_re_arrangements_of_a_parameter_cast_down_stay_weights():
  def f(w, x):
    w = w.astype(jnp.bfloat16).T.reshape(32, 64)[:, :48]
    return jnp.tanh(x).astype(jnp.bfloat16) @ w  # An activation.

  (dot,) = _dots(mpolicy.explain(mpolicy.amp(f, F8), _normal(0, (64, 32)),
                                 _normal(1, (4, 32))))
  assert dot.ran_in == "float8_e4m3fn", dot.decided_by


def _block_run(fmt, rules):
  x, w = _normal(0, (8, 64)), _normal(1, (64, 32))
  return mpolicy.amp(lambda x, w: x @ w, f"p=f32,c={fmt},o=f32",
                     rules=rules)(x, w)


def test_recipe_options_mxfp8_does_not_use_are_warned_about():
  rules = RULES.with_fp8(hadamard=True, stochastic_rounding=True)
  with pytest.warns(UserWarning) as caught:
    y = _block_run("mxfp8", rules)
  (message,) = {str(w.message) for w in caught}
  assert message.startswith(
      "OpRules.with_fp8(hadamard=True, stochastic_rounding=True): mxfp8 does "
      "not use hadamard (used by mxfp4 and nvfp4) or stochastic_rounding "
      "(used by mxfp4 and nvfp4)")
  np.testing.assert_array_equal(y, _block_run("mxfp8", RULES))  # No effect.


@pytest.mark.parametrize("fmt, options, used_by", [
    ("mxfp4", {"weight_tiles": True}, "nvfp4"),
    ("f8", {"seed": 3}, "mxfp4 and nvfp4"),
])
def test_recipe_options_other_formats_do_not_use_are_warned_about(
    fmt, options, used_by):
  with pytest.warns(UserWarning, match=rf"does not use {next(iter(options))} "
                    rf"\(used by {used_by}\)"):
    _block_run(fmt, RULES.with_fp8(**options))


@pytest.mark.parametrize("fmt, options", [
    ("mxfp8", {}),  # The defaults, set by no one.
    ("mxfp8", {"hadamard": False, "stochastic_rounding": False}),
    ("mxfp8", {"hadamard": True}),  # Taken back below.
    ("nvfp4", {"hadamard": True, "weight_tiles": True, "seed": 3}),
    ("mxfp4", {"stochastic_rounding": True, "seed": 1}),
])
def test_recipe_options_the_format_uses_warn_about_nothing(fmt, options):
  rules = RULES.with_fp8(**options)
  if options == {"hadamard": True}:
    rules = rules.with_fp8(hadamard=False)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    _block_run(fmt, rules)
