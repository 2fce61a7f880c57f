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
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import datetime
import os
import platform
import re
import statistics
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
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
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


if __name__ == "__main__":
  main()
