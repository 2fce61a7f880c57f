r"""A digits CNN trained with int8 dense layers (QAT), exported in int8.

Trains a small CNN on scikit-learn's handwritten digits twice, with the
same seed and batches: in float32, and with its dense layers under
``c=int8`` (its convolutions in bfloat16, which int8 does not cover):

  mpolicy.set_policy(hk.Linear, "p=f32,c=int8,o=f32")
  mpolicy.set_policy(hk.Conv2D, "p=f32,c=bf16,o=f32")

Then exports both with `jax.export`, the int8 model through
`mpolicy.export_quantized` (its dense weights stored as int8 codes and
float32 scales), checks that the int8 artifact's outputs on the test set
are the jitted model's bit for bit, and prints both test accuracies and
both serving artifacts' bytes. Run it as a file, from any directory:

  python examples/digits_int8.py
  python examples/digits_int8.py --steps=50 --hidden=64
"""

from __future__ import annotations

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

FLAGS = flags.FLAGS
flags.adopt_module_key_flags(mp_flags)
flags.DEFINE_integer("hidden", 256, "Width of the hidden dense layer.",
                     lower_bound=1)

INT8 = "p=f32,c=int8,o=f32"
RULES = mpolicy.DEFAULT_RULES.with_fp8(min_size=0)  # Every dense layer.


def forward(x: jax.Array, hidden: int) -> jax.Array:
  for i, c in enumerate((16, 32)):
    x = jax.nn.relu(hk.Conv2D(c, kernel_shape=3, name=f"conv_{i}")(x))
    x = hk.max_pool(x, window_shape=2, strides=2, padding="SAME")
  x = jax.nn.relu(hk.Linear(hidden, name="hidden")(hk.Flatten()(x)))
  return hk.Linear(10, name="logits")(x)


def train(data, policy: str, *, steps: int, batch_size: int,
          learning_rate: float, seed: int, hidden: int):
  """Trains under ``policy`` (dense layers; convolutions in bfloat16 under
  int8); returns ``(apply, params)``, ``apply(params, None, x) -> logits``
  (policies are read when it is traced: trace it under the same ones)."""
  with mpolicy.push_policy(hk.Linear, policy), \
       mpolicy.push_policy(hk.Conv2D,
                           "p=f32,c=bf16,o=f32" if policy == INT8 else policy):
    model = mpolicy.transform_amp(lambda x: forward(x, hidden), rules=RULES)
    params = model.init(jax.random.PRNGKey(seed), data.x_train[:1])
    optimizer = optax.adam(learning_rate)
    opt_state = optimizer.init(params)

    def loss_fn(params, x, y):
      logits = model.apply(params, None, x).astype(jnp.float32)
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @jax.jit
    def step(params, opt_state, x, y):
      loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
      updates, opt_state = optimizer.update(grads, opt_state)
      return optax.apply_updates(params, updates), opt_state, loss

    order = digits_data.batches(len(data.y_train), batch_size, steps, seed)
    for i, idx in enumerate(order):
      params, opt_state, loss = step(params, opt_state, data.x_train[idx],
                                     data.y_train[idx])
      if FLAGS.log_every and (i + 1) % FLAGS.log_every == 0:
        print(f"[{policy}] step {i + 1}/{steps} loss {float(loss):.4f}")
  return model.apply, params


def accuracy(logits, labels) -> float:
  return float(np.mean(np.argmax(np.asarray(logits), -1) == labels))


def artifact_bytes(exported, params) -> int:
  """The serialized program plus the parameters it is called with."""
  return len(exported.serialize()) + sum(
      np.asarray(l).nbytes for l in jax.tree_util.tree_leaves(params))


def main() -> None:
  data = digits_data.load_digits()
  print(f"digits: {len(data.y_train)} train / {len(data.y_test)} test "
        f"images, {FLAGS.steps} steps of {FLAGS.batch_size}, jax "
        f"{jax.__version__} on {jax.default_backend()}")
  settings = dict(steps=FLAGS.steps, batch_size=FLAGS.batch_size,
                  learning_rate=FLAGS.learning_rate, seed=FLAGS.seed,
                  hidden=FLAGS.hidden)
  x = data.x_test
  f32_apply, f32_params = train(data, "full", **settings)
  f32_exported = jax.export.export(jax.jit(
      lambda p, x: f32_apply(p, None, x)))(f32_params, x)
  with mpolicy.push_policy(hk.Linear, INT8), \
       mpolicy.push_policy(hk.Conv2D, "p=f32,c=bf16,o=f32"):
    int8_apply, int8_params = train(data, INT8, **settings)
    want = jax.jit(int8_apply)(int8_params, None, x)
    exported, serving = mpolicy.export_quantized(int8_apply, int8_params,
                                                 None, x)
    got = exported.call(serving, None, x)
  same = bool(np.array_equal(np.asarray(got).view(np.uint32),
                             np.asarray(want).view(np.uint32)))
  stored = [jax.tree_util.keystr(path) for path, leaf in
            jax.tree_util.tree_flatten_with_path(serving)[0]
            if leaf.dtype == jnp.int8]
  print(f"float32 test accuracy: {accuracy(f32_apply(f32_params, None, x), data.y_test):.4f}")
  print(f"int8 QAT test accuracy: {accuracy(want, data.y_test):.4f}")
  print(f"stored in int8: {', '.join(stored)}")
  print(f"exported int8 artifact equals the jitted model bit for bit: {same}")
  f32_bytes = artifact_bytes(f32_exported, f32_params)
  int8_bytes = artifact_bytes(exported, serving)
  print(f"serving artifact bytes: int8 {int8_bytes:,} vs float32 "
        f"{f32_bytes:,} ({int8_bytes / f32_bytes:.2f}x)")
  if not same:
    raise SystemExit("the exported int8 artifact differs from the model")


if __name__ == "__main__":
  mp_flags.run(main, steps=300, batch_size=64, learning_rate=3e-3,
               log_every=100)
