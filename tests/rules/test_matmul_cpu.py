"""Every amp dot runs on XLA:CPU, whatever the layouts after fusion.

XLA:CPU runs a bf16 x bf16 -> f32 dot only in its fast path, which takes a
left operand that contracts its last dimension; a dot that ends up in
another form fails at run time ("Unsupported element type for
DotThunk::Execute: BF16 x BF16 = F32"). The CPU lowering puts the left
operand in that form behind an optimization barrier, so XLA cannot fold a
transpose back into the dot. GPU/TPU lowerings are untouched.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpolicy
from mpolicy._src.rules import matmul

HALF = "p=f32,c=bf16,o=f32"
KEYS = jax.random.split(jax.random.PRNGKey(0), 4)


def _transposed_reshape_then_two_matmuls(x, w1, w2):
  # Per example: a reshaped input, transposed, then two matmuls.
  return jax.vmap(lambda xi: (xi.reshape(6, 8).T @ w1) @ w2)(x)


def _args():
  return (jax.random.normal(KEYS[0], (16, 48)),
          jax.random.normal(KEYS[1], (6, 32)) / 3,
          jax.random.normal(KEYS[2], (32, 5)) / 6)


def _close(got, want, tol=0.03):
  assert got.dtype == want.dtype == jnp.float32
  np.testing.assert_allclose(got, want, rtol=tol,
                             atol=tol * float(jnp.abs(want).max()))


def test_vmapped_transpose_of_a_reshape_then_two_matmuls():
  f = _transposed_reshape_then_two_matmuls
  amp_f = mpolicy.amp(f, HALF)
  _close(jax.jit(amp_f)(*_args()), f(*_args()))
  for loss in (jnp.sum, lambda y: jnp.sum(y ** 2)):
    got = jax.jit(jax.grad(lambda *a: loss(amp_f(*a)), argnums=(0, 1, 2)))(
        *_args())
    want = jax.grad(lambda *a: loss(f(*a)), argnums=(0, 1, 2))(*_args())
    for g, w in zip(got, want):
      _close(g, w, tol=0.05)


@pytest.mark.parametrize("dims", [
    ((1,), (0,)),  # x @ w
    ((0,), (0,)),  # x.T @ w: the weight gradient's form.
    ((1,), (1,)),  # x @ w.T
    ((0,), (1,)),
])
def test_cpu_dot_is_the_float32_dot_of_the_rounded_operands(dims):
  a = jax.random.normal(KEYS[0], (24, 24))
  b = jax.random.normal(KEYS[1], (24, 24))
  ah, bh = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
  dn = (dims, ((), ()))
  got = jax.jit(lambda a, b: matmul.amp_dot_general(
      a, b, dimension_numbers=dn, out_dtype=jnp.float32))(ah, bh)
  want = jax.lax.dot_general(ah.astype(jnp.float32), bh.astype(jnp.float32),
                             dn, precision=jax.lax.Precision.HIGHEST)
  # Same rounded operands, float32 accumulation (the order may differ).
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def _lowered(fn, *args, platform):
  return jax.jit(fn).trace(*args).lower(
      lowering_platforms=(platform,)).as_text()


def test_only_the_cpu_lowering_pins_the_left_operand():
  f = jax.grad(lambda *a: jnp.sum(
      mpolicy.amp(_transposed_reshape_then_two_matmuls, HALF)(*a)),
               argnums=(1, 2))
  cpu = _lowered(f, *_args(), platform="cpu")
  cuda = _lowered(f, *_args(), platform="cuda")
  dots = re.findall(r"stablehlo\.dot_general %(\w+)", cpu)
  assert len(dots) >= 4
  barriers = set(re.findall(r"%(\w+)(?::\d+)? = stablehlo\.optimization_barrier",
                            cpu))
  assert set(dots) <= barriers, (dots, barriers)
  # Every CPU dot contracts the left operand's last dimension.
  for line in cpu.splitlines():
    m = re.search(r"stablehlo\.dot_general .*contracting_dims = \[(\d+)\].*"
                  r"\(tensor<((?:\d+x)*)bf16>", line)
    if m:
      assert int(m.group(1)) == m.group(2).count("x") - 1, line
  assert "optimization_barrier" not in cuda
