r"""Int8 QAT measured: fidelity, serving bytes, serving time, step time.

Four parts (`--parts`), each printed as a markdown table:

  fidelity  the digits CNN of `examples/digits_int8.py` (dense layers in
            int8, convolutions in bfloat16 under int8) and the char
            transformer of `examples/char_transformer.py` (every weight
            matmul in int8), trained under float32, bfloat16 and int8 QAT
            on the same seeds and batches, and post-training quantization
            (PTQ: the float32-trained params served by the int8 model,
            through `export_quantized` for the digits); test accuracy
            (digits) and held-out loss in nats (char), mean and min-max
            over `--seeds`.
  bytes     the serving artifact, `len(exported.serialize())` plus the
            bytes of the params it is called with, of `export_quantized`
            against `jax.export` of the float32 apply and its params: the
            digits CNN, the char transformer, and an MLP whose weights
            dominate (`models.MLP`, 784-1024-1024-10; untrained, bytes and
            time do not depend on the values).
  serve     process CPU time per batch of `exported.call` (jitted), int8
            artifact against float32, interleaved over `--repeats`
            (A B A B ...), ratio per repeat; the dots of the compiled int8
            program by operand dtypes and XLA:CPU kernel; and a raw
            `--matmul_n`^3 int8 x int8 -> int32 matmul against float32 as
            the reference row, measured in the same run.
  step      process CPU time of a jitted Adam step under int8 QAT against
            the same step under bfloat16 (`p=f32,c=bf16,o=f32`),
            interleaved, for the char transformer and the MLP.

  python benchmarks/bench_int8.py                         # about 15 min on 2 busy cores
  python benchmarks/bench_int8.py --parts=bytes,serve --repeats=20
  python benchmarks/bench_int8.py --seeds=0 --digits_steps=20 --char_steps=5 \
      --d_model=16 --seq_len=16 --mlp=64 --repeats=2 --matmul_n=64   # smoke
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time

from absl import flags
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax

import mpolicy

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
# pylint: disable=g-import-not-at-top,wrong-import-position
import hlo_kernels
import models
import report_util
import digits_data
import mp_flags
# pylint: enable=g-import-not-at-top,wrong-import-position

digits = models.load_example("digits_int8")
ct = models.load_example("char_transformer")

FLAGS = flags.FLAGS
PARTS = ("fidelity", "bytes", "serve", "step")
flags.DEFINE_list("parts", list(PARTS), f"What to measure: {', '.join(PARTS)}.")
flags.DEFINE_list("seeds", ["0", "1", "2"], "Training seeds (fidelity).")
flags.DEFINE_integer("digits_steps", 300, "Training steps of the digits CNN.",
                     lower_bound=1)
flags.DEFINE_integer("char_steps", 300,
                     "Training steps of the char transformer.", lower_bound=1)
flags.DEFINE_list("mlp", ["1024", "1024"], "Hidden widths of the MLP.")
flags.DEFINE_integer("mlp_batch", 256, "The MLP's batch.", lower_bound=1)
flags.DEFINE_integer("repeats", 10, "Interleaved timing repeats.",
                     lower_bound=1)
flags.DEFINE_integer("calls", 5, "Calls per variant per repeat.",
                     lower_bound=1)
flags.DEFINE_integer("matmul_n", 1024, "Size of the raw matmul row.",
                     lower_bound=1)
flags.register_validator(
    "parts", lambda v: bool(v) and set(v) <= set(PARTS),
    message=f"--parts must be a comma-separated subset of {','.join(PARTS)}.")
for _name in ("seeds", "mlp"):
  flags.register_validator(
      _name, lambda v: bool(v) and all(s.isdigit() for s in v),
      message=f"--{_name} must be a comma-separated list of integers.")

INT8, BF16, F32 = digits.INT8, "p=f32,c=bf16,o=f32", "full"
RULES = digits.RULES  # Every weight matmul, however small.
TRAINED = {"float32": F32, "bf16": BF16, "int8 QAT": INT8}


def _spread(xs) -> str:
  return (f"{statistics.mean(xs):.4f} | {min(xs):.4f}-{max(xs):.4f} | "
          + " ".join(f"{x:.4f}" for x in xs))


def _ratios(a, b) -> str:
  """Per-repeat a/b: the median and the range."""
  r = [x / y for x, y in zip(a, b)]
  return f"{statistics.median(r):.2f}x ({min(r):.2f}-{max(r):.2f})"


def interleaved(fns: dict, repeats: int, calls: int) -> dict:
  """Process CPU seconds per call of each ``fns[name]()``, one list per
  name, the names taking turns within each repeat (after one warm call)."""
  for fn in fns.values():
    jax.block_until_ready(fn())
  times = {name: [] for name in fns}
  for _ in range(repeats):
    for name, fn in fns.items():
      start = time.process_time()
      for _ in range(calls):
        jax.block_until_ready(fn())
      times[name].append((time.process_time() - start) / calls)
  return times


# --- The models ----------------------------------------------------------------


@contextlib.contextmanager
def digits_policies(policy: str):
  """Dense layers under ``policy``; convolutions in bfloat16 under int8."""
  with mpolicy.push_policy(hk.Linear, policy), \
       mpolicy.push_policy(hk.Conv2D, BF16 if policy == INT8 else policy):
    yield


def char_train(corpus, config, policy: str, seed: int, steps: int):
  """The char transformer trained under ``policy`` (LayerNorms in float32):
  ``(apply, params, step, step_args)``; trace ``apply`` and ``step`` under
  ``ct.policies(policy)``."""
  with ct.policies(policy):
    model = mpolicy.transform_amp(
        ct.make_forward(len(corpus.vocab), config), rules=RULES)
    optimizer = optax.adam(3e-3)

    @jax.jit
    def step(params, opt_state, batch):
      loss, grads = jax.value_and_grad(
          lambda p: ct.lm_loss(model.apply, p, batch)[0])(params)
      updates, opt_state = optimizer.update(grads, opt_state)
      return optax.apply_updates(params, updates), opt_state, loss

    starts = ct.sample_starts(corpus.train, config.seq_len, steps, 32, seed)
    batch = ct.windows(corpus.train, starts[0], config.seq_len)
    params = model.init(jax.random.PRNGKey(seed), batch[:, :-1])
    opt_state = optimizer.init(params)
    for i in range(steps):
      params, opt_state, _ = step(
          params, opt_state, ct.windows(corpus.train, starts[i], config.seq_len))
  return model.apply, params, step, (params, opt_state, batch)


def mlp_model(policy: str):
  """``(apply, params, step, step_args)`` of the MLP under ``policy``."""
  sizes = [int(h) for h in FLAGS.mlp]
  rng = np.random.RandomState(0)
  x = jnp.asarray(rng.randn(FLAGS.mlp_batch, 784).astype(np.float32))
  y = jnp.asarray(rng.randint(0, 10, FLAGS.mlp_batch).astype(np.int32))
  model = mpolicy.amp(
      hk.transform(lambda x: models.MLP(sizes, 10)(x)).apply, policy,
      rules=RULES)
  params = hk.transform(lambda x: models.MLP(sizes, 10)(x)).init(
      jax.random.PRNGKey(0), x)
  optimizer = optax.adam(1e-3)

  @jax.jit
  def step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(
        lambda p: optax.softmax_cross_entropy_with_integer_labels(
            model(p, None, x).astype(jnp.float32), y).mean())(params)
    updates, opt_state = optimizer.update(grads, opt_state)
    return optax.apply_updates(params, updates), opt_state, loss

  return model, params, step, (params, optimizer.init(params), x, y)


def exports(int8_apply, f32_apply, int8_params, f32_params, *args):
  """``(int8 artifact, serving params, float32 artifact)``."""
  exported, serving = mpolicy.export_quantized(int8_apply, int8_params, *args)
  f32 = jax.export.export(jax.jit(f32_apply))(f32_params, *args)
  return exported, serving, f32


# --- The parts ------------------------------------------------------------------


def fidelity(data, corpus, config, seeds) -> None:
  rows = {}
  for seed in seeds:
    settings = dict(steps=FLAGS.digits_steps, batch_size=64,
                    learning_rate=3e-3, seed=seed, hidden=FLAGS.hidden)
    x = data.x_test
    for name, policy in TRAINED.items():
      with digits_policies(policy):
        apply, params = digits.train(data, policy, **settings)
        acc = digits.accuracy(jax.jit(apply)(params, None, x), data.y_test)
      rows.setdefault(("digits CNN", name), []).append(acc)
      if name == "float32":
        f32_params = params
      if name == "int8 QAT":
        with digits_policies(INT8):  # PTQ: the float32 params, exported.
          exported, serving = mpolicy.export_quantized(apply, f32_params,
                                                       None, x)
          acc = digits.accuracy(exported.call(serving, None, x), data.y_test)
        rows.setdefault(("digits CNN", "PTQ (float32 → int8)"), []).append(acc)
    for name, policy in TRAINED.items():
      apply, params, _, _ = char_train(corpus, config, policy, seed,
                                       FLAGS.char_steps)
      with ct.policies(policy):
        loss = ct.evaluate(apply, params, corpus, config.seq_len)["test loss"]
      rows.setdefault(("char transformer", name), []).append(loss)
      if name == "float32":
        f32_params = params
      if name == "int8 QAT":
        with ct.policies(INT8):
          loss = ct.evaluate(apply, f32_params, corpus,
                             config.seq_len)["test loss"]
        rows.setdefault(("char transformer", "PTQ (float32 → int8)"),
                        []).append(loss)
    print(f"  (seed {seed} done)", flush=True)
  print(f"\n### Fidelity (seeds {','.join(map(str, seeds))}; digits "
        f"{FLAGS.digits_steps} steps, hidden {FLAGS.hidden}; char "
        f"{FLAGS.char_steps} steps, d_model {config.d_model})\n")
  print("| model | variant | metric | mean | min-max | per seed |")
  print("|---|---|---|---|---|---|")
  for (model, name), xs in rows.items():
    metric = "test accuracy" if model == "digits CNN" else "test loss (nats)"
    print(f"| {model} | {name} | {metric} | {_spread(xs)} |")


def serving_models(data, corpus, config):
  """``{name: (int8 artifact, serving, f32 artifact, f32 params, args)}``;
  the digits CNN and the char transformer briefly trained (seed 0)."""
  out = {}
  with digits_policies(INT8):
    apply, params = digits.train(data, INT8, steps=FLAGS.digits_steps,
                                 batch_size=64, learning_rate=3e-3, seed=0,
                                 hidden=FLAGS.hidden)
  with digits_policies(F32):
    f32_apply, f32_params = digits.train(
        data, F32, steps=FLAGS.digits_steps, batch_size=64,
        learning_rate=3e-3, seed=0, hidden=FLAGS.hidden)
    f32 = jax.export.export(jax.jit(f32_apply))(f32_params, None, data.x_test)
  with digits_policies(INT8):
    exported, serving = mpolicy.export_quantized(apply, params, None,
                                                 data.x_test)
  out[f"digits CNN (hidden {FLAGS.hidden})"] = (
      exported, serving, f32, f32_params, (None, data.x_test))
  applies = {}
  for policy in (INT8, F32):
    applies[policy] = char_train(corpus, config, policy, 0,
                                 FLAGS.char_steps)[:2]
  tokens = ct.windows(corpus.test, np.arange(32) * config.seq_len,
                      config.seq_len)[:, :-1]
  # Served without hk.remat (the same params): export_quantized finds
  # weights only where the top-level function reads them, not inside a
  # jax.checkpoint.
  serve = mpolicy.transform_amp(ct.make_forward(
      len(corpus.vocab), config._replace(remat=False)), rules=RULES).apply
  with ct.policies(INT8):
    exported, serving = mpolicy.export_quantized(serve, applies[INT8][1],
                                                 None, tokens)
  with ct.policies(F32):
    f32 = jax.export.export(jax.jit(serve))(applies[F32][1], None, tokens)
  out[f"char transformer (d_model {config.d_model})"] = (
      exported, serving, f32, applies[F32][1], (None, tokens))
  int8_apply, params, _, (_, _, x, _) = mlp_model(INT8)
  f32_apply = mlp_model(F32)[0]
  exported, serving, f32 = exports(int8_apply, f32_apply, params, params,
                                   None, x)
  out[f"MLP 784-{'-'.join(FLAGS.mlp)}-10"] = (exported, serving, f32, params,
                                               (None, x))
  return out


def artifact_bytes(served) -> None:
  print("\n### Serving artifact bytes (program + params)\n")
  print("| model | float32 program | float32 params | int8 program | "
        "int8 params | int8 / float32 | target ≤0.3x |")
  print("|---|---|---|---|---|---|---|")
  for name, (exported, serving, f32, f32_params, _) in served.items():
    sizes = []
    for art, params in ((f32, f32_params), (exported, serving)):
      sizes += [len(art.serialize()), sum(
          np.asarray(l).nbytes for l in jax.tree_util.tree_leaves(params))]
    r = (sizes[2] + sizes[3]) / (sizes[0] + sizes[1])
    print(f"| {name} | {sizes[0]:,} | {sizes[1]:,} | {sizes[2]:,} | "
          f"{sizes[3]:,} | {r:.3f}x | {'met' if r <= 0.3 else 'missed'} |")


def _dots(compiled_text: str) -> str:
  kernels = hlo_kernels.hlo_stats(compiled_text).kernels
  return ", ".join(f"{n}× {k}" for k, n in sorted(kernels.items())) or "-"


def serve_time(served) -> None:
  print(f"\n### Serving CPU time per batch ({FLAGS.repeats} interleaved "
        f"repeats of {FLAGS.calls} calls, process time)\n")
  print("| model | float32 ms | int8 ms | int8 / float32 | target ≤0.5x | "
        "int8 program's dots |")
  print("|---|---|---|---|---|---|")
  for name, (exported, serving, f32, f32_params, args) in served.items():
    call8, call32 = jax.jit(exported.call), jax.jit(f32.call)
    t = interleaved({"f32": lambda: call32(f32_params, *args),
                     "int8": lambda: call8(serving, *args)},
                    FLAGS.repeats, FLAGS.calls)
    r = statistics.median(a / b for a, b in zip(t["int8"], t["f32"]))
    dots = _dots(call8.lower(serving, *args).compile().as_text())
    print(f"| {name} | {report_util.fmt_ms(t['f32'])} | "
          f"{report_util.fmt_ms(t['int8'])} | {_ratios(t['int8'], t['f32'])} "
          f"| {'met' if r <= 0.5 else 'missed'} | {dots} |")
  n = FLAGS.matmul_n
  a = jax.random.normal(jax.random.PRNGKey(0), (n, n))
  b = jax.random.normal(jax.random.PRNGKey(1), (n, n))
  a8, b8 = (jnp.clip(jnp.round(v * 40), -127, 127).astype(jnp.int8)
            for v in (a, b))
  mm32 = jax.jit(jnp.dot)
  mm8 = jax.jit(lambda a, b: jax.lax.dot_general(
      a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32))
  t = interleaved({"f32": lambda: mm32(a, b), "int8": lambda: mm8(a8, b8)},
                  FLAGS.repeats, FLAGS.calls)
  print(f"| raw matmul {n}^3 (reference) | {report_util.fmt_ms(t['f32'])} | "
        f"{report_util.fmt_ms(t['int8'])} | {_ratios(t['int8'], t['f32'])} "
        f"| - | {_dots(mm8.lower(a8, b8).compile().as_text())} |")


def step_time(corpus, config) -> None:
  print(f"\n### Training step CPU time, int8 QAT against bfloat16 "
        f"({FLAGS.repeats} interleaved repeats of {FLAGS.calls} steps)\n")
  print("| model | bf16 step ms | int8 QAT step ms | int8 / bf16 | "
        "target ≤1.2x |")
  print("|---|---|---|---|---|")
  for name in ("char transformer", "MLP"):
    fns = {}
    for policy in (BF16, INT8):
      if name == "MLP":
        _, _, step, args = mlp_model(policy)
      else:  # One step taken: traced (and cached) under its policies.
        _, _, step, args = char_train(corpus, config, policy, 0, 1)
      fns[policy] = (lambda s, a: lambda: s(*a))(step, args)
    t = interleaved(fns, FLAGS.repeats, FLAGS.calls)
    r = statistics.median(a / b for a, b in zip(t[INT8], t[BF16]))
    print(f"| {name} | {report_util.fmt_ms(t[BF16])} | "
          f"{report_util.fmt_ms(t[INT8])} | {_ratios(t[INT8], t[BF16])} | "
          f"{'met' if r <= 1.2 else 'missed'} |")


def main() -> None:
  cpu, cpu_flags = report_util.cpu_info()
  units = [f for f in ("amx_int8", "amx_bf16", "avx512_vnni", "avx_vnni")
           if f in cpu_flags]
  print(f"jax {jax.__version__} on {jax.default_backend()}; CPU {cpu} "
        f"({os.cpu_count()} cores; {', '.join(units) or 'no int8 units'}); "
        f"load average {report_util.loadavg()}", flush=True)
  data = digits_data.load_digits()
  config = ct.model_config_from_flags()
  corpus = ct.load_corpus_from_flags(config.seq_len)
  seeds = [int(s) for s in FLAGS.seeds]
  if "fidelity" in FLAGS.parts:
    fidelity(data, corpus, config, seeds)
  if "bytes" in FLAGS.parts or "serve" in FLAGS.parts:
    served = serving_models(data, corpus, config)
    if "bytes" in FLAGS.parts:
      artifact_bytes(served)
    if "serve" in FLAGS.parts:
      serve_time(served)
  if "step" in FLAGS.parts:
    step_time(corpus, config)
  print(f"\nload average at the end {report_util.loadavg()}")


if __name__ == "__main__":
  mp_flags.run(main, log_every=0)
