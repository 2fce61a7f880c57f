"""compare_to_float32: each module's error against its float32 shadow."""

from __future__ import annotations

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpolicy
from mpolicy._src.debugging import program as program_lib
from mpolicy._src.debugging import shadow as shadow_lib

BF16 = "p=f32,c=bf16,o=f32"


class Cancel(hk.Module):
  """Adds and subtracts a large constant: the input drowns in its rounding."""

  def __call__(self, x):
    return (x + 64.0) - 64.0


class Block(hk.Module):
  """A linear layer plus a small, ruined residual branch."""

  def __call__(self, x):
    h = hk.Linear(16, name="encoder")(x)
    return h + 0.05 * Cancel(name="cancel")(h)


def _net(x):
  return hk.Linear(1, name="head")(jax.nn.relu(Block(name="block")(x)))


def _model():
  mpolicy.set_policy(hk.Module, BF16)
  model = mpolicy.transform_amp(_net)
  x = jax.random.normal(jax.random.PRNGKey(1), (8, 4))
  params = jax.jit(model.init)(jax.random.PRNGKey(0), x)  # Not op by op.
  loss = lambda p, x: jnp.mean(model.apply(p, None, x) ** 2)
  return model, params, x, loss


def test_the_cancelling_module_ranks_first():
  _, params, x, loss = _model()
  report = mpolicy.compare_to_float32(loss, params, x)
  assert report.rows[0].path == "block/cancel"
  cancel = report.row("block/cancel")
  # Its own doing: what it read was close to float32, what it made is not.
  assert cancel.rel_error > 0.05 > 10 * cancel.input_rel_error
  assert report.row("block").rel_error < 0.02  # Diluted by the residual.
  assert [r.rel_error for r in report.rows if r.rel_error is not None] == (
      sorted([r.rel_error for r in report.rows if r.rel_error is not None],
             reverse=True))
  text = str(report)
  assert text.splitlines()[2].startswith("block/cancel ")
  assert "inputs' error" in text and "loss " in text.splitlines()[-1]


def test_errors_are_norm_wise_and_split_into_bias_and_noise():
  def loss(x):
    with jax.named_scope("round"):
      y = x.astype(jnp.bfloat16) * 1.0  # Rounded to bfloat16.
    return jnp.mean(y.astype(jnp.float32))
  x = jnp.linspace(0.01, 1.0, 64) * 3.3
  f = mpolicy.amp(loss, BF16)
  row = mpolicy.compare_to_float32(f, x, grad=False).row("round")
  got = np.asarray(x.astype(jnp.bfloat16), np.float64)
  want = np.asarray(x, np.float64)
  d = got - want
  rms = np.sqrt(np.mean(want ** 2))
  np.testing.assert_allclose(row.rel_error,
                             np.linalg.norm(d) / np.linalg.norm(want),
                             rtol=1e-6)
  np.testing.assert_allclose(row.bias, np.mean(d) / rms, rtol=1e-6)
  np.testing.assert_allclose(row.noise, np.std(d) / rms, rtol=1e-6)
  np.testing.assert_allclose(row.rel_error ** 2, row.bias ** 2 + row.noise ** 2,
                             rtol=1e-6)
  assert (row.values, row.dtype, row.grad_rel_error) == (64, "bfloat16", None)


@pytest.mark.slow  # Beyond the ranking: run with -m slow.
def test_parameter_gradients_are_compared_per_module():
  model, params, x, loss = _model()
  report = mpolicy.compare_to_float32(loss, params, x)
  got = jax.grad(loss)(params, x)
  with mpolicy.push_policy(hk.Module, "full"):
    want = jax.grad(loss)(params, x)

  def rel(name):
    g = np.concatenate([np.ravel(v) for v in jax.tree_util.tree_leaves(
        got[name])]).astype(np.float64)
    w = np.concatenate([np.ravel(v) for v in jax.tree_util.tree_leaves(
        want[name])]).astype(np.float64)
    return np.linalg.norm(g - w) / np.linalg.norm(w)

  for name in ("block/encoder", "head"):
    np.testing.assert_allclose(report.row(name).grad_rel_error, rel(name),
                               rtol=1e-4)
  assert report.row("block/cancel").grad_rel_error is None  # No params.
  assert 0 < report.grad_rel_error < 0.1
  with mpolicy.push_policy(hk.Module, "full"):
    assert report.loss_float32 == pytest.approx(float(loss(params, x)),
                                                rel=1e-6)


@pytest.mark.slow  # Beyond the ranking: run with -m slow.
def test_a_module_in_a_scan_is_pooled_over_iterations():
  def loss(w, xs):
    def body(c, x):
      with jax.named_scope("cell"):
        c = jnp.tanh(c * w + x)
      return c, c
    return jnp.mean(jax.lax.scan(body, jnp.zeros(4), xs)[1])
  f = mpolicy.amp(loss, BF16)
  report = mpolicy.compare_to_float32(f, jnp.float32(0.7),
                                      jnp.linspace(-1, 1, 20).reshape(5, 4))
  assert report.row("cell").values == 20  # 5 iterations of 4.
  assert 0 < report.row("cell").rel_error < 0.05


@pytest.mark.slow  # Beyond the ranking: run with -m slow.
def test_the_plot_draws_the_rows(tmp_path):
  pytest.importorskip("matplotlib")
  _, params, x, loss = _model()
  report = mpolicy.compare_to_float32(loss, params, x, grad=False)
  path = tmp_path / "errors.png"
  fig = report.plot(str(path), top=2)
  assert path.stat().st_size > 1000
  labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
  assert labels == [r.name for r in report.rows[:2]]


def test_a_large_value_is_compared_on_a_fixed_random_sample():
  # 2**16 elements, 4 times the sample. The error sits in one column of
  # 16 (as in an outlier feature): a sample strided by 4 would miss it.
  x = jnp.tile(jnp.arange(16.0) == 3, 1 << 12) * 1000.0 + 1.0

  def loss(x):
    with jax.named_scope("round"):
      y = x.astype(jnp.bfloat16) + 0.1  # 1000.1 is 1000 in bfloat16.
    return jnp.mean(y.astype(jnp.float32))

  report = mpolicy.compare_to_float32(mpolicy.amp(loss, BF16), x, grad=False)
  row = report.row("round")
  assert row.values == shadow_lib.SAMPLE == 1 << 14
  got = np.asarray((x.astype(jnp.bfloat16) + 0.1).astype(jnp.float32),
                   np.float64)
  want = np.asarray(x, np.float64) + 0.1
  whole = np.linalg.norm(got - want) / np.linalg.norm(want)
  np.testing.assert_allclose(row.rel_error, whole, rtol=0.1)
  # The same elements each call: the same value, the same error.
  again = mpolicy.compare_to_float32(mpolicy.amp(loss, BF16), x, grad=False)
  assert again.row("round").rel_error == row.rel_error


def test_a_run_drops_each_value_after_its_last_read():
  # A chain of 40 ops on a 4 MB value: a run that kept every value would
  # hold 40 of them at its end.
  shape = (1024, 1024)

  def loss(x):
    for _ in range(40):
      x = jnp.sin(x) * 1.01
    return jnp.mean(x)

  seen = []

  class Count(shadow_lib.Outputs):
    def made(self, event, in_ids, out_ids, outs):
      seen.append(sum(a.shape == shape for a in jax.live_arrays()))
      super().made(event, in_ids, out_ids, outs)

  f = mpolicy.amp(loss, BF16)
  call = program_lib.Call(f, (jnp.ones(shape),), "test")
  run = program_lib.run(call, call.program(False), checking=False,
                        observer=Count)
  assert np.isfinite(float(run.outs[0]))
  assert len(seen) >= 80 and max(seen) <= 4, seen


def _underflowing():
  """A float16 model whose unscaled gradients underflow: the loss is
  1e-4 of a mean, so the cotangents reaching the matmul are ~1e-8."""

  def loss(w, x):
    with jax.named_scope("layer"):
      h = jnp.tanh(x @ w)
    with jax.named_scope("head"):
      return jnp.mean(h) * 1e-4

  w = jnp.asarray(np.random.RandomState(0).normal(size=(16, 16)) * 0.3,
                  jnp.float32)
  x = jnp.asarray(np.random.RandomState(1).normal(size=(64, 16)),
                  jnp.float32)
  return mpolicy.amp(loss, "p=f32,c=f16,o=f32"), w, x


def test_gradients_are_judged_on_the_loss_scaled_ones_a_step_computes():
  f, w, x = _underflowing()
  unscaled = mpolicy.compare_to_float32(f, w, x)
  scaled = mpolicy.compare_to_float32(f, w, x, loss_scale=2.0 ** 15)
  static = mpolicy.compare_to_float32(
      f, w, x, loss_scale=mpolicy.StaticLossScale(2.0 ** 15))
  assert unscaled.grad_rel_error > 0.2  # Underflowed in float16.
  assert scaled.grad_rel_error < 0.005  # Divided back: the true gradient.
  assert static.grad_rel_error == pytest.approx(scaled.grad_rel_error)
  # The loss itself is the loss, not the loss times the scale.
  assert scaled.loss == pytest.approx(unscaled.loss)
  assert abs(scaled.loss_float32) < 1.0


def test_compare_refuses_a_loss_scale_it_cannot_use():
  f, w, x = _underflowing()
  with pytest.raises(TypeError, match="compare_to_float32: loss_scale must be"):
    mpolicy.compare_to_float32(f, w, x, loss_scale="big")
