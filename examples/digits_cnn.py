r"""A CNN with BatchNorm on scikit-learn's handwritten digits, in mixed precision.

The digits (8x8 images, 1797 of them) ship inside scikit-learn: no download.
The model runs under `--mp_policy` (bfloat16 compute by default) while its
BatchNorm layers run under `--mp_bn_policy` (float32 by default), wired the
way Haiku's ImageNet example does it:

  mpolicy.set_policy(hk.BatchNorm, bn_policy)   # class rule wins inside...
  mpolicy.set_policy(DigitsCNN, policy)         # ...the model's policy
  f = mpolicy.transform_amp_with_state(forward) # BatchNorm has state

(here with `push_policy`, so several runs in one process stay independent).

With `--compare` (the default) it also trains a float32 baseline with the
same seed and prints a markdown table:

  python -m examples.digits_cnn                     # bf16 vs f32
  python -m examples.digits_cnn --mp_policy=p=f32,c=f16,o=f32 \
      --mp_scale_type=Dynamic --plot=/tmp/digits.png
"""

from __future__ import annotations

from collections.abc import Sequence
import dataclasses
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

flags.DEFINE_list("channels", ["32", "64"],
                  "Output channels of the conv layers (each followed by "
                  "BatchNorm and ReLU).")

DEFAULTS = dict(steps=400, batch_size=64, learning_rate=3e-3, log_every=100,
                compare=True)
METRICS = ("test accuracy", "final loss")


# --- Data ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Digits:
  """The digits, split 80/20 (stratified, fixed seed), images in [0, 1]."""
  x_train: np.ndarray  # [N, 8, 8, 1] float32
  y_train: np.ndarray  # [N] int32
  x_test: np.ndarray
  y_test: np.ndarray


def load_digits(split_seed: int = 0) -> Digits:
  """Loads scikit-learn's bundled digits; the split does not use --seed."""
  from sklearn import datasets  # pylint: disable=g-import-not-at-top
  from sklearn import model_selection  # pylint: disable=g-import-not-at-top
  data = datasets.load_digits()
  x = (data.images / 16.0).astype(np.float32)[..., None]
  y = data.target.astype(np.int32)
  x_train, x_test, y_train, y_test = model_selection.train_test_split(
      x, y, test_size=0.2, random_state=split_seed, stratify=y)
  return Digits(x_train, y_train, x_test, y_test)


def batch_indices(num_examples: int, batch_size: int, steps: int,
                  seed: int) -> np.ndarray:
  """[steps, batch_size] indices: shuffled epochs, deterministic in `seed`."""
  rng = np.random.RandomState(seed)
  epochs = -(-steps * batch_size // num_examples)
  order = np.concatenate([rng.permutation(num_examples) for _ in range(epochs)])
  return order[:steps * batch_size].reshape(steps, batch_size)


# --- Model ---------------------------------------------------------------------


class DigitsCNN(hk.Module):
  """Conv -> BatchNorm -> ReLU blocks, 2x2 max pooling after each, a linear head."""

  def __init__(self, channels: Sequence[int] = (32, 64), num_classes: int = 10,
               name: Optional[str] = None):
    super().__init__(name=name)
    self.channels = tuple(channels)
    self.num_classes = num_classes

  def __call__(self, x: jax.Array, is_training: bool) -> jax.Array:
    for i, c in enumerate(self.channels):
      x = hk.Conv2D(c, kernel_shape=3, name=f"conv_{i}")(x)
      x = hk.BatchNorm(create_scale=True, create_offset=True, decay_rate=0.9,
                       name=f"batch_norm_{i}")(x, is_training)
      x = jax.nn.relu(x)
      x = hk.max_pool(x, window_shape=2, strides=2, padding="SAME")
    x = hk.Flatten()(x)
    return hk.Linear(self.num_classes, name="logits")(x)


def make_model(channels: Sequence[int]) -> hk.TransformedWithState:
  """The CNN under `transform_amp_with_state` (BatchNorm has state)."""

  def forward(x, is_training):
    return DigitsCNN(channels)(x, is_training)

  return mpolicy.transform_amp_with_state(forward)


# --- Training ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Config:
  """Everything a run depends on besides the mixed precision settings."""
  steps: int = DEFAULTS["steps"]
  batch_size: int = DEFAULTS["batch_size"]
  learning_rate: float = DEFAULTS["learning_rate"]
  seed: int = 0
  channels: tuple[int, ...] = (32, 64)
  log_every: int = DEFAULTS["log_every"]


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Mean softmax cross-entropy, computed in float32."""
  return optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), labels).mean()


def make_train_step(model: hk.TransformedWithState,
                    optimizer: optax.GradientTransformation,
                    skip_nonfinite: bool) -> Callable[..., Any]:
  """A jitted step: loss-scaled grads, then an update skipped if not finite.

  `mpolicy.scaled_value_and_grad` does scale -> grad -> unscale -> finite
  check -> scale adjustment in one call; `optimizer` is expected to be
  wrapped in `mpolicy.skip_nonfinite` when `skip_nonfinite` is set, and the
  BatchNorm state is kept too on a skipped step.
  """

  def loss_fn(params, state, x, y):
    logits, new_state = model.apply(params, state, None, x, is_training=True)
    return cross_entropy(logits, y), new_state

  grad_fn = mpolicy.scaled_value_and_grad(loss_fn, has_aux=True)

  @jax.jit
  def step(params, state, opt_state, loss_scale, x, y):
    loss_scale, finite, (loss, new_state), grads = grad_fn(
        loss_scale, params, state, x, y)
    if skip_nonfinite:
      updates, opt_state = optimizer.update(grads, opt_state, params,
                                            grads_finite=finite)
      new_state = mpolicy.select_tree(finite, new_state, state)
    else:
      updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, new_state, opt_state, loss_scale, loss, finite

  return step


def make_optimizer(learning_rate: float, skip_nonfinite: bool):
  tx = optax.adam(learning_rate)
  return mpolicy.skip_nonfinite(tx) if skip_nonfinite else tx


def accuracy(model: hk.TransformedWithState, params, state, x, y) -> float:
  """Test accuracy with BatchNorm's moving averages."""
  logits, _ = jax.jit(
      lambda p, s, x: model.apply(p, s, None, x, is_training=False))(
          params, state, x)
  return float(np.mean(np.argmax(np.asarray(logits), -1) == y))


def train(config: Config, mp: common.MixedPrecision,
          data: Optional[Digits] = None, label: Optional[str] = None,
          callback: Optional[Callable[[int, Any], None]] = None
          ) -> common.RunResult:
  """Trains the CNN under the policies in `mp`; returns the run's record.

  `callback(step, (params, state, opt_state, loss_scale))` runs after every
  step. The registry entries are pushed for this run only, and everything
  is traced inside the push, since policies are read at trace time.
  """
  data = load_digits() if data is None else data
  label = mp.label if label is None else label
  with mpolicy.push_policy(DigitsCNN, mp.policy), \
       mpolicy.push_policy(hk.BatchNorm, mp.norm_policy):
    model = make_model(config.channels)
    params, state = model.init(jax.random.PRNGKey(config.seed),
                               data.x_train[:config.batch_size], True)
    optimizer = make_optimizer(config.learning_rate, mp.skip_nonfinite)
    opt_state = optimizer.init(params)
    train_step = make_train_step(model, optimizer, mp.skip_nonfinite)
    indices = batch_indices(len(data.y_train), config.batch_size,
                            config.steps, config.seed)

    def step(carry, i):
      idx = indices[i]
      params, state, opt_state, loss_scale = carry
      params, state, opt_state, loss_scale, loss, finite = train_step(
          params, state, opt_state, loss_scale, data.x_train[idx],
          data.y_train[idx])
      info = common.StepInfo(loss, loss_scale.loss_scale, finite)
      return (params, state, opt_state, loss_scale), info

    carry = (params, state, opt_state, mp.loss_scale())
    carry, history, compile_time, train_time = common.train_loop(
        step, carry, config.steps, label=label, log_every=config.log_every,
        skip_nonfinite=mp.skip_nonfinite, callback=callback)
    params, state, _, _ = carry
    metrics = {
        "test accuracy": accuracy(model, params, state, data.x_test,
                                  data.y_test),
        "final loss": float(np.mean(history.loss[-10:])),
    }
    explained = common.explain_summary(model.apply, params, state, None,
                                       data.x_test[:8], False)
  return common.RunResult(label, mp, metrics, train_time, compile_time,
                          history, explained, final=(params, state))


def config_from_flags() -> Config:
  return Config(steps=FLAGS.steps, batch_size=FLAGS.batch_size,
                learning_rate=FLAGS.learning_rate, seed=FLAGS.seed,
                channels=tuple(int(c) for c in FLAGS.channels),
                log_every=FLAGS.log_every)


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
  common.set_defaults(**DEFAULTS)
  config = config_from_flags()
  mp = common.MixedPrecision.from_flags()
  data = load_digits()
  print(f"digits: {len(data.y_train)} train / {len(data.y_test)} test images, "
        f"{config.steps} steps of {config.batch_size}, "
        f"jax {jax.__version__} on {jax.default_backend()}")
  runs = []
  if FLAGS.compare:
    runs.append(common.MixedPrecision.float32(mp.skip_nonfinite))
  runs.append(mp)
  results = [train(config, run, data) for run in runs]
  print()
  common.report(results, METRICS, FLAGS.plot,
                title="digits CNN: " + " vs ".join(r.label for r in results))


def _validate_channels(values: Sequence[str]) -> bool:
  return bool(values) and all(v.isdigit() and int(v) > 0 for v in values)


flags.register_validator(
    "channels", _validate_channels,
    message="--channels must be a comma-separated list of positive integers.")

if __name__ == "__main__":
  common.run(main, DEFAULTS)
