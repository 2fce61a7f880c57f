"""Training-step benchmark: float32 vs mpolicy bf16 vs hand-written Haiku+jmp bf16.

Measures, side by side in one process, a jitted optax (adam) training step
(value_and_grad + optimizer update + apply_updates) for:

  float32    plain `hk.transform`, everything in float32;
  mpolicy    `mpolicy.transform_amp` with
             `mpolicy.set_policy(hk.Module, "p=f32,c=bf16,o=f32")`;
  jmp        what users write today: `hk.transform` plus
             `hk.mixed_precision.set_policy(Model, jmp.get_policy(
             "p=f32,c=bf16,o=f32"))` on the top-level model class;
  jaxamp     `jaxamp.amp(loss, compute_dtype=bfloat16)` over `hk.transform`,
             when jaxamp is installed and runs (reported otherwise).

Both bf16 variants use the same policy for the whole model: mpolicy through
its `hk.Module` default entry, Haiku through a policy on the top-level model
class (Haiku's registry is exact-class and children run under the parent's
policy, so this also covers every sub-module). The loss (softmax
cross-entropy) is computed outside the model module in every variant, so it
sees float32 logits (`o=f32`). Only one registry is populated while a variant
is traced; both are cleared afterwards.

Models (synthetic data from a fixed PRNG, nothing downloaded):

  mlp          784 -> 1024 -> 1024 -> 10, batch 256;
  transformer  token + position embedding, 2 pre-LN blocks of causal
               multi-head attention (4 heads) + GELU MLP (4x), final
               LayerNorm, vocab projection; seq 128, d_model 256, batch 16,
               vocab 256; next-token softmax cross-entropy.

Reported per variant: median training-step time over N timed steps after
warm-up (variants interleaved round-robin, starting variant rotated every
round, `block_until_ready` on every step), trace+lower time
(`jax.jit(step).lower(...)`), XLA compile time (`.compile()`), the wall time
of the first call of a fresh `jax.jit(step)` (trace + compile + one step),
and op counts in the optimized HLO (`compiled.as_text()`, instructions whose
opcode is `convert`, including those inside fusion computations). One
discarded warm-up compile of every variant runs first so the first variant
does not pay JAX's process-level one-time costs.

Usage:

  python benchmarks/bench_training.py                  # full run, both models
  python benchmarks/bench_training.py --quick          # smoke run (< 60 s)
  python benchmarks/bench_training.py --models=mlp --steps=50 --profile
  python benchmarks/bench_training.py --dump-hlo=/tmp/hlo --out=results.md

`--preset=gpu` runs a different set instead (`training_gpu.py`): an MLP, a
GPT and ResNet50 at real sizes, each variant compiled and timed on its own,
with the dtypes of the gemm/convolution kernels and XLA's temp memory:

  python benchmarks/bench_training.py --preset=gpu --json=gpu.json
  python benchmarks/bench_training.py --preset=gpu --scale=32 --steps=2  # CPU smoke

Layout: the CPU preset is `training_cpu.py`, the GPU preset
`training_gpu.py`; the models are defined once in `models.py` (the
transformer is the examples' `examples/transformer_lm.py`), and the HLO is
read by `hlo_kernels.py`.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# pylint: disable=g-import-not-at-top,wrong-import-position
import training_cpu
import training_gpu
# The models, under the names other scripts import them by.
from models import GPT, MLP
from training_gpu import GpuGPT, GpuMLP
# pylint: enable=g-import-not-at-top,wrong-import-position

__all__ = ["main", "GPT", "MLP", "GpuGPT", "GpuMLP"]


def main(argv=None):
  """Runs the preset `--preset` names (cpu by default) with the other flags."""
  argv = sys.argv[1:] if argv is None else list(argv)
  preset = argparse.ArgumentParser(add_help=False)
  preset.add_argument("--preset", choices=("cpu", "gpu"), default="cpu")
  known, rest = preset.parse_known_args(argv)
  if known.preset == "gpu":
    return training_gpu.main(rest)
  return training_cpu.main(argv)


if __name__ == "__main__":
  main()
