"""The policy grammar's block-scaled compute dtypes: mxfp8, mxfp4, nvfp4."""

import pickle

import jax.numpy as jnp
import numpy as np
import pytest

import mpolicy
from mpolicy._src import policy as policy_lib
from mpolicy._src.blocks import formats

NAMES = ("mxfp8", "mxfp4", "nvfp4")


@pytest.mark.parametrize("name", NAMES)
def test_parse_and_round_trip(name):
  policy = mpolicy.get_policy(f"p=f32,c={name},o=bf16")
  assert str(policy) == f"p=f32,c={name},o=bf16"
  assert mpolicy.get_policy(str(policy)) == policy
  assert policy.compute_dtype == jnp.bfloat16
  assert policy.matmul_format == name
  assert str(mpolicy.get_policy(f"compute={name}")) == f"p=f32,c={name},o=bf16"
  assert pickle.loads(pickle.dumps(policy)) == policy
  assert repr(policy) == (
      "Policy(param_dtype=float32, compute_dtype=bfloat16, "
      f"output_dtype=bfloat16, matmul_format='{name}')")
  assert mpolicy.Policy(jnp.float32, jnp.bfloat16, jnp.bfloat16,
                        matmul_format=name) == policy


@pytest.mark.parametrize("name", NAMES)
def test_a_format_given_as_compute_dtype_is_read_as_bf16_with_it(name):
  want = mpolicy.get_policy(f"p=f32,c={name},o=bf16")
  for given in (name, formats.FORMATS[name]):
    policy = mpolicy.Policy(jnp.float32, given, jnp.bfloat16)
    assert policy == want and hash(policy) == hash(want)
    assert policy.compute_dtype is jnp.bfloat16
    assert policy.matmul_format == name
  assert mpolicy.Policy(jnp.float32, jnp.bfloat16, jnp.bfloat16,
                        formats.FORMATS[name]).matmul_format == name


def test_formats_are_distinct_from_f8_and_each_other():
  policies = [mpolicy.get_policy(f"c={n}") for n in ("f8",) + NAMES]
  for i, a in enumerate(policies):
    for j, b in enumerate(policies):
      assert (a == b) == (i == j), (str(a), str(b))
  assert len({hash(p) for p in policies}) == 4


@pytest.mark.parametrize("name", NAMES)
def test_everything_but_the_matmuls_runs_as_bf16(name):
  policy = mpolicy.get_policy(f"c={name}")
  assert np.dtype(policy.compute_dtype) == jnp.bfloat16
  assert not policy_lib.is_fp8(policy.compute_dtype)
  assert policy_lib.elementwise_dtype(policy) == jnp.bfloat16
  assert policy.cast_to_compute(jnp.ones(2)).dtype == jnp.bfloat16
  assert policy.output_dtype == jnp.bfloat16


@pytest.mark.parametrize("spec", ["mxfp8", "p=nvfp4", "o=mxfp4",
                                  "p=f32,c=f32,o=nvfp4"])
def test_block_formats_are_compute_only(spec):
  with pytest.raises(ValueError, match="only a compute dtype"):
    mpolicy.get_policy(spec)
  with pytest.raises(ValueError, match="cannot be mxfp4: a quantized matmul"):
    mpolicy.Policy(formats.FORMATS["mxfp4"], jnp.float32, jnp.float32)
  with pytest.raises(ValueError, match="output_dtype cannot be nvfp4: a "):
    mpolicy.Policy(jnp.float32, jnp.bfloat16, "nvfp4")


def test_unknown_name_lists_the_allowed_ones():
  with pytest.raises(ValueError) as info:
    mpolicy.get_policy("p=f32,c=mxfp6,o=bf16")
  message = str(info.value)
  assert "Unknown dtype 'mxfp6'" in message
  assert ("f8|float8|e4m3|float8_e4m3fn, mxfp8, mxfp4, nvfp4, int8 (quantized "
          "matmul formats, compute only)") in message
  assert "bf16|bfloat16" in message


def test_f8_is_the_fp8_format_over_bf16():
  policy = mpolicy.get_policy("p=f32,c=f8,o=bf16")
  assert np.dtype(policy.compute_dtype) == jnp.bfloat16
  assert policy.matmul_format == "fp8"
  assert str(policy) == "p=f32,c=f8,o=bf16"


def test_a_block_format_is_no_dtype():
  with pytest.raises(TypeError):
    np.dtype(formats.FORMATS["mxfp8"])
