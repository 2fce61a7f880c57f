"""openxla/xla#41605: XLA:GPU rewrote ``convert(convert(x, bf16), f32)`` to
``convert(x, f32)``, eliding the narrowing cast: a bfloat16 round trip inside
jit changed none of 65,536 values.

mpolicy instead: where it promises a half rounding that a float32 reader
sees (a half result handed out in float32 under ``o=f32``, a half value
widened for a float32 op), the up-cast is followed by `reduce_precision` to
the half format, which XLA keeps: it is in the program lowered for CPU and
for CUDA and in the optimized CPU program, and the values fetched with
`jax.device_get` are the bfloat16-rounded ones, on whatever backend runs
the test.
"""

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import mpolicy

F = mpolicy.amp(lambda x, w: x @ w, "p=f32,c=bf16,o=f32")
RNG = np.random.default_rng(0)
# Small integers: every product and sum is exact in float32, and most of
# the 65,536 sums (about 4096, at most 64 * 16 * 16) are integers that
# bfloat16 (8 significant bits) cannot hold.
X = RNG.integers(0, 17, size=(256, 64)).astype(np.float32)
W = RNG.integers(0, 17, size=(64, 256)).astype(np.float32)
EXACT = X.astype(np.float64) @ W.astype(np.float64)
ROUNDED = EXACT.astype(ml_dtypes.bfloat16).astype(np.float64)
BF16_ROUNDING = re.compile(
    r"stablehlo\.reduce_precision %\S+, format = e8m7 : tensor<256x256xf32>")


def test_the_rounding_changes_most_values():
  assert (ROUNDED != EXACT).mean() > 0.9  # What an elided cast would keep.


def test_fetched_values_are_rounded_to_bfloat16():
  out = jax.device_get(jax.jit(F)(X, W))
  assert out.dtype == np.float32 and out.shape == (256, 256)
  np.testing.assert_array_equal(out.astype(np.float64), ROUNDED)


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_the_lowered_program_keeps_the_rounding(platform):
  text = jax.jit(F).trace(X, W).lower(lowering_platforms=(platform,)).as_text()
  assert len(BF16_ROUNDING.findall(text)) == 1, text


def test_the_optimized_cpu_program_keeps_the_rounding():
  hlo = jax.jit(F).lower(X, W).compile().as_text()
  if jax.default_backend() != "cpu":
    hlo = jax.jit(F, backend="cpu").lower(X, W).compile().as_text()
  lines = [l for l in hlo.splitlines() if "reduce-precision(" in l]
  assert len(lines) == 1, hlo
  assert "exponent_bits=8, mantissa_bits=7" in lines[0]
  assert lines[0].lstrip().split(" = ")[1].startswith("f32[256,256]")


def test_plain_jax_relies_on_the_convert_pair_alone():
  # The same computation written in plain JAX: no rounding XLA must keep.
  plain = lambda x, w: jnp.dot(x.astype(jnp.bfloat16), w.astype(
      jnp.bfloat16), preferred_element_type=jnp.float32).astype(
          jnp.bfloat16).astype(jnp.float32)
  text = jax.jit(plain).trace(X, W).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "reduce_precision" not in text
