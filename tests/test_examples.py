"""The examples run end to end, and their flags fail early and clearly.

Fast tests run each example as a user would (`python -m examples.<name>`)
with a few tiny steps. Slow tests (`-m slow`) call the training functions in
process: bfloat16 matches float32 on the digits, and float16 with a dynamic
loss scale never puts a NaN into the params.
"""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path[:1]:
  # The repository's `examples` package, ahead of any other on the path.
  sys.path.insert(0, ROOT)


def run_example(module, *args, timeout=240):
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep
             + os.environ.get("PYTHONPATH", ""))
  proc = subprocess.run(
      [sys.executable, "-m", f"examples.{module}", *args], cwd=ROOT, env=env,
      capture_output=True, text=True, timeout=timeout)
  return proc.returncode, proc.stdout, proc.stderr


def assert_ok(rc, out, err):
  assert rc == 0, f"exit {rc}\nstdout:\n{out}\nstderr:\n{err}"


def test_digits_cnn_compares_float32_and_bfloat16_and_plots(tmp_path):
  png = tmp_path / "digits.png"
  rc, out, err = run_example("digits_cnn", "--steps=3", "--batch_size=16",
                             "--log_every=1", "--channels=4,8",
                             f"--plot={png}")
  assert_ok(rc, out, err)
  assert "| run | policy | loss scale | test accuracy | final loss |" in out
  assert "| f32 | p=f32,c=f32,o=f32 | NoOp |" in out
  assert "| bf16 | p=f32,c=bf16,o=f32 | NoOp |" in out
  assert "[bf16] test accuracy:" in out
  assert "[bf16] step     3/3" in out
  assert png.stat().st_size > 0


def test_char_transformer_with_attention_policy_and_dynamic_scale():
  rc, out, err = run_example(
      "char_transformer", "--steps=2", "--batch_size=2", "--seq_len=8",
      "--d_model=8", "--num_heads=2", "--num_layers=1", "--log_every=1",
      "--attention_policy=full", "--mp_scale_type=Dynamic")
  assert_ok(rc, out, err)
  assert "| bf16+dynamic+attn:f32 | p=f32,c=bf16,o=f32 | Dynamic" in out
  assert "test accuracy:" in out


def test_loss_scaling_lesson_prints_underflow_table():
  rc, out, err = run_example("loss_scaling_lesson", "--steps=2",
                             "--batch_size=8", "--channels=4",
                             "--measure_every=1", "--log_every=0")
  assert_ok(rc, out, err)
  assert "| run | policy | loss scale | grads underflowed (mean) |" in out
  assert "| f16+dynamic | p=f32,c=f16,o=f32 | Dynamic" in out


@pytest.mark.parametrize("flag, message", [
    ("--mp_scale_type=Bogus",
     "flag --mp_scale_type=Bogus: value should be one of <NoOp|Static|Dynamic>"),
    ("--mp_policy=p=f17", "flag --mp_policy=p=f17:"),
    ("--mp_bn_policy=fulll", "flag --mp_bn_policy=fulll:"),
])
def test_bad_flag_fails_at_start_up(flag, message):
  rc, out, err = run_example("digits_cnn", flag, "--steps=1", timeout=60)
  assert rc != 0
  assert "FATAL Flags parsing error" in err
  assert message in err
  assert "step" not in out  # Nothing trained.


def test_bad_policy_message_quotes_get_policy():
  rc, _, err = run_example("char_transformer", "--attention_policy=c=f17",
                           timeout=60)
  assert rc != 0
  assert "FATAL Flags parsing error: flag --attention_policy=c=f17:" in err
  assert "f17" in err.split("flag --attention_policy=c=f17:")[1]


# --- Slow checks, in process -------------------------------------------------


@pytest.fixture(scope="module")
def digits():
  from examples import digits_cnn  # pylint: disable=g-import-not-at-top
  return digits_cnn, digits_cnn.load_digits()


@pytest.mark.slow
def test_bfloat16_accuracy_within_half_a_point_of_float32(digits):
  digits_cnn, data = digits
  from examples import common  # pylint: disable=g-import-not-at-top
  config = digits_cnn.Config(log_every=0)
  f32 = digits_cnn.train(config, common.MixedPrecision.float32(), data)
  bf16 = digits_cnn.train(
      config, common.MixedPrecision(policy="p=f32,c=bf16,o=f32"), data)
  acc32 = 100 * f32.metrics["test accuracy"]
  acc16 = 100 * bf16.metrics["test accuracy"]
  assert acc32 > 95
  assert abs(acc16 - acc32) <= 0.5, (acc16, acc32)


@pytest.mark.slow
@pytest.mark.parametrize("initial_scale", [2.0**15, 2.0**30])
def test_float16_dynamic_scale_never_puts_nan_in_params(digits, initial_scale):
  digits_cnn, data = digits
  from examples import common  # pylint: disable=g-import-not-at-top
  bad_steps = []

  def check(step, carry):
    params, state, _, _ = carry
    leaves = jax.tree_util.tree_leaves((params, state))
    if not all(np.isfinite(np.asarray(x)).all() for x in leaves):
      bad_steps.append(step)

  mp = common.MixedPrecision(policy="p=f32,c=f16,o=f32", scale_type="Dynamic",
                             scale_value=initial_scale)
  result = digits_cnn.train(digits_cnn.Config(log_every=0), mp, data,
                            callback=check)
  assert not bad_steps, f"non-finite params after steps {bad_steps[:5]}"
  assert all(np.isfinite(result.history.loss_scale))
  if initial_scale > 2.0**20:  # Too big for float16: it must have backed off.
    assert result.history.nonfinite_steps > 0
    assert result.history.loss_scale[-1] < initial_scale
  assert result.metrics["test accuracy"] > 0.95
