"""Shared pieces of the examples: flags, loss scales, progress, tables, plots.

The mixed-precision flags keep the names Haiku's ImageNet example made
familiar (`--mp_policy`, `--mp_bn_policy`, `--mp_scale_type`,
`--mp_scale_value`, `--mp_skip_nonfinite`). Bad values fail at start-up with
absl's usual `FATAL Flags parsing error: ...` message: the scale type is an
enum, and policy specs are validated with `mpolicy.get_policy`.

Each example keeps its model and training code free of flags: `main` builds
a `MixedPrecision` and a config from the flags and calls a plain function,
which tests (and notebooks) can call directly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import dataclasses
import math
import time
from typing import Any, Optional

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

import mpolicy

FLAGS = flags.FLAGS

SCALE_TYPES = ("NoOp", "Static", "Dynamic")

# --- Flags ---------------------------------------------------------------------

flags.DEFINE_string(
    "mp_policy", "p=f32,c=bf16,o=f32",
    "Mixed precision policy for the model, in jmp's grammar "
    "(e.g. 'p=f32,c=bf16,o=f32', 'half', 'full').")
flags.DEFINE_string(
    "mp_bn_policy", "full",
    "Policy for the normalisation layers (hk.BatchNorm in the CNN, "
    "hk.LayerNorm in the transformer); they are most stable in float32.")
flags.DEFINE_enum(
    "mp_scale_type", "NoOp", list(SCALE_TYPES),
    "Loss scale: NoOp (none; fine for bfloat16), Static (fixed "
    "--mp_scale_value) or Dynamic (starts at --mp_scale_value, halves on "
    "overflow, doubles after a run of finite steps; use it with float16).")
flags.DEFINE_float(
    "mp_scale_value", 2.0**15,
    "Value of the Static loss scale, or the initial Dynamic one.")
flags.DEFINE_bool(
    "mp_skip_nonfinite", True,
    "Skip the optimizer update (params, optimizer and model state unchanged) "
    "on steps whose gradients are not finite. Needed with a Dynamic scale, "
    "which finds its level by overflowing now and then.")
flags.DEFINE_integer("steps", 500, "Number of training steps.")
flags.DEFINE_integer("batch_size", 64, "Training batch size.")
flags.DEFINE_integer("seed", 0, "Random seed (initialisation, batch order).")
flags.DEFINE_float("learning_rate", 1e-3, "Adam learning rate.")
flags.DEFINE_integer("log_every", 100,
                     "Print progress every this many steps (0: never).")
flags.DEFINE_bool(
    "compare", False,
    "Also train a float32 baseline (policy 'full', no loss scaling) with the "
    "same seed, and print a markdown table of the two runs.")
flags.DEFINE_string(
    "plot", None,
    "If set, write a PNG with the loss curves and the loss scale over the "
    "steps to this path.")


def check_policy_spec(spec: str) -> bool:
  """A flag validator: accepts specs `mpolicy.get_policy` accepts.

  Raises `flags.ValidationError` with `get_policy`'s own message otherwise,
  so absl prints it as `FATAL Flags parsing error: flag --name=...: <msg>`.
  """
  try:
    mpolicy.get_policy(spec)
  except (TypeError, ValueError) as e:
    raise flags.ValidationError(str(e)) from e
  return True


def check_optional_policy_spec(spec: Optional[str]) -> bool:
  """Like `check_policy_spec`, where an empty value means 'no policy'."""
  return not spec or check_policy_spec(spec)


flags.register_validator("mp_policy", check_policy_spec)
flags.register_validator("mp_bn_policy", check_policy_spec)
flags.register_validator(
    "mp_scale_value", lambda v: v > 0 and math.isfinite(v),
    message="--mp_scale_value must be a positive finite number.")
flags.register_validator("steps", lambda v: v >= 1,
                         message="--steps must be at least 1.")
flags.register_validator("batch_size", lambda v: v >= 1,
                         message="--batch_size must be at least 1.")


def set_defaults(**defaults: Any) -> None:
  """Sets this example's defaults for shared flags (`--steps`, ...).

  Values given on the command line win: absl only replaces a flag's value
  when it still holds its default.
  """
  for name, value in defaults.items():
    FLAGS.set_default(name, value)


def run(main: Callable[[Sequence[str]], None], defaults: dict[str, Any]) -> None:
  """`app.run(main)` with this example's flag defaults.

  JAX's start-up INFO lines are hidden (absl `--verbosity` defaults to
  WARNING here; pass `--verbosity=0` to see them).
  """
  from absl import app  # pylint: disable=g-import-not-at-top
  from absl import logging  # pylint: disable=g-import-not-at-top

  def quiet_main(argv):
    if not FLAGS["verbosity"].present:
      logging.set_verbosity(logging.WARNING)
    main(argv)

  set_defaults(**defaults)
  app.run(quiet_main)


# --- Mixed precision settings --------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
  """What the `--mp_*` flags say, as plain data.

  Attributes:
    policy: spec string of the model's policy.
    norm_policy: spec string of the normalisation layers' policy.
    scale_type: "NoOp", "Static" or "Dynamic".
    scale_value: the static scale, or the dynamic scale's initial value.
    skip_nonfinite: whether to skip updates with non-finite gradients.
  """
  policy: str = "p=f32,c=bf16,o=f32"
  norm_policy: str = "full"
  scale_type: str = "NoOp"
  scale_value: float = 2.0**15
  skip_nonfinite: bool = True

  @classmethod
  def from_flags(cls) -> MixedPrecision:
    """The settings given by the `--mp_*` flags."""
    return cls(policy=FLAGS.mp_policy, norm_policy=FLAGS.mp_bn_policy,
               scale_type=FLAGS.mp_scale_type,
               scale_value=FLAGS.mp_scale_value,
               skip_nonfinite=FLAGS.mp_skip_nonfinite)

  @classmethod
  def float32(cls, skip_nonfinite: bool = True) -> MixedPrecision:
    """The float32 baseline: policy 'full' everywhere and no loss scaling."""
    return cls(policy="full", norm_policy="full", scale_type="NoOp",
               skip_nonfinite=skip_nonfinite)

  @property
  def label(self) -> str:
    """A short name for tables: the compute dtype and the scale type."""
    compute = compute_name(self.policy)
    return compute if self.scale_type == "NoOp" else (
        f"{compute}+{self.scale_type.lower()}")

  def loss_scale(self) -> mpolicy.LossScale:
    """A fresh loss scale (see `make_loss_scale`)."""
    return make_loss_scale(self.scale_type, self.scale_value)


def compute_name(spec: Any) -> str:
  """The short name of a policy's compute dtype: 'f32', 'bf16', 'f16'.

  >>> compute_name("p=f32,c=bf16,o=f32")
  'bf16'
  """
  parts = dict(part.split("=") for part in str(mpolicy.get_policy(spec)).split(","))
  return parts["c"]


def make_loss_scale(scale_type: str, value: float) -> mpolicy.LossScale:
  """The loss scale named by `--mp_scale_type`, starting at `value`.

  >>> make_loss_scale("Static", 1024.).loss_scale
  1024.0
  """
  if scale_type == "NoOp":
    return mpolicy.NoOpLossScale()
  if scale_type == "Static":
    return mpolicy.StaticLossScale(float(value))
  if scale_type == "Dynamic":
    return mpolicy.DynamicLossScale(jnp.float32(value))
  raise ValueError(f"Unknown loss scale type {scale_type!r}; expected one of "
                   f"{', '.join(SCALE_TYPES)}.")


# --- Training loop and its record ----------------------------------------------


@dataclasses.dataclass
class History:
  """Per-step record of a training run (host floats)."""
  loss: list[float] = dataclasses.field(default_factory=list)
  loss_scale: list[float] = dataclasses.field(default_factory=list)
  finite: list[bool] = dataclasses.field(default_factory=list)

  @property
  def nonfinite_steps(self) -> int:
    return sum(not f for f in self.finite)


@dataclasses.dataclass(frozen=True)
class StepInfo:
  """What a step reports to the loop (device scalars are fine)."""
  loss: Any
  loss_scale: Any
  finite: Any


@dataclasses.dataclass
class RunResult:
  """One training run: its settings, metrics, timings and history.

  Attributes:
    label: short name (e.g. "f32", "bf16", "f16+dynamic").
    mp: the mixed precision settings.
    metrics: final metrics, e.g. {"test accuracy": 0.97, "final loss": 0.05}.
    train_time: seconds spent in steps after the first (compiled) one.
    compile_time: seconds the first step took (tracing and compilation).
    history: per-step losses, loss scales and finiteness.
    explain: a one-line summary of `mpolicy.explain` of the forward pass.
    final: anything else the example returns (params, state, ...).
  """
  label: str
  mp: MixedPrecision
  metrics: dict[str, float]
  train_time: float
  compile_time: float
  history: History
  explain: str = "n/a"
  final: Any = None


def loss_scale_value(loss_scale: Any) -> float:
  """The current scale of any loss scale, as a Python float."""
  return float(np.asarray(loss_scale.loss_scale))


def train_loop(
    step: Callable[[Any, int], tuple[Any, StepInfo]],
    carry: Any,
    steps: int,
    *,
    label: str = "",
    log_every: int = 100,
    skip_nonfinite: bool = True,
    callback: Optional[Callable[[int, Any], None]] = None,
) -> tuple[Any, History, float, float]:
  """Runs `carry, info = step(carry, i)` for `steps` steps, printing progress.

  Progress lines show the step, the loss, the loss scale, the number of
  skipped (or, without skipping, non-finite) steps so far and steps/s.
  `callback(i, carry)` runs after every step (tests use it to check params).

  Returns:
    `(carry, history, compile_time, train_time)`: the first step's time
    (dominated by compilation) and the time of the other steps.
  """
  history = History()
  skipped_name = "skipped" if skip_nonfinite else "nonfinite"
  start = time.perf_counter()
  compile_time = 0.0
  last_time, last_step = start, 0
  for i in range(steps):
    carry, info = step(carry, i)
    loss, scale, finite = jax.device_get(
        (info.loss, info.loss_scale, info.finite))
    history.loss.append(float(loss))
    history.loss_scale.append(float(scale))
    history.finite.append(bool(finite))
    if callback is not None:
      callback(i, carry)
    now = time.perf_counter()
    if i == 0:
      compile_time = now - start
      last_time, last_step = now, 1
    if log_every and ((i + 1) % log_every == 0 or i + 1 == steps):
      rate = (i + 1 - last_step) / max(now - last_time, 1e-9)
      print(f"[{label}] step {i + 1:5d}/{steps}  loss {loss:8.4f}  "
            f"loss scale {scale:8g}  {skipped_name} "
            f"{history.nonfinite_steps:3d}  "
            + (f"{rate:7.1f} steps/s" if i + 1 > last_step else ""),
            flush=True)
      last_time, last_step = now, i + 1
  train_time = time.perf_counter() - start - compile_time
  return carry, history, compile_time, train_time


# --- Inspection ----------------------------------------------------------------

_EXPLAIN = getattr(mpolicy, "explain", None)


def explain_summary(fn: Callable[..., Any], *args, **kwargs) -> str:
  """A one-line summary of `mpolicy.explain(fn, *args, **kwargs)`.

  "n/a" only if this mpolicy has no `explain`; errors are not hidden.
  """
  if _EXPLAIN is None:
    return "n/a"
  report = _EXPLAIN(fn, *args, **kwargs)
  return summarize_report(report)


def summarize_report(report: Any) -> str:
  """E.g. '212 ops: 40 bfloat16, 172 float32; 31 casts'."""
  totals = report.to_dict()["totals"]
  per_dtype = totals.get("ops_per_dtype", {})
  ops = sum(per_dtype.values())
  dtypes = ", ".join(f"{n} {d}" for d, n in
                     sorted(per_dtype.items(), key=lambda kv: -kv[1]))
  return f"{ops} ops: {dtypes}; {totals.get('casts_inserted', 0)} casts"


# --- Output --------------------------------------------------------------------


def _cell(value: Any) -> str:
  if isinstance(value, float):
    return f"{value:.4f}"
  return str(value).replace("|", "\\|")


def markdown_table(header: Sequence[str],
                   rows: Sequence[Sequence[Any]]) -> str:
  """A markdown table; floats are shown with 4 decimals.

  >>> print(markdown_table(["a", "b"], [[1, 0.5]]))
  | a | b |
  |---|---|
  | 1 | 0.5000 |
  """
  lines = ["| " + " | ".join(header) + " |",
           "|" + "|".join("---" for _ in header) + "|"]
  lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
  return "\n".join(lines)


def results_table(results: Sequence[RunResult],
                  metric_names: Sequence[str]) -> str:
  """The --compare table: one row per run."""
  header = (["run", "policy", "loss scale"] + list(metric_names)
            + ["skipped steps", "compile (s)", "train time (s)", "explain"])
  rows = []
  for r in results:
    scale = r.mp.scale_type
    if scale != "NoOp":
      scale = f"{scale} ({r.mp.scale_value:g})"
    rows.append([r.label, str(mpolicy.get_policy(r.mp.policy)), scale]
                + [r.metrics[m] for m in metric_names]
                + [r.history.nonfinite_steps, f"{r.compile_time:.1f}",
                   f"{r.train_time:.1f}", r.explain])
  return markdown_table(header, rows)


def print_metrics(result: RunResult) -> None:
  """Prints a run's final metrics, one per line."""
  for name, value in result.metrics.items():
    shown = f"{100 * value:.2f}%" if "accuracy" in name else f"{value:.4f}"
    print(f"[{result.label}] {name}: {shown}")
  print(f"[{result.label}] explain: {result.explain}")


def plot_results(results: Sequence[RunResult], path: str,
                 title: str = "") -> None:
  """Writes a PNG: loss curves (top) and loss scales (bottom) per run."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, (ax_loss, ax_scale) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
  for r in results:
    steps = np.arange(1, len(r.history.loss) + 1)
    ax_loss.plot(steps, r.history.loss, label=r.label, linewidth=1)
    ax_scale.plot(steps, r.history.loss_scale, label=r.label)
  ax_loss.set_ylabel("training loss")
  ax_loss.set_yscale("log")
  ax_loss.legend()
  if title:
    ax_loss.set_title(title)
  ax_scale.set_ylabel("loss scale")
  ax_scale.set_yscale("log", base=2)
  ax_scale.set_xlabel("step")
  ax_scale.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  print(f"Wrote {path}")


def report(results: Sequence[RunResult], metric_names: Sequence[str],
           plot_path: Optional[str], title: str) -> None:
  """Prints each run's metrics, the table if there are several, the plot."""
  for r in results:
    print_metrics(r)
  print()
  print(results_table(results, metric_names))
  if plot_path:
    plot_results(results, plot_path, title)
