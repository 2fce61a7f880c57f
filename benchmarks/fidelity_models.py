"""The five models `fidelity.py` trains, each on data a pip package ships.

  digits_cnn        Haiku: examples/digits_cnn.py's CNN on scikit-learn's
                    digits; test accuracy and loss.
  char_transformer  Haiku: the examples' transformer LM (`models.py`) on
                    the standard library's source; held-out loss (nats).
  gpt2_linen        Flax linen: a GPT-2-style LM (pre-LN blocks, learned
                    positions, untied head by default) on the same text.
  patches_eqx       Equinox: which of 24 regions (2 photos of
                    `sklearn.datasets.load_sample_images`, 3 x 4 cells each)
                    a 16x16 patch comes from; the test patches come from
                    rows of each cell that no training patch touches.
  co2_mlp           plain JAX under `mpolicy.amp`: the next weekly change
                    of statsmodels' Mauna Loa CO2 series from the last 52;
                    held-out MSE (standardized units) on the last 20%.

Each is a `Task`: float32 functions with no mpolicy in them; `fidelity.py`
puts the precision on. Layers of Equinox and plain JAX are named scopes
(patterns for `set_policy`), the others module paths.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from typing import Any, Callable

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
sys.path.insert(0, os.path.join(os.path.dirname(_HERE), "examples"))
# pylint: disable=g-import-not-at-top,wrong-import-position
import char_transformer
import digits_cnn
import digits_data
import models


@dataclasses.dataclass(frozen=True)
class Task:
  """A model, its data and its held-out metrics, all in float32.

  `init(data, seed)` gives `(params, state)`; `apply(params, state, x,
  training)` gives `(output, state)`; `loss(output, y)` the mean training
  loss; `evaluate(output, y)` the held-out metrics; `batches(data, seed,
  steps)` the `(x, y)` of each step; `test(data)` the held-out `(x, y)`.
  `root`: the framework's module class (its registry entry is the default
  policy), or None; `full`: registry keys kept in float32 (norms);
  `first_last`: patterns of the first and last layers.
  """
  name: str
  front_end: str
  metric: str
  load: Callable[[], Any]
  init: Callable[[Any, int], tuple]
  apply: Callable[..., tuple]
  loss: Callable[[jax.Array, jax.Array], jax.Array]
  evaluate: Callable[[jax.Array, jax.Array], dict]
  batches: Callable[[Any, int, int], list]
  test: Callable[[Any], tuple]
  root: Any = None
  full: tuple = ()
  first_last: tuple = ()
  learning_rate: float = 3e-3


def cross_entropy(logits, labels):
  """Mean softmax cross-entropy in float32 (nats)."""
  return optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), labels).mean()


def _classified(logits, labels) -> dict:
  logits = jnp.asarray(logits, jnp.float32)
  return {"test_loss": float(cross_entropy(logits, labels)),
          "test_accuracy": float(jnp.mean(logits.argmax(-1) == labels))}


def _haiku(fn) -> tuple:
  """`(init(rng, x), apply(params, state, x, training))` of a Haiku fn."""
  f = hk.transform_with_state(fn)
  return (lambda key, x: f.init(key, x, True),
          lambda p, s, x, training: f.apply(p, s, None, x, training))


# --- digits_cnn ---------------------------------------------------------------

_digits_init, _digits_apply = _haiku(
    lambda x, training: digits_cnn.DigitsCNN()(x, training))


def _digits_batches(data, seed: int, steps: int) -> list:
  order = digits_data.batches(len(data.y_train), 64, steps, seed)
  return [(data.x_train[i], data.y_train[i]) for i in order]


DIGITS = Task(
    "digits_cnn", "Haiku", "test_accuracy", digits_data.load_digits,
    lambda data, seed: _digits_init(jax.random.PRNGKey(seed),
                                    data.x_train[:64]),
    _digits_apply, cross_entropy, _classified, _digits_batches,
    lambda data: (data.x_test, data.y_test), root=hk.Module,
    full=(hk.BatchNorm,), first_last=("*/conv_0", "*/logits"))

# --- The language models: the standard library's source -----------------------

SEQ_LEN, BATCH = 64, 32


def _lm_batches(corpus, seed: int, steps: int) -> list:
  starts = char_transformer.sample_starts(corpus.train, SEQ_LEN, steps, BATCH,
                                          seed)
  windows = [char_transformer.windows(corpus.train, s, SEQ_LEN)
             for s in starts]
  return [(w[:, :-1], w[:, 1:]) for w in windows]


def _lm_test(corpus) -> tuple:
  starts = np.arange(0, len(corpus.test) - SEQ_LEN - 1, SEQ_LEN)[:128]
  w = char_transformer.windows(corpus.test, starts, SEQ_LEN)
  return w[:, :-1], w[:, 1:]


def _lm_evaluate(logits, targets) -> dict:
  return _classified(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


_CONFIG = models.ModelConfig(SEQ_LEN, 64, 4, 2, False)
_VOCAB = len(char_transformer.load_corpus().vocab)
_char_init, _char_apply = _haiku(
    lambda x, training: models.CharTransformer(_VOCAB, _CONFIG)(x))

CHAR = Task(
    "char_transformer", "Haiku", "test_loss", char_transformer.load_corpus,
    lambda corpus, seed: _char_init(jax.random.PRNGKey(seed),
                                    _lm_batches(corpus, seed, 1)[0][0]),
    _char_apply, cross_entropy, _lm_evaluate, _lm_batches, _lm_test,
    root=hk.Module, full=(hk.LayerNorm,),
    first_last=char_transformer.KEEP_FIRST_LAST)


def _gpt2_task() -> Task:
  """The linen GPT-2 (Flax is imported only for it)."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top

  class Block(nn.Module):
    """Pre-LN: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""
    heads: int

    @nn.compact
    def __call__(self, x):
      b, t, d = x.shape
      qkv = nn.Dense(3 * d, name="attn_qkv")(nn.LayerNorm(name="ln_1")(x))
      q, k, v = jnp.split(qkv.reshape(b, t, 3 * self.heads, -1), 3, axis=2)
      scores = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(d // self.heads)
      causal = jnp.tril(jnp.ones((t, t), bool))
      scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
      out = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(scores, -1), v)
      x = x + nn.Dense(d, name="attn_proj")(out.reshape(b, t, d))
      h = nn.Dense(4 * d, name="mlp_fc")(nn.LayerNorm(name="ln_2")(x))
      return x + nn.Dense(d, name="mlp_proj")(jax.nn.gelu(h))

  class GPT2(nn.Module):
    """Token and learned position embeddings, blocks, ln_f, the head."""
    vocab: int
    d_model: int = 64
    heads: int = 4
    layers: int = 2
    tied: bool = False

    @nn.compact
    def __call__(self, tokens):
      init = nn.initializers.normal(0.02)
      wte = nn.Embed(self.vocab, self.d_model, embedding_init=init, name="wte")
      pos = nn.Embed(SEQ_LEN, self.d_model, embedding_init=init, name="wpe")
      x = wte(tokens) + pos(jnp.arange(tokens.shape[1]))[None]
      for i in range(self.layers):
        x = Block(self.heads, name=f"block_{i}")(x)
      x = nn.LayerNorm(name="ln_f")(x)
      return wte.attend(x) if self.tied else nn.Dense(self.vocab,
                                                      name="head")(x)

  model = GPT2(_VOCAB)

  def init(corpus, seed):
    x = _lm_batches(corpus, seed, 1)[0][0]
    return model.init(jax.random.PRNGKey(seed), x), {}

  return Task(
      "gpt2_linen", "Flax linen", "test_loss", char_transformer.load_corpus,
      init, lambda p, s, x, training: (model.apply(p, x), s), cross_entropy,
      _lm_evaluate, _lm_batches, _lm_test, root=nn.Module,
      full=(nn.LayerNorm,), first_last=("*/block_0/attn_qkv", "*/head"))


# --- patches_eqx: regions of scikit-learn's two sample photos ------------------

PATCH, GRID, TEST_ROWS = 16, (3, 4), 32


def _load_patches() -> dict:
  """The photos in [-0.5, 0.5] and each class's cell (image, top, left,
  height, width); the last `TEST_ROWS` rows of a cell are held out."""
  from sklearn.datasets import load_sample_images  # pylint: disable=g-import-not-at-top
  images = np.stack(load_sample_images().images).astype(np.float32) / 255 - .5
  _, h, w, _ = images.shape
  ch, cw = h // GRID[0], w // GRID[1]
  cells = [(i, r * ch, c * cw, ch, cw) for i in range(len(images))
           for r in range(GRID[0]) for c in range(GRID[1])]
  rng = np.random.RandomState(0)
  test = _sample(images, cells, rng, 40, held_out=True)
  return {"images": images, "cells": cells, "test": test}


def _sample(images, cells, rng, per_class: int, held_out: bool) -> tuple:
  xs, ys = [], []
  for label, (i, top, left, ch, cw) in enumerate(cells):
    lo = top + ch - TEST_ROWS if held_out else top
    hi = top + ch - PATCH if held_out else top + ch - TEST_ROWS - PATCH
    for _ in range(per_class):
      y, x = rng.randint(lo, hi + 1), rng.randint(left, left + cw - PATCH + 1)
      xs.append(images[i, y:y + PATCH, x:x + PATCH])
      ys.append(label)
  return np.stack(xs), np.array(ys, np.int32)


def _patch_batches(data, seed: int, steps: int) -> list:
  rng = np.random.RandomState(seed)
  out = []
  for _ in range(steps):
    x, y = _sample(data["images"], data["cells"], rng, 1, held_out=False)
    order = rng.permutation(len(y))[:64]
    out.append((x[order], y[order]))
  return out


def _patches_task() -> Task:
  """An Equinox MLP on flattened patches, each layer a named scope."""
  import equinox as eqx  # pylint: disable=g-import-not-at-top

  class PatchMLP(eqx.Module):
    layers: list

    def __init__(self, key, sizes=(PATCH * PATCH * 3, 256, 128, 24)):
      keys = jax.random.split(key, len(sizes) - 1)
      self.layers = [eqx.nn.Linear(a, b, key=k)
                     for a, b, k in zip(sizes[:-1], sizes[1:], keys)]

    def __call__(self, x):
      x = x.reshape(-1)
      for i, layer in enumerate(self.layers):
        last = i == len(self.layers) - 1
        with jax.named_scope("head" if last else f"hidden_{i}"):
          x = layer(x) if last else jax.nn.relu(layer(x))
      return x

  def apply(model, state, x, training):
    del training
    return jax.vmap(model)(x), state

  return Task(
      "patches_eqx", "Equinox", "test_loss", _load_patches,
      lambda data, seed: (PatchMLP(jax.random.PRNGKey(seed)), {}), apply,
      cross_entropy, _classified, _patch_batches, lambda data: data["test"],
      first_last=("hidden_0", "head"), learning_rate=1e-3)


# --- co2_mlp: plain JAX on statsmodels' CO2 series ------------------------------

WINDOW = 52


def _load_co2() -> dict:
  """Weekly changes of the series (gaps interpolated), standardized on the
  first 80%, as windows of `WINDOW` and the change after each."""
  from statsmodels.datasets import co2  # pylint: disable=g-import-not-at-top
  series = co2.load_pandas().data["co2"].interpolate().to_numpy(np.float64)
  diff = np.diff(series)
  split = int(0.8 * len(diff))
  diff = ((diff - diff[:split].mean()) / diff[:split].std()).astype(np.float32)
  starts = np.arange(len(diff) - WINDOW)
  x = diff[starts[:, None] + np.arange(WINDOW)]
  y = diff[starts + WINDOW]
  train = starts + WINDOW < split
  return {"x_train": x[train], "y_train": y[train],
          "x_test": x[~train], "y_test": y[~train]}


def _co2_init(data, seed: int) -> tuple:
  del data
  sizes = (WINDOW, 128, 128, 1)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(sizes) - 1)
  params = [{"w": jax.random.normal(k, (a, b)) / np.sqrt(a), "b": jnp.zeros(b)}
            for a, b, k in zip(sizes[:-1], sizes[1:], keys)]
  return params, {}


def _co2_apply(params, state, x, training) -> tuple:
  del training
  for i, layer in enumerate(params):
    last = i == len(params) - 1
    with jax.named_scope("head" if last else f"layer_{i}"):
      x = x @ layer["w"] + layer["b"]
      x = x if last else jax.nn.relu(x)
  return x[:, 0], state


def _mse(out, y):
  return jnp.mean((out.astype(jnp.float32) - y) ** 2)


def _co2_batches(data, seed: int, steps: int) -> list:
  order = digits_data.batches(len(data["y_train"]), 64, steps, seed)
  return [(data["x_train"][i], data["y_train"][i]) for i in order]


CO2 = Task(
    "co2_mlp", "plain JAX (mpolicy.amp)", "test_mse", _load_co2, _co2_init,
    _co2_apply, _mse, lambda out, y: {"test_mse": float(_mse(out, y))},
    _co2_batches, lambda data: (data["x_test"], data["y_test"]),
    first_last=("layer_0", "head"), learning_rate=1e-3)

_LAZY = {"gpt2_linen": _gpt2_task, "patches_eqx": _patches_task}
NAMES = ("digits_cnn", "char_transformer", "gpt2_linen", "patches_eqx",
         "co2_mlp")


@functools.lru_cache(maxsize=None)
def task(name: str) -> Task:
  """The `Task` called `name` (one of `NAMES`)."""
  fixed = {"digits_cnn": DIGITS, "char_transformer": CHAR, "co2_mlp": CO2}
  if name in fixed:
    return fixed[name]
  if name in _LAZY:
    return _LAZY[name]()
  raise ValueError(f"unknown model {name!r}; the models are {NAMES}")
