"""How well each way of holding Adam's weights trains, over seeds.

Trains two models of examples/ under a bf16 compute policy, on the same
seeds and batches, holding the weights four ways:

  f32       float32 params, `optax.adam` (12 bytes per parameter; jmp's
            recipe: the float32 params are the master);
  master    bfloat16 params, `master_weights(optax.adam)` (14 bytes);
  adam6     bfloat16 params and moments, stochastic rounding
            (`param_rounding="stochastic"` over `with_state_dtypes(adam,
            jnp.bfloat16, rounding="stochastic")`; 6 bytes);
  adam8     bfloat16 params truncating an exact float32 master kept as 16
            low bits, the same bfloat16 moments
            (`param_rounding="low_bits"`; 8 bytes).

Models: the digits CNN of examples/digits_cnn.py (Haiku, scikit-learn's
digits; test accuracy and test loss after --digits_steps) and the char
transformer of examples/optimizer_lesson.py (the standard library's
source; held-out loss and accuracy after --char_steps).

Prints one line per run, `RUN <model> <mode> <seed> <metric>=<value> ...`,
then per model and mode the mean and the spread (max - min) over seeds.

  python benchmarks/optimizer_modes.py --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

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
import optimizer_lesson
import report_util

import mpolicy

MODES = ("f32", "master", "adam6", "adam8")
POLICY = "p=f32,c=bf16,o=f32"


def _optimizer(mode: str, learning_rate: float):
  """`(tx for make_train_step, param_rounding, wrapped tx to init with)`."""
  adam = optax.adam(learning_rate)
  if mode == "f32":
    return adam, "nearest", adam
  if mode == "master":
    tx = mpolicy.master_weights(adam)
    return tx, "nearest", tx
  half_adam = mpolicy.with_state_dtypes(adam, jnp.bfloat16,
                                        rounding="stochastic")
  if mode == "adam6":
    return half_adam, "stochastic", mpolicy.stochastic_params(half_adam)
  return half_adam, "low_bits", mpolicy.master_weights(half_adam,
                                                       storage="low_bits")


def _start(mode: str, wrapped, params32):
  """Params and optimizer state to start `mode` from float32 params."""
  if mode == "f32":
    return params32, wrapped.init(params32)
  if mode in ("master", "adam8"):
    return mpolicy.init_master_weights(wrapped, params32, jnp.bfloat16)
  half = jax.tree_util.tree_map(lambda p: p.astype(jnp.bfloat16), params32)
  return half, wrapped.init(half)


def digits_run(data, mode: str, seed: int, steps: int, batch_size: int = 64,
               learning_rate: float = 3e-3) -> dict[str, float]:
  """The digits CNN (BatchNorm in float32) trained holding weights `mode`'s way."""
  with mpolicy.push_policy(digits_cnn.DigitsCNN, POLICY), \
       mpolicy.push_policy(hk.BatchNorm, "full"):
    model = mpolicy.transform_amp_with_state(
        lambda x, is_training: digits_cnn.DigitsCNN()(x, is_training))

    def loss_fn(params, state, x, y):
      logits, state = model.apply(params, state, None, x, is_training=True)
      return digits_cnn.cross_entropy(logits, y), state

    tx, rounding, wrapped = _optimizer(mode, learning_rate)
    step = jax.jit(mpolicy.make_train_step(loss_fn, tx, has_state=True,
                                           param_rounding=rounding))
    params32, state = model.init(jax.random.PRNGKey(seed),
                                 data.x_train[:batch_size], True)
    params, opt_state = _start(mode, wrapped, params32)
    skipped = 0
    for idx in digits_data.batches(len(data.y_train), batch_size, steps,
                                   seed):
      out = step(params, state, opt_state, mpolicy.NoOpLossScale(),
                 data.x_train[idx], data.y_train[idx])
      params, state, opt_state = out.params, out.model_state, out.opt_state
      skipped += int(not bool(out.grads_finite))
    logits, _ = jax.jit(model.apply, static_argnums=4)(
        params, state, None, data.x_test, False)
  logits = np.asarray(logits, np.float32)
  loss = float(digits_cnn.cross_entropy(jnp.asarray(logits), data.y_test))
  return {"test accuracy": float(np.mean(logits.argmax(-1) == data.y_test)),
          "test loss": loss, "skipped": skipped}


def char_run(corpus, mode: str, seed: int, steps: int) -> dict[str, float]:
  """The char transformer via the optimizer lesson's runner."""
  lesson_mode = {"f32": "f32", "master": "master", "adam6": "stochastic",
                 "adam8": "low_bits"}[mode]
  r = optimizer_lesson.run(corpus, char_transformer.ModelConfig(),
                           mode=lesson_mode, steps=steps, seed=seed,
                           log_every=0)
  return {"test loss": r.metrics["test loss"],
          "test accuracy": r.metrics["test accuracy"],
          "skipped": r.log.skipped}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  parser.add_argument("--models", nargs="+", default=["digits_cnn", "char"])
  parser.add_argument("--modes", nargs="+", default=list(MODES))
  parser.add_argument("--digits_steps", type=int, default=400)
  parser.add_argument("--char_steps", type=int, default=300)
  args = parser.parse_args()
  cpu, _ = report_util.cpu_info()
  print(f"{datetime.date.today()} | jax {jax.__version__} | {cpu} | "
        f"loadavg {report_util.loadavg()}")
  runners = {
      "digits_cnn": (digits_data.load_digits, digits_run, args.digits_steps),
      "char": (char_transformer.load_corpus, char_run, args.char_steps)}
  results = {}
  for model in args.models:
    load, runner, steps = runners[model]
    data = load()
    for mode in args.modes:
      for seed in args.seeds:
        m = runner(data, mode, seed, steps)
        results[(model, mode, seed)] = m
        print(f"RUN {model} {mode} {seed} steps={steps} " + " ".join(
            f"{k.replace(' ', '_')}={v:.4g}" for k, v in m.items()),
              flush=True)
  print("\n| model | mode | test loss (mean, spread) | test accuracy (mean, "
        "spread) | skipped steps |\n|---|---|---|---|---|")
  for model in args.models:
    for mode in args.modes:
      runs = [results[(model, mode, s)] for s in args.seeds]
      loss = [r["test loss"] for r in runs]
      acc = [100 * r["test accuracy"] for r in runs]
      print(f"| {model} | {mode} | {np.mean(loss):.4f} ({np.ptp(loss):.4f}) "
            f"| {np.mean(acc):.2f}% ({np.ptp(acc):.2f}) | "
            f"{sum(r['skipped'] for r in runs)} |")


if __name__ == "__main__":
  main()
