"""Specification of CheckpointManager: the last N steps of a training loop."""

import os
import pathlib
import re
import signal
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import pytest

import mpolicy


def _tree(step):
  return {"w": jnp.full(3, step, jnp.bfloat16),
          "loss_scale": mpolicy.DynamicLossScale(2. ** 10, period=7)}


def test_keeps_the_newest_steps_and_restores_the_latest(tmp_path):
  manager = mpolicy.CheckpointManager(tmp_path / "run", max_to_keep=2)
  assert manager.all_steps() == [] and manager.latest_step() is None
  for step in (10, 20, 30, 40):
    manager.save(step, _tree(step))
  assert manager.all_steps() == [30, 40]
  assert manager.latest_step() == 40
  assert sorted(os.listdir(tmp_path / "run")) == ["step_30", "step_40"]
  restored = manager.restore(_tree(0))
  assert restored["w"].dtype == jnp.bfloat16
  assert restored["w"].tolist() == [40.] * 3
  assert restored["loss_scale"].period == 7
  assert manager.restore(_tree(0), step=30)["w"].tolist() == [30.] * 3


def test_keeps_every_step_when_asked(tmp_path):
  manager = mpolicy.CheckpointManager(tmp_path, max_to_keep=None)
  for step in (3, 1, 2):
    manager.save(step, _tree(step))
  assert manager.all_steps() == [1, 2, 3]


def test_a_step_is_saved_once_unless_overwritten(tmp_path):
  manager = mpolicy.CheckpointManager(tmp_path)
  manager.save(5, _tree(5))
  with pytest.raises(FileExistsError, match="overwrite=True"):
    manager.save(5, _tree(6))
  manager.save(5, _tree(6), overwrite=True)
  assert manager.restore(_tree(0))["w"].tolist() == [6.] * 3


def test_what_an_interrupted_prune_left_is_never_listed_and_goes(tmp_path):
  manager = mpolicy.CheckpointManager(tmp_path, max_to_keep=1)
  (tmp_path / ".step_1.deleting").mkdir()
  (tmp_path / ".step_2.x.mpolicy-tmp").mkdir()  # A save in progress.
  assert manager.all_steps() == []
  manager.save(3, _tree(3))
  assert sorted(os.listdir(tmp_path)) == [".step_2.x.mpolicy-tmp", "step_3"]


def test_nothing_saved_yet_is_named(tmp_path):
  manager = mpolicy.CheckpointManager(tmp_path / "empty")
  with pytest.raises(FileNotFoundError, match="no checkpoint in .*empty"):
    manager.restore(_tree(0))
  with pytest.raises(FileNotFoundError, match=r"CheckpointManager.restore: "
                     "no checkpoint of step 3 in .*empty; saved steps: none"):
    manager.restore(_tree(0), step=3)


def test_a_step_never_saved_is_named_with_the_saved_ones(tmp_path):
  manager = mpolicy.CheckpointManager(tmp_path)
  for step in (10, 20):
    manager.save(step, _tree(step))
  with pytest.raises(FileNotFoundError, match=re.escape(
      f"CheckpointManager.restore: no checkpoint of step 7 in {tmp_path}; "
      "saved steps: [10, 20].")):
    manager.restore(_tree(0), step=7)
  with pytest.raises(ValueError, match="step must be a whole number >= 0"):
    manager.restore(_tree(0), step=-1)
  assert manager.restore(_tree(0), step=10)["w"].tolist() == [10.] * 3


@pytest.mark.parametrize("max_to_keep, error", [
    (0, ValueError), (-2, ValueError), ("3", TypeError), (True, TypeError),
    (2.0, TypeError)])
def test_bad_settings_are_named(tmp_path, max_to_keep, error):
  with pytest.raises(error, match="max_to_keep must be a whole number >= 1, "
                     "or None to keep every step; got"):
    mpolicy.CheckpointManager(tmp_path, max_to_keep=max_to_keep)
  with pytest.raises(TypeError, match="directory must be a directory path"):
    mpolicy.CheckpointManager(None)


@pytest.mark.parametrize("step, error", [
    (-1, ValueError), (1.5, TypeError), ("7", TypeError), (True, TypeError)])
def test_a_bad_step_is_named(tmp_path, step, error):
  manager = mpolicy.CheckpointManager(tmp_path)
  with pytest.raises(error, match=r"step must be a whole number >= 0; got"):
    manager.save(step, _tree(0))
  assert os.listdir(tmp_path) == []


def test_a_step_whose_replacing_save_died_is_still_listed_and_restored(
    tmp_path, monkeypatch):
  manager = mpolicy.CheckpointManager(tmp_path, max_to_keep=2)
  manager.save(5, _tree(5))
  rename = os.rename

  def dies_before_the_new_one_is_in(src, dst):
    if os.path.basename(dst) == "step_5":
      raise KeyboardInterrupt("the process dies here")
    rename(src, dst)

  monkeypatch.setattr(os, "rename", dies_before_the_new_one_is_in)
  with pytest.raises(KeyboardInterrupt):
    manager.save(5, _tree(6), overwrite=True)
  monkeypatch.setattr(os, "rename", rename)
  assert manager.all_steps() == [5]
  assert manager.restore(_tree(0))["w"].tolist() == [5.] * 3
  for step in (7, 8):
    manager.save(step, _tree(step))
  assert manager.all_steps() == [7, 8]
  assert sorted(os.listdir(tmp_path)) == ["step_7", "step_8"]


def test_a_url_is_refused(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  with pytest.raises(ValueError, match="gs:// URL; mpolicy checkpoints go "
                     "to a directory"):
    mpolicy.CheckpointManager("gs://bucket/run")
  assert os.listdir(tmp_path) == []


def test_a_killed_save_leaves_scratch_that_the_next_save_removes(tmp_path):
  """A save killed mid-write leaves its scratch directory, named for its
  process; a later save (of any step) removes it once that process is gone,
  and leaves the scratch of live processes and of other machines."""
  script = textwrap.dedent(f"""
      import os, signal, jax.numpy as jnp, mpolicy
      from mpolicy._src.checkpoint import disk
      write = disk.write
      def write_then_die(*args):
        write(*args)
        os.kill(os.getpid(), signal.SIGKILL)
      disk.write = write_then_die
      mpolicy.save_checkpoint({str(tmp_path / "step_1")!r}, {{"w": jnp.ones(3)}})
      """)
  repo = pathlib.Path(mpolicy.__file__).resolve().parents[1]
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(repo))
  died = subprocess.run([sys.executable, "-c", script], env=env, timeout=300,
                        capture_output=True, text=True)
  assert died.returncode == -signal.SIGKILL, died.stderr[-2000:]
  (left,) = os.listdir(tmp_path)
  assert re.fullmatch(r"\.step_1\.\d+@[0-9a-f]{8}\.\w+\.mpolicy-tmp", left)
  assert os.listdir(tmp_path / left) == ["checkpoint"]  # Written, not placed.
  machine = left.split("@")[1].split(".")[0]
  alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
  kept = [f".step_3.{alive.pid}@{machine}.abc.mpolicy-tmp",  # Another's save.
          f".step_3.{os.getpid()}@{machine}.abc.mpolicy-tmp",  # This one's.
          f".step_3.1@{int(machine, 16) ^ 1:08x}.abc.mpolicy-tmp",  # Elsewhere.
          ".step_3.abc.mpolicy-tmp"]  # An older mpolicy's: its owner unknown.
  try:
    for name in kept:
      (tmp_path / name).mkdir()
    manager = mpolicy.CheckpointManager(tmp_path)
    assert manager.all_steps() == []
    manager.save(2, _tree(2))
  finally:
    alive.kill()
    alive.wait()
  assert sorted(os.listdir(tmp_path)) == sorted(kept + ["step_2"])
