r"""A CNN with BatchNorm on scikit-learn's handwritten digits, in mixed precision.

The main job: trains a float32 baseline and a bfloat16 run with the same
seed and batches, then prints a table of both. Run it as a file, from any
directory:

  python examples/digits_cnn.py
  python examples/digits_cnn.py --mp_policy=p=f32,c=f16,o=f32 \
      --mp_scale_type=Dynamic --plot=/tmp/digits.png

The model runs under `--mp_policy` (bfloat16 compute by default) and its
BatchNorm layers under `--mp_bn_policy` (float32 by default), the way
Haiku's ImageNet example wires them:

  mpolicy.set_policy(DigitsCNN, policy)         # the model...
  mpolicy.set_policy(hk.BatchNorm, bn_policy)   # ...but BatchNorm in float32
  model = mpolicy.transform_amp_with_state(forward)

(`train` uses `push_policy`, so that two runs in one process stay apart.)
The step is `mpolicy.make_train_step(loss_fn, optimizer, has_state=True)`:
loss-scaled gradients, and an update applied only when they are finite,
BatchNorm's moving averages included.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Optional

from absl import flags
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax

import mpolicy

# Sibling modules in examples/ (the script's directory is on sys.path).
import digits_data
import mp_flags
import mp_report

FLAGS = flags.FLAGS
flags.adopt_module_key_flags(mp_flags)  # --helpshort lists them too.
mp_flags.define_bn_policy()
flags.DEFINE_list("channels", ["32", "64"],
                  "Output channels of the conv layers (each followed by "
                  "BatchNorm, ReLU and 2x2 max pooling).")
flags.register_validator(
    "channels", lambda v: bool(v) and all(c.isdigit() and int(c) > 0 for c in v),
    message="--channels must be a comma-separated list of positive integers.")

METRICS = ("test accuracy", "final loss")


class DigitsCNN(hk.Module):
  """Conv -> BatchNorm -> ReLU -> max pool blocks, then a linear head."""

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


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Mean softmax cross-entropy, computed in float32."""
  return optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), labels).mean()


def train(data: digits_data.Digits, *, policy: str = "p=f32,c=bf16,o=f32",
          bn_policy: str = "full", scale_type: str = "NoOp",
          scale_value: float = 2.0**15, steps: int = 400, batch_size: int = 64,
          learning_rate: float = 3e-3, seed: int = 0,
          channels: Sequence[int] = (32, 64), log_every: int = 100,
          callback: Optional[Callable[..., None]] = None) -> mp_report.Run:
  """Trains the CNN under `policy` (BatchNorm under `bn_policy`).

  `callback(step, params, state)` runs after every step (tests use it).
  """
  name = mp_report.label(policy, scale_type)
  # Policies are read when the model is traced: trace (and so compile) the
  # step inside the pushes.
  with mpolicy.push_policy(DigitsCNN, policy), \
       mpolicy.push_policy(hk.BatchNorm, bn_policy):
    model = mpolicy.transform_amp_with_state(
        lambda x, is_training: DigitsCNN(channels)(x, is_training))

    def loss_fn(params, state, x, y):
      logits, state = model.apply(params, state, None, x, is_training=True)
      return cross_entropy(logits, y), state

    optimizer = optax.adam(learning_rate)
    # scale -> grad -> unscale -> finite? -> adjust the scale, then the
    # update only if finite (params, optimizer and BatchNorm state are kept
    # as they were on a non-finite step, and the loss scale backs off).
    train_step = jax.jit(
        mpolicy.make_train_step(loss_fn, optimizer, has_state=True))

    params, state = model.init(jax.random.PRNGKey(seed),
                               data.x_train[:batch_size], True)
    opt_state = optimizer.init(params)
    loss_scale = mp_flags.make_loss_scale(scale_type, scale_value)
    log = mp_report.Log(name, steps, log_every)
    order = digits_data.batches(len(data.y_train), batch_size, steps, seed)
    for i, idx in enumerate(order):
      out = train_step(params, state, opt_state, loss_scale,
                       data.x_train[idx], data.y_train[idx])
      params, state = out.params, out.model_state
      opt_state, loss_scale = out.opt_state, out.loss_scale
      log.record(out.value, loss_scale.loss_scale, out.grads_finite)
      if callback is not None:
        callback(i, params, state)

    # Evaluation uses BatchNorm's moving averages.
    logits, _ = jax.jit(model.apply, static_argnums=4)(
        params, state, None, data.x_test, False)
    metrics = {
        "test accuracy": float(np.mean(np.argmax(logits, -1) == data.y_test)),
        "final loss": float(np.mean(log.loss[-10:])),
    }
    explained = mp_report.explain_summary(model.apply, params, state, None,
                                          data.x_test[:8], False)
  return mp_report.Run(name, policy, scale_type, metrics, log, explained)


def main() -> None:
  data = digits_data.load_digits()
  print(f"digits: {len(data.y_train)} train / {len(data.y_test)} test images, "
        f"{FLAGS.steps} steps of {FLAGS.batch_size}, "
        f"jax {jax.__version__} on {jax.default_backend()}")
  settings = dict(steps=FLAGS.steps, batch_size=FLAGS.batch_size,
                  learning_rate=FLAGS.learning_rate, seed=FLAGS.seed,
                  channels=[int(c) for c in FLAGS.channels],
                  log_every=FLAGS.log_every)
  runs = []
  if FLAGS.compare:
    runs.append(train(data, policy="full", bn_policy="full", **settings))
  runs.append(train(data, policy=FLAGS.mp_policy, bn_policy=FLAGS.mp_bn_policy,
                    scale_type=FLAGS.mp_scale_type,
                    scale_value=FLAGS.mp_scale_value, **settings))
  print()
  mp_report.summary(runs, METRICS)
  if FLAGS.plot:
    mp_report.plot(runs, FLAGS.plot, "digits CNN: "
                   + " vs ".join(r.name for r in runs))


if __name__ == "__main__":
  mp_flags.run(main, steps=400, batch_size=64, learning_rate=3e-3,
               compare=True)
