r"""Why bfloat16 weights need a float32 copy or stochastic rounding, measured.

Trains the character transformer of `char_transformer.py` (its flags set
the model's size and corpus) with bfloat16 compute (`--mp_policy`), Adam,
and the same seed and batches, holding the weights four ways:

1. `master`: bfloat16 params with a float32 master copy in the optimizer
   (`mpolicy.master_weights(optax.adam)`): 14 bytes per parameter;
2. `nearest`: bfloat16 params and moments, every write rounded to nearest
   (`mpolicy.keep_dtypes(optax.adam)`): 6 bytes;
3. `stochastic`: bfloat16 params and moments, every write rounded
   stochastically (`make_train_step(..., param_rounding="stochastic")` over
   `with_state_dtypes(adam, jnp.bfloat16, rounding="stochastic")`): 6 bytes;
4. `low_bits`: bfloat16 params that are an exact float32 master's top 16
   bits, its other 16 bits in the optimizer state, and bfloat16 moments
   (`make_train_step(..., param_rounding="low_bits")` over the same
   `with_state_dtypes`): 8 bytes, the master's arithmetic exactly.

and, with `--compare`, a float32 baseline (policy 'full', float32 params).
`--modes=stochastic` (a comma-separated list) trains only the ways named.

Adam's step is about the learning rate whatever the gradient, and a
bfloat16 weight ignores any step below half its spacing (2**-9 of its
magnitude): round-to-nearest cancels the small updates (Zamirai et al.,
2020). The table counts the parameters whose value never changed in the
whole run, and the share that each step left unchanged (mean over the
last 10 steps), next to each run's losses; the plot (`--plot`) shows both
step by step. Stochastic rounding makes each write unbiased, so the
small updates add up on average, without the float32 copy.
"""

from __future__ import annotations

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
import optax

import mpolicy

# Sibling modules in examples/ (the script's directory is on sys.path).
import char_transformer
import mp_flags
import mp_report

FLAGS = flags.FLAGS
flags.adopt_module_key_flags(mp_flags)  # --helpshort lists them,
flags.adopt_module_key_flags(char_transformer)  # and the model's.

NEVER_CHANGED = "params never changed (%)"
STILL = "params the step left unchanged (%)"
MODES = ("master", "nearest", "stochastic", "low_bits")

flags.DEFINE_list("modes", list(MODES),
                  f"Which of the ways to hold the weights to train, of {MODES}.")
flags.register_validator(
    "modes", lambda modes: bool(modes) and set(modes) <= set(MODES),
    f"--modes must be a comma-separated, non-empty subset of {MODES}.")


def optimizer_for(mode: str, learning_rate: float):
  """`(optimizer for make_train_step, param_rounding, init)` of a mode."""
  adam = optax.adam(learning_rate)
  if mode == "f32" or mode == "master":
    tx = adam if mode == "f32" else mpolicy.master_weights(adam)
    return tx, "nearest", tx.init
  if mode == "nearest":
    tx = mpolicy.keep_dtypes(adam)
    return tx, "nearest", tx.init
  if mode == "stochastic":
    tx = mpolicy.with_state_dtypes(adam, jnp.bfloat16, rounding="stochastic")
    return tx, "stochastic", mpolicy.stochastic_params(tx).init
  if mode == "low_bits":
    tx = mpolicy.with_state_dtypes(adam, jnp.bfloat16, rounding="stochastic")
    return tx, "low_bits", mpolicy.master_weights(tx, storage="low_bits").init
  raise ValueError(f"mode must be 'f32' or one of {MODES}, got {mode!r}.")


def never_changed_percent(changed) -> jax.Array:
  """% of the parameters whose `changed` flag is still False."""
  flags_ = jax.tree_util.tree_leaves(changed)
  total = sum(f.size for f in flags_)
  return 100 * sum((~f).sum() for f in flags_) / total


def unchanged_percent(new, old) -> jax.Array:
  """% of the parameters equal in `new` and `old`."""
  return never_changed_percent(
      jax.tree_util.tree_map(lambda a, b: a != b, new, old))


def run(corpus: char_transformer.Corpus, config: char_transformer.ModelConfig,
        *, mode: str, policy: str = "p=f32,c=bf16,o=f32",
        norm_policy: str = "full", steps: int = 150, batch_size: int = 32,
        learning_rate: float = 1e-3, seed: int = 0,
        log_every: int = 50) -> mp_report.Run:
  """One training run, counting the params that never changed."""
  if mode == "f32":
    policy = "full"
  with char_transformer.policies(policy, norm_policy):
    model = mpolicy.transform_amp(
        char_transformer.make_forward(len(corpus.vocab), config))

    def loss_fn(params, batch):
      logits = model.apply(params, None, batch[:, :-1])
      return char_transformer.cross_entropy(logits, batch[:, 1:])

    optimizer, rounding, init = optimizer_for(mode, learning_rate)
    step = mpolicy.make_train_step(loss_fn, optimizer, param_rounding=rounding)

    @jax.jit
    def train_step(params, opt_state, changed, batch):
      out = step(params, opt_state, mpolicy.NoOpLossScale(), batch)
      changed = jax.tree_util.tree_map(lambda c, new, old: c | (new != old),
                                       changed, out.params, params)
      still = unchanged_percent(out.params, params)
      return (out.params, out.opt_state, changed, out.value,
              out.grads_finite, still)

    starts = char_transformer.sample_starts(corpus.train, config.seq_len,
                                            steps, batch_size, seed)
    batch = lambda i: char_transformer.windows(corpus.train, starts[i],
                                               config.seq_len)
    full = model.init(jax.random.PRNGKey(seed), batch(0)[:, :-1])
    if mode == "f32":
      params, opt_state = full, init(full)
    elif mode in ("master", "low_bits"):
      wrapped = (optimizer if mode == "master" else
                 mpolicy.master_weights(optimizer, storage="low_bits"))
      params, opt_state = mpolicy.init_master_weights(wrapped, full,
                                                      jnp.bfloat16)
    else:
      params = jax.tree_util.tree_map(lambda p: p.astype(jnp.bfloat16), full)
      opt_state = init(params)
    changed = jax.tree_util.tree_map(lambda p: jnp.zeros(p.shape, bool),
                                     params)
    log = mp_report.Log(mode, steps, log_every)
    for i in range(steps):
      params, opt_state, changed, loss, finite, still = train_step(
          params, opt_state, changed, batch(i))
      log.record(loss, 1.0, finite, **{
          NEVER_CHANGED: never_changed_percent(changed), STILL: still})
    metrics = char_transformer.evaluate(model.apply, params, corpus,
                                        config.seq_len)
  metrics["final loss"] = float(np.mean(log.loss[-10:]))
  metrics["never changed"] = log.extra[NEVER_CHANGED][-1]
  metrics["unchanged by a step"] = float(np.mean(log.extra[STILL][-10:]))
  return mp_report.Run(mode, policy, "NoOp", metrics, log)


BYTES = {"f32": 12, "master": 14, "nearest": 6, "stochastic": 6,
         "low_bits": 8}


def lesson_table(runs, reference: str = "master") -> str:
  """The lesson's markdown table: never-changed params next to the losses."""
  ref = next((r for r in runs if r.name == reference), runs[0])
  lines = ["| run | bytes/param | params never changed | params a step left "
           f"unchanged (last 10) | final loss | vs {ref.name} | test loss | "
           "test accuracy |", "|---" * 8 + "|"]
  for r in runs:
    final = r.metrics["final loss"]
    diff = 100 * (final / ref.metrics["final loss"] - 1)
    lines.append(
        f"| {r.name} | {BYTES[r.name]} | {r.metrics['never changed']:.2f}% | "
        f"{r.metrics['unchanged by a step']:.1f}% | {final:.4f} | {diff:+.2f}% | {r.metrics['test loss']:.4f} | "
        f"{100 * r.metrics['test accuracy']:.2f}% |")
  return "\n".join(lines)


def main() -> None:
  config = char_transformer.model_config_from_flags()
  corpus = char_transformer.load_corpus_from_flags(config.seq_len)
  print(f"Optimizer lesson: char transformer d_model={config.d_model}, "
        f"{config.num_layers} layers, {FLAGS.steps} steps of "
        f"{FLAGS.batch_size}x{config.seq_len}, Adam lr {FLAGS.learning_rate}, "
        f"compute {FLAGS.mp_policy}, jax {jax.__version__} on "
        f"{jax.default_backend()}")
  settings = dict(steps=FLAGS.steps, batch_size=FLAGS.batch_size,
                  learning_rate=FLAGS.learning_rate, seed=FLAGS.seed,
                  log_every=FLAGS.log_every, policy=FLAGS.mp_policy,
                  norm_policy=FLAGS.mp_bn_policy)
  modes = (("f32",) if FLAGS.compare else ()) + tuple(FLAGS.modes)
  runs = [run(corpus, config, mode=m, **settings) for m in modes]
  print()
  print(lesson_table(runs))
  if FLAGS.plot:
    mp_report.plot(runs, FLAGS.plot, "optimizer lesson: "
                   + " vs ".join(r.name for r in runs))


if __name__ == "__main__":
  mp_flags.run(main, mp_policy="p=f32,c=bf16,o=f32", compare=False,
               steps=150, batch_size=32, learning_rate=1e-3, log_every=50)
