"""Fidelity of the block-scaled formats on the char transformer, against bf16.

Trains `examples/char_transformer.py`'s model at its defaults (seq_len 64,
d_model 64, 4 heads, 2 blocks, batch 32, Adam 3e-3, no loss scaling) under
each configuration below, on the same seeds and the same batches, and
prints the end-of-training loss (the mean training loss over the last 10
steps, and the held-out test loss) per seed and the gap to bf16 on the
same seed:

  bf16              p=f32,c=bf16,o=f32
  mxfp8             c=mxfp8 on every weight matmul (min_size=0)
  nvfp4             c=nvfp4, the recipe's defaults (stochastic rounding of
                    gradients, 16x16 Hadamard on the weight gradient,
                    16x16 weight tiles), first and last layers in bf16:
                    block_0's attention projections and the logits head
  nvfp4-no-sr       the same, stochastic_rounding=False
  nvfp4-no-hadamard the same, hadamard=False
  nvfp4-no-tiles    the same, weight_tiles=False (1x16 weight blocks)
  nvfp4-all-layers  the recipe's defaults, no layer kept in bf16

The recipe's keys fold in the step count (``model.apply.at_step``).

  python benchmarks/block_fidelity.py --steps 300 --seeds 0 1 2 \
      --configs bf16 mxfp8 nvfp4
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import mpolicy

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "..", "examples"))
# pylint: disable=g-import-not-at-top,wrong-import-position
import char_transformer as ct
from transformer_lm import CharTransformer, ModelConfig, make_forward
# pylint: enable=g-import-not-at-top,wrong-import-position

BF16 = "p=f32,c=bf16,o=f32"
KEEP_BF16 = ("*/block_0/~/attention", "*/logits")  # First and last layers.
CONFIGS = {
    "bf16": (BF16, {}, ()),
    "mxfp8": ("p=f32,c=mxfp8,o=f32", {}, ()),
    "nvfp4": ("p=f32,c=nvfp4,o=f32", {}, KEEP_BF16),
    "nvfp4-no-sr": ("p=f32,c=nvfp4,o=f32", {"stochastic_rounding": False},
                    KEEP_BF16),
    "nvfp4-no-hadamard": ("p=f32,c=nvfp4,o=f32", {"hadamard": False},
                          KEEP_BF16),
    "nvfp4-no-tiles": ("p=f32,c=nvfp4,o=f32", {"weight_tiles": False},
                       KEEP_BF16),
    "nvfp4-all-layers": ("p=f32,c=nvfp4,o=f32", {}, ()),
}


def make_stepper(policy: str, options: dict, keep, corpus, seed: int,
                 steps: int = 100_000):
  """``stepper(n)``: runs the next ``n`` training steps of one
  configuration (its state kept between calls) and returns their losses;
  ``stepper.evaluate()`` gives the held-out loss."""
  rules = mpolicy.DEFAULT_RULES.with_fp8(min_size=0, **options)
  config = ModelConfig()
  stack = contextlib.ExitStack()
  stack.enter_context(mpolicy.push_policy(CharTransformer, policy))
  stack.enter_context(mpolicy.push_policy(ct.hk.LayerNorm, "full"))
  for pattern in keep:
    stack.enter_context(mpolicy.push_policy(pattern, BF16))
  model = mpolicy.transform_amp(make_forward(len(corpus.vocab), config),
                                rules=rules)
  optimizer = optax.adam(3e-3)

  def step(params, opt_state, batch, count):
    (loss, _), grads = jax.value_and_grad(
        lambda p: ct.lm_loss(model.apply.at_step(count), p, batch),
        has_aux=True)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  step = jax.jit(step)
  starts = ct.sample_starts(corpus.train, config.seq_len, steps, 32, seed)
  with stack:  # Policies are read when the model is first traced.
    params = model.init(jax.random.PRNGKey(seed),
                        ct.windows(corpus.train, starts[0], config.seq_len)
                        [:, :-1])
  state = {"params": params, "opt": optimizer.init(params), "i": 0}

  def stepper(n: int) -> list:
    losses = []
    with contextlib.ExitStack() as again:
      again.enter_context(mpolicy.push_policy(CharTransformer, policy))
      again.enter_context(mpolicy.push_policy(ct.hk.LayerNorm, "full"))
      for pattern in keep:
        again.enter_context(mpolicy.push_policy(pattern, BF16))
      for _ in range(n):
        i = state["i"]
        batch = ct.windows(corpus.train, starts[i], config.seq_len)
        state["params"], state["opt"], loss = step(
            state["params"], state["opt"], batch, jnp.int32(i))
        losses.append(float(loss))
        state["i"] = i + 1
    return losses

  def evaluate() -> float:
    with contextlib.ExitStack() as again:
      again.enter_context(mpolicy.push_policy(CharTransformer, policy))
      again.enter_context(mpolicy.push_policy(ct.hk.LayerNorm, "full"))
      for pattern in keep:
        again.enter_context(mpolicy.push_policy(pattern, BF16))
      return ct.evaluate(model.apply, state["params"], corpus,
                         config.seq_len)["test loss"]
  stepper.evaluate = evaluate
  return stepper


def run(name: str, seed: int, steps: int, corpus) -> dict:
  """Trains one configuration on one seed; returns its losses."""
  policy, options, keep = CONFIGS[name]
  stepper = make_stepper(policy, options, keep, corpus, seed, steps)
  start = time.perf_counter()
  losses = stepper(steps)
  seconds = time.perf_counter() - start
  return {"config": name, "seed": seed, "steps": steps,
          "final loss": float(np.mean(losses[-10:])),
          "test loss": stepper.evaluate(), "seconds": round(seconds, 1)}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  parser.add_argument("--configs", nargs="+", default=list(CONFIGS),
                      choices=list(CONFIGS))
  parser.add_argument("--out", default=None, help="JSON lines, appended.")
  args = parser.parse_args()
  corpus = ct.load_corpus()
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, "
        f"steps {args.steps}", flush=True)
  results = {}
  for seed in args.seeds:
    for name in args.configs:
      r = run(name, seed, args.steps, corpus)
      results[name, seed] = r
      base = results.get(("bf16", seed))
      gap = "" if base is None else (
          f" gap final {r['final loss'] - base['final loss']:+.4f}"
          f" test {r['test loss'] - base['test loss']:+.4f}")
      print(f"seed {seed} {name:18s} final {r['final loss']:.4f} test "
            f"{r['test loss']:.4f} ({r['seconds']} s){gap}", flush=True)
      if args.out:
        with open(args.out, "a") as f:
          f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
  main()
