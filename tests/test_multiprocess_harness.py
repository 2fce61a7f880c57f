"""The multi-process harness never leaves processes behind or waits forever.

Slow: each check starts two JAX processes only to watch them fail.
"""

import os
import time

import _pytest.outcomes
import pytest

from _multiprocess import launch

_PIDS = r"""
import os, sys, time
open(os.path.join(ARGS, f"pid{PROCESS}"), "w").write(str(os.getpid()))
"""


def _alive(directory):
  pids = [int((directory / f"pid{i}").read_text()) for i in range(2)]
  alive = []
  for pid in pids:
    try:
      os.kill(pid, 0)
      alive.append(pid)
    except ProcessLookupError:
      pass
  return alive


@pytest.mark.slow
def test_a_failing_process_stops_the_others_and_shows_why(tmp_path):
  script = _PIDS + r"""
if PROCESS == 1:
  raise RuntimeError("process one gives up")
from jax.experimental import multihost_utils
multihost_utils.sync_global_devices("never reached by process 1")
"""
  start = time.monotonic()
  with pytest.raises(_pytest.outcomes.Failed) as e:
    launch(script, 2, 1, args=str(tmp_path), timeout=120)
  assert time.monotonic() - start < 60
  assert "process 1 exited with 1" in str(e.value)
  assert "RuntimeError: process one gives up" in str(e.value)
  assert _alive(tmp_path) == []


@pytest.mark.slow
def test_processes_past_the_deadline_are_killed(tmp_path):
  script = _PIDS + "time.sleep(600)\n"
  start = time.monotonic()
  with pytest.raises(_pytest.outcomes.Failed, match="ran past 20 s"):
    launch(script, 2, 1, args=str(tmp_path), timeout=20)
  assert time.monotonic() - start < 40
  assert _alive(tmp_path) == []
