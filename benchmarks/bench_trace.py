"""Trace, lower and compile time of a deep Python-loop GPT, against jmp.

A GPT built from a Python loop of Haiku layers (`models.GPT`: d_model 512,
8 heads, seq 256, batch 4, vocab 8192 unless flags say otherwise), a jitted
Adam step, four ways:

  float32      `hk.transform`, no policy;
  jmp          Haiku + jmp bf16 (`hk.mixed_precision.set_policy` on the model);
  transform_amp  `mpolicy.transform_amp` with `set_policy(hk.Module, bf16)`;
  amp(apply)   `mpolicy.amp` over a plain `hk.transform`'s apply.

Each run clears JAX's caches and builds a fresh step, then times
`jax.jit(step).trace(...)`, `.lower()` and `.compile()` separately, in
process CPU time (`time.process_time`: what a shared machine's other work
does not add) next to wall time; the variants are interleaved within each
repeat so machine noise hits them alike. Ratios to jmp are taken within
each repeat (same depth, measured moments apart) and reported as the
median and the range over repeats. Per variant it also prints the jaxpr's
equation count (sub-jaxprs included), the number of `Primitive.bind` calls
during one trace, the optimized HLO's instruction count, XLA's temp memory,
and the trace + lower CPU time per layer (the difference between the
shallowest and the deepest model divided by the layers added).

  python benchmarks/bench_trace.py                   # 12 and 24 layers
  python benchmarks/bench_trace.py --layers=12,24,48 --repeats=3 --no_compile
  python benchmarks/bench_trace.py --layers=2,4 --repeats=1 --d_model=64 \
      --seq=32 --vocab=256                           # a smoke run
  python benchmarks/bench_trace.py --acceptance      # the target's check

``--acceptance`` is ``--layers=24,48 --repeats=5 --no_compile
--variants=jmp,transform_amp,amp(apply)`` (unless those flags are given
too) and ends with one line per variant and depth saying whether the
median trace + lower CPU time is at most jmp's.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
import time
from typing import Any, Callable

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
import report_util
import training_cpu

POLICY = "p=f32,c=bf16,o=f32"
VARIANTS = ("float32", "jmp", "transform_amp", "amp(apply)")
# What `--acceptance` sets (flags given on the command line win).
ACCEPTANCE = {"layers": "24,48", "repeats": 5, "no_compile": True,
              "variants": "jmp,transform_amp,amp(apply)"}


def make_loss(variant: str, config: argparse.Namespace, layers: int):
  """`(init, loss(params, tokens), policy context)` for one variant."""

  def forward(tokens):
    logits = models.GPT(config.vocab, config.d_model, config.heads, layers,
                        name="gpt")(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), tokens[:, 1:]).mean()

  if variant == "transform_amp":
    transformed = mpolicy.transform_amp(forward)
    context = lambda: mpolicy.push_policy(hk.Module, POLICY)
  else:
    transformed = hk.transform(forward)
    context = contextlib.nullcontext
    if variant == "jmp":
      context = lambda: _jmp_policy(models.GPT)
  loss = lambda p, tokens: transformed.apply(p, None, tokens)
  if variant == "amp(apply)":
    loss = mpolicy.amp(loss, POLICY)
  return transformed.init, loss, context


@contextlib.contextmanager
def _jmp_policy(model_cls):
  hk.mixed_precision.set_policy(model_cls, jmp.get_policy(POLICY))
  try:
    yield
  finally:
    hk.mixed_precision.clear_policy(model_cls)


def make_step(loss: Callable[..., Any], tx: optax.GradientTransformation):
  def step(params, opt_state, tokens):
    value, grads = jax.value_and_grad(loss)(params, tokens)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value
  return step


@contextlib.contextmanager
def count_binds():
  """Counts `Primitive.bind` calls (all primitives) inside the block."""
  primitive_cls = type(jax.lax.add_p)
  original = primitive_cls.bind
  counter = [0]

  def bind(self, *args, **params):
    counter[0] += 1
    return original(self, *args, **params)

  primitive_cls.bind = bind
  try:
    yield counter
  finally:
    primitive_cls.bind = original


def measure(variant, config, layers, tokens, compile_it: bool):
  """One fresh trace, lower (and compile): a dict of times and counts."""
  jax.clear_caches()
  init, loss, context = make_loss(variant, config, layers)
  tx = optax.adam(1e-3)
  with context():
    params = init(jax.random.PRNGKey(0), tokens)
    opt_state = tx.init(params)
    jitted = jax.jit(make_step(loss, tx))
    gc.collect()  # Each variant starts from a collected heap.
    t0, c0 = time.perf_counter(), time.process_time()
    traced = jitted.trace(params, opt_state, tokens)
    t1, c1 = time.perf_counter(), time.process_time()
    lowered = traced.lower()
    t2, c2 = time.perf_counter(), time.process_time()
    out = {"trace": t1 - t0, "lower": t2 - t1,
           "trace cpu": c1 - c0, "lower cpu": c2 - c1}
    if compile_it:
      compiled = lowered.compile()
      out["compile"] = time.perf_counter() - t2
      out["hlo"] = hlo_kernels.hlo_stats(compiled.as_text()).instructions
      out["temp MiB"] = hlo_kernels.temp_bytes(compiled) / 2**20
      out["eqns"] = training_cpu.jaxpr_stats(traced.jaxpr.jaxpr).eqns
      jax.clear_caches()
      with count_binds() as binds:
        jax.jit(make_step(loss, tx)).trace(params, opt_state, tokens)
      out["binds"] = binds[0]
  return out


def eager_overhead(repeats: int = 200) -> dict[str, float]:
  """Median microseconds per call of a small function, four ways.

  ``f(x, w) = tanh(x @ w)`` on 8 x 8 float32 arrays, called un-jitted and
  jitted, plain and under `mpolicy.amp` (bf16); the first call of each
  (its trace and compile) is not counted.
  """
  f = lambda x, w: jnp.tanh(x @ w)
  g = mpolicy.amp(f, POLICY)
  x = w = jnp.ones((8, 8), jnp.float32)
  out = {}
  for name, fn in (("f", f), ("amp(f)", g), ("jit(f)", jax.jit(f)),
                   ("jit(amp(f))", jax.jit(g))):
    fn(x, w).block_until_ready()
    times = []
    for _ in range(repeats):
      t0 = time.perf_counter()
      fn(x, w).block_until_ready()
      times.append(time.perf_counter() - t0)
    out[name] = 1e6 * report_util.med(times)
  return out


def _ratios(runs, v, d, key: Callable[[dict], float]) -> list[float]:
  """``key`` of variant ``v`` over jmp's, within each repeat at depth ``d``."""
  return [key(r) / key(j) for r, j in zip(runs[v, d], runs["jmp", d])]


def _fmt_range(xs: list[float]) -> str:
  """`median (min-max)` of ratios; the median alone for one value."""
  if len(xs) == 1:
    return f"{xs[0]:.2f}"
  return f"{report_util.med(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"


def _cpu(r: dict) -> float:
  return r["trace cpu"] + r["lower cpu"]


def _wall(r: dict) -> float:
  return r["trace"] + r["lower"]


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--layers", default="12,24",
                      help="comma-separated depths (per-layer cost: first "
                      "to last)")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--no_compile", action="store_true",
                      help="skip the compile and the counts (one compile "
                      "per variant and depth, in the first repeat)")
  parser.add_argument("--d_model", type=int, default=512)
  parser.add_argument("--heads", type=int, default=8)
  parser.add_argument("--seq", type=int, default=256)
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--vocab", type=int, default=8192)
  parser.add_argument("--variants", default=",".join(VARIANTS))
  parser.add_argument("--acceptance", action="store_true",
                      help="24 and 48 layers, 5 repeats, no compile, jmp "
                      "and the two mpolicy variants; ends with a verdict "
                      "per variant and depth")
  config = parser.parse_args(argv)
  if config.acceptance:
    given = " ".join(sys.argv[1:] if argv is None else argv)
    for flag, value in ACCEPTANCE.items():
      if f"--{flag}" not in given:
        setattr(config, flag, value)
  depths = [int(x) for x in config.layers.split(",")]
  variants = config.variants.split(",")
  for v in variants:
    if v not in VARIANTS:
      parser.error(f"unknown variant {v!r}: choose from {', '.join(VARIANTS)}")
  if "jmp" not in variants:
    parser.error("the ratios are to jmp: include it in --variants")
  print("## Trace, lower and compile time against jmp\n")
  print(training_cpu.machine_header())
  print(f"\nGPT d_model {config.d_model}, {config.heads} heads, seq "
        f"{config.seq}, batch {config.batch}, vocab {config.vocab}; a jitted "
        f"Adam step; {config.repeats} repeats. Times are medians; ratios to "
        "jmp are taken within each repeat: median (range).")
  tokens = jax.random.randint(jax.random.PRNGKey(1),
                              (config.batch, config.seq + 1), 0, config.vocab)
  runs = {(v, d): [] for v in variants for d in depths}
  for repeat in range(config.repeats):
    for d in depths:
      for v in variants:
        compile_it = repeat == 0 and not config.no_compile
        runs[v, d].append(measure(v, config, d, tokens, compile_it))
  med = lambda v, d, k: report_util.med([r[k] for r in runs[v, d]])
  for d in depths:
    print(f"\n### {d} layers\n")
    print("| variant | trace CPU s | lower CPU s "
          "| trace + lower CPU × jmp | trace + lower wall × jmp "
          "| compile s | compile × jmp | jaxpr eqns | binds "
          "| HLO instructions | XLA temp MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for v in variants:
      first, jmp_first = runs[v, d][0], runs["jmp", d][0]
      if "compile" in first:
        compiled = (f"{first['compile']:.2f} "
                    f"| {first['compile'] / jmp_first['compile']:.2f} "
                    f"| {first['eqns']} | {first['binds']} | {first['hlo']} "
                    f"| {first['temp MiB']:.1f}")
      else:
        compiled = "- | - | - | - | - | -"
      print(f"| {v} | {med(v, d, 'trace cpu'):.3f} "
            f"| {med(v, d, 'lower cpu'):.3f} "
            f"| {_fmt_range(_ratios(runs, v, d, _cpu))} "
            f"| {_fmt_range(_ratios(runs, v, d, _wall))} | {compiled} |")
  if len(depths) >= 2:
    lo, hi = depths[0], depths[-1]
    tl = lambda v, d: report_util.med([_cpu(r) for r in runs[v, d]])
    print(f"\n### trace + lower CPU time per layer ({lo} → {hi} layers)\n")
    print(f"| variant | ms per layer, {lo} layers | ms per added layer "
          f"| × jmp per added layer |")
    print("|---|---|---|---|")
    per_added = {v: (tl(v, hi) - tl(v, lo)) / (hi - lo) for v in variants}
    for v in variants:
      print(f"| {v} | {1e3 * tl(v, lo) / lo:.1f} | {1e3 * per_added[v]:.1f} "
            f"| {per_added[v] / per_added['jmp']:.2f} |")
  if config.acceptance:
    print("\n### verdict: median trace + lower CPU time at most jmp's\n")
    for d in depths:
      for v in variants:
        if v in ("jmp", "float32"):
          continue
        ratio = report_util.med(_ratios(runs, v, d, _cpu))
        verdict = "yes" if ratio <= 1.0 else "no"
        print(f"- {v}, {d} layers: {ratio:.2f}x jmp: {verdict}")
  eager = eager_overhead()
  print("\n### eager calls: tanh(x @ w) on 8 x 8 arrays, µs per call\n")
  print("| f | amp(f) | amp(f) × f | jit(f) | jit(amp(f)) |")
  print("|---|---|---|---|---|")
  print(f"| {eager['f']:.0f} | {eager['amp(f)']:.0f} "
        f"| {eager['amp(f)'] / eager['f']:.1f} | {eager['jit(f)']:.0f} "
        f"| {eager['jit(amp(f))']:.0f} |")
  print(f"\nloadavg at the end {report_util.loadavg()}")


if __name__ == "__main__":
  main()
