"""What the precision debugger costs, against one training step, on the GPT.

The GPT of `bench_training.py`'s CPU preset (the examples' transformer
without `hk.remat`: 2 layers, d_model 256, 4 heads, seq 128, batch 16,
vocab 256) under `p=f32,c=f16,o=f32` with LayerNorm in float32, trained
by a jitted `mpolicy.make_train_step` (adam, a static loss scale). In one
process, in this order:

  step             the training step: its first call (trace, compile, run)
                   and then its steady time (median of --steps);
  locate, finite   `locate_nonfinite` on a finite batch (it returns None);
  locate, skipped  `locate_nonfinite` on the same batch with a loss scale
                   of 2**30, where the float16 backward pass overflows (a
                   step the training loop skips), float32 check included;
  shadow           `compare_to_float32` on the batch.

Each debugger call is timed cold (its first call in the process: JAX
compiles each primitive it dispatches once per shape) and warm (later
calls, median of --repeats). Times are process CPU time (all threads),
with the wall time beside; ratios are against the step measured in the
same run. Steps that do not call the debugger are unchanged: it adds
nothing to a compiled step.

Usage:

  python benchmarks/bench_debugging.py                 # the CPU preset
  python benchmarks/bench_debugging.py --quick         # smoke run (1 layer, small)
  python benchmarks/bench_debugging.py --layers=4 --repeats=5
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# pylint: disable=g-import-not-at-top,wrong-import-position
import mpolicy
import models
import report_util
# pylint: enable=g-import-not-at-top,wrong-import-position

POLICY = "p=f32,c=f16,o=f32"


def _timed(fn):
  """``(result, process seconds, wall seconds)`` of ``fn()``."""
  cpu, wall = time.process_time(), time.perf_counter()
  out = jax.block_until_ready(fn())
  return out, time.process_time() - cpu, time.perf_counter() - wall


def _tokens(batch: int, seq: int, vocab: int, seed: int) -> jax.Array:
  """Learnable synthetic sequences, as `bench_training.py` makes them."""
  rng = np.random.default_rng(seed)
  a = rng.integers(1, 8, size=(batch, 1)) * 2 + 1
  b = rng.integers(0, vocab, size=(batch, 1))
  toks = np.empty((batch, seq + 1), np.int64)
  toks[:, :1] = rng.integers(0, vocab, size=(batch, 1))
  for i in range(seq):
    toks[:, i + 1:i + 2] = (a * toks[:, i:i + 1] + b) % vocab
  return jnp.asarray(toks.astype(np.int32))


def run(layers: int, d_model: int, seq: int, batch: int, steps: int,
        repeats: int, seed: int = 0) -> dict:
  """Times the step and the debugger; returns the rows of the report."""
  vocab, heads = 256, 4
  tokens = _tokens(batch, seq, vocab, seed)
  with mpolicy.push_policy(hk.Module, POLICY), \
      mpolicy.push_policy(hk.LayerNorm, "full"):
    model = mpolicy.transform_amp(
        lambda t: models.GPT(vocab, d_model, heads, layers, name="gpt")(t))
    params = model.init(jax.random.PRNGKey(seed), tokens[:, :-1])

    def loss_fn(p, toks):
      logits = model.apply(p, None, toks[:, :-1]).astype(jnp.float32)
      return optax.softmax_cross_entropy_with_integer_labels(
          logits, toks[:, 1:]).mean()

    opt = optax.adam(1e-3)
    step = jax.jit(mpolicy.make_train_step(loss_fn, opt,
                                           attribute_overflow=True))
    opt_state = opt.init(params)
    scale = mpolicy.StaticLossScale(2.0 ** 10)
    rows: dict[str, dict[str, list]] = {}

    def record(name, kind, fn):
      out, cpu, wall = _timed(fn)
      rows.setdefault(name, {}).setdefault(kind, []).append((cpu, wall))
      return out

    out = record("step", "first", lambda: step(params, opt_state, scale,
                                               tokens))
    assert bool(out.grads_finite), "the preset's step is not finite"
    for _ in range(steps):
      record("step", "warm", lambda: step(params, opt_state, scale, tokens))
    calls = {
        "locate, finite": lambda: mpolicy.locate_nonfinite(
            loss_fn, params, tokens, loss_scale=scale),
        "locate, skipped": lambda: mpolicy.locate_nonfinite(
            loss_fn, params, tokens,
            loss_scale=mpolicy.StaticLossScale(2.0 ** 30)),
        "shadow": lambda: mpolicy.compare_to_float32(loss_fn, params, tokens),
    }
    results = {}
    for name, fn in calls.items():
      results[name] = record(name, "first", fn)
    for _ in range(repeats):
      for name, fn in calls.items():
        record(name, "warm", fn)
    skipped = step(params, opt_state, mpolicy.StaticLossScale(2.0 ** 30),
                   tokens)
  assert results["locate, finite"] is None
  assert results["locate, skipped"] is not None
  assert not bool(skipped.grads_finite)
  return {"rows": rows, "report": results["locate, skipped"],
          "skipped_params": len(skipped.nonfinite_paths()),
          "shadow": results["shadow"]}


def report(result: dict, title: str) -> str:
  rows = result["rows"]
  step_first = [c for c, _ in rows["step"]["first"]]
  step_warm = [c for c, _ in rows["step"]["warm"]]
  lines = [f"### {title}", "",
           "| | first call: CPU s (wall s) | later calls: CPU s (wall s) | "
           "first ÷ step's first call | later ÷ step |",
           "|---|---|---|---|---|"]
  for name, kinds in rows.items():
    first, warm = kinds.get("first", []), kinds.get("warm", [])
    lines.append(
        f"| {name} | {report_util.fmt_s([c for c, _ in first])} "
        f"({report_util.fmt_s([w for _, w in first])}) | "
        f"{report_util.fmt_s([c for c, _ in warm])} "
        f"({report_util.fmt_s([w for _, w in warm])}) | "
        f"{report_util.fmt_ratio(report_util.ratio([c for c, _ in first], step_first))} | "
        f"{report_util.fmt_ratio(report_util.ratio([c for c, _ in warm], step_warm))} |")
  lines += ["", f"The skipped step: {result['skipped_params']} parameters' "
            "gradients not finite (`nonfinite_paths`); `locate_nonfinite`:",
            "", "> " + str(result["report"]), ""]
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--quick", action="store_true",
                      help="smoke run: 1 layer, d_model 64, seq 32, batch 4")
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--d_model", type=int, default=256)
  parser.add_argument("--seq", type=int, default=128)
  parser.add_argument("--batch", type=int, default=16)
  parser.add_argument("--steps", type=int, default=10,
                      help="steady steps timed after the first")
  parser.add_argument("--repeats", type=int, default=3,
                      help="warm calls of each debugger function")
  args = parser.parse_args(argv)
  if args.quick:
    args.layers, args.d_model, args.seq, args.batch = 1, 64, 32, 4
    args.steps, args.repeats = 3, 1
  print(f"CPU: {report_util.cpu_info()[0]} ({os.cpu_count()} logical cores)"
        f" | jax {jax.__version__} | {datetime.date.today().isoformat()} | "
        f"loadavg at start {report_util.loadavg()}")
  result = run(args.layers, args.d_model, args.seq, args.batch, args.steps,
               args.repeats)
  print(report(result, f"GPT: {args.layers} layers, d_model {args.d_model}, "
                        f"seq {args.seq}, batch {args.batch}, {POLICY}"))
  print(result["shadow"])


if __name__ == "__main__":
  main()
