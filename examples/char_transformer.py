r"""A small character-level transformer LM, trained in mixed precision.

The corpus is a few of the standard library's own source files, read from
the directory of `os.py` in a fixed order: it exists wherever Python does,
so nothing is downloaded. Each block has causal attention, softmax,
LayerNorm and a GELU MLP, under `hk.remat`.

The attention blocks are modules named `attention`, so a name pattern
reaches all of them, e.g. to keep attention in float32 while the rest of the
model computes in bfloat16:

  python examples/char_transformer.py --attention_policy=full --compare

which sets `mpolicy.set_policy("*/attention", "full")` for the run (a
pattern on a module's own name beats the class default). LayerNorms follow
`--mp_bn_policy` (float32 by default).

The step is written out: `mpolicy.scaled_value_and_grad` (scale, grad,
unscale, finiteness check, scale adjustment in one call), then an optimizer
wrapped in `mpolicy.skip_nonfinite`, which leaves params and optimizer state
as they were when the gradients are not finite. With `--microbatches=k` the
step is `mpolicy.make_train_step(..., microbatches=k)` instead: each batch
runs as k microbatches (a k-times-smaller batch's activations), gradients
summed in float32, one loss-scale decision and one Adam update per batch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
import contextlib
import os
from typing import NamedTuple

from absl import app
from absl import flags
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax

import mpolicy

# Sibling modules in examples/ (the script's directory is on sys.path).
import mp_flags
import mp_report
# The model, shared with benchmarks/.
from transformer_lm import CharTransformer, ModelConfig, make_forward

FLAGS = flags.FLAGS
flags.adopt_module_key_flags(mp_flags)  # --helpshort lists them too.
mp_flags.define_bn_policy()

STDLIB = os.path.dirname(os.__file__)
DEFAULT_CORPUS = ("bisect.py", "heapq.py", "functools.py", "textwrap.py",
                  "string.py", "abc.py", "contextlib.py")
ATTENTION_PATTERN = "*/attention"
KEEP_FIRST_LAST = ("*/block_0/~/attention", "*/logits")
"""The first weight matmuls (block 0's attention) and the last (the head)."""
METRICS = ("test accuracy", "test loss", "final loss")

flags.DEFINE_string(
    "attention_policy", "",
    f"Policy of the attention blocks (registry pattern "
    f"'{ATTENTION_PATTERN}'), e.g. 'full'; empty: they follow --mp_policy.")
flags.DEFINE_list(
    "keep_bf16", [],
    "Registry patterns of layers kept in p=f32,c=bf16,o=f32 whatever "
    "--mp_policy says, e.g. with --mp_policy=p=f32,c=nvfp4,o=f32 keep the "
    f"first and last layers: --keep_bf16={','.join(KEEP_FIRST_LAST)}.")
flags.DEFINE_list("corpus_files", list(DEFAULT_CORPUS),
                  f"Files to train on, in this order: paths relative to "
                  f"the standard library ({STDLIB}) or absolute.")
flags.DEFINE_integer("seq_len", 64, "Characters per training sequence.")
flags.DEFINE_integer("d_model", 64, "Width of the residual stream.")
flags.DEFINE_integer("num_heads", 4, "Attention heads per block.")
flags.DEFINE_integer("num_layers", 2, "Number of transformer blocks.")
flags.DEFINE_bool("remat", True, "Wrap each block in hk.remat.")
flags.DEFINE_bool(
    "debug_nonfinite", False,
    "When a step is skipped (its gradients were not finite), print where "
    "the first non-finite value appeared (mpolicy.locate_nonfinite on that "
    "batch, with that step's loss scale), for the first "
    f"{3} skipped steps.")
flags.DEFINE_integer(
    "microbatches", 1, "Split each batch into this many microbatches and "
    "accumulate their gradients (1: no accumulation); divides --batch_size.")


def _check_corpus_files(names: Sequence[str]) -> bool:
  missing = [n for n in names if not os.path.isfile(os.path.join(STDLIB, n))]
  if not names or missing:
    raise flags.ValidationError(
        f"no such file: {', '.join(missing) or '(empty list)'} (relative "
        f"names are looked up in {STDLIB}). Give standard library files "
        f"such as bisect.py,heapq.py, or absolute paths.")
  return True


flags.register_validator("corpus_files", _check_corpus_files)
flags.register_validator("attention_policy", mp_flags.check_policy_spec)
for _name in ("seq_len", "d_model", "num_heads", "num_layers"):
  flags.register_validator(_name, lambda v: v >= 1,
                           message=f"--{_name} must be at least 1.")
flags.register_multi_flags_validator(
    ["batch_size", "microbatches"],
    lambda f: f["microbatches"] >= 1 and f["batch_size"] % f["microbatches"] == 0,
    message="--microbatches must be at least 1 and divide --batch_size.")
flags.register_multi_flags_validator(
    ["d_model", "num_heads"], lambda f: f["d_model"] % f["num_heads"] == 0,
    message="--d_model must be a multiple of --num_heads.")


# --- Data ----------------------------------------------------------------------


class Corpus(NamedTuple):
  """Token ids of the text, split 90/10, and the vocabulary."""
  train: np.ndarray  # [N] int32
  test: np.ndarray
  vocab: str


def load_corpus(files: Sequence[str] = DEFAULT_CORPUS) -> Corpus:
  """Concatenates the files (relative to the standard library, or absolute)."""
  texts = []
  for name in files:
    with open(os.path.join(STDLIB, name), encoding="utf-8") as f:
      texts.append(f.read())
  text = "\n".join(texts)
  vocab = "".join(sorted(set(text)))
  lookup = {c: i for i, c in enumerate(vocab)}
  ids = np.array([lookup[c] for c in text], np.int32)
  split = int(0.9 * len(ids))
  return Corpus(ids[:split], ids[split:], vocab)


def windows(ids: np.ndarray, starts: np.ndarray, seq_len: int) -> np.ndarray:
  """[len(starts), seq_len + 1] slices: inputs and next-character targets."""
  return ids[starts[:, None] + np.arange(seq_len + 1)]


# --- Model ---------------------------------------------------------------------


def model_config_from_flags() -> ModelConfig:
  """The model's sizes from `--seq_len`, `--d_model`, ... and `--remat`."""
  return ModelConfig(FLAGS.seq_len, FLAGS.d_model, FLAGS.num_heads,
                     FLAGS.num_layers, FLAGS.remat)


@contextlib.contextmanager
def policies(policy: str, norm_policy: str = "full",
             attention_policy: str = "",
             keep_bf16: Sequence[str] = ()) -> Iterator[None]:
  """The model's registry entries, for the duration of a run."""
  with contextlib.ExitStack() as stack:
    for pattern in keep_bf16:
      stack.enter_context(mpolicy.push_policy(pattern, "p=f32,c=bf16,o=f32"))
    stack.enter_context(mpolicy.push_policy(CharTransformer, policy))
    stack.enter_context(mpolicy.push_policy(hk.LayerNorm, norm_policy))
    if attention_policy:
      stack.enter_context(mpolicy.push_policy(ATTENTION_PATTERN,
                                              attention_policy))
    yield


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Mean next-character cross-entropy, in float32."""
  return optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), targets).mean()


def lm_loss(apply, params, batch) -> tuple[jax.Array, jax.Array]:
  """The mean cross-entropy of `apply`'s logits, and their accuracy."""
  inputs, targets = batch[:, :-1], batch[:, 1:]
  logits = apply(params, None, inputs)
  accuracy = (jnp.argmax(logits, -1) == targets).mean()
  return cross_entropy(logits, targets), accuracy


def sample_starts(ids: np.ndarray, seq_len: int, steps: int, batch_size: int,
                  seed: int) -> np.ndarray:
  """[steps, batch_size] random window starts, deterministic in `seed`."""
  return np.random.RandomState(seed).randint(
      0, len(ids) - seq_len - 1, size=(steps, batch_size))


def evaluate(apply, params, corpus: Corpus, seq_len: int) -> dict[str, float]:
  """Test loss and accuracy on up to 128 windows of the held-out text."""
  starts = np.arange(0, len(corpus.test) - seq_len - 1, seq_len)[:128]
  loss, acc = jax.jit(lambda p, b: lm_loss(apply, p, b))(
      params, windows(corpus.test, starts, seq_len))
  return {"test accuracy": float(acc), "test loss": float(loss)}


# --- Training ------------------------------------------------------------------


def train(corpus: Corpus, config: ModelConfig = ModelConfig(), *,
          policy: str = "p=f32,c=bf16,o=f32", norm_policy: str = "full",
          attention_policy: str = "", keep_bf16: Sequence[str] = (),
          scale_type: str = "NoOp",
          scale_value: float = 2.0**15, steps: int = 300, batch_size: int = 32,
          learning_rate: float = 3e-3, seed: int = 0,
          log_every: int = 50, microbatches: int = 1,
          debug_nonfinite: bool = False) -> mp_report.Run:
  """Trains the LM under the given policies; returns the run's record.

  With `debug_nonfinite`, a skipped step prints `mpolicy.locate_nonfinite`'s
  report for its batch and loss scale (the first few skipped steps).
  """
  name = mp_report.label(policy, scale_type)
  if attention_policy:
    name += "+attn:" + mp_report.label(attention_policy)
  if keep_bf16:
    name += "+bf16:" + ",".join(keep_bf16)
  with policies(policy, norm_policy, attention_policy, keep_bf16):
    model = mpolicy.transform_amp(make_forward(len(corpus.vocab), config))
    grad_fn = mpolicy.scaled_value_and_grad(
        lambda p, b: lm_loss(model.apply, p, b), has_aux=True)
    optimizer = mpolicy.skip_nonfinite(optax.adam(learning_rate))

    @jax.jit
    def train_step(params, opt_state, loss_scale, batch):
      # scale -> grad -> unscale -> finite? -> adjust the scale, in one call.
      loss_scale, finite, (loss, _), grads = grad_fn(loss_scale, params, batch)
      # skip_nonfinite leaves params and optimizer state as they were if not.
      updates, opt_state = optimizer.update(grads, opt_state, params,
                                            grads_finite=finite)
      params = optax.apply_updates(params, updates)
      return params, opt_state, loss_scale, loss, finite

    if microbatches > 1:  # The same step over microbatches, in one call.
      optimizer = optax.adam(learning_rate)
      # `step`: the optimizer's count, for block formats' random draws.
      accumulating = jax.jit(mpolicy.make_train_step(
          lambda p, b, *, step: lm_loss(model.apply.at_step(step), p, b),
          optimizer, has_aux=True,
          microbatches=microbatches),
          # --debug_nonfinite reads a skipped step's params afterwards.
          donate_argnums=() if debug_nonfinite else (0, 1))

      def train_step(params, opt_state, loss_scale, batch):  # pylint: disable=function-redefined
        out = accumulating(params, opt_state, loss_scale, batch)
        return (out.params, out.opt_state, out.loss_scale, out.value[0],
                out.grads_finite)

    starts = sample_starts(corpus.train, config.seq_len, steps, batch_size,
                           seed)
    params = model.init(jax.random.PRNGKey(seed),
                        windows(corpus.train, starts[0], config.seq_len)[:, :-1])
    opt_state = optimizer.init(params)
    loss_scale = mp_flags.make_loss_scale(scale_type, scale_value)
    log = mp_report.Log(name, steps, log_every)
    reported = 0
    for i in range(steps):
      batch = windows(corpus.train, starts[i], config.seq_len)
      before = params, loss_scale
      params, opt_state, loss_scale, loss, finite = train_step(
          params, opt_state, loss_scale, batch)
      log.record(loss, loss_scale.loss_scale, finite)
      if debug_nonfinite and not finite and reported < DEBUG_REPORTS:
        reported += 1
        report_nonfinite(model.apply, i, batch, *before)

    metrics = evaluate(model.apply, params, corpus, config.seq_len)
    metrics["final loss"] = float(np.mean(log.loss[-10:]))
    explained = mp_report.explain_summary(
        model.apply, params, None, windows(corpus.test, np.zeros(2, int),
                                           config.seq_len)[:, :-1])
  return mp_report.Run(name, policy, scale_type, metrics, log, explained)


DEBUG_REPORTS = 3  # Skipped steps `--debug_nonfinite` reports on.


def report_nonfinite(apply, step: int, batch, params, loss_scale) -> None:
  """Prints where step `step`'s first non-finite value appeared."""
  report = mpolicy.locate_nonfinite(
      lambda p, b: lm_loss(apply, p, b)[0], params, batch,
      loss_scale=loss_scale)
  print(f"step {step + 1} was skipped: "
        + (str(report) if report is not None else
           "this batch is finite when run op by op (XLA's fused code "
           "differs)"), flush=True)


def load_corpus_from_flags(seq_len: int) -> Corpus:
  """The `--corpus_files` corpus; a usage error if it is too short."""
  corpus = load_corpus(FLAGS.corpus_files)
  if len(corpus.test) < seq_len + 2:
    raise app.UsageError(
        f"--corpus_files: the text has {len(corpus.train) + len(corpus.test)} "
        f"characters, too few for --seq_len={seq_len} (its last 10% is the "
        "test set, which needs more than one window): add files.")
  return corpus


def main() -> None:
  config = model_config_from_flags()
  corpus = load_corpus_from_flags(config.seq_len)
  print(f"corpus: {len(corpus.train)} train / {len(corpus.test)} test "
        f"characters, vocabulary of {len(corpus.vocab)}; {FLAGS.steps} steps "
        f"of {FLAGS.batch_size}x{config.seq_len}, jax {jax.__version__} on "
        f"{jax.default_backend()}")
  settings = dict(steps=FLAGS.steps, batch_size=FLAGS.batch_size,
                  learning_rate=FLAGS.learning_rate, seed=FLAGS.seed,
                  log_every=FLAGS.log_every, microbatches=FLAGS.microbatches,
                  debug_nonfinite=FLAGS.debug_nonfinite)
  runs = []
  if FLAGS.compare:
    runs.append(train(corpus, config, policy="full", **settings))
  runs.append(train(corpus, config, policy=FLAGS.mp_policy,
                    norm_policy=FLAGS.mp_bn_policy,
                    attention_policy=FLAGS.attention_policy,
                    keep_bf16=FLAGS.keep_bf16,
                    scale_type=FLAGS.mp_scale_type,
                    scale_value=FLAGS.mp_scale_value, **settings))
  print()
  mp_report.summary(runs, METRICS)
  if FLAGS.plot:
    mp_report.plot(runs, FLAGS.plot, "char transformer: "
                   + " vs ".join(r.name for r in runs))


if __name__ == "__main__":
  mp_flags.run(main, steps=300, batch_size=32, learning_rate=3e-3,
               log_every=50)
