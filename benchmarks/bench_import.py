"""What `import mpolicy` costs, against `import jax` measured in the same run.

Each variant runs in a fresh interpreter (`sys.executable`), interleaved
round-robin over the repeats so machine noise hits them alike:

  jax              ``import jax, numpy``: the floor mpolicy cannot go under;
  mpolicy          ``import mpolicy``;
  jax+haiku+optax  ``import jax, haiku, optax``: what mpolicy loaded at
                   import time when its flat names were eager imports;
  mpolicy+haiku    ``import mpolicy`` then ``mpolicy.transform_amp`` (the
                   Haiku bridge loads on first use).

Per variant it prints the child's process CPU time at the end of the
statement (``time.process_time()``, interpreter start-up included), the
wall time of the whole child seen from the parent, and which optional
packages the statement left in ``sys.modules``; ranges over the repeats and
the median ratio to ``jax``. A last line gives ``python -X importtime``'s
cumulative microseconds for ``mpolicy`` imported after ``jax`` (mpolicy's
own cost on top of JAX).

  python benchmarks/bench_import.py                  # 7 repeats
  python benchmarks/bench_import.py --repeats=2      # a smoke run
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPTIONAL = ("haiku", "optax", "flax", "orbax")

VARIANTS = {
    "jax": "import jax, numpy",
    "mpolicy": "import mpolicy",
    "jax+haiku+optax": "import jax, haiku, optax",
    "mpolicy+haiku": "import mpolicy; mpolicy.transform_amp",
}

_CHILD = """\
import sys, time
{statement}
cpu = time.process_time()
loaded = [m for m in {optional!r} if m in sys.modules]
print(cpu, ",".join(loaded) or "-")
"""


def _env() -> dict:
  path = os.environ.get("PYTHONPATH", "")
  return dict(os.environ, JAX_PLATFORMS="cpu",
              PYTHONPATH=ROOT + (os.pathsep + path if path else ""))


def run_once(statement: str) -> tuple[float, float, str]:
  """``(process CPU s, wall s, optional packages loaded)`` of one child."""
  code = _CHILD.format(statement=statement, optional=OPTIONAL)
  start = time.perf_counter()
  done = subprocess.run([sys.executable, "-c", code], capture_output=True,
                        text=True, env=_env(), cwd=ROOT, check=True)
  wall = time.perf_counter() - start
  cpu, loaded = done.stdout.split()
  return float(cpu), wall, loaded


def importtime_us() -> int:
  """`-X importtime`'s cumulative microseconds of ``mpolicy`` after jax."""
  done = subprocess.run(
      [sys.executable, "-X", "importtime", "-c", "import jax; import mpolicy"],
      capture_output=True, text=True, env=_env(), cwd=ROOT, check=True)
  for line in done.stderr.splitlines():
    fields = [f.strip() for f in line.split("|")]
    if len(fields) == 3 and fields[2] == "mpolicy":
      return int(fields[1])
  raise RuntimeError("mpolicy is missing from -X importtime's output")


def _cpu() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=7)
  args = parser.parse_args(argv)
  import jax  # pylint: disable=g-import-not-at-top
  print(f"# import time: {_cpu()}, "
        f"{os.cpu_count()} cores, python {platform.python_version()}, "
        f"jax {jax.__version__}, {time.strftime('%Y-%m-%d')}")
  cpu = {name: [] for name in VARIANTS}
  wall = {name: [] for name in VARIANTS}
  loaded = {}
  names = list(VARIANTS)
  for repeat in range(args.repeats):
    order = names[repeat % len(names):] + names[:repeat % len(names)]
    for name in order:
      c, w, packages = run_once(VARIANTS[name])
      cpu[name].append(c)
      wall[name].append(w)
      loaded[name] = packages
  base_cpu = statistics.median(cpu["jax"])
  base_wall = statistics.median(wall["jax"])
  print("| variant | CPU s (range) | wall s (range) | CPU / jax | "
        "wall / jax | optional packages loaded |")
  print("|---|---|---|---|---|---|")
  for name in names:
    print(f"| {name} | {min(cpu[name]):.2f}-{max(cpu[name]):.2f} "
          f"| {min(wall[name]):.2f}-{max(wall[name]):.2f} "
          f"| {statistics.median(cpu[name]) / base_cpu:.2f} "
          f"| {statistics.median(wall[name]) / base_wall:.2f} "
          f"| {loaded[name]} |")
  samples = sorted(importtime_us() for _ in range(max(1, args.repeats // 2)))
  print(f"-X importtime, mpolicy after jax: {samples[0] / 1e3:.0f}-"
        f"{samples[-1] / 1e3:.0f} ms cumulative over {len(samples)} runs")


if __name__ == "__main__":
  main()
