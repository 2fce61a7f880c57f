r"""An Equinox MLP on the digits, trained under `mpolicy.amp`.

Needs Equinox (`pip install -e ".[equinox]"`). Trains a float32 baseline
and a bfloat16 run with the same seed and batches, and prints a table:

  python examples/equinox_mlp.py
  python examples/equinox_mlp.py --mp_policy=p=f32,c=f16,o=f32 \
      --mp_scale_type=Dynamic

An Equinox model is a pytree, so it goes into `amp` as an argument:
`mpolicy.amp(lambda model, x: jax.vmap(model)(x), policy)`. The step is
written out in Equinox's style: `eqx.partition` the model into its
floating-point arrays and the rest, `mpolicy.scaled_value_and_grad` with
respect to the arrays, an optimizer wrapped in `mpolicy.skip_nonfinite`
(nothing changes when the gradients are not finite), `eqx.apply_updates`,
all under `eqx.filter_jit`.
"""

from __future__ import annotations

from absl import flags
import equinox as eqx
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


class MLP(eqx.Module):
  """Linear -> ReLU -> Linear on one flattened 8x8 image."""
  hidden: eqx.nn.Linear
  out: eqx.nn.Linear

  def __init__(self, hidden: int, key: jax.Array):
    k1, k2 = jax.random.split(key)
    self.hidden = eqx.nn.Linear(64, hidden, key=k1)
    self.out = eqx.nn.Linear(hidden, 10, key=k2)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.out(jax.nn.relu(self.hidden(x)))


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  return optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), labels).mean()


def setup(policy: str, learning_rate: float = 3e-3, seed: int = 0,
          hidden: int = 128):
  """The model, its optimizer state, training step and forward pass.

  Returns `(model, opt_state, train_step, forward)`, where
  `train_step(model, opt_state, loss_scale, x, y)` returns `(model,
  opt_state, loss_scale, loss, grads_finite)` and `forward(model, x)` the
  logits of a batch, both computing under `policy`.
  """
  model = MLP(hidden, jax.random.PRNGKey(seed))
  forward = mpolicy.amp(lambda model, x: jax.vmap(model)(x), policy)

  def loss_fn(params, static, x, y):
    return cross_entropy(forward(eqx.combine(params, static), x), y)

  grad_fn = mpolicy.scaled_value_and_grad(loss_fn)
  optimizer = mpolicy.skip_nonfinite(optax.adam(learning_rate))

  @eqx.filter_jit
  def train_step(model, opt_state, loss_scale, x, y):
    params, static = eqx.partition(model, eqx.is_inexact_array)
    # scale -> grad -> unscale -> finite? -> adjust the scale, in one call.
    loss_scale, finite, loss, grads = grad_fn(loss_scale, params, static, x, y)
    updates, opt_state = optimizer.update(grads, opt_state, params,
                                          grads_finite=finite)
    return eqx.apply_updates(model, updates), opt_state, loss_scale, loss, finite

  opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
  return model, opt_state, train_step, forward


def train(data: digits_data.Digits, *, policy: str = "p=f32,c=bf16,o=f32",
          scale_type: str = "NoOp", scale_value: float = 2.0**15,
          steps: int = 300, batch_size: int = 64, learning_rate: float = 3e-3,
          seed: int = 0, log_every: int = 100) -> mp_report.Run:
  """Trains the MLP under `policy`; returns the run's record."""
  name = mp_report.label(policy, scale_type)
  x_train = data.x_train.reshape(len(data.x_train), -1)
  x_test = data.x_test.reshape(len(data.x_test), -1)
  model, opt_state, train_step, forward = setup(policy, learning_rate, seed)
  loss_scale = mp_flags.make_loss_scale(scale_type, scale_value)
  log = mp_report.Log(name, steps, log_every)
  for idx in digits_data.batches(len(x_train), batch_size, steps, seed):
    model, opt_state, loss_scale, loss, finite = train_step(
        model, opt_state, loss_scale, x_train[idx], data.y_train[idx])
    log.record(loss, loss_scale.loss_scale, finite)

  logits = eqx.filter_jit(forward)(model, x_test)
  metrics = {
      "test accuracy": float(np.mean(np.argmax(logits, -1) == data.y_test)),
      "final loss": float(np.mean(log.loss[-10:])),
  }
  explained = mp_report.explain_summary(forward, model, x_test[:8])
  return mp_report.Run(name, policy, scale_type, metrics, log, explained)


def main() -> None:
  data = digits_data.load_digits()
  print(f"Equinox MLP on the digits: {FLAGS.steps} steps of "
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
    mp_report.plot(runs, FLAGS.plot, "Equinox MLP: "
                   + " vs ".join(r.name for r in runs))


if __name__ == "__main__":
  mp_flags.run(main, steps=300, batch_size=64, learning_rate=3e-3,
               compare=True)
