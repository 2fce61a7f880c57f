r"""A small character-level transformer LM, trained in mixed precision.

The corpus is a few of the standard library's own source files, read from
disk (`os.path.dirname(os.__file__)`) in a fixed order: it exists wherever
Python does, so nothing is downloaded. The model has attention, softmax,
LayerNorm and a GELU MLP per block, each block under `hk.remat`.

The attention blocks are modules named `attention`, so a name pattern
reaches all of them, e.g. to keep attention in float32 while the rest of the
model computes in bfloat16:

  python -m examples.char_transformer --attention_policy=full --compare

which sets `mpolicy.set_policy("*/attention", "full")` for the run (rule 1
of the registry: a pattern on a module's own name beats the class default).
LayerNorms follow `--mp_bn_policy` (float32 by default).
"""

from __future__ import annotations

from collections.abc import Sequence
import contextlib
import dataclasses
import math
import os
from typing import Any, Callable, Optional

from absl import app
from absl import flags
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax

import mpolicy
from examples import common

FLAGS = flags.FLAGS
flags.adopt_module_key_flags(common)  # --help lists the shared flags too.

DEFAULT_CORPUS = ("bisect.py", "heapq.py", "functools.py", "textwrap.py",
                  "string.py", "abc.py", "contextlib.py")
ATTENTION_PATTERN = "*/attention"

flags.DEFINE_string(
    "attention_policy", "",
    f"Policy for the attention blocks (registry pattern "
    f"'{ATTENTION_PATTERN}'), e.g. 'full'; empty: they follow --mp_policy.")
flags.DEFINE_list("corpus_files", list(DEFAULT_CORPUS),
                  "Standard library files (relative to the directory of "
                  "os.py) to train on, in this order.")
flags.DEFINE_integer("seq_len", 64, "Characters per training sequence.")
flags.DEFINE_integer("d_model", 64, "Width of the residual stream.")
flags.DEFINE_integer("num_heads", 4, "Attention heads per block.")
flags.DEFINE_integer("num_layers", 2, "Number of transformer blocks.")
flags.DEFINE_bool("remat", True, "Wrap each block in hk.remat.")

flags.register_validator("attention_policy", common.check_optional_policy_spec)

DEFAULTS = dict(steps=300, batch_size=32, learning_rate=3e-3, log_every=50,
                compare=False)
METRICS = ("test accuracy", "test loss", "final loss")


# --- Data ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Corpus:
  """Token ids of the text, split 90/10, and the vocabulary."""
  train: np.ndarray  # [N] int32
  test: np.ndarray
  vocab: str


def load_corpus(files: Sequence[str] = DEFAULT_CORPUS) -> Corpus:
  """Concatenates the named standard library files (missing ones skipped)."""
  root = os.path.dirname(os.__file__)
  texts = []
  for name in files:
    path = os.path.join(root, name)
    if os.path.isfile(path):
      with open(path, encoding="utf-8") as f:
        texts.append(f.read())
  if not texts:
    raise FileNotFoundError(f"None of {list(files)} found in {root}.")
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


class SelfAttention(hk.Module):
  """Causal multi-head self-attention."""

  def __init__(self, num_heads: int, name: str = "attention"):
    super().__init__(name=name)
    self.num_heads = num_heads

  def __call__(self, x: jax.Array) -> jax.Array:
    batch, length, width = x.shape
    head = width // self.num_heads

    def heads(name):  # [batch, length, heads, head]
      y = hk.Linear(width, name=name)(x)
      return y.reshape(batch, length, self.num_heads, head)

    q, k, v = heads("query"), heads("key"), heads("value")
    logits = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(head)
    causal = jnp.tril(jnp.ones((length, length), bool))
    logits = jnp.where(causal, logits, jnp.finfo(logits.dtype).min)
    weights = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bhts,bshd->bthd", weights, v)
    return hk.Linear(width, name="output")(out.reshape(batch, length, width))


class Block(hk.Module):
  """Pre-LayerNorm transformer block: attention, then a GELU MLP."""

  def __init__(self, num_heads: int, name: Optional[str] = None):
    super().__init__(name=name)
    self.num_heads = num_heads

  def __call__(self, x: jax.Array) -> jax.Array:
    width = x.shape[-1]
    ln = lambda n: hk.LayerNorm(-1, create_scale=True, create_offset=True,
                                name=n)
    x = x + SelfAttention(self.num_heads, name="attention")(ln("ln_1")(x))
    h = hk.Linear(4 * width, name="mlp_in")(ln("ln_2")(x))
    return x + hk.Linear(width, name="mlp_out")(jax.nn.gelu(h))


class CharTransformer(hk.Module):
  """Embeddings, `num_layers` blocks (each under `hk.remat`), logits."""

  def __init__(self, vocab_size: int, d_model: int, num_heads: int,
               num_layers: int, max_len: int, remat: bool = True,
               name: Optional[str] = None):
    super().__init__(name=name)
    self.vocab_size = vocab_size
    self.d_model = d_model
    self.num_heads = num_heads
    self.num_layers = num_layers
    self.max_len = max_len
    self.remat = remat

  def __call__(self, tokens: jax.Array) -> jax.Array:
    init = hk.initializers.TruncatedNormal(0.02)
    x = hk.Embed(self.vocab_size, self.d_model, w_init=init,
                 name="embed")(tokens)
    pos = hk.get_parameter("pos_embed", [self.max_len, self.d_model],
                           init=init)
    x = x + pos[:tokens.shape[1]].astype(x.dtype)
    for i in range(self.num_layers):
      block = Block(self.num_heads, name=f"block_{i}")
      x = hk.remat(block)(x) if self.remat else block(x)
    x = hk.LayerNorm(-1, create_scale=True, create_offset=True,
                     name="ln_final")(x)
    return hk.Linear(self.vocab_size, name="logits")(x)


# --- Training ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Config:
  """Everything a run depends on besides the mixed precision settings."""
  steps: int = DEFAULTS["steps"]
  batch_size: int = DEFAULTS["batch_size"]
  learning_rate: float = DEFAULTS["learning_rate"]
  seed: int = 0
  seq_len: int = 64
  d_model: int = 64
  num_heads: int = 4
  num_layers: int = 2
  remat: bool = True
  attention_policy: str = ""
  log_every: int = DEFAULTS["log_every"]


def make_model(config: Config, vocab_size: int) -> hk.Transformed:

  def forward(tokens):
    return CharTransformer(vocab_size, config.d_model, config.num_heads,
                           config.num_layers, config.seq_len,
                           remat=config.remat, name="transformer")(tokens)

  return mpolicy.transform_amp(forward)


def lm_loss(model: hk.Transformed, params, batch) -> tuple[jax.Array, Any]:
  """Mean next-character cross-entropy (float32) and the accuracy."""
  inputs, targets = batch[:, :-1], batch[:, 1:]
  logits = model.apply(params, None, inputs).astype(jnp.float32)
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  correct = jnp.argmax(logits, -1) == targets
  return loss.mean(), correct.mean()


def train(config: Config, mp: common.MixedPrecision,
          corpus: Optional[Corpus] = None, label: Optional[str] = None,
          callback: Optional[Callable[[int, Any], None]] = None
          ) -> common.RunResult:
  """Trains the LM under the policies in `mp` (and `attention_policy`)."""
  corpus = load_corpus() if corpus is None else corpus
  label = mp.label if label is None else label
  with contextlib.ExitStack() as policies:
    policies.enter_context(mpolicy.push_policy(CharTransformer, mp.policy))
    policies.enter_context(mpolicy.push_policy(hk.LayerNorm, mp.norm_policy))
    if config.attention_policy:
      policies.enter_context(mpolicy.push_policy(ATTENTION_PATTERN,
                                                 config.attention_policy))
      label += "+attn:" + common.compute_name(config.attention_policy)
    model = make_model(config, len(corpus.vocab))
    rng = np.random.RandomState(config.seed)
    starts = rng.randint(0, len(corpus.train) - config.seq_len - 1,
                         size=(config.steps, config.batch_size))
    params = model.init(jax.random.PRNGKey(config.seed),
                        windows(corpus.train, starts[0], config.seq_len)[:, :-1])
    tx = optax.adam(config.learning_rate)
    if mp.skip_nonfinite:
      tx = mpolicy.skip_nonfinite(tx)
    grad_fn = mpolicy.scaled_value_and_grad(
        lambda p, b: lm_loss(model, p, b), has_aux=True)

    @jax.jit
    def train_step(params, opt_state, loss_scale, batch):
      loss_scale, finite, (loss, _), grads = grad_fn(loss_scale, params, batch)
      extra = dict(grads_finite=finite) if mp.skip_nonfinite else {}
      updates, opt_state = tx.update(grads, opt_state, params, **extra)
      return (optax.apply_updates(params, updates), opt_state, loss_scale,
              loss, finite)

    def step(carry, i):
      params, opt_state, loss_scale = carry
      batch = windows(corpus.train, starts[i], config.seq_len)
      params, opt_state, loss_scale, loss, finite = train_step(
          params, opt_state, loss_scale, batch)
      return ((params, opt_state, loss_scale),
              common.StepInfo(loss, loss_scale.loss_scale, finite))

    carry = (params, tx.init(params), mp.loss_scale())
    carry, history, compile_time, train_time = common.train_loop(
        step, carry, config.steps, label=label, log_every=config.log_every,
        skip_nonfinite=mp.skip_nonfinite, callback=callback)
    params = carry[0]
    test_starts = np.arange(0, len(corpus.test) - config.seq_len - 1,
                            config.seq_len)[:128]
    test_batch = windows(corpus.test, test_starts, config.seq_len)
    test_loss, test_acc = jax.jit(lambda p, b: lm_loss(model, p, b))(
        params, test_batch)
    metrics = {"test accuracy": float(test_acc), "test loss": float(test_loss),
               "final loss": float(np.mean(history.loss[-10:]))}
    explained = common.explain_summary(model.apply, params, None,
                                       test_batch[:2, :-1])
  return common.RunResult(label, mp, metrics, train_time, compile_time,
                          history, explained, final=params)


def config_from_flags() -> Config:
  return Config(steps=FLAGS.steps, batch_size=FLAGS.batch_size,
                learning_rate=FLAGS.learning_rate, seed=FLAGS.seed,
                seq_len=FLAGS.seq_len, d_model=FLAGS.d_model,
                num_heads=FLAGS.num_heads, num_layers=FLAGS.num_layers,
                remat=FLAGS.remat, attention_policy=FLAGS.attention_policy,
                log_every=FLAGS.log_every)


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
  common.set_defaults(**DEFAULTS)
  config = config_from_flags()
  mp = common.MixedPrecision.from_flags()
  corpus = load_corpus(FLAGS.corpus_files)
  print(f"corpus: {len(corpus.train)} train / {len(corpus.test)} test "
        f"characters, vocabulary of {len(corpus.vocab)}; {config.steps} steps "
        f"of {config.batch_size}x{config.seq_len}, jax {jax.__version__} on "
        f"{jax.default_backend()}")
  runs = []
  if FLAGS.compare:
    runs.append(dataclasses.replace(config, attention_policy=""))
  runs.append(config)
  mps = ([common.MixedPrecision.float32(mp.skip_nonfinite)] if FLAGS.compare
         else []) + [mp]
  results = [train(c, m, corpus) for c, m in zip(runs, mps)]
  print()
  common.report(results, METRICS, FLAGS.plot,
                title="char transformer: "
                + " vs ".join(r.label for r in results))


flags.register_validator(
    "num_heads", lambda v: v >= 1, message="--num_heads must be at least 1.")
flags.register_multi_flags_validator(
    ["d_model", "num_heads"],
    lambda f: f["d_model"] % f["num_heads"] == 0,
    message="--d_model must be a multiple of --num_heads.")

if __name__ == "__main__":
  common.run(main, DEFAULTS)
