"""Runs a script in N JAX processes joined by `jax.distributed` on localhost.

`launch(script, num_processes, devices_per_process)` starts the processes
(one coordinator on a free port, CPU collectives through gloo, each process
with its own simulated CPU devices), waits for all of them and returns
what each reported with `report(**facts)` (JSON values), in process order.
With `num_processes=1` the script runs in one plain process, without
`jax.distributed`: the one-process run to compare with.

The processes never outlive the call: each runs in its own process group,
and when one fails, or the deadline passes, every group is killed and the
test fails with the tail of each process's output.

Inside the script, before its first line: `jax` is imported and joined,
`PROCESS`, `NUM_PROCESSES` and `ARGS` (the launch's `args`) are defined,
and `report` writes the facts.

`once(tmp_path_factory, name, run)` runs a launch once per test session,
even when pytest-xdist spreads the tests that read it over workers.
"""

from __future__ import annotations

import fcntl
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

_PRELUDE = r"""
import json as _json, os as _os, sys as _sys, traceback as _traceback

def _exit_now(*error):
  # An error ends this process at once: jax.distributed's exit handler
  # would wait for the other processes, which may wait for this one.
  _traceback.print_exception(*error)
  _sys.stderr.flush()
  _os._exit(1)

_sys.excepthook = _exit_now
PROCESS = int(_os.environ["MPOLICY_MP_PROCESS"])
NUM_PROCESSES = int(_os.environ["MPOLICY_MP_NUM_PROCESSES"])
ARGS = _json.loads(_os.environ["MPOLICY_MP_ARGS"])
import jax
if NUM_PROCESSES > 1:
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
      coordinator_address=_os.environ["MPOLICY_MP_COORDINATOR"],
      num_processes=NUM_PROCESSES, process_id=PROCESS,
      initialization_timeout=60)

def report(**facts):
  with open(_os.environ["MPOLICY_MP_FACTS"], "w") as _f:
    _json.dump(facts, _f)
"""

# Lines every gloo process prints; they are left out of failure messages.
_NOISE = ("[Gloo]",)


def free_port() -> int:
  """A TCP port on localhost that nothing listens on now."""
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def environment(devices_per_process: int) -> dict[str, str]:
  """The environment of a process with `devices_per_process` CPU devices,
  importing this checkout's mpolicy and the tests' helpers."""
  env = dict(os.environ)
  flags = [f for f in env.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  env["XLA_FLAGS"] = " ".join(
      flags + [f"--xla_force_host_platform_device_count={devices_per_process}"])
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = os.pathsep.join(
      p for p in (str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH")) if p)
  return env


def _tail(path: pathlib.Path, limit: int = 3000) -> str:
  text = path.read_text(errors="replace") if path.exists() else ""
  lines = [l for l in text.splitlines() if not l.startswith(_NOISE)]
  return "\n".join(lines)[-limit:]


def _kill(procs) -> None:
  for p in procs:
    if p.poll() is None:
      try:
        os.killpg(p.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
  for p in procs:
    p.wait()


def launch(script: str, num_processes: int, devices_per_process: int, *,
           args=None, timeout: float = 120.) -> list[dict]:
  """Runs `script` in `num_processes` joined processes; their reports.

  Fails the calling test (killing every process) when a process exits
  with an error, does not report, or the processes run past `timeout`
  seconds.
  """
  with tempfile.TemporaryDirectory(prefix="mpolicy-mp-") as tmp:
    tmp = pathlib.Path(tmp)
    (tmp / "script.py").write_text(_PRELUDE + script)
    env = environment(devices_per_process)
    env["MPOLICY_MP_NUM_PROCESSES"] = str(num_processes)
    env["MPOLICY_MP_COORDINATOR"] = f"localhost:{free_port()}"
    env["MPOLICY_MP_ARGS"] = json.dumps(args)
    procs = []
    try:
      for i in range(num_processes):
        env_i = dict(env, MPOLICY_MP_PROCESS=str(i),
                     MPOLICY_MP_FACTS=str(tmp / f"facts{i}.json"))
        with open(tmp / f"out{i}.txt", "w") as out:
          procs.append(subprocess.Popen(
              [sys.executable, str(tmp / "script.py")], cwd=tmp, env=env_i,
              stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
      deadline = time.monotonic() + timeout
      failed = None
      while failed is None and any(p.poll() is None for p in procs):
        bad = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
        if bad:
          failed = f"process {bad[0]} exited with {procs[bad[0]].returncode}"
        elif time.monotonic() > deadline:
          failed = f"the processes ran past {timeout:.0f} s"
        else:
          time.sleep(0.02)
      _kill(procs)
      if failed is None:
        bad = [i for i, p in enumerate(procs) if p.returncode != 0]
        if bad:
          failed = f"process {bad[0]} exited with {procs[bad[0]].returncode}"
      missing = [i for i in range(num_processes)
                 if not (tmp / f"facts{i}.json").exists()]
      if failed is None and missing:
        failed = f"process {missing[0]} exited without reporting"
      if failed is not None:
        outputs = "\n".join(
            f"--- process {i} (exit {p.returncode}):\n" + _tail(tmp / f"out{i}.txt")
            for i, p in enumerate(procs))
        pytest.fail(f"{num_processes} processes x {devices_per_process} "
                    f"devices: {failed}.\n{outputs}", pytrace=False)
      return [json.loads((tmp / f"facts{i}.json").read_text())
              for i in range(num_processes)]
    finally:
      _kill(procs)


def once(tmp_path_factory, name: str, run):
  """`run(directory)`'s result (JSON), computed once per test session.

  pytest-xdist's workers share the parent of their base temporary
  directory: the first worker to ask runs `run` under a lock and keeps
  its result (or its failure) there; the others wait and read it.
  """
  root = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    root = root.parent
  directory = root / f"multiprocess-{name}"
  with open(root / f"multiprocess-{name}.lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    facts, failure = directory / "facts.json", directory / "failure.txt"
    if failure.exists():
      pytest.fail(failure.read_text(), pytrace=False)
    if not facts.exists():
      directory.mkdir(exist_ok=True)
      try:
        result = run(directory)
      except BaseException as e:  # A failed launch fails every reader.
        failure.write_text(f"{type(e).__name__}: {e}")
        raise
      facts.write_text(json.dumps(result))
    return json.loads(facts.read_text())
