"""Specification of `amp` on first-order primitives."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _helpers import all_eqns, multiplies_in

from mpolicy._src import registry
from mpolicy._src.amp import amp
from mpolicy._src.amp import full_precision
from mpolicy._src.amp import interpret
from mpolicy._src.op_rules import DEFAULT_RULES

HALF = "p=f32,c=bf16,o=f32"
BF16, F32 = jnp.bfloat16, jnp.float32


def in_dtypes(fn, *args, prim):
  return [multiplies_in(e)
          for e in all_eqns(fn, *args) if e.primitive.name == prim]


def out_dtypes(fn, *args, prim):
  return [tuple(np.dtype(v.aval.dtype) for v in e.outvars)
          for e in all_eqns(fn, *args) if e.primitive.name == prim]


def converts(fn, *args):
  return [(np.dtype(e.invars[0].aval.dtype), np.dtype(e.params["new_dtype"]))
          for e in all_eqns(fn, *args)
          if e.primitive.name == "convert_element_type"]


X = jnp.linspace(-1, 1, 12, dtype=F32).reshape(3, 4)
W = jnp.linspace(-0.5, 0.5, 20, dtype=F32).reshape(4, 5)


def test_matmul_runs_in_half_with_f32_accumulation():
  f = amp(lambda x, w: x @ w, HALF)
  assert in_dtypes(f, X, W, prim="amp_dot_general") == [(BF16, BF16)]
  (eqn,) = [e for e in all_eqns(f, X, W) if e.primitive.name == "amp_dot_general"]
  assert eqn.params["out_dtype"] == BF16
  np.testing.assert_allclose(f(X, W), X @ W, atol=2e-2)


def test_output_is_cast_to_policy_output_dtype():
  assert amp(lambda x, w: x @ w, HALF)(X, W).dtype == F32
  assert amp(lambda x, w: x @ w, "p=f32,c=bf16,o=bf16")(X, W).dtype == BF16


def test_matmul_without_policy_runs_as_written():
  f = amp(lambda x, w: x @ w)
  assert in_dtypes(f, X, W, prim="dot_general") == [(F32, F32)]
  assert not converts(f, X, W)


def test_full_ops_upcast_half_inputs_even_without_policy():
  xh = X.astype(BF16)
  for fn, prim in ((jnp.exp, "exp"), (jnp.log1p, "log1p"),
                   (lambda x: x.sum(), "reduce_sum"),
                   (lambda x: jnp.cumsum(x, 0), "cumsum")):
    f = amp(fn)
    assert in_dtypes(f, xh, prim=prim) == [(F32,)], prim
    assert out_dtypes(f, xh, prim=prim) == [(F32,)], prim


def test_full_output_stays_f32_downstream():
  f = amp(lambda x: jnp.exp(x) * 2.0 + x)
  assert in_dtypes(f, X.astype(BF16), prim="add") == [(F32, F32)]


def test_other_ops_run_in_input_dtype_without_casts():
  f = amp(lambda x: jnp.tanh(x) * x - 1.0, HALF)
  xh = X.astype(BF16)
  assert in_dtypes(f, xh, prim="tanh") == [(BF16,)]
  assert in_dtypes(f, xh, prim="mul") == [(BF16, BF16)]
  assert converts(f, xh) == [(BF16, F32)]  # Only the output cast.


def test_reduce_max_stays_in_half():
  f = amp(lambda x: jnp.max(x), HALF)
  assert in_dtypes(f, X.astype(BF16), prim="reduce_max") == [(BF16,)]


def test_softmax_runs_in_f32():
  f = amp(lambda x, w: jax.nn.softmax(x @ w), HALF)
  assert in_dtypes(f, X, W, prim="exp") == [(F32,)]
  assert in_dtypes(f, X, W, prim="reduce_sum") == [(F32,)]
  np.testing.assert_allclose(f(X, W), jax.nn.softmax(X @ W), atol=1e-2)


def test_literals_follow_array_operands():
  # relu's `max x 0.0:f32[]` meets a bf16 x: the literal follows, no cast.
  f = amp(lambda x, w: jax.nn.relu(x @ w) + 1.0, HALF)
  assert in_dtypes(f, X, W, prim="max") == [(BF16, BF16)]
  assert in_dtypes(f, X, W, prim="add") == [(BF16, BF16)]
  assert converts(f, X, W) == [(F32, BF16), (F32, BF16), (BF16, F32)]


def test_disagreeing_arrays_meet_at_widest():
  f = amp(lambda x, y: x * y)
  assert in_dtypes(f, X, X.astype(BF16), prim="mul") == [(F32, F32)]


def test_param_used_three_times_is_cast_once():
  def fn(x, w):
    return (x @ w) + (x @ w) * 2 + (x @ w) * 3
  f = amp(fn, HALF)
  casts = converts(f, X, W)
  assert casts.count((F32, BF16)) == 2  # x once, w once.


def test_no_half_f32_half_chain():
  # exp(x) upcasts the bf16 x; the later matmul needs x in bf16 again: it
  # reuses the bf16 source instead of rounding the f32 copy.
  def fn(x, w):
    xh = x.astype(BF16)
    return jnp.exp(xh).sum() + (xh @ w.astype(BF16)).sum()
  f = amp(fn, HALF)
  x_casts = [(np.dtype(e.invars[0].aval.dtype), np.dtype(e.params["new_dtype"]))
             for e in all_eqns(f, X, W)
             if e.primitive.name == "convert_element_type"
             and e.invars[0].aval.shape == X.shape]
  assert x_casts == [(F32, BF16), (BF16, F32)]  # x -> xh, xh -> exp's f32.


def test_full_policy_is_bitwise_identity():
  def fn(x, w):
    h = jax.nn.gelu(x @ w)
    h = jax.nn.log_softmax(h) + jnp.cumsum(h, 1)
    return jnp.mean(h ** 2), jnp.var(h, axis=0)
  # Compared with jit(fn): eager fn dispatches jnp's jitted pieces one by one,
  # which XLA fuses (and rounds) differently from the whole program.
  for g in (amp(fn, "full"), jax.jit(amp(fn, "full"))):
    for a, b in zip(g(X, W), jax.jit(fn)(X, W)):
      assert a.dtype == b.dtype
      np.testing.assert_array_equal(a, b)


def test_user_rule_overrides_default():
  rules = DEFAULT_RULES.with_ops(full=["dot_general"])
  f = amp(lambda x, w: x @ w, HALF, rules=rules)
  assert in_dtypes(f, X, W, prim="dot_general") == [(F32, F32)]
  assert not in_dtypes(f, X, W, prim="amp_dot_general")


def test_full_precision_context_manager():
  def fn(x, w):
    with full_precision():
      a = x @ w
    return a + x @ w
  f = amp(fn, HALF)
  assert in_dtypes(f, X, W, prim="dot_general") == [(F32, F32)]
  assert in_dtypes(f, X, W, prim="amp_dot_general") == [(BF16, BF16)]


def test_full_precision_decorator_both_spellings():
  @full_precision()
  def mm(x, w):
    return x @ w

  @full_precision
  def mm2(x, w):
    return x @ w

  for inner in (mm, mm2):
    f = amp(inner, HALF)
    assert in_dtypes(f, X, W, prim="dot_general") == [(F32, F32)]


def test_full_precision_turns_off_full_rule_too():
  f = amp(full_precision()(jnp.exp))
  assert in_dtypes(f, X.astype(BF16), prim="exp") == [(BF16,)]


def test_named_scope_pattern_governs_plain_jax():
  def fn(x, w):
    with jax.named_scope("encoder"):
      a = x @ w
    return a + x @ w
  with registry.push_policy("encoder", HALF):
    f = amp(fn)
    assert in_dtypes(f, X, W, prim="amp_dot_general") == [(BF16, BF16)]
    assert in_dtypes(f, X, W, prim="dot_general") == [(F32, F32)]


def test_static_args_pass_through():
  def fn(x, *, is_training, name=None):
    assert isinstance(is_training, bool) and name == "n"
    return x * 2 if is_training else x
  np.testing.assert_allclose(amp(fn, HALF)(X, is_training=True, name="n"), X * 2)


def test_bitcast_and_rng_run_as_written():
  def fn(key, x):
    return jax.random.normal(key, (3,), BF16) + jnp.exp(x)
  f = amp(fn, HALF)
  out = f(jax.random.PRNGKey(0), jnp.ones(3, BF16))
  assert out.dtype == F32 and np.all(np.isfinite(out))


def test_works_under_jit_vmap_and_pmap():
  f = amp(lambda x, w: jnp.tanh(x @ w), HALF)
  ref = np.tanh(np.asarray(X) @ np.asarray(W))
  np.testing.assert_allclose(jax.jit(f)(X, W), ref, atol=2e-2)
  np.testing.assert_allclose(jax.vmap(f, (0, None))(X[:, None], W)[:, 0], ref,
                             atol=2e-2)
  np.testing.assert_allclose(jax.pmap(f, in_axes=(None, None))(X, W)[0]
                             if False else jax.pmap(lambda x: f(x, W))(X[None])[0],
                             ref, atol=2e-2)


def test_grad_dtype_follows_primal_inputs():
  f = amp(lambda x, w: jnp.sum(jnp.tanh(x @ w)), HALF)
  gx, gw = jax.grad(f, argnums=(0, 1))(X, W)
  assert gx.dtype == F32 and gw.dtype == F32
  gh = jax.grad(f)(X.astype(BF16), W)
  assert gh.dtype == BF16


def test_interpret_without_output_cast_keeps_fn_signature():
  f = interpret(lambda x, w: x @ w, policy=HALF, cast_outputs=False)
  assert f(X, W).dtype == F32
  g = interpret(lambda x: x * 2, policy=HALF, cast_outputs=False)
  assert g(X.astype(BF16)).dtype == BF16


def test_amp_marks_function():
  f = amp(jnp.sin, HALF)
  assert hasattr(f, "__mpolicy_amp__")


def test_rejects_bad_rules():
  with pytest.raises(TypeError, match="OpRules"):
    amp(jnp.sin, rules={"exp": "full"})


def test_named_scope_prefix_is_carried_into_nested_jit():
  # Inside the jit's jaxpr the dot's name stack is relative (empty); the
  # interpreter carries the enclosing "encoder" scope down.
  def fn(x, w):
    with jax.named_scope("encoder"):
      return jax.jit(lambda a, b: jnp.tanh(a @ b))(x, w)
  with registry.push_policy("encoder", HALF):
    f = amp(fn)
    assert in_dtypes(f, X, W, prim="amp_dot_general") == [(BF16, BF16)]
    assert in_dtypes(f, X, W, prim="dot_general") == []


def test_named_scope_pattern_reaches_through_jvp_and_transpose_names():
  # amp of a gradient: JAX names the backward equations
  # transpose(jvp(encoder)); the pattern still governs them.
  def loss(x, w):
    with jax.named_scope("encoder"):
      return jnp.sum(jnp.tanh(x @ w))
  with registry.push_policy("encoder", HALF):
    f = amp(jax.grad(loss, argnums=1))
    dots = in_dtypes(f, X, W, prim="amp_dot_general")
    assert dots == [(BF16, BF16)] * 2
    assert in_dtypes(f, X, W, prim="dot_general") == []
    assert f(X, W).dtype == F32
