r"""Float32 islands, suggested and measured, on the char transformer.

Where float16 or float8 goes wrong for a model, which modules must stay
wider? This script answers it for the char transformer of
`char_transformer.py`, measured rather than guessed. On the same
batches it trains:

1. float32;
2. the half policy on every module (`--mp_policy`, with the loss scale of
   `--mp_scale_type`);
3. the half policy with the islands `mpolicy.suggest_policy` finds at
   `--probes` points of the second run (its parameters and batch there,
   one search over all of them): the modules whose own ops run in
   `--island_dtype`. It then suggests again over the probes of both runs,
   and trains again if that adds an island (`--rounds`).

  python examples/precision_islands.py
  python examples/precision_islands.py --mp_policy=p=f32,c=f8,o=f32 \
      --mp_scale_type=NoOp --fp8_matmuls=all --island_dtype=bfloat16

At its defaults (learning rate 0.03, float16 on every module) the
attention scores of the first block pass 65504 as training goes on: the
loss is not finite, every such step is skipped and no loss scale helps
(the overflow is in the forward pass), and the half run ends in NaN. The
islands it finds keep that attention's own ops (its score and value
matmuls, not its projections) and the last LayerNorm in float32; 96% of
the matmul FLOPs stay in float16 (docs/debugging.md tabulates the runs).
At a learning rate of 0.01 float16 keeps up and nothing is suggested.

It prints the suggestion, the `set_policy` lines that reproduce it, and a
table: test loss and its distance from float32, the share of matmul FLOPs
(forward and backward) that multiply in a half dtype, skipped steps, and
the evaluations the search spent. The model's and the training flags
(`--d_model`, `--seq_len`, `--steps`, ...) are `char_transformer.py`'s.
"""

from __future__ import annotations

import time

from absl import flags
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax

import mpolicy

# Sibling modules in examples/ (the script's directory is on sys.path).
import char_transformer as ct
import mp_flags
from transformer_lm import make_forward

FLAGS = flags.FLAGS
flags.DEFINE_enum("fp8_matmuls", "all", ["all", "weights"],
                  "Which matmuls run in float8 under c=f8 "
                  "(OpRules.with_fp8(matmuls=...)).")
flags.DEFINE_enum("island_dtype", "float32", ["float32", "bfloat16"],
                  "The dtype the islands compute in.")
flags.DEFINE_float("tolerance", 0.3,
                   "The relative error suggest_policy allows for the loss and "
                   "its gradients (against float32). At these learning "
                   "rates float16 gradients of this model differ from "
                   "float32's by 10-20% where training does not suffer: 0.1 "
                   "buys islands that do not change the loss curve.")
flags.DEFINE_integer("max_evals", 16,
                     "How many times suggest_policy may run the loss.")
flags.DEFINE_integer("probes", 3,
                     "Where suggest_policy looks in a run: after 1/n, 2/n, "
                     "... of its steps (a problem can come and go as "
                     "training moves); the islands are the union.")
flags.DEFINE_integer("rounds", 2,
                     "Suggest, train with the islands, suggest again with "
                     "that run's probes too, ... at most this many times.")
flags.register_validator("probes", lambda v: v >= 1,
                         message="--probes must be at least 1.")
flags.register_validator("rounds", lambda v: v >= 1,
                         message="--rounds must be at least 1.")
flags.register_validator("tolerance", lambda v: v > 0,
                         message="--tolerance must be positive.")
flags.register_validator("max_evals", lambda v: v >= 2,
                         message="--max_evals must be at least 2.")


def rules_from_flags() -> mpolicy.OpRules:
  """The op rules: float8 on the matmuls `--fp8_matmuls` names, any size."""
  return mpolicy.DEFAULT_RULES.with_fp8(matmuls=FLAGS.fp8_matmuls,
                                        min_size=0)


def train(model, corpus: ct.Corpus, config, registry, *, steps: int,
          batch_size: int, learning_rate: float, seed: int,
          loss_scale: mpolicy.LossScale) -> dict:
  """Trains ``model`` under ``registry`` (a context manager factory).

  Returns:
    Its metrics, and under ``"probes"`` the parameters and the batch at
    ``--probes`` evenly spaced steps, the last step last.
  """
  with registry():
    loss_fn = lambda p, b: ct.lm_loss(model.apply, p, b)[0]
    optimizer = optax.adam(learning_rate)
    step = jax.jit(mpolicy.make_train_step(loss_fn, optimizer))
    starts = ct.sample_starts(corpus.train, config.seq_len, steps, batch_size,
                              seed)
    params = model.init(jax.random.PRNGKey(seed),
                        ct.windows(corpus.train, starts[0],
                                   config.seq_len)[:, :-1])
    opt_state = optimizer.init(params)
    losses, skipped, probes = [], 0, []
    probe_at = {(steps * (j + 1)) // FLAGS.probes - 1
                for j in range(FLAGS.probes)}
    start = time.perf_counter()
    for i in range(steps):
      batch = ct.windows(corpus.train, starts[i], config.seq_len)
      out = step(params, opt_state, loss_scale, batch)
      skipped += not bool(out.grads_finite)
      params, opt_state, loss_scale = out.params, out.opt_state, out.loss_scale
      losses.append(float(out.value))
      if i in probe_at:
        probes.append((params, batch))
    metrics = ct.evaluate(model.apply, params, corpus, config.seq_len)
  finite = [x for x in losses[-10:] if np.isfinite(x)]
  metrics.update({"final loss": float(np.mean(finite)) if finite else np.nan,
                  "skipped": skipped, "seconds": time.perf_counter() - start,
                  "probes": probes})
  return metrics


def suggest(model, probes, policy) -> mpolicy.PolicySuggestion:
  """One `suggest_policy` over a run's probes at once: the loss summed over
  them (each its parameters on its batch), the gradients with respect to
  every probe's parameters as one vector."""
  params = tuple(p for p, _ in probes)
  batches = tuple(b for _, b in probes)

  def loss(ps, bs):
    return sum(ct.lm_loss(model.apply, p, b)[0] for p, b in zip(ps, bs))

  return mpolicy.suggest_policy(
      loss, params, batches, policy=policy, tolerance=FLAGS.tolerance,
      max_evals=FLAGS.max_evals, island_dtype=jnp.dtype(FLAGS.island_dtype))


def main() -> None:
  config = ct.model_config_from_flags()
  corpus = ct.load_corpus_from_flags(config.seq_len)
  policy = mpolicy.get_policy(FLAGS.mp_policy)
  model = mpolicy.transform_amp(make_forward(len(corpus.vocab), config),
                                rules=rules_from_flags())
  print(f"corpus: {len(corpus.train)} train characters; {FLAGS.steps} steps "
        f"of {FLAGS.batch_size}x{config.seq_len} at learning rate "
        f"{FLAGS.learning_rate:g}, d_model {config.d_model}, "
        f"{config.num_layers} layers; jax {jax.__version__} on "
        f"{jax.default_backend()}", flush=True)
  settings = dict(steps=FLAGS.steps, batch_size=FLAGS.batch_size,
                  learning_rate=FLAGS.learning_rate, seed=FLAGS.seed)
  full = train(model, corpus, config,
               lambda: mpolicy.push_policy(hk.Module, "full"),
               loss_scale=mpolicy.NoOpLossScale(), **settings)
  half = train(model, corpus, config,
               lambda: mpolicy.push_policy(hk.Module, policy),
               loss_scale=mp_flags.loss_scale(), **settings)
  report(f"[float32] {FLAGS.steps} steps", full)
  report(f"[half] {FLAGS.steps} steps", half)

  # Suggest at the half run's probes; train with the islands; suggest
  # again at the probes of both runs: a module the first run never
  # stressed may need an island too. Stop when nothing new is suggested.
  probes = half["probes"]
  suggestion = suggest(model, probes, policy)
  runs = []
  for round_ in range(1, FLAGS.rounds + 1):
    print(f"\nround {round_}: {suggestion}", flush=True)
    if not suggestion.float32_paths:  # Nothing to change: the half run.
      runs.append((suggestion, half))
      break
    run = train(model, corpus, config, suggestion.apply,
                loss_scale=mp_flags.loss_scale(), **settings)
    report(f"[half + {len(suggestion.float32_paths)} islands]", run)
    runs.append((suggestion, run))
    if round_ == FLAGS.rounds:
      break
    probes = probes + run["probes"]
    again = suggest(model, probes, policy)
    if set(again.float32_paths) <= set(suggestion.float32_paths):
      break
    suggestion = again
  suggestion, islands = runs[-1]
  print("\nTo use it:\n" + suggestion.set_policy_lines() + "\n")

  rows = [("float32", "full", 0, float("nan"), full, "-"),
          ("half", str(policy), 0, suggestion.before.half_flops, half, "-"),
          ("half + islands", str(policy), len(suggestion.float32_paths),
           suggestion.after.half_flops, islands, suggestion.evals)]
  base = full["test loss"]
  print("| run | policy | islands | test loss | vs float32 | final loss | "
        "skipped steps | matmul FLOPs in half | evaluations |")
  print("|---|---|---|---|---|---|---|---|---|")
  for name, spec, n, share, m, evals in rows:
    share = "-" if np.isnan(share) else f"{100 * share:.1f}%"
    print(f"| {name} | {spec} | {n} | {m['test loss']:.4f} | "
          f"{m['test loss'] - base:+.4f} | {m['final loss']:.4f} | "
          f"{m['skipped']} | {share} | {evals} |")


def report(name: str, metrics: dict) -> None:
  print(f"{name}: test loss {metrics['test loss']:.4f}, final loss "
        f"{metrics['final loss']:.4f}, {metrics['skipped']} skipped steps, "
        f"{metrics['seconds']:.1f} s", flush=True)


if __name__ == "__main__":
  mp_flags.run(main, steps=300, batch_size=32, learning_rate=0.03,
               log_every=0, mp_policy="p=f32,c=f16,o=f32",
               mp_scale_type="Dynamic", d_model=128, remat=False)
