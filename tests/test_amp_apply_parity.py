"""`amp` over code traced in float32 against `transform_amp` on the same model.

Code traced in float32 writes float32 constants (a mask's fill value) and
looks up float32 embedding rows; under a half policy neither should keep
the computation in float32 where the module policies of `transform_amp`
(and jmp) give half values.
"""

import contextlib
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


def _compiled_grad(variant, layers):
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
    params = model.init(jax.random.PRNGKey(0), tokens)
    lowered = jax.jit(jax.grad(loss)).lower(params, tokens)
  return lowered.compile().as_text()


@pytest.mark.slow  # Compiles two 6-layer models: about 10 s on 2 cores.
def test_amp_over_apply_compiles_no_bigger_than_transform_amp():
  """A deep model's HLO grows with its depth alike under both."""
  count = lambda text: len(re.findall(r"\n\s+(?:ROOT )?%\S+ = ", text))
  ta, amp = count(_compiled_grad("ta", 6)), count(_compiled_grad("amp", 6))
  assert amp <= 1.05 * ta, (amp, ta)
