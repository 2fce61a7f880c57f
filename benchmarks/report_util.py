"""Small helpers the benchmark reports share: medians, ratios, the CPU.

>>> fmt_ms([0.010, 0.012, 0.011, 0.013])
'11.5 (10.2-12.8)'
>>> fmt_ratio(ratio([2.0], [4.0]), target=0.6)
'0.50x ✓ (≤0.6)'
"""

from __future__ import annotations

import os
import platform
import statistics
from typing import Optional, Sequence

import numpy as np


def med(xs: Sequence[float]) -> float:
  """The median, NaN for no values."""
  return statistics.median(xs) if xs else float("nan")


def fmt_ms(xs: Sequence[float]) -> str:
  """Seconds as `median (first-third quartile)` in ms (the median alone for
  fewer than 4 values, `-` for none)."""
  if not xs:
    return "-"
  if len(xs) >= 4:
    q = statistics.quantiles(xs, n=4)
    return f"{med(xs) * 1e3:.1f} ({q[0] * 1e3:.1f}-{q[2] * 1e3:.1f})"
  return f"{med(xs) * 1e3:.1f}"


def fmt_s(xs: Sequence[float]) -> str:
  """The median in seconds, `-` for none."""
  return f"{med(xs):.2f}" if xs else "-"


def ratio(a: Sequence[float], b: Sequence[float]) -> float:
  """median(a) / median(b), NaN where either is missing or b's is 0."""
  if not a or not b or not np.isfinite(med(b)) or med(b) == 0:
    return float("nan")
  return med(a) / med(b)


def fmt_ratio(x: float, target: Optional[float] = None) -> str:
  """`0.84x`, with ✓/✗ against `target` (at most) when given."""
  if not np.isfinite(x):
    return "-"
  s = f"{x:.2f}x"
  if target is not None:
    s += f" {'✓' if x <= target else '✗'} (≤{target})"
  return s


def cpu_info() -> tuple[str, set[str]]:
  """The CPU's model name and its /proc/cpuinfo flags (empty if unknown)."""
  cpu, flags = platform.processor() or "unknown", set()
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name") and cpu in ("unknown", "", "x86_64"):
          cpu = line.split(":", 1)[1].strip()
        elif line.startswith("flags"):
          flags = set(line.split(":", 1)[1].split())
  except OSError:
    pass
  return cpu, flags


def loadavg() -> str:
  """The 1, 5 and 15 minute load averages, as `0.52, 0.61, 0.70`."""
  return ", ".join(f"{x:.2f}" for x in os.getloadavg())
