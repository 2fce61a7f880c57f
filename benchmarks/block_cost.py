"""CPU step time of the char transformer under each block format vs bf16.

The block formats are emulated on CPU (operands quantized and dequantized
in float32), so this measures the emulation's cost, not a GPU's. Each
configuration is compiled first; then the timed reps are interleaved
(bf16, mxfp8, mxfp4, nvfp4, bf16, ...), each rep the mean of --steps
training steps (forward, backward, Adam) of examples/char_transformer.py's
model at its defaults (batch 32 x 64 characters).

  python benchmarks/block_cost.py --reps 3 --steps 10
"""

from __future__ import annotations

import argparse
import datetime
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

import block_fidelity as bf  # pylint: disable=g-import-not-at-top

POLICIES = {"bf16": bf.BF16, "mxfp8": "p=f32,c=mxfp8,o=f32",
            "mxfp4": "p=f32,c=mxfp4,o=f32", "nvfp4": "p=f32,c=nvfp4,o=f32"}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--reps", type=int, default=3)
  parser.add_argument("--steps", type=int, default=10)
  args = parser.parse_args()
  corpus = bf.ct.load_corpus()
  steppers = {name: bf.make_stepper(policy, {}, (), corpus, seed=0)
              for name, policy in POLICIES.items()}
  for stepper in steppers.values():
    stepper(1)  # Compile.
  times = {name: [] for name in POLICIES}
  for _ in range(args.reps):
    for name, stepper in steppers.items():
      start = time.perf_counter()
      stepper(args.steps)
      times[name].append((time.perf_counter() - start) / args.steps * 1e3)
  print(f"{datetime.date.today()}, jax {jax.__version__}, "
        f"{platform.processor() or platform.machine()}, "
        f"{args.reps} reps of {args.steps} steps")
  base = np.median(times["bf16"])
  for name, ms in times.items():
    print(f"| {name} | {np.median(ms):.1f} ms | {min(ms):.1f}-{max(ms):.1f} "
          f"| {np.median(ms) / base:.2f}x |")


if __name__ == "__main__":
  main()
