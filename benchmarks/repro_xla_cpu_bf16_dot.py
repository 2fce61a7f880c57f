#!/usr/bin/env python
# Standalone repro (found by bench_training.py): run with
#   python benchmarks/repro_xla_cpu_bf16_dot.py
# XLA:CPU (jaxlib 0.10.2): the weight gradient of y = x @ w with bf16 operands
# and float32 accumulation, for a 3-D x, compiles to a standalone
# bf16 x bf16 -> f32 DotThunk that fails at run time with
# "UNIMPLEMENTED: Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32".
# (Pure JAX; mirrors the jaxpr jax.grad(transform_amp(hk.Linear)) on a 3-D
# input once had. XLA:CPU runs a bf16 x bf16 -> f32 dot only when the left
# operand contracts its last dimension; a transpose that puts it in that form
# is folded back into the dot by XLA unless an optimization barrier holds it,
# which is what mpolicy's CPU lowering does: the "pinned lhs" workaround
# below. Kept to show the XLA limitation that lowering works around.)
import sys
import jax, jax.numpy as jnp
from jax import lax
bf16, f32 = jnp.bfloat16, jnp.float32

def grads(w, x, round_trip):
  d = x.astype(bf16)
  y = lax.dot_general(d, w.astype(bf16), (((2,), (0,)), ((), ())),
                      preferred_element_type=f32).astype(bf16)
  o = (2.0 * y.astype(f32)).astype(bf16)          # cotangent, bf16
  r = lax.dot_general(o, d, (((0, 1), (0, 1)), ((), ())),
                      preferred_element_type=f32)   # dW^T, f32 accumulation
  dw = r.T
  return dw.astype(bf16).astype(f32) if round_trip else dw

x = jnp.ones((4, 32, 128)); w = jnp.ones((128, 128))
for rt in (False, True):
  try:
    jax.block_until_ready(jax.jit(grads, static_argnums=2)(w, x, rt))
    print(f"round_trip={rt}: ok")
  except Exception as e:
    print(f"round_trip={rt}: FAIL:", str(e).splitlines()[0])

# Workarounds an interpreter could emit for the backward dot on CPU:
def grads_w(w, x, mode):
  d = x.astype(bf16)
  y = lax.dot_general(d, w.astype(bf16), (((2,), (0,)), ((), ())),
                      preferred_element_type=f32).astype(bf16)
  o = (2.0 * y.astype(f32)).astype(bf16)
  if mode == "f32 operands":
    r = lax.dot_general(o.astype(f32), d.astype(f32), (((0, 1), (0, 1)), ((), ())))
  elif mode == "bf16 out":
    r = lax.dot_general(o, d, (((0, 1), (0, 1)), ((), ())),
                        preferred_element_type=bf16).astype(f32)
  elif mode == "pinned lhs":
    lhs = lax.optimization_barrier(o.reshape(-1, 128).T)
    r = lax.dot_general(lhs, d.reshape(-1, 128), (((1,), (0,)), ((), ())),
                        preferred_element_type=f32)
  elif mode == "reshape to 2-D first":
    r = lax.dot_general(o.reshape(-1, 128), d.reshape(-1, 128),
                        (((0,), (0,)), ((), ())), preferred_element_type=f32)
  return r.T
for mode in ("f32 operands", "bf16 out", "pinned lhs", "reshape to 2-D first"):
  try:
    jax.block_until_ready(jax.jit(grads_w, static_argnums=2)(w, x, mode))
    print(f"workaround {mode}: ok")
  except Exception as e:
    print(f"workaround {mode}: FAIL:", str(e).splitlines()[0])
