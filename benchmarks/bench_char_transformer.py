r"""Training-loop speed of a char-level transformer under loss scaling settings.

Times the training loop of a character-level transformer LM (d_model 512,
6 pre-LN blocks each under `hk.remat`, 4 heads, seq 256, batch 64, a
96-symbol vocabulary, 150 steps) in these runs:

  f32               policy `full`, no loss scale, no skipping
  f32_dyn_skip      `full`, DynamicLossScale(2^15) + skip_nonfinite
  f16               `p=f32,c=f16,o=f32`, no loss scale, no skipping
  f16_static_skip   f16, StaticLossScale(1024) + skip_nonfinite
  f16_dyn_noskip    f16, DynamicLossScale(2^15), no skipping
  f16_dyn_skip      f16, DynamicLossScale(2^15) + skip_nonfinite
  bf16              `p=f32,c=bf16,o=f32`, no loss scale, no skipping

The model is the examples' `CharTransformer` (`examples/transformer_lm.py`,
imported through `models.py`). The training code is that of a user of
mpolicy: `mpolicy.transform_amp` with the policy pushed on the model class
and `full` on `hk.LayerNorm`; one
`mpolicy.scaled_value_and_grad(..., has_aux=True)` call for the gradients
(with `NoOpLossScale` where there is no scaling); `mpolicy.skip_nonfinite`
around `optax.adam(3e-3)` when skipping, fed the `grads_finite` flag; a
jitted step taking (params, opt_state, loss_scale, batch).

Two timings per run:

  loop steps/s    the training loop a user writes: the batch is cut on the
                  host (numpy) every step and the loss, loss scale and
                  finiteness flag are fetched every step (`jax.device_get`);
                  the first (compiling) step is excluded;
  device steps/s  `--device_steps` more steps on one batch already on the
                  device, dispatched back to back, one `block_until_ready`
                  at the end: the step's own cost without host round trips.

`--hlo_stats` adds, per run, op counts of the step's optimized HLO
(`jax.jit(step).lower(...).compile().as_text()`): converts by dtype pair,
fusions, matmul kernels (dots / cuBLAS calls) by dtype, while loops,
conditionals, and the most common opcodes; plus XLA's temp memory.

Data are synthetic (seeded "words" over the vocabulary); nothing is
downloaded. `--scale=N` divides the width, depth, sequence and batch for a
smoke run (e.g. `--scale=16 --steps=5` runs in seconds on CPU).

Usage:

  python benchmarks/bench_char_transformer.py                 # all 7 runs
  python benchmarks/bench_char_transformer.py --runs=f16,f16_dyn_skip,bf16 \
      --hlo_stats --json=/tmp/char.json
  python benchmarks/bench_char_transformer.py --scale=16 --steps=5 --hlo_stats
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import platform
import sys
import time
from typing import Any

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax

import mpolicy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# pylint: disable=g-import-not-at-top,wrong-import-position
import hlo_kernels
from models import CharTransformer, ModelConfig  # The examples' model.
# pylint: enable=g-import-not-at-top,wrong-import-position

F32, F16, BF16 = "full", "p=f32,c=f16,o=f32", "p=f32,c=bf16,o=f32"
NORM_POLICY = "full"
LEARNING_RATE = 3e-3
DYNAMIC_START = 2.0**15
STATIC_SCALE = 1024.0


@dataclasses.dataclass(frozen=True)
class Run:
  """One training configuration: policy, loss scale and skipping."""
  key: str
  policy: str
  scale_type: str     # "NoOp", "Static" or "Dynamic"
  scale_value: float
  skip_nonfinite: bool

  def loss_scale(self):
    if self.scale_type == "NoOp":
      return mpolicy.NoOpLossScale()
    if self.scale_type == "Static":
      return mpolicy.StaticLossScale(float(self.scale_value))
    return mpolicy.DynamicLossScale(jnp.float32(self.scale_value))


RUNS = {r.key: r for r in [
    Run("f32", F32, "NoOp", 1.0, False),
    Run("f32_dyn_skip", F32, "Dynamic", DYNAMIC_START, True),
    Run("f16", F16, "NoOp", 1.0, False),
    Run("f16_static_skip", F16, "Static", STATIC_SCALE, True),
    Run("f16_dyn_noskip", F16, "Dynamic", DYNAMIC_START, False),
    Run("f16_dyn_skip", F16, "Dynamic", DYNAMIC_START, True),
    Run("bf16", BF16, "NoOp", 1.0, False),
]}


# --- Data ----------------------------------------------------------------------


def synthetic_text(vocab: int, length: int, seed: int) -> np.ndarray:
  """Token ids: seeded random "words" (2-9 symbols) separated by token 0."""
  rng = np.random.default_rng(seed)
  words = [rng.integers(1, vocab, size=rng.integers(2, 10)) for _ in range(500)]
  # Zipf-like word frequencies, so the text has learnable structure.
  p = 1.0 / np.arange(1, len(words) + 1)
  picks = rng.choice(len(words), size=length // 4, p=p / p.sum())
  text = np.concatenate([np.append(words[i], 0) for i in picks])
  return text[:length].astype(np.int32)


def windows(ids: np.ndarray, starts: np.ndarray, seq_len: int) -> np.ndarray:
  """[len(starts), seq_len + 1]: inputs and next-token targets."""
  return ids[starts[:, None] + np.arange(seq_len + 1)]


# --- One run -------------------------------------------------------------------


@dataclasses.dataclass
class Config:
  d_model: int = 512
  num_layers: int = 6
  num_heads: int = 4
  seq_len: int = 256
  batch_size: int = 64
  vocab: int = 96
  steps: int = 150
  device_steps: int = 30
  remat: bool = True
  seed: int = 0

  def scaled(self, scale: int) -> Config:
    if scale == 1:
      return self
    heads = max(1, self.num_heads // scale)
    return dataclasses.replace(
        self, num_heads=heads,
        d_model=max(8 * heads, self.d_model // scale),
        num_layers=max(1, self.num_layers // scale),
        seq_len=max(16, self.seq_len // scale),
        batch_size=max(2, self.batch_size // scale))


def run_one(run: Run, config: Config, text: np.ndarray, args, log
            ) -> dict[str, Any]:
  """Trains `config.steps` steps under `run`; returns timings and stats."""
  result: dict[str, Any] = {"run": run.key, "policy": run.policy,
                            "loss_scale": run.scale_type,
                            "skip_nonfinite": run.skip_nonfinite,
                            "status": "ok"}
  with contextlib.ExitStack() as policies:
    policies.enter_context(mpolicy.push_policy(CharTransformer, run.policy))
    policies.enter_context(mpolicy.push_policy(hk.LayerNorm, NORM_POLICY))

    sizes = ModelConfig(config.seq_len, config.d_model, config.num_heads,
                        config.num_layers, config.remat)

    def forward(tokens):
      return CharTransformer(config.vocab, sizes, name="transformer")(tokens)

    model = mpolicy.transform_amp(forward)

    def lm_loss(params, batch):
      inputs, targets = batch[:, :-1], batch[:, 1:]
      logits = model.apply(params, None, inputs).astype(jnp.float32)
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
      return loss.mean(), (jnp.argmax(logits, -1) == targets).mean()

    rng = np.random.RandomState(config.seed)
    starts = rng.randint(0, len(text) - config.seq_len - 1,
                         size=(config.steps, config.batch_size))
    params = model.init(jax.random.PRNGKey(config.seed),
                        windows(text, starts[0], config.seq_len)[:, :-1])
    tx = optax.adam(LEARNING_RATE)
    if run.skip_nonfinite:
      tx = mpolicy.skip_nonfinite(tx)
    grad_fn = mpolicy.scaled_value_and_grad(lm_loss, has_aux=True)

    def train_step(params, opt_state, loss_scale, batch):
      loss_scale, finite, (loss, _), grads = grad_fn(loss_scale, params, batch)
      extra = dict(grads_finite=finite) if run.skip_nonfinite else {}
      updates, opt_state = tx.update(grads, opt_state, params, **extra)
      return (optax.apply_updates(params, updates), opt_state, loss_scale,
              loss, finite)

    train_step = jax.jit(train_step)
    opt_state, loss_scale = tx.init(params), run.loss_scale()

    if args.hlo_stats:
      batch0 = windows(text, starts[0], config.seq_len)
      t0 = time.perf_counter()
      compiled = train_step.lower(params, opt_state, loss_scale,
                                  batch0).compile()
      result["aot_compile_s"] = time.perf_counter() - t0
      stats = hlo_kernels.hlo_stats(compiled.as_text())
      result["hlo"] = stats.to_dict()
      result["temp_bytes"] = hlo_kernels.temp_bytes(compiled)
      if args.dump_hlo:
        os.makedirs(args.dump_hlo, exist_ok=True)
        with open(os.path.join(args.dump_hlo, f"{run.key}.hlo.txt"), "w") as f:
          f.write(compiled.as_text())
      del compiled

    # The user's loop: host batch, step, fetch loss/scale/flag every step.
    losses, scales, finites = [], [], []
    start = time.perf_counter()
    first = start
    for i in range(config.steps):
      batch = windows(text, starts[i], config.seq_len)
      params, opt_state, loss_scale, loss, finite = train_step(
          params, opt_state, loss_scale, batch)
      loss, scale, finite = jax.device_get(
          (loss, loss_scale.loss_scale, finite))
      losses.append(float(loss))
      scales.append(float(scale))
      finites.append(bool(finite))
      if i == 0:
        first = time.perf_counter()
        result["first_step_s"] = first - start
    end = time.perf_counter()
    result["loop_steps_per_s"] = ((config.steps - 1) / (end - first)
                                  if config.steps > 1 else None)

    # Device-bound: same step, one batch already on the device, no fetches.
    if config.device_steps:
      batch = jnp.asarray(windows(text, starts[-1], config.seq_len))
      carry = (params, opt_state, loss_scale)
      out = jax.block_until_ready(train_step(*carry, batch))  # warm
      carry = out[:3]
      t0 = time.perf_counter()
      for _ in range(config.device_steps):
        out = train_step(*carry, batch)
        carry = out[:3]
      jax.block_until_ready(out)
      result["device_steps_per_s"] = (config.device_steps /
                                      (time.perf_counter() - t0))
  result.update(
      final_loss=float(np.mean(losses[-10:])),
      nonfinite_steps=sum(not f for f in finites),
      final_loss_scale=scales[-1],
      losses=losses, loss_scales=scales)
  log(f"  {run.key}: loop {result['loop_steps_per_s'] or float('nan'):.1f} "
      f"steps/s, device {result.get('device_steps_per_s', float('nan')):.1f} "
      f"steps/s, first step {result['first_step_s']:.1f} s, "
      f"non-finite {result['nonfinite_steps']}, final loss "
      f"{result['final_loss']:.3f}")
  return result


# --- Report --------------------------------------------------------------------


def _f(x, fmt=".1f"):
  return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) \
      else format(x, fmt)


def report(results: list[dict[str, Any]], hlo: bool) -> str:
  base = next((r for r in results if r["run"] == "f32" and r["status"] == "ok"),
              None)
  lines = ["| run | policy | loss scale | skip | loop steps/s | × f32 | "
           "device steps/s | first step s | non-finite steps | final scale | "
           "final loss |", "|" + "---|" * 11]
  for r in results:
    if r["status"] != "ok":
      lines.append(f"| {r['run']} | {r['status']} |" + " |" * 9)
      continue
    ratio = (r["loop_steps_per_s"] / base["loop_steps_per_s"]
             if base and base.get("loop_steps_per_s") and
             r.get("loop_steps_per_s") else None)
    lines.append(
        f"| {r['run']} | `{r['policy']}` | {r['loss_scale']} | "
        f"{'yes' if r['skip_nonfinite'] else 'no'} | "
        f"{_f(r['loop_steps_per_s'])} | {_f(ratio, '.2f')} | "
        f"{_f(r.get('device_steps_per_s'))} | {_f(r['first_step_s'])} | "
        f"{r['nonfinite_steps']} | {r['final_loss_scale']:g} | "
        f"{r['final_loss']:.3f} |")
  if hlo:
    lines += ["", "| run | AOT compile s | HLO instrs | fusions | converts | "
              "while | conditional | custom-call | XLA temp MiB | matmul "
              "kernels by dtype | convert pairs |", "|" + "---|" * 11]
    for r in results:
      h = r.get("hlo")
      if not h:
        continue
      temp = r.get("temp_bytes")
      kernels = ", ".join(f"{n}× {k}" for k, n in sorted(
          h["kernels"].items(), key=lambda kv: -kv[1]))
      pairs = ", ".join(f"{n}× {k}" for k, n in sorted(
          h["convert_pairs"].items(), key=lambda kv: -kv[1]))
      lines.append(
          f"| {r['run']} | {_f(r.get('aot_compile_s'))} | "
          f"{h['instructions']} | {h['fusions']} | "
          f"{h['converts']} | {h['while_loops']} | {h['conditionals']} | "
          f"{h['custom_calls']} | "
          f"{'n/a' if temp is None else f'{temp / 2**20:.1f}'} | "
          f"{kernels or '-'} | {pairs or '-'} |")
    lines.append("")
    for r in results:
      h = r.get("hlo")
      if h:
        top = sorted(h["opcodes"].items(), key=lambda kv: -kv[1])[:12]
        lines.append(f"- {r['run']} opcodes: "
                     + ", ".join(f"{n}× {k}" for k, n in top))
  return "\n".join(lines)


def main(argv=None) -> list[dict[str, Any]]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--runs", default=",".join(RUNS),
                      help=f"comma-separated, from {', '.join(RUNS)}")
  parser.add_argument("--steps", type=int, default=150)
  parser.add_argument("--device_steps", type=int, default=30,
                      help="back-to-back steps on one device batch (0: skip)")
  parser.add_argument("--scale", type=int, default=1,
                      help="divide width, depth, sequence and batch by this")
  parser.add_argument("--remat", action=argparse.BooleanOptionalAction,
                      default=True, help="each block under hk.remat")
  parser.add_argument("--hlo_stats", action="store_true",
                      help="op counts of each run's optimized HLO")
  parser.add_argument("--dump_hlo", default=None, metavar="DIR",
                      help="with --hlo_stats: write each run's HLO text here")
  parser.add_argument("--json", default=None, metavar="PATH",
                      help="also write the results (with per-step losses) here")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  if args.scale < 1:
    parser.error(f"--scale must be a positive integer divisor, got {args.scale}")
  if args.steps < 2:
    parser.error(f"--steps must be at least 2 (the first one compiles), got "
                 f"{args.steps}")
  if args.device_steps < 0:
    parser.error(f"--device_steps must be >= 0, got {args.device_steps}")
  keys = [k.strip() for k in args.runs.split(",") if k.strip()]
  for k in keys:
    if k not in RUNS:
      parser.error(f"--runs: unknown run {k!r}; choose from {', '.join(RUNS)}")
  config = Config(steps=args.steps, device_steps=args.device_steps,
                  remat=args.remat, seed=args.seed).scaled(args.scale)

  def log(msg):
    print(msg, file=sys.stderr, flush=True)

  dev = jax.devices()[0]
  header = (f"device {dev.platform}: {getattr(dev, 'device_kind', '?')} | "
            f"jax {jax.__version__} | python {platform.python_version()} | "
            f"{datetime.datetime.now().isoformat(timespec='seconds')}")
  desc = (f"char transformer: d_model {config.d_model}, {config.num_layers} "
          f"layers, {config.num_heads} heads, seq {config.seq_len}, batch "
          f"{config.batch_size}, vocab {config.vocab}, remat "
          f"{'on' if config.remat else 'off'}; {config.steps} steps (loop), "
          f"{config.device_steps} (device); adam {LEARNING_RATE}; LayerNorm "
          f"policy `{NORM_POLICY}`")
  print(header + "\n" + desc + "\n", flush=True)
  text = synthetic_text(config.vocab, 1 << 20, config.seed)
  results = []
  for k in keys:
    try:
      results.append(run_one(RUNS[k], config, text, args, log))
    except Exception as e:  # pylint: disable=broad-except
      first = (str(e).splitlines() or [""])[0][:300]
      log(f"  {k} FAILED: {type(e).__name__}: {first}")
      results.append({"run": k, "status": f"failed: {type(e).__name__}: "
                      f"{first}"})
  print(report(results, args.hlo_stats), flush=True)
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"header": header, "config": dataclasses.asdict(config),
                 "results": results}, f, indent=1, default=str)
    log(f"wrote {args.json}")
  return results


if __name__ == "__main__":
  main()
