"""Does a model train as well as in float32? Every format, five models.

Trains each model of `fidelity_models.py` on the same seeds and batches
under each format (the flag's spellings):

  f32    float32 throughout ('full'), Adam;
  bf16   p=f32,c=bf16,o=f32 (norms in float32);
  f16    p=f32,c=f16,o=f32, a dynamic loss scale (2**15), and the float32
         islands `mpolicy.suggest_policy` finds at the first step;
  fp8    c=f8, per-row scaling, every weight matmul (min_size=0);
  mxfp8  c=mxfp8, every weight matmul;
  nvfp4  c=nvfp4, the recipe's defaults, the first and last layers in bf16;
  int8   c=int8 (quantization-aware), every weight matmul;
  adam6  bf16 compute, bf16 params with stochastic rounding, bf16 moments;
  adam8  the same moments, bf16 params over an exact float32 master kept as
         16 low bits (`master_weights(..., storage="low_bits")`).

Per run: the held-out metrics, the share of matmul FLOPs (dot_general and
convolutions of the forward pass, each counted in the dtype or format
`mpolicy.explain` says it ran in) narrower than float32 (`low_flops`) and
in the format itself (`format_flops`), the skipped (non-finite) steps and
the process CPU seconds. Prints `CELL <model> <format> <seed>
<metric>=<value>` per run and metric, then per model and format the mean,
the spread over seeds (max - min), the gap to f32 and whether the cell is
outside one f32 spread.

  python benchmarks/fidelity.py --steps=300 --seeds=0,1,2 \\
      --csv=docs/fidelity.csv --plot=docs/fidelity.png
"""

from __future__ import annotations

import contextlib
import csv
import datetime
import os
import sys
import time

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# pylint: disable=g-import-not-at-top,wrong-import-position
import fidelity_models
import report_util

import mpolicy

BF16 = "p=f32,c=bf16,o=f32"
POLICIES = {
    "f32": "p=f32,c=f32,o=f32", "bf16": BF16, "f16": "p=f32,c=f16,o=f32",
    "fp8": "p=f32,c=f8,o=f32", "mxfp8": "p=f32,c=mxfp8,o=f32",
    "nvfp4": "p=f32,c=nvfp4,o=f32", "int8": "p=f32,c=int8,o=f32",
    "adam6": BF16, "adam8": BF16}
FORMATS = tuple(POLICIES)
# What `explain` says a matmul of the format ran in.
RAN_IN = {"bf16": ("bfloat16",), "f16": ("float16",),
          "fp8": ("float8_e4m3fn", "float8_e5m2"), "mxfp8": ("mxfp8",),
          "nvfp4": ("nvfp4",), "int8": ("int8",), "adam6": ("bfloat16",),
          "adam8": ("bfloat16",)}
MATMULS = ("dot_general", "conv_general_dilated")

FLAGS = flags.FlagValues()
flags.DEFINE_list("models", list(fidelity_models.NAMES),
                  f"Models to train, of {fidelity_models.NAMES}.",
                  flag_values=FLAGS)
flags.DEFINE_list("formats", None, f"Formats, of {FORMATS} (default: every "
                  "one this mpolicy has).", flag_values=FLAGS)
flags.DEFINE_list("seeds", ["0", "1", "2"], "Seeds (init and batches).",
                  flag_values=FLAGS)
flags.DEFINE_integer("steps", 300, "Training steps per run.",
                     flag_values=FLAGS)
flags.DEFINE_string("csv", None, "Write every run here: model,format,seed,"
                    "steps,metric,value.", flag_values=FLAGS)
flags.DEFINE_string("plot", None, "Write the plot here (PNG).",
                    flag_values=FLAGS)
flags.DEFINE_list("from_csv", [], "Train nothing: read the runs from these "
                  "CSV files (written by --csv) for the table and the plot.",
                  flag_values=FLAGS)
flags.register_validator(
    "models", lambda v: bool(v) and set(v) <= set(fidelity_models.NAMES),
    f"--models must be a comma-separated subset of {fidelity_models.NAMES}.",
    flag_values=FLAGS)
flags.register_validator(
    "formats", lambda v: v is None or (bool(v) and set(v) <= set(FORMATS)),
    f"--formats must be a comma-separated subset of {FORMATS}.",
    flag_values=FLAGS)
flags.register_validator(
    "seeds", lambda v: bool(v) and all(s.isdigit() for s in v),
    "--seeds must be comma-separated non-negative integers.",
    flag_values=FLAGS)
flags.register_validator("steps", lambda v: v >= 1,
                         "--steps must be at least 1.", flag_values=FLAGS)


def check_format(fmt: str) -> None:
  """Raises a ValueError where this mpolicy cannot run `fmt`."""
  if fmt == "int8":
    try:
      mpolicy.get_policy("c=int8")
    except ValueError as e:
      raise ValueError(
          "this mpolicy has no int8: mpolicy.get_policy('c=int8') fails "
          f"({e}); leave int8 out of --formats") from e


def available() -> list:
  """The formats this mpolicy can run."""
  found = []
  for fmt in FORMATS:
    try:
      check_format(fmt)
      found.append(fmt)
    except ValueError:
      pass
  return found


def read_csv(paths) -> tuple:
  """`(results, models, formats, seeds, steps)` of CSV files --csv wrote."""
  results, models, formats, seeds, steps = {}, [], [], [], set()
  for path in paths:
    with open(path, newline="") as f:
      for row in csv.DictReader(f):
        key = (row["model"], row["format"], int(row["seed"]))
        results.setdefault(key, {})[row["metric"]] = float(row["value"])
        steps.add(int(row["steps"]))
        for seen, item in zip((models, formats, seeds), key):
          if item not in seen:
            seen.append(item)
  return results, models, formats, seeds, sorted(steps)


def rules(fmt: str) -> mpolicy.OpRules:
  if fmt == "fp8":
    return mpolicy.DEFAULT_RULES.with_fp8(min_size=0, scaling="per_row")
  if fmt in ("mxfp8", "nvfp4", "int8"):
    return mpolicy.DEFAULT_RULES.with_fp8(min_size=0)
  return mpolicy.DEFAULT_RULES


@contextlib.contextmanager
def registry(task, fmt: str, suggestion=None):
  """The registry entries of a run (policies are read when a step traces)."""
  with contextlib.ExitStack() as stack:
    if suggestion is not None:
      stack.enter_context(suggestion.apply())
    elif task.root is not None:
      stack.enter_context(mpolicy.push_policy(task.root, POLICIES[fmt]))
    for key in task.full if fmt != "f32" else ():
      stack.enter_context(mpolicy.push_policy(key, "full"))
    for pattern in task.first_last if fmt == "nvfp4" else ():
      stack.enter_context(mpolicy.push_policy(pattern, BF16))
    yield


def optimizer(fmt: str, learning_rate: float, params32):
  """`(tx for make_train_step, param_rounding, params, opt_state)`."""
  adam = optax.adam(learning_rate)
  if fmt not in ("adam6", "adam8"):
    return adam, "nearest", params32, adam.init(params32)
  half = mpolicy.with_state_dtypes(adam, jnp.bfloat16, rounding="stochastic")
  if fmt == "adam8":
    params, state = mpolicy.init_master_weights(
        mpolicy.master_weights(half, storage="low_bits"), params32,
        jnp.bfloat16)
    return half, "low_bits", params, state
  params = jax.tree_util.tree_map(lambda p: p.astype(jnp.bfloat16), params32)
  return (half, "stochastic", params,
          mpolicy.stochastic_params(half).init(params))


def _jaxprs(value):
  """The jaxprs in an equation's parameter (a jaxpr, closed or not, or a
  tuple of them)."""
  for v in value if isinstance(value, (tuple, list)) else (value,):
    inner = getattr(v, "jaxpr", v)
    if hasattr(inner, "eqns"):
      yield inner


def matmul_flops(jaxpr) -> list:
  """FLOPs of each dot_general and convolution, in program order."""
  out = []
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name in MATMULS:
      lhs, rhs = (v.aval for v in eqn.invars)
      res = eqn.outvars[0].aval
      if name == "dot_general":
        (_, contract), (_, batch) = eqn.params["dimension_numbers"]
        free = [n for i, n in enumerate(rhs.shape)
                if i not in contract and i not in batch]
        out.append(2 * int(np.prod(lhs.shape)) * int(np.prod(free)))
      else:
        features = rhs.shape[eqn.params["dimension_numbers"].rhs_spec[0]]
        out.append(2 * int(np.prod(res.shape)) * int(np.prod(rhs.shape))
                   // features)
    for value in eqn.params.values():
      for inner in _jaxprs(value):
        out.extend(matmul_flops(inner))
  return out


def flop_shares(fmt, forward, forward32, params, params32, state, x):
  """`(low, in the format)`: shares of the forward pass's matmul FLOPs."""
  ran = [r.ran_in for r in mpolicy.explain(forward, params, state, x).rows
         if r.primitive in MATMULS]
  flops = matmul_flops(jax.make_jaxpr(forward32)(params32, state, x).jaxpr)
  if len(ran) != len(flops):
    raise RuntimeError(f"explain gives {len(ran)} matmuls, the float32 "
                       f"program {len(flops)}: the counts cannot be paired")
  total = sum(flops)
  low = sum(f for f, r in zip(flops, ran) if r not in ("float32", "float64"))
  own = sum(f for f, r in zip(flops, ran) if r in RAN_IN.get(fmt, ()))
  return low / total, own / total


def run(task, data, fmt: str, seed: int, steps: int) -> dict:
  """Trains `task` under `fmt` on `seed`; returns its metrics."""
  start = time.process_time()
  check_format(fmt)
  params32, state = task.init(data, seed)
  batches = task.batches(data, seed, steps)
  policy = None if task.root is not None else POLICIES[fmt]
  amp = lambda training: mpolicy.amp(
      lambda p, s, x: task.apply(p, s, x, training), policy, rules=rules(fmt))
  forward = amp(True)

  def loss_fn(params, state, x, y, *, step=None):
    # make_train_step passes the optimizer's count: the NVFP4 recipe's keys.
    at_step = forward if step is None else forward.at_step(step)
    out, state = at_step(params, state, x)
    return task.loss(out, y), state

  loss_scale = (mpolicy.DynamicLossScale(jnp.float32(2.0**15))
                if fmt == "f16" else mpolicy.NoOpLossScale())
  suggestion = None
  if fmt == "f16":
    with registry(task, fmt):
      suggestion = mpolicy.suggest_policy(
          lambda p: loss_fn(p, state, *batches[0])[0], params32,
          policy=POLICIES[fmt], tolerance=0.1, max_evals=6,
          loss_scale=loss_scale)
  tx, rounding, params, opt_state = optimizer(fmt, task.learning_rate,
                                              params32)
  step = jax.jit(mpolicy.make_train_step(loss_fn, tx, has_state=True,
                                         param_rounding=rounding))
  skipped = 0
  with registry(task, fmt, suggestion):
    for x, y in batches:
      out = step(params, state, opt_state, loss_scale, x, y)
      params, state, opt_state = out.params, out.model_state, out.opt_state
      loss_scale = out.loss_scale
      skipped += int(not bool(out.grads_finite))
    x_test, y_test = task.test(data)
    metrics = task.evaluate(jax.jit(amp(False))(params, state, x_test)[0],
                            y_test)
    low, own = flop_shares(
        fmt, forward, lambda p, s, x: task.apply(p, s, x, True), params,
        params32, state, x_test[:8])
  metrics.update(low_flops=100 * low, format_flops=100 * own,
                 skipped=skipped, cpu_s=time.process_time() - start)
  if suggestion is not None:
    metrics["islands"] = len(suggestion.float32_paths)
  return metrics


def _runs(results: dict, model: str, fmt: str, seeds) -> list:
  """The metrics of the seeds that ran (a table may be partial)."""
  return [results[(model, fmt, s)] for s in seeds
          if (model, fmt, s) in results]


def table(results: dict, models, formats, seeds) -> str:
  """Per model and format: mean, spread, gap to f32, outside f32's spread."""
  lines = ["| model | format | metric | mean | spread | gap to f32 | outside "
           "f32 spread | matmul FLOPs in low precision % | in the format % "
           "| skipped | seeds | CPU s |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for model in models:
    metric = fidelity_models.task(model).metric
    base = [r[metric] for r in _runs(results, model, "f32", seeds)]
    for fmt in formats:
      runs = _runs(results, model, fmt, seeds)
      if not runs:
        lines.append(f"| {model} | {fmt} | {metric} | not run |" + " |" * 8)
        continue
      got = [r[metric] for r in runs]
      gap = outside = "-"
      if base and fmt != "f32":
        diff = np.mean(got) - np.mean(base)
        gap = f"{diff:+.4f}"
        outside = "yes" if abs(diff) > np.ptp(base) else "no"
      lines.append(
          f"| {model} | {fmt} | {metric} | {np.mean(got):.4f} | "
          f"{np.ptp(got):.4f} | {gap} | {outside} | "
          f"{np.mean([r['low_flops'] for r in runs]):.1f} | "
          f"{np.mean([r['format_flops'] for r in runs]):.1f} | "
          f"{sum(r['skipped'] for r in runs):.0f} | {len(runs)} | "
          f"{sum(r['cpu_s'] for r in runs):.0f} |")
  return "\n".join(lines)


def targets(results: dict, models, formats, seeds) -> str:
  """The targets: mxfp8 against bf16 on the held-out loss; f16's skipped
  steps and half FLOPs."""
  lines = []
  for model in models:
    runs = {fmt: _runs(results, model, fmt, seeds) for fmt in formats}
    some = next(iter(r for r in runs.values() if r), [{}])[0]
    metric = ("test_loss" if "test_loss" in some
              else fidelity_models.task(model).metric)
    ran = [r for rs in runs.values() for r in rs]
    lines.append(f"{model}: {len(ran)} runs, "
                 f"{sum(r['cpu_s'] for r in ran):.0f} CPU s in all")
    if runs.get("mxfp8") and runs.get("bf16"):
      gap = (np.mean([r[metric] for r in runs["mxfp8"]])
             - np.mean([r[metric] for r in runs["bf16"]]))
      lines.append(f"{model}: mxfp8 - bf16 {metric} {gap:+.4f}")
    if runs.get("f16"):
      f16 = runs["f16"]
      lines.append(
          f"{model}: f16 skipped {sum(r['skipped'] for r in f16):.0f} steps, "
          f"half matmul FLOPs {min(r['low_flops'] for r in f16):.1f}% "
          f"(the least of the seeds), islands "
          f"{max(r.get('islands', 0) for r in f16):.0f} (the most)")
  return "\n".join(lines)


def plot(results: dict, models, formats, seeds, path: str, title: str) -> None:
  """Per model: each seed's metric per format, its mean, f32's range."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, axes = plt.subplots(1, len(models), figsize=(2.6 * len(models), 2.8),
                           squeeze=False)
  for ax, model in zip(axes[0], models):
    metric = fidelity_models.task(model).metric
    for i, fmt in enumerate(formats):
      got = [r[metric] for r in _runs(results, model, fmt, seeds)]
      if got:
        ax.plot([i] * len(got), got, "o", ms=3, color="C0")
        ax.plot([i], [np.mean(got)], "_", ms=10, color="k")
    base = [r[metric] for r in _runs(results, model, "f32", seeds)]
    if base:
      ax.axhspan(min(base), max(base), color="C1", alpha=0.3)
    ax.set_xticks(range(len(formats)), formats, rotation=90, fontsize=7)
    ax.set_title(f"{model}: {metric}", fontsize=8)
    ax.tick_params(labelsize=7)
  fig.suptitle(f"{title}; dots: seeds, bar: mean, band: f32's range",
               fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=70)


def main(argv) -> int:
  try:
    FLAGS.unparse_flags()  # A second main() in one process starts afresh.
    FLAGS(argv)
    for fmt in FLAGS.formats or ():
      check_format(fmt)
  except (flags.Error, ValueError) as e:
    print(f"fidelity.py: {e}\nusage: python benchmarks/fidelity.py "
          "[--models=...] [--formats=...] [--seeds=0,1,2] [--steps=N] "
          "[--csv=PATH] [--plot=PATH]", file=sys.stderr)
    return 2
  if FLAGS.from_csv:
    results, models, formats, seeds, steps = read_csv(FLAGS.from_csv)
    print(f"{len(results)} runs from {', '.join(FLAGS.from_csv)}; steps "
          f"{', '.join(map(str, steps))}")
    print(table(results, models, formats, seeds))
    print(targets(results, models, formats, seeds))
    if FLAGS.plot:
      plot(results, models, formats, seeds, FLAGS.plot,
           f"{'/'.join(map(str, steps))} steps")
    return 0
  seeds = [int(s) for s in FLAGS.seeds]
  formats = FLAGS.formats or available()
  cpu, _ = report_util.cpu_info()
  print(f"{datetime.date.today()} | jax {jax.__version__} | {cpu} | "
        f"{FLAGS.steps} steps", flush=True)
  results, rows = {}, []
  for model in FLAGS.models:
    task = fidelity_models.task(model)
    data = task.load()
    for fmt in formats:
      for seed in seeds:
        metrics = run(task, data, fmt, seed, FLAGS.steps)
        results[(model, fmt, seed)] = metrics
        for name, value in metrics.items():
          print(f"CELL {model} {fmt} {seed} {name}={value:.6g}", flush=True)
          rows.append((model, fmt, seed, FLAGS.steps, name, f"{value:.6g}"))
  print(table(results, FLAGS.models, formats, seeds))
  print(targets(results, FLAGS.models, formats, seeds))
  if FLAGS.csv:
    with open(FLAGS.csv, "w", newline="") as f:
      writer = csv.writer(f)
      writer.writerow(("model", "format", "seed", "steps", "metric", "value"))
      writer.writerows(rows)
  if FLAGS.plot:
    plot(results, FLAGS.models, formats, seeds, FLAGS.plot,
         f"{FLAGS.steps} steps, jax {jax.__version__}, {cpu}, "
         f"{datetime.date.today()}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
