"""What the examples print and plot: progress lines, a table, a PNG.

Nothing here trains: each example keeps its own step and loop, and hands
each step's loss, loss scale and finiteness to a `Log`.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Optional, Sequence

import jax
import numpy as np

import mpolicy


def label(policy: str, scale_type: str = "NoOp") -> str:
  """A run's short name: the compute dtype, and the scale if any: 'f16+dynamic'."""
  compute = str(mpolicy.get_policy(policy)).split(",")[1][2:]
  return compute if scale_type == "NoOp" else f"{compute}+{scale_type.lower()}"


class Log:
  """Per-step losses, loss scales and finiteness; prints progress lines.

  `record` syncs with the device (it reads the loss), as a progress line
  must. The first step's time is reported as compile time.
  """

  def __init__(self, name: str, steps: int, log_every: int = 100):
    self.name, self.steps, self.log_every = name, steps, log_every
    self.loss, self.scale, self.finite = [], [], []
    self.extra: dict[str, list[float]] = {}  # More per-step series to plot.
    self._start = self._last = time.perf_counter()
    self._last_step = 0
    self.compile_time = self.train_time = 0.0

  @property
  def skipped(self) -> int:
    return sum(not f for f in self.finite)

  def record(self, loss: Any, loss_scale: Any, finite: Any, **extra) -> None:
    loss, scale, finite, extra = jax.device_get((loss, loss_scale, finite, extra))
    self.loss.append(float(loss))
    self.scale.append(float(scale))
    self.finite.append(bool(finite))
    for key, value in extra.items():
      self.extra.setdefault(key, []).append(float(value))
    now, i = time.perf_counter(), len(self.loss)
    if i == 1:
      self.compile_time = now - self._start
      self._last, self._last_step = now, 1
    self.train_time = now - self._start - self.compile_time
    if self.log_every and (i % self.log_every == 0 or i == self.steps):
      done = i - self._last_step
      rate = done / max(now - self._last, 1e-9) if done else 0.0
      print(f"[{self.name}] step {i:5d}/{self.steps}  loss {loss:8.4f}  "
            f"loss scale {scale:8g}  skipped {self.skipped:3d}  "
            f"{rate:7.1f} steps/s", flush=True)
      self._last, self._last_step = now, i


@dataclasses.dataclass
class Run:
  """One finished run: its settings, final metrics and log."""
  name: str
  policy: str
  scale_type: str
  metrics: dict[str, float]
  log: Log
  explain: str = ""


def explain_summary(fn, *args) -> str:
  """`mpolicy.explain` in one line: its `Report.summary`."""
  return mpolicy.explain(fn, *args).summary()


def table(runs: Sequence[Run], metrics: Sequence[str]) -> str:
  """A markdown table of the runs: settings, metrics, skipped steps, times."""
  header = (["run", "policy", "loss scale", *metrics, "skipped steps",
             "compile (s)", "train time (s)", "explain"])
  lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
  for r in runs:
    cells = [r.name, str(mpolicy.get_policy(r.policy)), r.scale_type]
    cells += [f"{r.metrics[m]:.4f}" for m in metrics]
    cells += [r.log.skipped, f"{r.log.compile_time:.1f}",
              f"{r.log.train_time:.1f}", r.explain or "—"]
    lines.append("| " + " | ".join(str(c) for c in cells) + " |")
  return "\n".join(lines)


def summary(runs: Sequence[Run], metrics: Sequence[str]) -> None:
  """Prints each run's metrics, one per line, then the table."""
  for r in runs:
    for m in metrics:
      value = r.metrics[m]
      shown = f"{100 * value:.2f}%" if "accuracy" in m else f"{value:.4f}"
      print(f"[{r.name}] {m}: {shown}")
  print()
  print(table(runs, metrics))


_STYLES = [("-", None), ("--", "o"), (":", "s"), ("-.", "^")]


def plot(runs: Sequence[Run], path: str, title: str = "") -> None:
  """Writes a PNG with one panel per series, a line style per run.

  Panels: the loss; the loss minus the first run's (runs that overlap at
  the top are told apart here); the loss scale, if any run has one; then
  each `Log.extra` series (e.g. the share of underflowed gradients).
  """
  folder = os.path.dirname(os.path.abspath(path))
  os.makedirs(folder, exist_ok=True)  # A missing folder is created.
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  extras = sorted({k for r in runs for k in r.log.extra})
  scaled = any(r.scale_type != "NoOp" for r in runs)
  panels = (["training loss"]
            + ([f"loss - loss of {runs[0].name}"] if len(runs) > 1 else [])
            + (["loss scale"] if scaled else []) + extras)
  fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.6 * len(panels)),
                           sharex=True, squeeze=False)
  for i, r in enumerate(runs):
    line, marker = _STYLES[i % len(_STYLES)]
    steps = np.arange(1, len(r.log.loss) + 1)
    style = dict(color=f"C{i}", linestyle=line, marker=marker, label=r.name,
                 markevery=max(1, len(steps) // 15), linewidth=1.2,
                 markersize=4)
    series = {"training loss": r.log.loss, "loss scale": r.log.scale,
              **r.log.extra}
    if len(runs) > 1:
      n = min(len(r.log.loss), len(runs[0].log.loss))
      series[panels[1]] = np.subtract(r.log.loss[:n], runs[0].log.loss[:n])
    for ax, name in zip(axes[:, 0], panels):
      if name in series:
        ax.plot(steps[:len(series[name])], series[name], **style)
  for ax, name in zip(axes[:, 0], panels):
    ax.set_ylabel(name)
    ax.legend(fontsize=8)
  axes[0, 0].set_yscale("log")
  if scaled:
    axes[panels.index("loss scale"), 0].set_yscale("log", base=2)
  axes[-1, 0].set_xlabel("step")
  axes[0, 0].set_title(title)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  print(f"Wrote {path}")
