"""Training-step benchmark: float32 vs mpolicy bf16 vs hand-written Haiku+jmp bf16.

Measures, side by side in one process, a jitted optax (adam) training step
(value_and_grad + optimizer update + apply_updates) for:

  float32    plain `hk.transform`, everything in float32;
  mpolicy    `mpolicy.transform_amp` with
             `mpolicy.set_policy(hk.Module, "p=f32,c=bf16,o=f32")`;
  jmp        what users write today: `hk.transform` plus
             `hk.mixed_precision.set_policy(Model, jmp.get_policy(
             "p=f32,c=bf16,o=f32"))` on the top-level model class;
  jaxamp     `jaxamp.amp(loss, compute_dtype=bfloat16)` over `hk.transform`,
             when jaxamp is installed and runs (reported otherwise).

Both bf16 variants use the same policy for the whole model: mpolicy through
its `hk.Module` default entry, Haiku through a policy on the top-level model
class (Haiku's registry is exact-class and children run under the parent's
policy, so this also covers every sub-module). The loss (softmax
cross-entropy) is computed outside the model module in every variant, so it
sees float32 logits (`o=f32`). Only one registry is populated while a variant
is traced; both are cleared afterwards.

Models (synthetic data from a fixed PRNG, nothing downloaded):

  mlp          784 -> 1024 -> 1024 -> 10, batch 256;
  transformer  token + position embedding, 2 pre-LN blocks of causal
               multi-head attention (4 heads) + GELU MLP (4x), final
               LayerNorm, vocab projection; seq 128, d_model 256, batch 16,
               vocab 256; next-token softmax cross-entropy.

Reported per variant: median training-step time over N timed steps after
warm-up (variants interleaved round-robin, starting variant rotated every
round, `block_until_ready` on every step), trace+lower time
(`jax.jit(step).lower(...)`), XLA compile time (`.compile()`), the wall time
of the first call of a fresh `jax.jit(step)` (trace + compile + one step),
and op counts in the optimized HLO (`compiled.as_text()`, instructions whose
opcode is `convert`, including those inside fusion computations). One
discarded warm-up compile of every variant runs first so the first variant
does not pay JAX's process-level one-time costs.

Usage:

  python benchmarks/bench_training.py                  # full run, both models
  python benchmarks/bench_training.py --quick          # smoke run (< 60 s)
  python benchmarks/bench_training.py --models=mlp --steps=50 --profile
  python benchmarks/bench_training.py --dump-hlo=/tmp/hlo --out=results.md

`--preset=gpu` runs a different set instead (see `gpu_main`): an MLP, a GPT
and ResNet50 at real sizes, each variant compiled and timed on its own, with
the dtypes of the gemm/convolution kernels and XLA's temp memory:

  python benchmarks/bench_training.py --preset=gpu --json=gpu.json
  python benchmarks/bench_training.py --preset=gpu --scale=32 --steps=2  # CPU smoke
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import datetime
import json
import os
import platform
import re
import statistics
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
import hlo_kernels  # pylint: disable=g-import-not-at-top,wrong-import-position

POLICY = "p=f32,c=bf16,o=f32"

# Targets the op-level interpreter aims for (mpolicy vs the others), on a CPU
# with AMX (bf16 matrix units).
TARGET_STEP_VS_F32 = 0.5
TARGET_STEP_VS_JMP = 0.4
TARGET_COMPILE_VS_F32 = 1.5


# --------------------------------------------------------------------------
# Models.


class MLPModel(hk.Module):
  """784 -> 1024 -> 1024 -> 10 with ReLU."""

  def __init__(self, hidden=(1024, 1024), classes=10, name=None):
    super().__init__(name=name)
    self.sizes = list(hidden) + [classes]

  def __call__(self, x):
    return hk.nets.MLP(self.sizes, name="mlp")(x)


class TransformerModel(hk.Module):
  """A small causal pre-LN transformer language model."""

  def __init__(self, vocab, d_model, heads, layers, name=None):
    super().__init__(name=name)
    self.vocab, self.d_model = vocab, d_model
    self.heads, self.layers = heads, layers

  def __call__(self, tokens):
    seq = tokens.shape[-1]
    init = hk.initializers.TruncatedNormal(0.02)
    x = hk.Embed(self.vocab, self.d_model, w_init=init, name="embed")(tokens)
    pos = hk.get_parameter("pos_embed", [seq, self.d_model], init=init)
    x = x + pos
    mask = jnp.tril(jnp.ones((seq, seq), dtype=bool))[None, None]
    w_init = hk.initializers.VarianceScaling(2.0 / self.layers)
    for i in range(self.layers):
      h = hk.LayerNorm(-1, True, True, name=f"ln_attn_{i}")(x)
      h = hk.MultiHeadAttention(
          num_heads=self.heads, key_size=self.d_model // self.heads,
          model_size=self.d_model, w_init=w_init, name=f"attn_{i}")(
              h, h, h, mask=mask)
      x = x + h
      h = hk.LayerNorm(-1, True, True, name=f"ln_mlp_{i}")(x)
      h = hk.nets.MLP([4 * self.d_model, self.d_model], w_init=w_init,
                      activation=jax.nn.gelu, name=f"mlp_{i}")(h)
      x = x + h
    x = hk.LayerNorm(-1, True, True, name="ln_final")(x)
    return hk.Linear(self.vocab, name="unembed")(x)


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
    return _xent(MLPModel(name="model")(x), y)

  return ModelSpec("mlp", f"MLP 784-1024-1024-10, batch {batch_size}",
                   MLPModel, forward, (jnp.asarray(x), jnp.asarray(y)))


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
    logits = TransformerModel(vocab, d_model, heads, layers,
                              name="model")(tokens[:, :-1])
    return _xent(logits, tokens[:, 1:])

  return ModelSpec(
      "transformer",
      f"Transformer {layers} layers, d_model {d_model}, {heads} heads, "
      f"seq {seq}, batch {batch_size}, vocab {vocab}",
      TransformerModel, forward, toks)


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


# --------------------------------------------------------------------------
# HLO and jaxpr analysis.

_INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<type>.+?)\s"
    r"(?P<op>[a-z][a-z0-9\-_]*)\((?P<args>.*)$")
_DTYPE = re.compile(r"^\(?\s*([a-z]+[0-9]*)\[")
_OPNAME = re.compile(r'op_name="([^"]*)"')
_ARG = re.compile(r"%?([\w.\-]+)")


def _short_source(op_name: str) -> str:
  """`jit(step)/jvp(model)/mlp/linear_0/dot_general` -> `mlp/linear_0/dot_general`."""
  parts = [p for p in op_name.split("/") if p]
  keep = []
  for p in parts:
    m = re.fullmatch(r"(?:jit|jvp|transpose|pjit|vmap|checkpoint|remat)"
                     r"\((.*)\)", p)
    if m:
      p = m.group(1)
      if p in ("step", "model") or not keep and p.startswith("<"):
        continue
    keep.append(p)
  # Drop the numeric suffixes Haiku/XLA add and keep the last 3 components.
  return "/".join(keep[-3:]) if keep else _NO_META


@dataclasses.dataclass
class HloStats:
  instructions: int = 0
  converts: int = 0            # every `convert` instruction, fused or not
  converts_in_reducers: int = 0  # inside reduce/scatter `to_apply` bodies
  fusions: int = 0
  cast_only_fusions: int = 0   # fusions doing nothing but casts/layout
  convert_pairs: collections.Counter = dataclasses.field(
      default_factory=collections.Counter)
  convert_sources: collections.Counter = dataclasses.field(
      default_factory=collections.Counter)
  dots: collections.Counter = dataclasses.field(
      default_factory=collections.Counter)
  dot_sources: collections.Counter = dataclasses.field(
      default_factory=collections.Counter)
  ops_by_dtype: collections.Counter = dataclasses.field(
      default_factory=collections.Counter)


_NON_COMPUTE = {"parameter", "constant", "tuple", "get-tuple-element",
                "bitcast", "copy", "fusion", "call", "custom-call"}
_LAYOUT_ONLY = {"parameter", "constant", "bitcast", "copy", "reshape",
                "transpose", "broadcast", "tuple", "get-tuple-element",
                "slice", "convert"}
_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_TO_APPLY = re.compile(r"to_apply=%?([\w.\-]+)")
_NO_META = "<no op_name: inserted by XLA>"


def hlo_stats(text: str) -> HloStats:
  """Op counts of an optimized HLO module (`compiled.as_text()`)."""
  stats = HloStats()
  comp_ops: dict[str, collections.Counter] = {}
  fusion_calls: list[str] = []
  types: dict[str, str] = {}
  ops = collections.Counter()
  for line in text.splitlines():
    c = _COMPUTATION.match(line)
    if c:
      types, ops = {}, collections.Counter()  # Names are per computation.
      comp_ops[c.group(1)] = ops
      continue
    m = _INSTR.match(line)
    if not m:
      continue
    dt = _DTYPE.match(m["type"])
    dtype = dt.group(1) if dt else "?"
    types[m["name"]] = dtype
    op = m["op"]
    ops[op] += 1
    stats.instructions += 1
    if op == "fusion":
      stats.fusions += 1
      call = _CALLS.search(line)
      if call:
        fusion_calls.append(call.group(1))
    if op not in _NON_COMPUTE:
      stats.ops_by_dtype[dtype] += 1
    if op == "convert":
      stats.converts += 1
      arg = _ARG.match(m["args"].strip())
      src = types.get(arg.group(1), "?") if arg else "?"
      stats.convert_pairs[f"{src}->{dtype}"] += 1
      on = _OPNAME.search(line)
      stats.convert_sources[_short_source(on.group(1)) if on else
                            _NO_META] += 1
    if op in ("dot", "convolution"):
      args = [a.strip() for a in m["args"].split(")")[0].split(",")][:2]
      ins = [types.get(_ARG.match(a).group(1), "?") if _ARG.match(a) else "?"
             for a in args]
      stats.dots[f"{op}({','.join(ins)})->{dtype}"] += 1
      on = _OPNAME.search(line)
      src = _short_source(on.group(1)) if on else _NO_META
      stats.dot_sources[f"{','.join(ins)}->{dtype} {src}"] += 1
  reducers = set(_TO_APPLY.findall(text))
  stats.converts_in_reducers = sum(o.get("convert", 0)
                                   for n, o in comp_ops.items() if n in reducers)
  for name in fusion_calls:
    body = comp_ops.get(name, collections.Counter())
    if body.get("convert") and set(body) <= _LAYOUT_ONLY:
      stats.cast_only_fusions += 1
  return stats


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
      stats.convert_sources[_short_source(ns + "/convert")] += 1
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
  hlo: Optional[HloStats] = None
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
      r.hlo = hlo_stats(text)
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


def _med(xs):
  return statistics.median(xs) if xs else float("nan")


def _fmt_ms(xs):
  if not xs:
    return "-"
  if len(xs) >= 4:
    q = statistics.quantiles(xs, n=4)
    return f"{_med(xs) * 1e3:.1f} ({q[0] * 1e3:.1f}-{q[2] * 1e3:.1f})"
  return f"{_med(xs) * 1e3:.1f}"


def _fmt_s(xs):
  return f"{_med(xs):.2f}" if xs else "-"


def _ratio(a, b):
  if not a or not b or not np.isfinite(_med(b)) or _med(b) == 0:
    return float("nan")
  return _med(a) / _med(b)


def _fmt_ratio(x, target=None):
  if not np.isfinite(x):
    return "-"
  s = f"{x:.2f}x"
  if target is not None:
    s += f" {'✓' if x <= target else '✗'} (≤{target})"
  return s


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
    step_f32 = _ratio(r.step_s, f32.step_s) if f32 else float("nan")
    step_jmp = _ratio(r.step_s, jm.step_s) if jm else float("nan")
    comp_f32 = (_ratio(_trace_compile(r), _trace_compile(f32))
                if f32 else float("nan"))
    conv = str(r.hlo.converts)
    if is_mp and jm and jm.hlo:
      conv += f" {'✓' if r.hlo.converts <= jm.hlo.converts else '✗'} (≤{jm.hlo.converts})"
    out.append(
        f"| {r.variant.label} | {_fmt_ms(r.step_s)} | "
        f"{_fmt_ratio(step_f32, TARGET_STEP_VS_F32 if is_mp else None)} | "
        f"{_fmt_ratio(step_jmp, TARGET_STEP_VS_JMP if is_mp else None)} | "
        f"{_fmt_s(r.lower_s)} | {_fmt_s(r.compile_s)} | "
        f"{_fmt_ratio(comp_f32, TARGET_COMPILE_VS_F32 if is_mp else None)} | "
        f"{_fmt_s(r.first_call_s)} | {conv} | {r.hlo.cast_only_fusions} | "
        f"{r.hlo.instructions} | "
        f"{r.jaxpr.converts} | {r.final_loss:.4g} |")
  out.append("")
  mp = results.get("mpolicy")
  if mp and mp.status == "ok" and f32 and jm and jm.status == "ok":
    checks = [
        (f"step ≤ {TARGET_STEP_VS_F32}× float32", _ratio(mp.step_s, f32.step_s),
         TARGET_STEP_VS_F32),
        (f"step ≤ {TARGET_STEP_VS_JMP}× hand-written jmp",
         _ratio(mp.step_s, jm.step_s), TARGET_STEP_VS_JMP),
        (f"trace+compile ≤ {TARGET_COMPILE_VS_F32}× plain hk.transform",
         _ratio(_trace_compile(mp), _trace_compile(f32)),
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
      out.append(f"  - HLO dots/convs: {dict(h.dots)}")
      if args.profile > 1:
        out.append("  - HLO dots by source: " + ", ".join(
            f"{n}× {s}" for s, n in sorted(h.dot_sources.items())))
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
  amx = sorted(f for f in flags if f.startswith("amx"))
  bf16 = sorted(f for f in flags if "bf16" in f)
  load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
  return (f"CPU: {cpu} ({os.cpu_count()} logical cores); "
          f"AMX: {'yes (' + ' '.join(amx) + ')' if amx else 'no (no amx_bf16/amx_tile flags)'}; "
          f"bf16 flags: {' '.join(bf16) or 'none'} | "
          f"jax {jax.__version__}, devices {jax.devices()[0].platform}, "
          f"haiku {hk.__version__}, optax {optax.__version__} | "
          f"{datetime.datetime.now().isoformat(timespec='seconds')} | "
          f"loadavg at start {load}")


def main(argv=None):
  argv = sys.argv[1:] if argv is None else list(argv)
  preset = argparse.ArgumentParser(add_help=False)
  preset.add_argument("--preset", choices=("cpu", "gpu"), default="cpu")
  known, rest = preset.parse_known_args(argv)
  if known.preset == "gpu":
    return gpu_main(rest)
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
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

  models = [m.strip() for m in args.models.split(",") if m.strip()]
  for m in models:
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
  for m in models:
    spec = MODELS[m](args.quick, args.seed)
    log(f"== {spec.name}: {spec.description}")
    results = run_model(spec, variants, args, log)
    sections.append(report_model(spec, results, args))
  load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
  sections.append(f"Total wall time {time.perf_counter() - t_start:.1f} s; "
                  f"loadavg at end {load}.")
  text = "\n".join(sections)
  print(text)
  if args.out:
    with open(args.out, "w") as f:
      f.write(text + "\n")


# ==========================================================================
# GPU preset (`--preset=gpu`): three models at real sizes, one variant at a
# time, with kernel dtypes and XLA temp memory. Everything below is separate
# from the CPU preset above; `main` only dispatches to `gpu_main`.

GPU_BF16 = "p=f32,c=bf16,o=f32"
GPU_F16 = "p=f32,c=f16,o=f32"
GPU_FP8 = "p=f32,c=f8,o=bf16"
GPU_LEARNING_RATE = 3e-4
GPU_INITIAL_LOSS_SCALE = 2.0**15


class GpuMLP(hk.Module):
  """ReLU MLP: `hidden` layers, then `classes` logits."""

  def __init__(self, hidden, classes, name=None):
    super().__init__(name=name)
    self.sizes = list(hidden) + [classes]

  def __call__(self, x):
    return hk.nets.MLP(self.sizes, name="mlp")(x)


class GpuCausalSelfAttention(hk.Module):
  """Causal multi-head self-attention written with plain jnp ops."""

  def __init__(self, heads, name=None):
    super().__init__(name=name)
    self.heads = heads

  def __call__(self, x):
    batch, seq, width = x.shape
    head = width // self.heads
    qkv = hk.Linear(3 * width, name="qkv")(x)
    q, k, v = jnp.split(qkv.reshape(batch, seq, 3, self.heads, head), 3, 2)
    q, k, v = q[:, :, 0], k[:, :, 0], v[:, :, 0]   # [batch, seq, heads, head]
    # A Python float keeps the logits in the compute dtype (weak typing).
    logits = jnp.einsum("bthd,bshd->bhts", q, k) / float(np.sqrt(head))
    causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    logits = jnp.where(causal, logits, jnp.finfo(logits.dtype).min)
    weights = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bhts,bshd->bthd", weights, v).reshape(batch, seq, width)
    return hk.Linear(width, name="out")(out)


class GpuGPT(hk.Module):
  """Pre-LN GPT: embeddings, `layers` blocks (attention, GELU MLP 4x), logits."""

  def __init__(self, vocab, d_model, heads, layers, name=None):
    super().__init__(name=name)
    self.vocab, self.d_model = vocab, d_model
    self.heads, self.layers = heads, layers

  def __call__(self, tokens):
    seq = tokens.shape[-1]
    init = hk.initializers.TruncatedNormal(0.02)
    x = hk.Embed(self.vocab, self.d_model, w_init=init, name="embed")(tokens)
    pos = hk.get_parameter("pos_embed", [seq, self.d_model], init=init)
    x = x + pos.astype(x.dtype)
    ln = lambda n: hk.LayerNorm(-1, True, True, name=n)
    for i in range(self.layers):
      x = x + GpuCausalSelfAttention(self.heads, name=f"attn_{i}")(
          ln(f"ln_attn_{i}")(x))
      h = hk.Linear(4 * self.d_model, name=f"mlp_in_{i}")(ln(f"ln_mlp_{i}")(x))
      x = x + hk.Linear(self.d_model, name=f"mlp_out_{i}")(jax.nn.gelu(h))
    return hk.Linear(self.vocab, name="unembed")(ln("ln_final")(x))


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


# --- Variants of the GPU preset ---------------------------------------------
#
# Each variant gives a context manager that fills its registry while the
# model is initialised and traced, a loss builder `forward -> (init,
# loss_fn)` with `loss_fn(params, state, batch) -> (loss, state)`, and a step
# builder `loss_fn -> (step, optimizer, initial loss scale)` with
# `step(params, state, opt_state, loss_scale, batch) -> (params, state,
# opt_state, loss_scale, loss, grads_finite)`.


def _bn_policy(compute: str) -> str:
  # As Haiku's ImageNet example: BatchNorm computes in float32 and hands its
  # output to the next layer in the model's compute dtype.
  return f"p=f32,c=f32,o={compute}"


@contextlib.contextmanager
def _gpu_no_policy(model: GpuModel):
  del model
  yield


def _gpu_haiku_policy(policy: str, compute: str):

  @contextlib.contextmanager
  def ctx(model: GpuModel):
    hk.mixed_precision.set_policy(model.model_cls, jmp.get_policy(policy))
    if model.has_batchnorm:
      hk.mixed_precision.set_policy(hk.BatchNorm,
                                    jmp.get_policy(_bn_policy(compute)))
    try:
      yield
    finally:
      hk.mixed_precision.clear_policy(model.model_cls)
      hk.mixed_precision.clear_policy(hk.BatchNorm)

  return ctx


def _gpu_mpolicy_policy(policy: str, compute: str):

  @contextlib.contextmanager
  def ctx(model: GpuModel):
    with contextlib.ExitStack() as stack:
      stack.enter_context(mpolicy.push_policy(hk.Module, policy))
      if model.has_batchnorm:
        stack.enter_context(
            mpolicy.push_policy(hk.BatchNorm, _bn_policy(compute)))
      yield

  return ctx


def _haiku_loss(forward):
  t = hk.transform_with_state(forward)
  return t.init, lambda p, s, batch: t.apply(p, s, None, batch)


def _mpolicy_transform_loss(forward):
  t = mpolicy.transform_amp_with_state(forward)
  return t.init, lambda p, s, batch: t.apply(p, s, None, batch)


def _amp_loss(policy):

  def build(forward):
    t = hk.transform_with_state(forward)
    loss = mpolicy.amp(lambda p, s, batch: t.apply(p, s, None, batch), policy)
    return t.init, loss

  return build


def _plain_step(loss_fn):
  opt = optax.adam(GPU_LEARNING_RATE)

  def step(params, state, opt_state, loss_scale, batch):
    (loss, new_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        params, state, batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), new_state, opt_state,
            loss_scale, loss, jnp.array(True))

  return step, opt, None


def _jmp_dynamic_scale_step(loss_fn):
  """Float16 training as a Haiku+jmp user writes it by hand."""
  opt = optax.adam(GPU_LEARNING_RATE)

  def step(params, state, opt_state, loss_scale, batch):
    def scaled_loss(p):
      loss, new_state = loss_fn(p, state, batch)
      return loss_scale.scale(loss), (loss, new_state)

    (_, (loss, new_state)), grads = jax.value_and_grad(
        scaled_loss, has_aux=True)(params)
    grads = loss_scale.unscale(grads)
    finite = jmp.all_finite(grads)
    loss_scale = loss_scale.adjust(finite)
    updates, new_opt_state = opt.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    params, state, opt_state = jmp.select_tree(
        finite, (new_params, new_state, new_opt_state),
        (params, state, opt_state))
    return params, state, opt_state, loss_scale, loss, finite

  return step, opt, jmp.DynamicLossScale(jnp.float32(GPU_INITIAL_LOSS_SCALE))


def _mpolicy_dynamic_scale_step(loss_fn):
  """Float16 training with mpolicy's helpers."""
  opt = mpolicy.skip_nonfinite(optax.adam(GPU_LEARNING_RATE))
  grad_fn = mpolicy.scaled_value_and_grad(loss_fn, has_aux=True)

  def step(params, state, opt_state, loss_scale, batch):
    loss_scale, finite, (loss, new_state), grads = grad_fn(
        loss_scale, params, state, batch)
    updates, opt_state = opt.update(grads, opt_state, params,
                                    grads_finite=finite)
    state = mpolicy.select_tree(finite, new_state, state)
    return (optax.apply_updates(params, updates), state, opt_state,
            loss_scale, loss, finite)

  return step, opt, mpolicy.DynamicLossScale(
      jnp.float32(GPU_INITIAL_LOSS_SCALE))


@dataclasses.dataclass
class GpuVariant:
  key: str
  label: str
  policy: Callable[[GpuModel], Any]   # model -> context manager
  loss: Callable[[Callable[..., Any]], tuple[Callable, Callable]]
  step: Callable[[Callable[..., Any]], tuple[Callable, Any, Any]]
  baseline: str = "jmp"   # the hand-written counterpart for "× jmp"


GPU_VARIANTS = {
    "f32": GpuVariant("f32", "float32 (hk.transform)", _gpu_no_policy,
                      _haiku_loss, _plain_step),
    "jmp": GpuVariant("jmp", "Haiku + jmp bf16 (hand-written)",
                      _gpu_haiku_policy(GPU_BF16, "bf16"), _haiku_loss,
                      _plain_step),
    "mpolicy": GpuVariant("mpolicy", "mpolicy.transform_amp bf16",
                          _gpu_mpolicy_policy(GPU_BF16, "bf16"),
                          _mpolicy_transform_loss, _plain_step),
    "amp": GpuVariant("amp", "mpolicy.amp(apply) bf16", _gpu_no_policy,
                      _amp_loss(GPU_BF16), _plain_step),
    "f16_jmp": GpuVariant(
        "f16_jmp", "Haiku + jmp f16, DynamicLossScale by hand",
        _gpu_haiku_policy(GPU_F16, "f16"), _haiku_loss,
        _jmp_dynamic_scale_step, baseline="f16_jmp"),
    "f16_mpolicy": GpuVariant(
        "f16_mpolicy", "mpolicy f16, scaled_value_and_grad + skip_nonfinite",
        _gpu_mpolicy_policy(GPU_F16, "f16"), _mpolicy_transform_loss,
        _mpolicy_dynamic_scale_step, baseline="f16_jmp"),
    # ---- fp8 hook -------------------------------------------------------
    # mpolicy.transform_amp with compute in float8 (`c=f8`, BatchNorm as in
    # the bf16 variants). Runs only with --fp8 (or when listed in
    # --variants), and is skipped with a printed note when this mpolicy's
    # `get_policy` does not know float8 compute yet.
    "fp8": GpuVariant("fp8", "mpolicy.transform_amp fp8 (c=f8,o=bf16)",
                      _gpu_mpolicy_policy(GPU_FP8, "bf16"),
                      _mpolicy_transform_loss, _plain_step),
}
GPU_DEFAULT_VARIANTS = "f32,jmp,mpolicy,amp,f16_jmp,f16_mpolicy"


def fp8_unavailable() -> Optional[str]:
  """Why the fp8 variant cannot run here, or None if it can."""
  try:
    mpolicy.get_policy(GPU_FP8)
  except Exception as e:  # pylint: disable=broad-except
    return f"get_policy({GPU_FP8!r}) raised {type(e).__name__}: {e}"
  return None


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
    med = _med(self.step_s)
    return {
        "variant": self.variant, "label": self.label, "status": self.status,
        "step_ms": [x * 1e3 for x in self.step_s],
        "median_step_ms": med * 1e3 if self.step_s else None,
        "compile_s": self.compile_s if np.isfinite(self.compile_s) else None,
        "temp_bytes": self.temp_bytes, "flops": self.flops,
        "tflops_per_s": (self.flops / med / 1e12
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
      + (f", median step {_med(r.step_s) * 1e3:.2f} ms" if r.step_s else ""))
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
    vs_f32 = _ratio(r.step_s, f32.step_s) if f32 else float("nan")
    vs_jmp = _ratio(r.step_s, base.step_s) if base else float("nan")
    jmp_col = _fmt_ratio(vs_jmp)
    if base is not None and base.variant != "jmp" and jmp_col != "-":
      jmp_col += f" (vs {base.variant})"
    tflops = (f"{r.flops / _med(r.step_s) / 1e12:.3g}"
              if r.flops and r.step_s else "n/a")
    scale = "-" if r.final_loss_scale is None else f"{r.final_loss_scale:g}"
    out.append(
        f"| {r.label} | {_fmt_ms(r.step_s)} | {_fmt_ratio(vs_f32)} | "
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


def gpu_main(argv) -> dict[str, Any]:
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
  models = [m.strip() for m in args.models.split(",") if m.strip()]
  for m in models:
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
  for name in models:
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


if __name__ == "__main__":
  main()
