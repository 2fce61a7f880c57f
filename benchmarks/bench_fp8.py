"""Times an n x n x n matmul in float32, bfloat16 and float8 (mpolicy).

Rows:
  f32           jnp.dot of float32 operands (XLA's default precision).
  bf16          jnp.dot of bfloat16 operands.
  fp8 amp       mpolicy.amp(a @ b, "p=f32,c=f8,o=bf16") on bfloat16 operands,
                float8 at every n (min_size=0), --scaling per_row (default)
                or per_tensor: amax reductions, quantization, the float8
                gemm, rescale.
  fp8 delayed   quantization with scales given (as delayed scaling takes
                them from an amax history), the amax for the history
                computed alongside: no reduction before the quantize.
  fp8 gemm      the float8 gemm and rescale alone, on operands quantized
                beforehand (the quantize step excluded).
  bf16 fwd+bwd  value and gradients of sum(a @ b), bfloat16.
  fp8 fwd+bwd   the same through mpolicy's float8 path (e5m2 cotangent).

For each it prints the median time per call, TFLOP/s, and, from the optimized
HLO (read by `hlo_kernels`), whether a float8 cuBLASLt gemm was chosen and
how many cuBLAS calls, fusions and reductions run. On CPU float8 is emulated: times there say nothing about a
GPU; use a small --n to check the script runs.

  python benchmarks/bench_fp8.py            # 8192, on the default device
  python benchmarks/bench_fp8.py --n 256    # a quick check on CPU
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

import mpolicy
from mpolicy._src.rules import fp8_scaling

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hlo_kernels  # pylint: disable=g-import-not-at-top,wrong-import-position


def _time(fn, args, iters, warmup):
  """Median over ``iters`` rounds of 10 back-to-back calls, per call (the
  calls queue on the device, so host dispatch overlaps them)."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iters):
    start = time.perf_counter()
    for _ in range(10):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - start) / 10)
  return statistics.median(times)


def _hlo_facts(fn, args) -> str:
  stats = hlo_kernels.hlo_stats(fn.lower(*args).compile().as_text())
  targets = stats.custom_call_targets
  f8_gemm = any("cublas$lt$matmul$f8" in t for t in targets)
  gemms = sum(n for t, n in targets.items() if t.startswith("__cublas"))
  return (f"f8 cublasLt gemm: {'yes' if f8_gemm else 'no'}, cublas calls: "
          f"{gemms}, fusions: {stats.fusions}, reduce ops: "
          f"{stats.opcodes['reduce']}")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--n", type=int, default=8192)
  parser.add_argument("--iters", type=int, default=20)
  parser.add_argument("--warmup", type=int, default=3)
  parser.add_argument("--hlo", action="store_true",
                      help="also print the optimized HLO of the fp8 amp row")
  parser.add_argument("--scaling", choices=("per_row", "per_tensor"),
                      default="per_row",
                      help="the fp8 amp rows' scaling (OpRules.with_fp8)")
  args = parser.parse_args(argv)
  n = args.n
  ka, kb = jax.random.split(jax.random.PRNGKey(0))
  a32 = jax.random.normal(ka, (n, n), jnp.float32)
  b32 = jax.random.normal(kb, (n, n), jnp.float32)
  a16, b16 = a32.astype(jnp.bfloat16), b32.astype(jnp.bfloat16)
  aq, sa = fp8_scaling.quantize(a16)
  bq, sb = fp8_scaling.quantize(b16)

  policy = "p=f32,c=f8,o=bf16"
  # min_size=0: float8 at every n (by default a GPU runs matmuls below its
  # device kind's threshold in bfloat16).
  rules = mpolicy.DEFAULT_RULES.with_fp8(min_size=0, scaling=args.scaling)
  amp_mm = mpolicy.amp(lambda a, b: a @ b, policy, rules=rules)

  def gemm_only(aq, bq, sa, sb):
    out = jax.lax.dot_general(aq, bq, (((1,), (0,)), ((), ())),
                              preferred_element_type=jnp.float32)
    return (out * (sa * sb)).astype(jnp.bfloat16)

  def quantize_with(x, scale):
    fmax = float(jnp.finfo(fp8_scaling.FORWARD_DTYPE).max)
    q = jnp.clip(x.astype(jnp.float32) / scale, -fmax, fmax)
    return q.astype(fp8_scaling.FORWARD_DTYPE), jnp.max(jnp.abs(x))

  def delayed(a, b, sa, sb):
    (aq, amax_a), (bq, amax_b) = quantize_with(a, sa), quantize_with(b, sb)
    return gemm_only(aq, bq, sa, sb), amax_a, amax_b

  def loss(mm):
    return lambda a, b: jnp.sum(mm(a, b).astype(jnp.float32))

  rows = [
      ("f32", jax.jit(jnp.dot), (a32, b32), 1),
      ("bf16", jax.jit(jnp.dot), (a16, b16), 1),
      ("fp8 amp", jax.jit(amp_mm), (a16, b16), 1),
      ("fp8 delayed", jax.jit(delayed), (a16, b16, sa, sb), 1),
      ("fp8 gemm", jax.jit(gemm_only), (aq, bq, sa, sb), 1),
      ("bf16 fwd+bwd", jax.jit(jax.value_and_grad(loss(jnp.dot), (0, 1))),
       (a16, b16), 3),
      ("fp8 fwd+bwd", jax.jit(jax.value_and_grad(loss(amp_mm), (0, 1))),
       (a16, b16), 3),
  ]
  device = jax.devices()[0]
  print(f"device: {device.device_kind} ({device.platform}), jax "
        f"{jax.__version__}, n={n}, median of {args.iters}")
  flops = 2 * n ** 3
  for name, fn, fn_args, gemms in rows:
    seconds = _time(fn, fn_args, args.iters, args.warmup)
    tflops = gemms * flops / seconds / 1e12
    print(f"{name:13s} {seconds * 1e3:9.3f} ms  {tflops:8.1f} TFLOP/s  "
          f"[{_hlo_facts(fn, fn_args)}]")
  if args.hlo:
    print(jax.jit(amp_mm).lower(a16, b16).compile().as_text())


if __name__ == "__main__":
  main()
