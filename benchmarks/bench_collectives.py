"""The cost of summing across devices in float32 instead of bfloat16.

A row-parallel layer on 8 simulated CPU devices (`shard_map` over one mesh
axis): each device multiplies its slice of the activations' features by
its rows of the weight (bfloat16 under `amp`, float32 accumulation), and
the partial results are summed with `psum`. Timed two ways, interleaved
(bf16, f32, bf16, ...), each rep the process CPU time of `--calls` calls
of the jitted forward and backward (`jax.grad` w.r.t. the weight shard):

  bf16   `amp(..., "p=f32,c=bf16,o=bf16")`: the psum in bfloat16;
  f32    the same with
         `rules=DEFAULT_RULES.with_collectives(sum_dtype=jnp.float32)`.

Prints the CPU, JAX version and date, each rep's ms per call and the ratio
f32 / bf16 (median and range over reps). Simulated devices share this
machine's cores, so the sum's cost is a memory copy and add, not a
network transfer: on real devices the float32 sum moves twice the bytes.

  python benchmarks/bench_collectives.py --reps 5 --calls 20
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8")

# pylint: disable=g-import-not-at-top,wrong-import-position
import argparse
import datetime
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report_util

import mpolicy

POLICY = "p=f32,c=bf16,o=bf16"


def make_step(rules, batch: int, features: int, out: int):
  """A jitted forward + backward of the row-parallel layer."""
  mesh = Mesh(np.array(jax.devices()), ("d",))

  def layer(x, w):
    return jax.lax.psum(x @ w, "d")

  def loss(x, w):
    y = mpolicy.amp(layer, POLICY, rules=rules)(x, w)
    return jnp.mean(jnp.square(y.astype(jnp.float32)))

  body = jax.shard_map(
      lambda x, w: jax.grad(loss, argnums=1)(x, w), mesh=mesh,
      in_specs=(P(None, "d"), P("d")), out_specs=P("d"))
  x = jax.random.normal(jax.random.PRNGKey(0), (batch, features))
  w = jax.random.normal(jax.random.PRNGKey(1), (features, out)) / 32
  step = jax.jit(body)
  jax.block_until_ready(step(x, w))  # Compile.
  return lambda: step(x, w)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument("--calls", type=int, default=20)
  parser.add_argument("--batch", type=int, default=256)
  parser.add_argument("--features", type=int, default=1024)
  parser.add_argument("--out", type=int, default=1024)
  args = parser.parse_args()
  wide = mpolicy.DEFAULT_RULES.with_collectives(sum_dtype=jnp.float32)
  steps = {"bf16": make_step(None, args.batch, args.features, args.out),
           "f32": make_step(wide, args.batch, args.features, args.out)}
  times = {name: [] for name in steps}
  for _ in range(args.reps):
    for name, step in steps.items():
      start = time.process_time()
      for _ in range(args.calls):
        out = step()
      jax.block_until_ready(out)
      times[name].append((time.process_time() - start) / args.calls * 1e3)
  cpu, flags = report_util.cpu_info()
  print(f"{datetime.date.today()} | jax {jax.__version__} | {cpu} | "
        f"{len(jax.devices())} simulated devices | loadavg "
        f"{report_util.loadavg()} | {args.reps} reps of {args.calls} calls, "
        f"x {args.batch}x{args.features} @ w {args.features}x{args.out}")
  ratios = [f / b for f, b in zip(times["f32"], times["bf16"])]
  for name, ms in times.items():
    print(f"| {name} sum | {np.median(ms):.2f} ms (CPU) | "
          f"{min(ms):.2f}-{max(ms):.2f} |")
  print(f"| f32 / bf16 | {np.median(ratios):.2f}x | "
        f"{min(ratios):.2f}-{max(ratios):.2f}x |")


if __name__ == "__main__":
  main()
