r"""Why float16 needs loss scaling (Micikevicius et al., 2018), measured.

Trains the character transformer of `char_transformer.py` (its flags set
the model's size and corpus) with the same seed and batches:

1. float32 (policy 'full'), the reference (with `--compare`, the default);
2. float16 compute (`--mp_policy`, default p=f32,c=f16,o=f32), no loss scale;
3. the same with `--mp_scale_type` (Dynamic by default, from
   `--mp_scale_value`), unless that is NoOp.

At every step of the half-precision runs it measures the underflow: the
backward pass starts with the gradient of the loss with respect to the
logits (times the loss scale) and casts it to float16 where the last layer
computes. Entries below 2**-25 (about 3e-8, half of float16's smallest
subnormal) become exactly 0 there, and every gradient computed from them
loses them. The table gives the percentage of nonzero entries flushed (mean
over the run, and over its last 10 steps) next to each run's losses; the
plot (`--plot`) shows it step by step. As the model grows confident, the
gradients of the characters it rules out shrink, and more of them flush.

Nothing is rigged: the loss is the usual mean over batch and sequence, so
each entry carries a factor 1/(batch_size * seq_len). With the CPU
defaults (a small model, 150 steps of 32x64, about a minute of CPU time),
float16 without a scale flushes 11% of the logit gradients by the end
(3.6% on average); with the dynamic scale, none. The loss hardly suffers at
this size. On a GPU a bigger model shows the cost in loss too: the same
transformer with d_model 512, 6 layers, 150 steps of 64x256 (H100) ended at
loss 3.10 in float16 without a scale, 2.81 with the dynamic scale and 2.80
in float32. The lesson at that size:

  python examples/loss_scaling_lesson.py --d_model=512 --num_layers=6 \
      --seq_len=256 --batch_size=64 --steps=150 --plot=/tmp/lesson.png
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

UNDERFLOW = "underflowed logit grads (%)"


def underflowed_percent(logits, targets, loss_scale, dtype) -> jax.Array:
  """% of the logits' nonzero gradient entries that `dtype` flushes to zero.

  The backward pass starts with the (scaled) gradient of the loss with
  respect to the logits and casts it to the compute dtype where the model's
  last layer computes. Entries below half of `dtype`'s smallest subnormal
  become exactly 0 there, and every gradient computed from them loses them.
  """
  grad = jax.grad(lambda l: char_transformer.cross_entropy(l, targets))(
      logits) * loss_scale
  nonzero = grad != 0
  flushed = nonzero & (grad.astype(dtype) == 0)
  return 100 * flushed.sum() / jnp.maximum(nonzero.sum(), 1)


def run(corpus: char_transformer.Corpus, config: char_transformer.ModelConfig,
        *, policy: str, norm_policy: str = "full", attention_policy: str = "",
        scale_type: str = "NoOp", scale_value: float = 2.0**15,
        steps: int = 150, batch_size: int = 32, learning_rate: float = 3e-3,
        seed: int = 0, log_every: int = 50) -> mp_report.Run:
  """One training run; half-precision runs also log their underflow."""
  name = mp_report.label(policy, scale_type)
  compute_dtype = mpolicy.get_policy(policy).compute_dtype
  measure = compute_dtype != jnp.float32
  with char_transformer.policies(policy, norm_policy, attention_policy):
    model = mpolicy.transform_amp(
        char_transformer.make_forward(len(corpus.vocab), config))

    def loss_fn(params, batch):  # The LM loss; the logits as aux.
      logits = model.apply(params, None, batch[:, :-1]).astype(jnp.float32)
      return char_transformer.cross_entropy(logits, batch[:, 1:]), logits

    grad_fn = mpolicy.scaled_value_and_grad(loss_fn, has_aux=True)
    optimizer = mpolicy.skip_nonfinite(optax.adam(learning_rate))

    @jax.jit
    def train_step(params, opt_state, loss_scale, batch):
      new_scale, finite, (loss, logits), grads = grad_fn(loss_scale, params,
                                                         batch)
      underflow = jnp.float32(jnp.nan)
      if measure:
        underflow = underflowed_percent(logits, batch[:, 1:],
                                        loss_scale.loss_scale, compute_dtype)
      updates, opt_state = optimizer.update(grads, opt_state, params,
                                            grads_finite=finite)
      params = optax.apply_updates(params, updates)
      return params, opt_state, new_scale, loss, finite, underflow

    starts = char_transformer.sample_starts(corpus.train, config.seq_len,
                                            steps, batch_size, seed)
    batch = lambda i: char_transformer.windows(corpus.train, starts[i],
                                               config.seq_len)
    params = model.init(jax.random.PRNGKey(seed), batch(0)[:, :-1])
    opt_state = optimizer.init(params)
    loss_scale = mp_flags.make_loss_scale(scale_type, scale_value)
    log = mp_report.Log(name, steps, log_every)
    for i in range(steps):
      params, opt_state, loss_scale, loss, finite, underflow = train_step(
          params, opt_state, loss_scale, batch(i))
      extra = {UNDERFLOW: underflow} if measure else {}
      log.record(loss, loss_scale.loss_scale, finite, **extra)
    metrics = char_transformer.evaluate(model.apply, params, corpus,
                                        config.seq_len)
  metrics["final loss"] = float(np.mean(log.loss[-10:]))
  return mp_report.Run(name, policy, scale_type, metrics, log)


def lesson_table(runs) -> str:
  """The lesson's markdown table: underflow next to the losses."""
  lines = ["| run | loss scale | underflowed logit grads (mean) | underflowed "
           "logit grads (last 10 steps) | final loss | test loss | test accuracy | "
           "skipped steps |", "|---" * 8 + "|"]
  for r in runs:
    scale = r.scale_type
    if scale != "NoOp":
      scale += f" (ends at {r.log.scale[-1]:g})"
    series = np.asarray(r.log.extra.get(UNDERFLOW, [np.nan]))
    pct = lambda v: "—" if np.all(np.isnan(v)) else f"{np.nanmean(v):.3f}%"
    lines.append(
        f"| {r.name} | {scale} | {pct(series)} | {pct(series[-10:])} | "
        f"{r.metrics['final loss']:.4f} | {r.metrics['test loss']:.4f} | "
        f"{100 * r.metrics['test accuracy']:.2f}% | {r.log.skipped} |")
  return "\n".join(lines)


def main() -> None:
  config = char_transformer.model_config_from_flags()
  corpus = char_transformer.load_corpus_from_flags(config.seq_len)
  print(f"Loss scaling lesson: char transformer d_model={config.d_model}, "
        f"{config.num_layers} layers, {FLAGS.steps} steps of "
        f"{FLAGS.batch_size}x{config.seq_len}, jax {jax.__version__} on "
        f"{jax.default_backend()}")
  settings = dict(steps=FLAGS.steps, batch_size=FLAGS.batch_size,
                  learning_rate=FLAGS.learning_rate, seed=FLAGS.seed,
                  log_every=FLAGS.log_every)
  half = dict(policy=FLAGS.mp_policy, norm_policy=FLAGS.mp_bn_policy,
              attention_policy=FLAGS.attention_policy)
  runs = []
  if FLAGS.compare:
    runs.append(run(corpus, config, policy="full", **settings))
  runs.append(run(corpus, config, **half, **settings))
  if FLAGS.mp_scale_type != "NoOp":
    runs.append(run(corpus, config, **half, scale_type=FLAGS.mp_scale_type,
                    scale_value=FLAGS.mp_scale_value, **settings))
  print()
  print(lesson_table(runs))
  if FLAGS.plot:
    mp_report.plot(runs, FLAGS.plot, "loss scaling lesson: "
                   + " vs ".join(r.name for r in runs))


if __name__ == "__main__":
  mp_flags.run(main, mp_policy="p=f32,c=f16,o=f32", mp_scale_type="Dynamic",
               compare=True, steps=150, batch_size=32, learning_rate=3e-3,
               log_every=50)
