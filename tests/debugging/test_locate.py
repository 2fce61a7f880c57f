"""locate_nonfinite: seeded failures, each found where it was planted."""

from __future__ import annotations

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpolicy

from _helpers import overflowing_flax_net

HALF16 = "p=f32,c=f16,o=f32"
BF16 = "p=f32,c=bf16,o=f32"
THIS = __file__


def _line(marker: str) -> str:
  """``file:line`` of the line of this file that ends with ``marker``."""
  with open(THIS, encoding="utf-8") as f:
    for n, line in enumerate(f, 1):
      if line.rstrip().endswith(marker):
        return f"{THIS}:{n}"
  raise AssertionError(marker)


class Attention(hk.Module):
  """Single-head attention logits and their softmax-weighted values."""

  def __call__(self, x):
    q = hk.Linear(8, name="query")(x)
    k = hk.Linear(8, name="key")(x)
    logits = jnp.einsum("btd,bsd->bts", q, k)  # LOGITS
    return jnp.einsum("bts,bsd->btd", jax.nn.softmax(logits), x)


def _attention_model():
  mpolicy.set_policy(hk.Module, HALF16)
  model = mpolicy.transform_amp(
      lambda x: hk.Linear(1, name="head")(Attention(name="attention")(x)))
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 4, 8))
  params = jax.jit(model.init)(jax.random.PRNGKey(0), x)  # Not op by op.
  return model, params, x


def test_float16_attention_logits_that_overflow_are_the_first_nonfinite():
  model, params, x = _attention_model()
  loss = lambda p, x: jnp.mean(model.apply(p, None, x) ** 2)
  params["attention/query"]["w"] = params["attention/query"]["w"] * 300.
  params["attention/key"]["w"] = params["attention/key"]["w"] * 300.
  report = mpolicy.locate_nonfinite(loss, params, x)
  assert (report.primitive, report.path, report.direction, report.dtype) == (
      "dot_general", "attention", "forward", "float16")
  assert report.source == _line("# LOGITS")
  assert (report.iteration, report.device) == (None, None)
  assert report.fixed_by_float32  # The logits fit in float32.
  assert report.outputs[:2] == ("loss", "gradient of attention/key/b")
  assert "It made the loss and the gradients of attention/key/b," in str(
      report)
  text = str(report)
  assert "forward pass" in text and "'attention'" in text
  assert "float16" in text and "makes every value finite" in text


def test_the_log_of_an_underflowed_bfloat16_softmax():
  def forward(x):
    with jax.named_scope("probs"):
      p = jax.nn.softmax(x * 200.0)
    return -jnp.mean(jnp.log(p))  # LOG
  f = mpolicy.amp(forward, BF16)
  x = jnp.array([[0.0, 1.0, -1.0]], jnp.bfloat16)
  report = mpolicy.locate_nonfinite(f, x, grad=False)
  assert (report.primitive, report.path, report.direction) == (
      "log", "", "forward")
  assert report.source == _line("# LOG")
  rows = [r for r in mpolicy.explain(f, x).rows if r.primitive == "log"]
  assert report.dtype == rows[0].ran_in
  # exp(-400) is zero in float32 too: float32 does not save this log.
  assert not report.fixed_by_float32
  assert "does not make every value finite" in str(report)


def test_sqrt_at_zero_goes_nonfinite_in_the_backward_pass():
  def loss(w, x):
    with jax.named_scope("norm"):
      return jnp.sum(jnp.sqrt(w * x))  # SQRT
  f = mpolicy.amp(loss, BF16)
  w, x = jnp.array([0.0, 1.0, 4.0]), jnp.ones(3)
  assert mpolicy.locate_nonfinite(f, w, x, grad=False) is None
  report = mpolicy.locate_nonfinite(f, w, x)
  assert (report.primitive, report.path, report.direction) == (
      "sqrt", "norm", "backward")
  assert report.source == _line("# SQRT")
  assert report.outputs == ("gradient",)  # Of w, the first argument.
  assert not report.fixed_by_float32
  assert "backward pass" in str(report) and "derivative of sqrt" in str(report)


def _scan_loss(w, xs):
  def body(c, x):
    return c + jnp.log(x * w), c  # SCAN
  return jax.lax.scan(body, jnp.float32(0.0), xs)[0]


def test_a_nan_in_one_scan_iteration_names_the_iteration():
  f = mpolicy.amp(_scan_loss, BF16)
  xs = jnp.array([1.0, 2.0, 3.0, -1.0, 5.0])
  report = mpolicy.locate_nonfinite(f, jnp.float32(1.0), xs)
  assert (report.primitive, report.direction, report.iteration) == (
      "log", "forward", 3)
  assert report.source == _line("# SCAN")
  assert "iteration 3" in str(report)


@pytest.mark.slow  # Beyond the seeded failures: run with -m slow.
def test_a_backward_scan_names_the_forward_iteration():
  def loss(w, xs):
    return jax.lax.scan(lambda c, x: (c + jnp.sqrt(x * w), None), 0.0, xs)[0]
  f = mpolicy.amp(loss, BF16)
  report = mpolicy.locate_nonfinite(f, jnp.float32(1.0),
                                    jnp.array([1.0, 4.0, 0.0, 9.0]))
  assert (report.primitive, report.direction, report.iteration) == (
      "sqrt", "backward", 2)


@pytest.mark.slow  # Beyond the seeded failures: run with -m slow.
def test_the_backward_pass_runs_from_the_scaled_loss():
  # Finite until the float16 backward pass is scaled: the loss scale's
  # overflow is what skips the step.
  def loss(w, x):
    with jax.named_scope("proj"):
      return jnp.mean(x @ w)
  f = mpolicy.amp(loss, HALF16)
  w, x = jnp.full((64, 4), 0.5), jnp.full((8, 64), 30.0)
  assert mpolicy.locate_nonfinite(f, w, x) is None
  report = mpolicy.locate_nonfinite(
      f, w, x, loss_scale=mpolicy.StaticLossScale(2.0 ** 24))
  assert (report.primitive, report.path, report.direction, report.dtype) == (
      "dot_general", "proj", "backward", "float16")
  assert report.fixed_by_float32
  assert mpolicy.locate_nonfinite(f, w, x, loss_scale=2.0 ** 24) == report


def test_a_nonfinite_argument_is_reported_as_the_input():
  f = mpolicy.amp(lambda p, x: jnp.sum(p["w"] * x), BF16)
  params = {"w": jnp.array([1.0, jnp.nan])}
  report = mpolicy.locate_nonfinite(f, params, jnp.ones(2))
  assert (report.primitive, report.path, report.direction, report.dtype) == (
      "input", "0/w", "forward", "float32")
  assert not report.fixed_by_float32
  assert "already holds a non-finite value" in str(report)


@pytest.mark.slow  # Beyond the seeded failures: run with -m slow.
def test_a_masked_nonfinite_value_is_no_origin_but_its_gradient_is():
  # jnp.where(x > 0, log(x), 0): the forward -inf never reaches the loss;
  # the gradient of the masked log (0 * inf) does.
  def loss(w):
    return jnp.sum(jnp.where(w > 0, jnp.log(w), 0.0))
  f = mpolicy.amp(loss, BF16)
  w = jnp.array([0.0, 2.0])
  assert mpolicy.locate_nonfinite(f, w, grad=False) is None
  report = mpolicy.locate_nonfinite(f, w)
  assert (report.primitive, report.direction) == ("log", "backward")


@pytest.mark.slow  # Beyond the seeded failures: run with -m slow.
def test_an_op_outside_modules_is_fixed_by_running_it_alone_in_float32():
  # A float16 product past 65504 overflows; in float32 it does not.
  f = mpolicy.amp(lambda x: jnp.sum(x * x) * 1e-4, HALF16)  # SQUARE
  x = jnp.full(4, 300.0, jnp.float16)  # 300 ** 2 > 65504.
  report = mpolicy.locate_nonfinite(f, x, grad=False)
  assert (report.primitive, report.path, report.dtype) == (
      "mul", "", "float16")
  assert report.source == _line("# SQUARE")
  assert report.fixed_by_float32
  assert "Running that op in float32 makes every value finite" in str(report)


@pytest.mark.slow  # Beyond the seeded failures: run with -m slow.
def test_cond_checkpoint_jit_and_custom_vjp_are_entered():
  @jax.custom_vjp
  def ident(x):
    return x

  ident.defvjp(lambda x: (x, None), lambda _, g: (g / 0.0,))

  def loss(w, x):
    h = jax.checkpoint(jax.jit(lambda v: v * 2.0))(w)
    return jax.lax.cond(x > 0, lambda: jnp.sum(ident(h)),  # VJP
                        lambda: jnp.sum(h))
  f = mpolicy.amp(loss, BF16)
  assert mpolicy.locate_nonfinite(f, jnp.ones(2), -1.0) is None
  report = mpolicy.locate_nonfinite(f, jnp.ones(2), 1.0)
  assert (report.primitive, report.direction, report.op) == (
      "custom_vjp_call", "backward", "div")
  assert report.source == _line("# VJP")


@pytest.mark.slow  # Flax's import and first trace: seconds.
def test_a_flax_linen_module_is_named_by_its_path():
  nn = pytest.importorskip("flax.linen")
  model, variables, x = overflowing_flax_net()
  mpolicy.set_policy(nn.Module, HALF16)
  apply = mpolicy.amp(model.apply)
  report = mpolicy.locate_nonfinite(
      lambda v, x: jnp.mean(apply(v, x)), variables, x)
  assert (report.primitive, report.path, report.dtype) == (
      "dot_general", "out", "float16")
  assert report.fixed_by_float32


def test_bad_arguments_say_what_is_wrong():
  f = mpolicy.amp(lambda x: x * 2, BF16)
  with pytest.raises(TypeError, match="scalar floating loss"):
    mpolicy.locate_nonfinite(f, jnp.ones(2))
  with pytest.raises(TypeError, match="loss_scale must be None, a number"):
    mpolicy.locate_nonfinite(lambda x: jnp.sum(x), jnp.ones(2),
                             loss_scale="big")
  with pytest.raises(TypeError, match="pass fn's arguments"):
    mpolicy.locate_nonfinite(lambda: 1.0)


EIGHT_DEVICES = r'''
import json
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P
import mpolicy

mesh = Mesh(np.array(jax.devices()), ("d",))

def body(w, x):
  with jax.named_scope("layer"):
    h = jnp.log(x @ w)
  return jax.lax.psum(jnp.sum(h), "d")

f = jax.shard_map(body, mesh=mesh, in_specs=(P(), P("d")), out_specs=P())
loss = mpolicy.amp(f, "p=f32,c=bf16,o=f32")
x = jnp.ones((16, 4)).at[10, :].set(-1.0)  # Rows 10 and 11: device 5.
report = mpolicy.locate_nonfinite(loss, jnp.ones((4, 3)), x)
healthy = mpolicy.locate_nonfinite(loss, jnp.ones((4, 3)), jnp.ones((16, 4)))
print("FACTS=" + json.dumps({
    "primitive": report.primitive, "path": report.path,
    "device": report.device, "direction": report.direction,
    "healthy": healthy is None, "text": str(report)}))
'''


@pytest.mark.ci  # An 8-device script, 8 s on 2 cores.
def test_a_nonfinite_value_on_one_device_of_a_shard_map(eight_devices):
  facts = eight_devices
  assert facts["healthy"]
  assert (facts["primitive"], facts["path"], facts["device"],
          facts["direction"]) == ("log", "layer", 5, "forward")
  assert "on device 5 of its shard_map" in facts["text"]


@pytest.mark.slow  # Runs the example as a file: tens of seconds.
def test_the_char_transformer_prints_the_report_of_a_skipped_step(tmp_path):
  import os  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  root = os.path.dirname(os.path.dirname(os.path.dirname(THIS)))
  env = dict(os.environ, PYTHONPATH=root + os.pathsep
             + os.environ.get("PYTHONPATH", ""))
  proc = subprocess.run(
      [sys.executable, os.path.join(root, "examples", "char_transformer.py"),
       "--steps=2", "--batch_size=2", "--seq_len=8", "--d_model=8",
       "--num_heads=2", "--num_layers=1", "--log_every=0",
       "--mp_policy=p=f32,c=f16,o=f32", "--mp_scale_type=Static",
       "--mp_scale_value=1e30", "--debug_nonfinite"],
      cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = [l for l in proc.stdout.splitlines() if "was skipped" in l]
  assert [l.split(":")[0] for l in lines] == ["step 1 was skipped",
                                              "step 2 was skipped"]
  assert "in the backward pass" in lines[0]
  assert "a smaller loss scale may be enough" in lines[0]
