"""The debugger's benchmark runs (its smoke preset) and says what it measured."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))


@pytest.mark.slow  # A whole benchmark run: a minute.
def test_the_smoke_run_reports_every_call(tmp_path):
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep
             + os.environ.get("PYTHONPATH", ""))
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "benchmarks", "bench_debugging.py"),
       "--quick"], cwd=tmp_path, env=env, capture_output=True, text=True,
      timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  for row in ("| step |", "| locate, finite |", "| locate, skipped |",
              "| shadow |"):
    assert row in proc.stdout
  assert "in the backward pass" in proc.stdout
  assert proc.stdout.startswith("CPU: ")
