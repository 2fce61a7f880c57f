"""The examples' `--microbatches` flag, run as files with tiny settings."""

import pytest

from test_examples import TINY_MODEL, assert_ok, run_example


@pytest.mark.ci  # Runs the script, 10 s on 2 cores.
def test_char_transformer_accumulates_over_microbatches(tmp_path):
  rc, out, err = run_example(
      "char_transformer", "--steps=2", "--batch_size=4", "--microbatches=2",
      *TINY_MODEL, "--log_every=1", "--mp_scale_type=Dynamic", cwd=tmp_path)
  assert_ok(rc, out, err)
  assert "[bf16+dynamic] step     2/2" in out
  assert "| bf16+dynamic | p=f32,c=bf16,o=f32 | Dynamic |" in out


def test_char_transformer_microbatches_must_divide_the_batch(tmp_path):
  rc, out, err = run_example("char_transformer", "--batch_size=3",
                             "--microbatches=2", "--steps=1", cwd=tmp_path,
                             timeout=120)
  assert rc != 0 and "Traceback" not in err
  assert ("--microbatches must be at least 1 and divide --batch_size" in err)


@pytest.mark.slow  # Two trainings on 8 devices; the 8-device tests cover k.
@pytest.mark.parametrize("flag", ["", "--shard_map"])
def test_data_parallel_accumulates_over_microbatches(tmp_path, flag):
  rc, out, err = run_example(
      "data_parallel", "--steps=2", "--batch_size=32", "--microbatches=2",
      *([flag] if flag else []), cwd=tmp_path)
  assert_ok(rc, out, err)
  assert f"{flag.lstrip('-') or 'jit'} on 8 devices: final loss" in out
  assert "one device:" in out


@pytest.mark.ci  # 5 s subprocess: once, in CI's newest job.
def test_data_parallel_microbatches_must_divide_each_share(tmp_path):
  rc, out, err = run_example("data_parallel", "--steps=1", "--batch_size=16",
                             "--microbatches=4", cwd=tmp_path, timeout=120)
  assert rc != 0 and "Traceback" not in err
  assert ("--microbatches=4 must divide each device's share of "
          "--batch_size=16 over 8 devices" in out + err)
