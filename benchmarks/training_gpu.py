"""The GPU preset of `bench_training.py` (`--preset=gpu`).

An MLP, a GPT and ResNet50 at real sizes (`--scale=N` divides them for smoke
runs); each variant is initialised, compiled, warmed up, timed and freed on
its own, and reported with its gemm/convolution kernels by dtype (read by
`hlo_kernels`), XLA's temp memory, TFLOP/s, non-finite steps and the final
loss scale. `main(argv)` parses the preset's flags, prints the tables and
returns (and with `--json` writes) the results as data:

  python benchmarks/bench_training.py --preset=gpu --json=gpu.json
  python benchmarks/bench_training.py --preset=gpu --scale=64 --steps=2  # CPU smoke

>>> sorted(GPU_MODELS), GPU_DEFAULT_VARIANTS.split(",")[:3]
(['gpt', 'mlp', 'resnet50'], ['f32', 'jmp', 'mpolicy'])
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys
import time
import traceback
from typing import Any, Callable, Optional

import haiku as hk
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax

import mpolicy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# pylint: disable=g-import-not-at-top,wrong-import-position
import hlo_kernels
import models
from report_util import cpu_info, fmt_ms, fmt_ratio, med, ratio
from training_gpu_variants import (GPU_BF16, GPU_DEFAULT_VARIANTS, GPU_F16,
                                   GPU_FP8, GPU_VARIANTS, GpuVariant,
                                   fp8_unavailable)
# pylint: enable=g-import-not-at-top,wrong-import-position

# The preset's models (one definition each, in models.py).
GpuMLP = models.MLP
GpuGPT = models.GPT


@dataclasses.dataclass
class GpuModel:
  """One model of the GPU preset at a given `--scale`."""
  name: str
  description: str
  model_cls: type           # the class Haiku's jmp policy is set on
  forward: Callable[..., Any]  # batch -> scalar float32 loss
  batch: Any
  has_batchnorm: bool = False


def _gpu_xent(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), labels).mean()


def gpu_mlp(scale: int, seed: int) -> GpuModel:
  batch, features = max(8, 8192 // scale), max(8, 4096 // scale)
  hidden, classes = max(8, 4096 // scale), max(10, 1000 // scale)
  kx, ky = jax.random.split(jax.random.PRNGKey(seed))
  x = jax.random.normal(kx, (batch, features), jnp.float32)
  y = jax.random.randint(ky, (batch,), 0, classes)

  def forward(batch):
    x, y = batch
    return _gpu_xent(GpuMLP([hidden] * 3, classes, name="model")(x), y)

  return GpuModel(
      "mlp", f"MLP {features}-{hidden}x3-{classes}, batch {batch}", GpuMLP,
      forward, (x, y))


def gpu_gpt(scale: int, seed: int) -> GpuModel:
  heads = max(1, 16 // scale)
  d_model = max(8 * heads, 1024 // scale)
  layers, seq = max(1, 8 // scale), max(16, 1024 // scale)
  batch, vocab = max(2, 16 // scale), max(64, 8192 // scale)
  tokens = jax.random.randint(jax.random.PRNGKey(seed), (batch, seq + 1), 0,
                              vocab)

  def forward(tokens):
    logits = GpuGPT(vocab, d_model, heads, layers, name="model")(
        tokens[:, :-1])
    return _gpu_xent(logits, tokens[:, 1:])

  return GpuModel(
      "gpt", f"GPT {layers} layers, d_model {d_model}, {heads} heads, "
      f"seq {seq}, batch {batch}, vocab {vocab}", GpuGPT, forward, tokens)


def gpu_resnet50(scale: int, seed: int) -> GpuModel:
  batch, size = max(2, 128 // scale), max(32, 128 // scale)
  classes = max(10, 1000 // scale)
  kx, ky = jax.random.split(jax.random.PRNGKey(seed))
  images = jax.random.normal(kx, (batch, size, size, 3), jnp.float32)
  labels = jax.random.randint(ky, (batch,), 0, classes)
  if scale == 1:
    model_cls, desc = hk.nets.ResNet50, "ResNet50"
    make = lambda: hk.nets.ResNet50(classes, name="model")
  else:
    # Smoke sizes: ResNet50's layout with 1/scale of its channels (and one
    # block per group from scale 8 on, to keep compiles short).
    blocks = (3, 4, 6, 3) if scale < 8 else (1, 1, 1, 1)
    channels = tuple(max(8, c // scale) for c in (256, 512, 1024, 2048))
    first = max(4, 64 // scale)
    model_cls = hk.nets.ResNet
    desc = f"ResNet (bottleneck, blocks {blocks}, channels {channels})"
    make = lambda: hk.nets.ResNet(
        blocks, classes, channels_per_group=channels,
        initial_conv_config={"output_channels": first}, name="model")

  def forward(batch):
    x, y = batch
    return _gpu_xent(make()(x, is_training=True), y)

  return GpuModel(
      "resnet50", f"{desc}, {size}x{size} images, batch {batch}, "
      f"{classes} classes", model_cls, forward, (images, labels),
      has_batchnorm=True)


GPU_MODELS = {"mlp": gpu_mlp, "gpt": gpu_gpt, "resnet50": gpu_resnet50}


# --- Measurement -------------------------------------------------------------


@dataclasses.dataclass
class GpuResult:
  """What one variant of one model measured."""
  variant: str
  label: str
  status: str = "ok"
  step_s: list = dataclasses.field(default_factory=list)
  compile_s: float = float("nan")
  temp_bytes: Optional[int] = None
  flops: Optional[float] = None
  hlo: Optional[Any] = None        # hlo_kernels.HloStats
  final_loss: float = float("nan")
  nonfinite_steps: int = 0
  final_loss_scale: Optional[float] = None

  def to_dict(self) -> dict[str, Any]:
    median = med(self.step_s)
    return {
        "variant": self.variant, "label": self.label, "status": self.status,
        "step_ms": [x * 1e3 for x in self.step_s],
        "median_step_ms": median * 1e3 if self.step_s else None,
        "compile_s": self.compile_s if np.isfinite(self.compile_s) else None,
        "temp_bytes": self.temp_bytes, "flops": self.flops,
        "tflops_per_s": (self.flops / median / 1e12
                         if self.flops and self.step_s else None),
        "final_loss": (self.final_loss if np.isfinite(self.final_loss)
                       else None),
        "nonfinite_steps": self.nonfinite_steps,
        "final_loss_scale": self.final_loss_scale,
        "hlo": self.hlo.to_dict() if self.hlo is not None else None,
    }


def _flops(compiled) -> Optional[float]:
  try:
    cost = compiled.cost_analysis()
  except Exception:  # pylint: disable=broad-except
    return None
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else None
  value = (cost or {}).get("flops")
  return float(value) if value else None


def _short_error(e: BaseException) -> str:
  lines = [l for l in str(e).splitlines() if l.strip()]
  return f"{type(e).__name__}: {lines[0][:300] if lines else ''}"


def run_gpu_variant(model: GpuModel, variant: GpuVariant, args, log
                    ) -> GpuResult:
  """Compiles, warms up and times one variant; errors end up in `status`."""
  r = GpuResult(variant.key, variant.label)
  try:
    init, loss_fn = variant.loss(model.forward)
    step, opt, loss_scale = variant.step(loss_fn)
    with variant.policy(model):
      params, state = jax.jit(init)(jax.random.PRNGKey(args.seed),
                                    model.batch)
      opt_state = opt.init(params)
      donate = (0, 1, 2, 3) if args.donate else ()
      # The loss scale crosses the jit boundary as its leaves: jmp's
      # DynamicLossScale cannot be rebuilt from the placeholders
      # `jax.jit(f).lower` unflattens it with (its __post_init__ checks the
      # dtype of what it is given).
      scale_leaves, scale_def = jax.tree_util.tree_flatten(loss_scale)

      def flat_step(params, state, opt_state, scale_leaves, batch):
        out = step(params, state, opt_state,
                   jax.tree_util.tree_unflatten(scale_def, scale_leaves), batch)
        return out[:3] + (jax.tree_util.tree_leaves(out[3]),) + out[4:]

      t0 = time.perf_counter()
      compiled = jax.jit(flat_step, donate_argnums=donate).lower(
          params, state, opt_state, scale_leaves, model.batch).compile()
      r.compile_s = time.perf_counter() - t0
    text = compiled.as_text()
    r.hlo = hlo_kernels.hlo_stats(text)
    r.temp_bytes = hlo_kernels.temp_bytes(compiled)
    r.flops = _flops(compiled)
    if args.dump_hlo:
      os.makedirs(args.dump_hlo, exist_ok=True)
      with open(os.path.join(args.dump_hlo,
                             f"{model.name}_{variant.key}.hlo.txt"), "w") as f:
        f.write(text)
    carry = (params, state, opt_state, scale_leaves)
    del params, state, opt_state
    finite_flags, loss = [], None
    for i in range(args.warmup + args.steps):
      t0 = time.perf_counter()
      out = jax.block_until_ready(compiled(*carry, model.batch))
      elapsed = time.perf_counter() - t0
      carry, loss = out[:4], out[4]
      finite_flags.append(out[5])
      if i >= args.warmup:
        r.step_s.append(elapsed)
    r.final_loss = float(loss)
    r.nonfinite_steps = int(sum(not bool(f) for f in
                                jax.device_get(finite_flags)))
    if loss_scale is not None:
      final_scale = jax.tree_util.tree_unflatten(scale_def, carry[3])
      r.final_loss_scale = float(np.asarray(final_scale.loss_scale))
    del carry, out, compiled
  except Exception as e:  # pylint: disable=broad-except
    r.status = f"failed: {_short_error(e)}"
    log(f"  [{model.name}] {variant.key} FAILED:\n"
        + "".join(traceback.format_exception_only(type(e), e)).strip()[:2000])
  log(f"  [{model.name}] {variant.key}: {r.status}"
      + (f", median step {med(r.step_s) * 1e3:.2f} ms" if r.step_s else ""))
  return r


# --- Report ------------------------------------------------------------------


def _mib(n: Optional[int]) -> str:
  return "n/a" if n is None else f"{n / 2**20:.1f}"


def gpu_report(model: GpuModel, results: dict[str, GpuResult]) -> str:
  """Markdown: the table of one model's variants, then kernels per variant."""
  out = [f"### {model.name}: {model.description}", "",
         "| variant | step ms median (IQR) | × f32 | × jmp | TFLOP/s | "
         "compile s | XLA temp MiB | gemm/conv kernels by dtype | "
         "HLO converts | loss after steps | non-finite steps | loss scale |",
         "|" + "---|" * 12]
  f32 = results.get("f32")
  for key, r in results.items():
    if r.status != "ok":
      out.append(f"| {r.label} | {r.status} |" + " |" * 10)
      continue
    base = results.get(GPU_VARIANTS[key].baseline)
    vs_f32 = ratio(r.step_s, f32.step_s) if f32 else float("nan")
    vs_jmp = ratio(r.step_s, base.step_s) if base else float("nan")
    jmp_col = fmt_ratio(vs_jmp)
    if base is not None and base.variant != "jmp" and jmp_col != "-":
      jmp_col += f" (vs {base.variant})"
    tflops = (f"{r.flops / med(r.step_s) / 1e12:.3g}"
              if r.flops and r.step_s else "n/a")
    scale = "-" if r.final_loss_scale is None else f"{r.final_loss_scale:g}"
    out.append(
        f"| {r.label} | {fmt_ms(r.step_s)} | {fmt_ratio(vs_f32)} | "
        f"{jmp_col} | {tflops} | {r.compile_s:.1f} | {_mib(r.temp_bytes)} | "
        f"{hlo_kernels.format_counter(r.hlo.kernel_dtypes(), 6)} | "
        f"{r.hlo.converts} | {r.final_loss:.4g} | {r.nonfinite_steps} | "
        f"{scale} |")
  out.append("")
  for key, r in results.items():
    if r.hlo is not None:
      out.append(f"- **{key}** kernels: "
                 f"{hlo_kernels.format_counter(r.hlo.kernels, 20)}; "
                 f"converts {hlo_kernels.format_counter(r.hlo.convert_pairs, 6)}"
                 f"; {r.hlo.fusions} fusions, {r.hlo.instructions} instrs")
  out.append("")
  return "\n".join(out)


def _cpu_flags() -> str:
  cpu, flags = cpu_info()
  wanted = sorted(f for f in flags if f.startswith(("amx", "avx512")) or
                  "bf16" in f or f in ("avx2", "fma", "f16c"))
  return f"CPU {cpu}, {os.cpu_count()} cores, flags: {' '.join(wanted) or 'n/a'}"


def gpu_header() -> dict[str, Any]:
  """Device and versions, as data (also printed)."""
  dev = jax.devices()[0]
  header = {
      "device": f"{dev.platform}: {getattr(dev, 'device_kind', '?')} "
                f"(x{jax.device_count()})",
      "platform": dev.platform,
      "jax": jax.__version__,
      "jaxlib": getattr(getattr(jax, "lib", None), "__version__", None) or
                __import__("jaxlib").__version__,
      "haiku": hk.__version__, "optax": optax.__version__,
      "jmp": getattr(jmp, "__version__", "?"),
      "python": platform.python_version(),
      "date": datetime.datetime.now().isoformat(timespec="seconds"),
      "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
  }
  if dev.platform == "cpu":
    header["cpu"] = _cpu_flags()
  return header


def main(argv) -> dict[str, Any]:
  """The GPU preset: parses its own flags, runs, prints, writes --json."""
  parser = argparse.ArgumentParser(
      prog="bench_training.py --preset=gpu",
      description="Mixed-precision training steps at real sizes: f32, "
      "hand-written Haiku+jmp, mpolicy.transform_amp, mpolicy.amp, float16 "
      "with dynamic loss scaling (and fp8 with --fp8).")
  parser.add_argument("--models", default="mlp,gpt,resnet50",
                      help=f"comma-separated, from {', '.join(GPU_MODELS)}")
  parser.add_argument("--variants", default=GPU_DEFAULT_VARIANTS,
                      help=f"comma-separated, from {', '.join(GPU_VARIANTS)}")
  parser.add_argument("--fp8", action="store_true",
                      help="add the fp8 variant (c=f8); skipped with a note if "
                      "this mpolicy has no fp8 policies")
  parser.add_argument("--steps", type=int, default=20,
                      help="timed steps per variant (default 20)")
  parser.add_argument("--warmup", type=int, default=3,
                      help="untimed steps before timing (default 3)")
  parser.add_argument("--scale", type=int, default=1,
                      help="divide batch, width, sequence and image sizes by "
                      "this (e.g. 16-64 for a smoke run on CPU)")
  parser.add_argument("--donate", action=argparse.BooleanOptionalAction,
                      default=True, help="donate params/state to the step")
  parser.add_argument("--json", default=None, metavar="PATH",
                      help="also write all results as JSON here")
  parser.add_argument("--dump-hlo", default=None, metavar="DIR",
                      help="write each variant's optimized HLO text to DIR")
  parser.add_argument("--out", default=None, help="also write markdown here")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  if args.scale < 1:
    parser.error(f"--scale must be a positive integer divisor, got {args.scale}")
  if args.steps < 1 or args.warmup < 0:
    parser.error("--steps must be >= 1 and --warmup >= 0, got "
                 f"{args.steps} and {args.warmup}")
  model_names = [m.strip() for m in args.models.split(",") if m.strip()]
  for m in model_names:
    if m not in GPU_MODELS:
      parser.error(f"--models: unknown model {m!r}; choose from "
                   f"{', '.join(GPU_MODELS)}")
  keys = [v.strip() for v in args.variants.split(",") if v.strip()]
  for k in keys:
    if k not in GPU_VARIANTS:
      parser.error(f"--variants: unknown variant {k!r}; choose from "
                   f"{', '.join(GPU_VARIANTS)}")
  if args.fp8 and "fp8" not in keys:
    keys.append("fp8")

  def log(msg):
    print(msg, file=sys.stderr, flush=True)

  header = gpu_header()
  notes = []
  if "fp8" in keys:
    why = fp8_unavailable()
    if why:
      keys.remove("fp8")
      notes.append(f"fp8 variant skipped: {why}")
  lines = ["## mpolicy training-step benchmark, GPU preset", ""]
  lines.append(" | ".join(f"{k}: {v}" for k, v in header.items() if v))
  lines.append("")
  lines.append(
      f"Policies: bf16 `{GPU_BF16}`, f16 `{GPU_F16}` (dynamic loss scale from "
      f"2^15), fp8 `{GPU_FP8}`; ResNet BatchNorm `p=f32,c=f32,o=<compute>` in "
      f"the jmp and mpolicy variants. optax.adam, jitted step"
      f"{' with donated buffers' if args.donate else ''}; median of "
      f"{args.steps} steps after {args.warmup} warm-up, each "
      f"`block_until_ready`-ed; --scale {args.scale}.")
  lines += [f"Note: {n}" for n in notes] + [""]
  print("\n".join(lines), flush=True)
  for n in notes:
    log(f"NOTE: {n}")
  data = {"preset": "gpu", "header": header, "notes": notes,
          "args": {k: v for k, v in vars(args).items()}, "models": {}}
  sections = list(lines)
  for name in model_names:
    try:
      model = GPU_MODELS[name](args.scale, args.seed)
    except Exception as e:  # pylint: disable=broad-except
      log(f"== {name}: could not be built: {_short_error(e)}")
      data["models"][name] = {"status": f"failed: {_short_error(e)}"}
      continue
    log(f"== {model.name}: {model.description}")
    assert mpolicy.current_policy() is None
    results = {}
    for k in keys:
      results[k] = run_gpu_variant(model, GPU_VARIANTS[k], args, log)
    text = gpu_report(model, results)
    print(text, flush=True)
    sections.append(text)
    data["models"][name] = {
        "description": model.description,
        "variants": {k: r.to_dict() for k, r in results.items()}}
    del model
  if args.json:
    with open(args.json, "w") as f:
      json.dump(data, f, indent=1, default=str)
    log(f"wrote {args.json}")
  if args.out:
    with open(args.out, "w") as f:
      f.write("\n".join(sections) + "\n")
  return data

