r"""A Flax NNX MLP with BatchNorm on the digits, trained under `mpolicy.amp`.

Needs Flax (`pip install -e ".[flax]"`). Trains a float32 baseline and a
bfloat16 run with the same seed and batches, and prints a table of both:

  python examples/flax_mlp.py
  python examples/flax_mlp.py --mp_policy=p=f32,c=f16,o=f32 \
      --mp_scale_type=Dynamic

`amp` works on any JAX function, so the model goes in as a pure function of
its state: `nnx.split` it into a graph definition, params and batch
statistics, `nnx.merge` them inside the function, and return the new
statistics. A model closed over by an `amp`-ed function cannot update its
BatchNorm statistics in place (amp traces the function on its own), and
`amp` says so with a `TypeError` that shows this form. The step is
`mpolicy.make_train_step(loss_fn, optimizer, has_state=True)`.
"""

from __future__ import annotations

from absl import flags
from flax import nnx
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
METRICS = ("test accuracy", "final loss")


class MLP(nnx.Module):
  """Linear -> BatchNorm -> ReLU -> Linear, on flattened 8x8 images."""

  def __init__(self, hidden: int, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(64, hidden, rngs=rngs)
    self.norm = nnx.BatchNorm(hidden, momentum=0.9, rngs=rngs)
    self.out = nnx.Linear(hidden, 10, rngs=rngs)

  def __call__(self, x: jax.Array, train: bool) -> jax.Array:
    x = self.norm(self.hidden(x), use_running_average=not train)
    return self.out(jax.nn.relu(x))


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  return optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), labels).mean()


def setup(policy: str, learning_rate: float = 3e-3, seed: int = 0,
          hidden: int = 128):
  """The model's state, its jitted training step and its forward pass.

  Returns `(params, stats, opt_state, train_step, forward)`, where
  `train_step(params, stats, opt_state, loss_scale, x, y)` returns a
  `mpolicy.TrainStepResult` and `forward(params, stats, x, train)` returns
  `(logits, new_stats)`, both computing under `policy`.
  """
  model = MLP(hidden, nnx.Rngs(seed))
  graphdef, params, stats = nnx.split(model, nnx.Param, nnx.BatchStat)

  def forward(params, stats, x, train):
    model = nnx.merge(graphdef, params, stats)
    logits = model(x, train)
    return logits, nnx.state(model, nnx.BatchStat)

  forward = mpolicy.amp(forward, policy)

  def loss_fn(params, stats, x, y):
    logits, stats = forward(params, stats, x, True)
    return cross_entropy(logits, y), stats

  optimizer = optax.adam(learning_rate)
  # Loss-scaled gradients; params, optimizer state and batch statistics are
  # all kept as they were on a step whose gradients are not finite.
  train_step = jax.jit(
      mpolicy.make_train_step(loss_fn, optimizer, has_state=True))
  return params, stats, optimizer.init(params), train_step, forward


def train(data: digits_data.Digits, *, policy: str = "p=f32,c=bf16,o=f32",
          scale_type: str = "NoOp", scale_value: float = 2.0**15,
          steps: int = 300, batch_size: int = 64, learning_rate: float = 3e-3,
          seed: int = 0, log_every: int = 100) -> mp_report.Run:
  """Trains the MLP under `policy`; returns the run's record."""
  name = mp_report.label(policy, scale_type)
  x_train = data.x_train.reshape(len(data.x_train), -1)
  x_test = data.x_test.reshape(len(data.x_test), -1)
  params, stats, opt_state, train_step, forward = setup(
      policy, learning_rate, seed)
  loss_scale = mp_flags.make_loss_scale(scale_type, scale_value)
  log = mp_report.Log(name, steps, log_every)
  for idx in digits_data.batches(len(x_train), batch_size, steps, seed):
    out = train_step(params, stats, opt_state, loss_scale, x_train[idx],
                     data.y_train[idx])
    params, stats = out.params, out.model_state
    opt_state, loss_scale = out.opt_state, out.loss_scale
    log.record(out.value, loss_scale.loss_scale, out.grads_finite)

  logits, _ = forward(params, stats, x_test, False)  # Running averages.
  metrics = {
      "test accuracy": float(np.mean(np.argmax(logits, -1) == data.y_test)),
      "final loss": float(np.mean(log.loss[-10:])),
  }
  explained = mp_report.explain_summary(forward, params, stats, x_test[:8],
                                        False)
  return mp_report.Run(name, policy, scale_type, metrics, log, explained)


def main() -> None:
  data = digits_data.load_digits()
  print(f"Flax NNX MLP on the digits: {FLAGS.steps} steps of "
        f"{FLAGS.batch_size}, jax {jax.__version__} on {jax.default_backend()}")
  settings = dict(steps=FLAGS.steps, batch_size=FLAGS.batch_size,
                  learning_rate=FLAGS.learning_rate, seed=FLAGS.seed,
                  log_every=FLAGS.log_every)
  runs = []
  if FLAGS.compare:
    runs.append(train(data, policy="full", **settings))
  runs.append(train(data, policy=FLAGS.mp_policy,
                    scale_type=FLAGS.mp_scale_type,
                    scale_value=FLAGS.mp_scale_value, **settings))
  print()
  mp_report.summary(runs, METRICS)
  if FLAGS.plot:
    mp_report.plot(runs, FLAGS.plot, "Flax MLP: "
                   + " vs ".join(r.name for r in runs))


if __name__ == "__main__":
  mp_flags.run(main, steps=300, batch_size=64, learning_rate=3e-3,
               compare=True)
