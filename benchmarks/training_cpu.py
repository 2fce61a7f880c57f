"""The CPU preset of `bench_training.py` (the default, `--preset=cpu`).

float32 (`hk.transform`), mpolicy bf16 (`transform_amp` with
`set_policy(hk.Module, "p=f32,c=bf16,o=f32")`), the hand-written Haiku+jmp
bf16 policy on the top-level model class, and jaxamp when installed, each
as a jitted optax (adam) step on an MLP (784-1024-1024-10, batch 256) and a
small causal transformer (2 pre-LN layers, d_model 256, 4 heads, seq 128,
batch 16, vocab 256), interleaved round-robin in one process. `main(argv)`
parses the preset's flags and prints one markdown table per model (and,
with `--profile`, where the converts and dots come from).

>>> list(MODELS), list(VARIANTS)
(['mlp', 'transformer'], ['float32', 'mpolicy', 'jmp', 'jaxamp'])
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import datetime
import os
import sys
import time
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
from report_util import cpu_info, fmt_ms, fmt_ratio, fmt_s, loadavg, ratio
# pylint: enable=g-import-not-at-top,wrong-import-position

POLICY = "p=f32,c=bf16,o=f32"

# Targets the op-level interpreter aims for (mpolicy vs the others), on a CPU
# with AMX (bf16 matrix units).
TARGET_STEP_VS_F32 = 0.5
TARGET_STEP_VS_JMP = 0.4
TARGET_COMPILE_VS_F32 = 1.5


# --------------------------------------------------------------------------
# Models (one definition each, in models.py) and their synthetic data.


def _xent(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


@dataclasses.dataclass
class ModelSpec:
  name: str
  description: str
  model_cls: type
  forward: Callable[..., Any]
  batch: Any


def make_mlp(quick: bool, seed: int) -> ModelSpec:
  batch_size = 64 if quick else 256
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((batch_size, 784), dtype=np.float32)
  teacher = rng.standard_normal((784, 10), dtype=np.float32)
  y = np.argmax(x @ teacher, axis=-1).astype(np.int32)  # Learnable labels.

  def forward(batch):
    x, y = batch
    return _xent(models.MLP((1024, 1024), 10, name="model")(x), y)

  return ModelSpec("mlp", f"MLP 784-1024-1024-10, batch {batch_size}",
                   models.MLP, forward, (jnp.asarray(x), jnp.asarray(y)))


def make_transformer(quick: bool, seed: int) -> ModelSpec:
  vocab, heads = 256, 4
  # --quick: 1 layer and small shapes, to keep the smoke run under a minute.
  d_model, layers, batch_size, seq = ((128, 1, 4, 32) if quick else
                                      (256, 2, 16, 128))
  rng = np.random.default_rng(seed)
  # Learnable synthetic sequences: t[i+1] = (a * t[i] + b) mod vocab, with a
  # random start and a per-sequence (a, b).
  a = rng.integers(1, 8, size=(batch_size, 1)) * 2 + 1
  b = rng.integers(0, vocab, size=(batch_size, 1))
  toks = np.empty((batch_size, seq + 1), dtype=np.int64)
  toks[:, :1] = rng.integers(0, vocab, size=(batch_size, 1))
  for i in range(seq):
    toks[:, i + 1:i + 2] = (a * toks[:, i:i + 1] + b) % vocab
  toks = jnp.asarray(toks.astype(np.int32))

  def forward(tokens):
    logits = models.GPT(vocab, d_model, heads, layers,
                        name="model")(tokens[:, :-1])
    return _xent(logits, tokens[:, 1:])

  return ModelSpec(
      "transformer",
      f"Transformer {layers} layers, d_model {d_model}, {heads} heads, "
      f"seq {seq}, batch {batch_size}, vocab {vocab}",
      models.GPT, forward, toks)


MODELS = {"mlp": make_mlp, "transformer": make_transformer}


# --------------------------------------------------------------------------
# Variants.


def _registries_empty(model_cls) -> bool:
  return (mpolicy.policy_for(hk.Module) is None
          and hk.mixed_precision.get_policy(model_cls) is None)


@contextlib.contextmanager
def _no_policy(model_cls):
  assert _registries_empty(model_cls), "a policy leaked between variants"
  yield


@contextlib.contextmanager
def _mpolicy_policy(model_cls):
  assert _registries_empty(model_cls), "a policy leaked between variants"
  mpolicy.set_policy(hk.Module, POLICY)
  try:
    yield
  finally:
    mpolicy.clear_policies()


@contextlib.contextmanager
def _jmp_policy(model_cls):
  assert _registries_empty(model_cls), "a policy leaked between variants"
  hk.mixed_precision.set_policy(model_cls, jmp.get_policy(POLICY))
  try:
    yield
  finally:
    hk.mixed_precision.clear_policy(model_cls)


def _plain_loss(forward):
  transformed = hk.transform(forward)
  return transformed.init, lambda p, batch: transformed.apply(p, None, batch)


def _mpolicy_loss(forward):
  transformed = mpolicy.transform_amp(forward)
  return transformed.init, lambda p, batch: transformed.apply(p, None, batch)


def _jaxamp_loss(forward):
  import jaxamp  # pylint: disable=g-import-not-at-top
  transformed = hk.transform(forward)
  loss = jaxamp.amp(lambda p, batch: transformed.apply(p, None, batch),
                    compute_dtype=jnp.bfloat16)
  return transformed.init, loss


@dataclasses.dataclass
class Variant:
  key: str
  label: str
  build: Callable[[Callable[..., Any]], tuple[Callable, Callable]]
  policy: Callable[[type], Any]  # model_cls -> context manager


VARIANTS = {
    "float32": Variant("float32", "float32 (hk.transform)", _plain_loss,
                       _no_policy),
    "mpolicy": Variant("mpolicy", "mpolicy.transform_amp bf16",
                       _mpolicy_loss, _mpolicy_policy),
    "jmp": Variant("jmp", "Haiku + jmp bf16 (hand-written)", _plain_loss,
                   _jmp_policy),
    "jaxamp": Variant("jaxamp", "jaxamp bf16", _jaxamp_loss, _no_policy),
}


def make_step(loss_fn, opt):
  """A fresh training-step function (fresh so JAX caches never hit)."""

  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step


def _sub_jaxprs(params):
  for v in params.values():
    vs = v if isinstance(v, (tuple, list)) else (v,)
    for x in vs:
      if hasattr(x, "eqns"):
        yield x
      elif hasattr(x, "jaxpr") and hasattr(x.jaxpr, "eqns"):
        yield x.jaxpr


@dataclasses.dataclass
class JaxprStats:
  eqns: int = 0
  converts: int = 0
  convert_pairs: collections.Counter = dataclasses.field(
      default_factory=collections.Counter)
  convert_sources: collections.Counter = dataclasses.field(
      default_factory=collections.Counter)
  prims_by_dtype: collections.Counter = dataclasses.field(
      default_factory=collections.Counter)


def _dtype_name(aval) -> str:
  dt = getattr(aval, "dtype", None)
  return str(dt) if dt is not None else "?"


def jaxpr_stats(jaxpr, stats: Optional[JaxprStats] = None) -> JaxprStats:
  stats = stats or JaxprStats()
  for eqn in jaxpr.eqns:
    subs = list(_sub_jaxprs(eqn.params))
    if subs:
      for sub in subs:
        jaxpr_stats(sub, stats)
      continue
    stats.eqns += 1
    name = eqn.primitive.name
    out = _dtype_name(eqn.outvars[0].aval) if eqn.outvars else "?"
    if out in ("float32", "bfloat16", "float16"):
      stats.prims_by_dtype[out] += 1
    if name == "convert_element_type":
      stats.converts += 1
      src = _dtype_name(eqn.invars[0].aval)
      stats.convert_pairs[f"{src}->{out}"] += 1
      ns = str(getattr(eqn.source_info, "name_stack", "")) or "<top>"
      stats.convert_sources[hlo_kernels.short_source(ns + "/convert")] += 1
  return stats

# --------------------------------------------------------------------------
# Measurement.


@dataclasses.dataclass
class Result:
  variant: Variant
  status: str = "ok"
  lower_s: list = dataclasses.field(default_factory=list)
  compile_s: list = dataclasses.field(default_factory=list)
  first_call_s: list = dataclasses.field(default_factory=list)
  step_s: list = dataclasses.field(default_factory=list)
  hlo: Optional[hlo_kernels.HloStats] = None
  jaxpr: Optional[JaxprStats] = None
  compiled: Any = None
  state: Any = None
  final_loss: float = float("nan")


def _block(tree):
  return jax.tree_util.tree_map(lambda x: x.block_until_ready(), tree)


def compile_once(spec, variant, opt, params, opt_state, record):
  """Times trace+lower, XLA compile, and the first call of a fresh jit.

  Two fresh step functions: one for `jax.jit(step).lower(...).compile()`,
  one for the first call of `jax.jit(step)` (trace + compile + one step).
  """
  _, loss_fn = variant.build(spec.forward)
  step = make_step(loss_fn, opt)
  with variant.policy(spec.model_cls):
    t0 = time.perf_counter()
    lowered = jax.jit(step).lower(params, opt_state, spec.batch)
    t1 = time.perf_counter()
    lowered.compile()
    t2 = time.perf_counter()
  _, loss_fn2 = variant.build(spec.forward)
  step2 = make_step(loss_fn2, opt)
  with variant.policy(spec.model_cls):
    jitted = jax.jit(step2)
    t3 = time.perf_counter()
    _block(jitted(params, opt_state, spec.batch))
    t4 = time.perf_counter()
  record.lower_s.append(t1 - t0)
  record.compile_s.append(t2 - t1)
  record.first_call_s.append(t4 - t3)


def run_model(spec, variants, args, log):
  opt = optax.adam(1e-3)
  results = {v.key: Result(v) for v in variants}
  live = []
  key = jax.random.PRNGKey(args.seed)
  for v in variants:
    r = results[v.key]
    try:
      init, _ = v.build(spec.forward)
      with v.policy(spec.model_cls):
        params = init(key, spec.batch)
      opt_state = opt.init(params)
      r.state = (params, opt_state)
      # Full runs: this first compile is a discarded warm-up that pays JAX's
      # one-time per-process costs; --quick records it instead.
      _, loss_fn = v.build(spec.forward)
      step = make_step(loss_fn, opt)
      with v.policy(spec.model_cls):
        t0 = time.perf_counter()
        lowered = jax.jit(step).lower(params, opt_state, spec.batch)
        t1 = time.perf_counter()
        r.compiled = lowered.compile()
        t2 = time.perf_counter()
        r.jaxpr = jaxpr_stats(
            jax.make_jaxpr(step)(params, opt_state, spec.batch).jaxpr)
      text = r.compiled.as_text()
      r.hlo = hlo_kernels.hlo_stats(text)
      if args.dump_hlo:
        os.makedirs(args.dump_hlo, exist_ok=True)
        path = os.path.join(args.dump_hlo, f"{spec.name}_{v.key}.hlo.txt")
        with open(path, "w") as f:
          f.write(text)
      t3 = time.perf_counter()
      _block(r.compiled(params, opt_state, spec.batch))  # May fail at run time.
      if args.quick:
        r.lower_s.append(t1 - t0)
        r.compile_s.append(t2 - t1)
        r.first_call_s.append(t2 - t0 + time.perf_counter() - t3)
      live.append(v)
    except ImportError as e:
      r.status = "not installed" if v.key == "jaxamp" else f"failed: {e}"
    except Exception as e:  # pylint: disable=broad-except
      r.status = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    log(f"  [{spec.name}] {v.key}: {r.status}")

  # Compile timings, interleaved across variants.
  for rep in range(args.compile_reps):
    order = live[rep % len(live):] + live[:rep % len(live)] if live else []
    for v in order:
      r = results[v.key]
      compile_once(spec, v, opt, *r.state, record=r)
    log(f"  [{spec.name}] compile rep {rep + 1}/{args.compile_reps} done")

  # Step timings: warm-up, then round-robin with a rotating start.
  for v in live:
    r = results[v.key]
    for _ in range(args.warmup):
      p, s, _ = _block(r.compiled(*r.state, spec.batch))
      r.state = (p, s)
  for i in range(args.steps):
    k = i % len(live) if live else 0
    for v in live[k:] + live[:k]:
      r = results[v.key]
      t0 = time.perf_counter()
      p, s, loss = _block(r.compiled(*r.state, spec.batch))
      r.step_s.append(time.perf_counter() - t0)
      r.state = (p, s)
      r.final_loss = float(loss)
    if (i + 1) % max(1, args.steps // 4) == 0:
      log(f"  [{spec.name}] timed step {i + 1}/{args.steps}")
  return results

# --------------------------------------------------------------------------
# Reporting.

def _trace_compile(r):
  return [a + b for a, b in zip(r.lower_s, r.compile_s)]


def report_model(spec, results, args) -> str:
  f32 = results.get("float32")
  jm = results.get("jmp")
  out = [f"### {spec.name}: {spec.description}", ""]
  out.append(
      "| variant | step ms median (IQR) | × f32 | × jmp | trace+lower s | "
      "XLA compile s | trace+compile × f32 | first call s | HLO converts | "
      "cast-only fusions | HLO instrs | jaxpr converts | loss after steps |")
  out.append("|" + "---|" * 13)
  for key, r in results.items():
    if r.status != "ok":
      out.append(f"| {r.variant.label} | {r.status} |" + " |" * 11)
      continue
    is_mp = key == "mpolicy"
    step_f32 = ratio(r.step_s, f32.step_s) if f32 else float("nan")
    step_jmp = ratio(r.step_s, jm.step_s) if jm else float("nan")
    comp_f32 = (ratio(_trace_compile(r), _trace_compile(f32))
                if f32 else float("nan"))
    conv = str(r.hlo.converts)
    if is_mp and jm and jm.hlo:
      conv += f" {'✓' if r.hlo.converts <= jm.hlo.converts else '✗'} (≤{jm.hlo.converts})"
    out.append(
        f"| {r.variant.label} | {fmt_ms(r.step_s)} | "
        f"{fmt_ratio(step_f32, TARGET_STEP_VS_F32 if is_mp else None)} | "
        f"{fmt_ratio(step_jmp, TARGET_STEP_VS_JMP if is_mp else None)} | "
        f"{fmt_s(r.lower_s)} | {fmt_s(r.compile_s)} | "
        f"{fmt_ratio(comp_f32, TARGET_COMPILE_VS_F32 if is_mp else None)} | "
        f"{fmt_s(r.first_call_s)} | {conv} | {r.hlo.cast_only_fusions} | "
        f"{r.hlo.instructions} | "
        f"{r.jaxpr.converts} | {r.final_loss:.4g} |")
  out.append("")
  mp = results.get("mpolicy")
  if mp and mp.status == "ok" and f32 and jm and jm.status == "ok":
    checks = [
        (f"step ≤ {TARGET_STEP_VS_F32}× float32", ratio(mp.step_s, f32.step_s),
         TARGET_STEP_VS_F32),
        (f"step ≤ {TARGET_STEP_VS_JMP}× hand-written jmp",
         ratio(mp.step_s, jm.step_s), TARGET_STEP_VS_JMP),
        (f"trace+compile ≤ {TARGET_COMPILE_VS_F32}× plain hk.transform",
         ratio(_trace_compile(mp), _trace_compile(f32)),
         TARGET_COMPILE_VS_F32),
    ]
    line = "; ".join(
        f"{name}: {x:.2f}x {'✓' if x <= t else '✗'}" for name, x, t in checks)
    line += (f"; HLO converts ≤ jmp: {mp.hlo.converts} vs {jm.hlo.converts} "
             f"{'✓' if mp.hlo.converts <= jm.hlo.converts else '✗'}")
    out.append(f"Targets (mpolicy): {line}")
    out.append("")
  elif mp is not None:
    out.append("Targets (mpolicy): not evaluated, a variant needed for them "
               "did not run (see the table).")
    out.append("")
  if args.profile:
    out.append(f"#### Profile: {spec.name}")
    out.append("")
    for key, r in results.items():
      if r.hlo is None or r.jaxpr is None:
        continue
      h, j = r.hlo, r.jaxpr
      failed = "" if r.status == "ok" else " (compiled, then " + r.status + ")"
      out.append(f"- **{r.variant.label}**{failed}: HLO {h.instructions} instrs, "
                 f"{h.fusions} fusions ({h.cast_only_fusions} cast-only), "
                 f"{h.converts} converts ({h.converts_in_reducers} inside "
                 f"reducer bodies) {dict(h.convert_pairs)}; compute ops by dtype "
                 f"{dict(h.ops_by_dtype)}")
      out.append(f"  - HLO dots/convs: {dict(h.kernels)}")
      if args.profile > 1:
        out.append("  - HLO dots by source: " + ", ".join(
            f"{n}× {s}" for s, n in sorted(h.kernel_sources.items())))
      top = ", ".join(f"{n}× {s}" for s, n in h.convert_sources.most_common(8))
      out.append(f"  - HLO convert sources (op_name): {top}")
      out.append(f"  - jaxpr: {j.eqns} eqns, {j.converts} convert_element_type "
                 f"{dict(j.convert_pairs)}; float ops by out dtype "
                 f"{dict(j.prims_by_dtype)}")
      top = ", ".join(f"{n}× {s}" for s, n in j.convert_sources.most_common(8))
      out.append(f"  - jaxpr convert sources (name stack): {top}")
    out.append("")
  return "\n".join(out)


def machine_header() -> str:
  cpu, flags = cpu_info()
  amx = sorted(f for f in flags if f.startswith("amx"))
  bf16 = sorted(f for f in flags if "bf16" in f)
  load = loadavg()
  return (f"CPU: {cpu} ({os.cpu_count()} logical cores); "
          f"AMX: {'yes (' + ' '.join(amx) + ')' if amx else 'no (no amx_bf16/amx_tile flags)'}; "
          f"bf16 flags: {' '.join(bf16) or 'none'} | "
          f"jax {jax.__version__}, devices {jax.devices()[0].platform}, "
          f"haiku {hk.__version__}, optax {optax.__version__} | "
          f"{datetime.datetime.now().isoformat(timespec='seconds')} | "
          f"loadavg at start {load}")


def main(argv=None):
  parser = argparse.ArgumentParser(
      prog="bench_training.py", description="Training-step benchmark: "
      "float32 vs mpolicy bf16 vs hand-written Haiku+jmp bf16.")
  parser.add_argument("--preset", choices=("cpu", "gpu"), default="cpu",
                      help="cpu (default): the small models below; gpu: real "
                      "sizes, see `--preset=gpu --help`")
  parser.add_argument("--steps", type=int, default=None,
                      help="timed steps per variant (default 30; quick 3)")
  parser.add_argument("--warmup", type=int, default=None,
                      help="untimed steps per variant (default 3; quick 1)")
  parser.add_argument("--compile-reps", type=int, default=None,
                      help="timed fresh compiles per variant after the discarded "
                      "warm-up (default 2); --quick times its single "
                      "compile instead (default 0 more)")
  parser.add_argument("--models", default="mlp,transformer")
  parser.add_argument("--variants", default="float32,mpolicy,jmp,jaxamp")
  parser.add_argument("--quick", action="store_true",
                      help="smoke run: smaller batches, few steps")
  parser.add_argument("--profile", action="count", default=0,
                      help="print convert / op breakdowns per variant "
                      "(twice: also every dot with its dtypes and source)")
  parser.add_argument("--dump-hlo", default=None, metavar="DIR",
                      help="write each variant's optimized HLO text to DIR")
  parser.add_argument("--out", default=None, help="also write markdown here")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  defaults = (3, 1, 0) if args.quick else (30, 3, 2)
  for name, d in zip(("steps", "warmup", "compile_reps"), defaults):
    if getattr(args, name) is None:
      setattr(args, name, d)

  def log(msg):
    print(msg, file=sys.stderr, flush=True)

  model_names = [m.strip() for m in args.models.split(",") if m.strip()]
  for m in model_names:
    if m not in MODELS:
      parser.error(f"unknown model {m!r}; choose from {sorted(MODELS)}")
  variants = []
  for v in args.variants.split(","):
    if v.strip() not in VARIANTS:
      parser.error(f"unknown variant {v!r}; choose from {sorted(VARIANTS)}")
    variants.append(VARIANTS[v.strip()])

  mpolicy.clear_policies()
  t_start = time.perf_counter()
  sections = [
      "## mpolicy training-step benchmark", "", machine_header(), "",
      f"Policy `{POLICY}` for both bf16 variants; optax.adam, jitted step; "
      f"{args.steps} timed steps per variant after {args.warmup} warm-up "
      f"(round-robin, rotating start); "
      + (f"compile times from the single, unwarmed compile of each variant "
         f"(indicative only); smaller --quick shapes." if args.quick else
         f"compile medians over {args.compile_reps} fresh compile(s) after "
         f"one discarded warm-up compile per variant."), ""]
  for m in model_names:
    spec = MODELS[m](args.quick, args.seed)
    log(f"== {spec.name}: {spec.description}")
    results = run_model(spec, variants, args, log)
    sections.append(report_model(spec, results, args))
  load = loadavg()
  sections.append(f"Total wall time {time.perf_counter() - t_start:.1f} s; "
                  f"loadavg at end {load}.")
  text = "\n".join(sections)
  print(text)
  if args.out:
    with open(args.out, "w") as f:
      f.write(text + "\n")

