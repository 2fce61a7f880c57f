"""What a training step holds: bytes per parameter, and XLA's temp memory.

For each model and each way of holding the weights and Adam's state, prints

  persistent bytes per parameter: params + optimizer state, summed from the
      pytrees' nbytes (shapes from `jax.eval_shape`, so nothing is
      allocated), over the number of parameters; step counters included;
  XLA temp: `compiled.memory_analysis().temp_size_in_bytes` of the jitted
      step (`mpolicy.make_train_step`): gradients, activations and scratch,
      beyond the step's inputs and outputs.

Variants:

  float32 Adam        float32 params, float32 compute, `optax.adam`.
  bf16 compute        float32 params under "p=f32,c=bf16,o=f32", `optax.adam`
                      (jmp's recipe: the float32 params are the master copy).
  master_weights      bfloat16 params, `mpolicy.master_weights(optax.adam)`:
                      a float32 copy and float32 moments in the state.
  mu in bf16          as "bf16 compute", with
                      `mpolicy.with_state_dtypes(adam, {"mu": jnp.bfloat16})`.
  8-byte              bfloat16 params that truncate an exact float32 master
                      kept as 16 low bits, bfloat16 moments:
                      `make_train_step(..., param_rounding="low_bits")` over
                      `with_state_dtypes(adam, jnp.bfloat16,
                      rounding="stochastic")`.
  6-byte              bfloat16 params and moments, stochastic rounding:
                      `make_train_step(..., param_rounding="stochastic")` over
                      `with_state_dtypes(adam, jnp.bfloat16,
                      rounding="stochastic")`.

Models: the character transformer of examples/char_transformer.py (at its
defaults) and the GPT of the benchmarks' GPU preset (training_gpu.py) (at
`--gpt_scale`, 1 = its real size), both imported, not copied.

  python benchmarks/bench_optimizer_memory.py
  python benchmarks/bench_optimizer_memory.py --gpt_scale=8   # quicker
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import Any, Callable

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax

import mpolicy

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
sys.path.insert(0, os.path.join(os.path.dirname(_HERE), "examples"))
import char_transformer  # pylint: disable=g-import-not-at-top,wrong-import-position
import training_cpu  # pylint: disable=g-import-not-at-top,wrong-import-position
import training_gpu  # pylint: disable=g-import-not-at-top,wrong-import-position

BF16_POLICY = "p=f32,c=bf16,o=f32"
LEARNING_RATE = 1e-3


@dataclasses.dataclass
class Variant:
  name: str
  policy: str                 # the compute policy, for every hk.Module
  param_dtype: Any            # params are cast to it after init
  optimizer: Callable[[], optax.GradientTransformation]
  param_rounding: str = "nearest"


VARIANTS = [
    Variant("float32 Adam", "full", jnp.float32, lambda: optax.adam(
        LEARNING_RATE)),
    Variant("bf16 compute, float32 params", BF16_POLICY, jnp.float32,
            lambda: optax.adam(LEARNING_RATE)),
    Variant("bf16 params + master_weights", BF16_POLICY, jnp.bfloat16,
            lambda: mpolicy.master_weights(optax.adam(LEARNING_RATE))),
    Variant("mu in bf16", BF16_POLICY, jnp.float32,
            lambda: mpolicy.with_state_dtypes(optax.adam(LEARNING_RATE),
                                              {"mu": jnp.bfloat16})),
    Variant("8-byte (bf16 params + low bits + moments)", BF16_POLICY,
            jnp.bfloat16, lambda: mpolicy.with_state_dtypes(
                optax.adam(LEARNING_RATE), jnp.bfloat16,
                rounding="stochastic"), "low_bits"),
    Variant("6-byte (bf16 params + moments, SR)", BF16_POLICY, jnp.bfloat16,
            lambda: mpolicy.with_state_dtypes(
                optax.adam(LEARNING_RATE), jnp.bfloat16,
                rounding="stochastic"), "stochastic"),
]


@dataclasses.dataclass
class Model:
  name: str
  description: str
  loss: Callable[[Any], jax.Array]  # a Haiku function: batch -> loss
  batch: Any


def char_model() -> Model:
  config = char_transformer.ModelConfig()
  vocab = len(char_transformer.load_corpus().vocab)
  batch = jnp.zeros((32, config.seq_len + 1), jnp.int32)

  def loss(tokens):
    logits = char_transformer.make_forward(vocab, config)(tokens[:, :-1])
    return char_transformer.cross_entropy(logits, tokens[:, 1:])

  return Model("char transformer", f"d_model {config.d_model}, "
               f"{config.num_layers} layers, vocab {vocab}, batch 32x"
               f"{config.seq_len}", loss, batch)


def gpt_model(scale: int) -> Model:
  spec = training_gpu.gpu_gpt(scale, seed=0)
  return Model(f"GPT (GPU preset, scale {scale})", spec.description,
               spec.forward, spec.batch)


def _nbytes(tree) -> int:
  return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
             for x in jax.tree_util.tree_leaves(tree))


def measure(model: Model, variant: Variant) -> dict[str, float]:
  with mpolicy.push_policy(hk.Module, variant.policy):
    transformed = mpolicy.transform_amp(model.loss)
    params = jax.eval_shape(transformed.init, jax.random.PRNGKey(0),
                            model.batch)
    params = jax.tree_util.tree_map(
        lambda p: jax.ShapeDtypeStruct(p.shape, variant.param_dtype), params)
    tx = variant.optimizer()
    init = {"stochastic": mpolicy.stochastic_params(tx).init,
            "low_bits": mpolicy.master_weights(tx, storage="low_bits").init,
            }.get(variant.param_rounding, tx.init)
    opt_state = jax.eval_shape(init, params)
    step = mpolicy.make_train_step(
        lambda p, batch: transformed.apply(p, None, batch), tx,
        param_rounding=variant.param_rounding)
    start = time.perf_counter()
    compiled = jax.jit(step).lower(
        params, opt_state, mpolicy.NoOpLossScale(), model.batch).compile()
    compile_s = time.perf_counter() - start
  count = sum(int(np.prod(p.shape)) for p in jax.tree_util.tree_leaves(params))
  stats = compiled.memory_analysis()
  temp = getattr(stats, "temp_size_in_bytes", float("nan"))
  return {"params": count, "bytes/param": (_nbytes(params)
                                           + _nbytes(opt_state)) / count,
          "params + state MiB": (_nbytes(params) + _nbytes(opt_state)) / 2**20,
          "temp MiB": temp / 2**20, "compile s": compile_s}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--gpt_scale", type=int, default=1,
                      help="divides the GPU preset GPT's sizes (1: real size)")
  parser.add_argument("--models", default="char,gpt",
                      help="comma-separated: char, gpt")
  args = parser.parse_args(argv)
  print(training_cpu.machine_header())
  models = {"char": char_model, "gpt": lambda: gpt_model(args.gpt_scale)}
  for name in args.models.split(","):
    model = models[name]()
    print(f"\n{model.name}: {model.description}")
    print("| variant | bytes/param (params + state) | params + state (MiB) "
          "| XLA temp (MiB) |")
    print("|---|---|---|---|")
    for variant in VARIANTS:
      m = measure(model, variant)
      print(f"| {variant.name} | {m['bytes/param']:.2f} | "
            f"{m['params + state MiB']:.1f} | {m['temp MiB']:.1f} |",
            flush=True)
    print(f"({m['params']:,} parameters)")


if __name__ == "__main__":
  main()
