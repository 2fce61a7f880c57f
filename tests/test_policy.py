"""Specification of mpolicy policies: grammar, str round-trips and casts."""

from __future__ import annotations

import dataclasses
import pickle

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import pytest

from mpolicy._src import policy as policy_lib

Policy = policy_lib.Policy
get_policy = policy_lib.get_policy

F32, BF16, F16, F64 = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16),
                       np.dtype(jnp.float16), np.dtype(jnp.float64))


def dtypes(policy):
  return (np.dtype(policy.param_dtype), np.dtype(policy.compute_dtype),
          np.dtype(policy.output_dtype))


# --- get_policy: the grammar ------------------------------------------------


@pytest.mark.parametrize("name,dtype", [
    ("full", F32), ("f32", F32), ("float32", F32),
    ("bf16", BF16), ("bfloat16", BF16),
    ("f16", F16), ("float16", F16),
    ("f64", F64), ("float64", F64),
])
def test_single_dtype_name_sets_all_three(name, dtype):
  assert dtypes(get_policy(name)) == (dtype, dtype, dtype)


def test_half_names_half_dtype():
  half = np.dtype(policy_lib.half_dtype())
  assert dtypes(get_policy("half")) == (half, half, half)
  assert dtypes(get_policy("c=half")) == (F32, half, half)


@pytest.mark.parametrize("key", ["p", "params"])
def test_param_key(key):
  assert dtypes(get_policy(f"{key}=f16")) == (F16, F16, F16)


@pytest.mark.parametrize("key", ["c", "compute"])
def test_compute_key_output_follows_compute(key):
  assert dtypes(get_policy(f"{key}=bf16")) == (F32, BF16, BF16)


@pytest.mark.parametrize("key", ["o", "output"])
def test_output_key_others_default_to_f32(key):
  assert dtypes(get_policy(f"{key}=bf16")) == (F32, F32, BF16)


def test_all_three_keys_long_form():
  policy = get_policy("params=float32,compute=bfloat16,output=float16")
  assert dtypes(policy) == (F32, BF16, F16)


def test_compute_follows_params_when_unset():
  assert dtypes(get_policy("p=bf16,o=f32")) == (BF16, BF16, F32)


def test_order_of_parts_does_not_matter():
  assert get_policy("o=f32,c=bf16,p=f16") == get_policy("p=f16,c=bf16,o=f32")


@pytest.mark.parametrize("spec", [
    " p=f32 , c=bf16 , o=f32 ", "p = f32,c= bf16,o =f32", "\tp=f32,c=bf16,o=f32\n"
])
def test_spaces_around_parts_are_ignored(spec):
  assert dtypes(get_policy(spec)) == (F32, BF16, F32)


def test_spaces_around_single_name_are_ignored():
  assert dtypes(get_policy("  bf16 ")) == (BF16, BF16, BF16)


def test_get_policy_returns_jmp_dtype_objects():
  policy = get_policy("p=f32,c=bf16,o=f16")
  assert policy.param_dtype is jnp.float32
  assert policy.compute_dtype is jnp.bfloat16
  assert policy.output_dtype is jnp.float16


def _error(spec):
  with pytest.raises(ValueError) as info:
    get_policy(spec)
  return str(info.value)


def _assert_lists_valid_names(message):
  for name in ("params", "compute", "output", "full", "f32", "float32", "half",
               "bf16", "bfloat16", "f16", "float16", "f64", "float64"):
    assert name in message, (name, message)


@pytest.mark.parametrize("spec,bad_part", [
    ("p=f16=f32", "'p=f16=f32'"),
    ("p=f32,x=f16", "'x=f16'"),
    ("p=f32,,c=f16", "''"),
    ("p=f32,", "''"),
    ("params", "'params'"),
    ("p=f32,c", "'c'"),
    ("compute_float16", "'compute_float16'"),
    ("p=f8", "'f8'"),
    ("F32", "'F32'"),
    ("", "''"),
    ("c=", "''"),
])
def test_bad_parts_raise_quoting_the_part_and_listing_names(spec, bad_part):
  message = _error(spec)
  assert bad_part in message
  _assert_lists_valid_names(message)


def test_unknown_dtype_message_says_unknown_dtype():
  assert "Unknown dtype 'compute_float16'" in _error("compute_float16")
  assert "Unknown dtype 'e5m2'" in _error("c=e5m2")


@pytest.mark.parametrize("name", ["float8_e5m2", "float8_e5m3fnu",
                                  "float4_e2m1fn", "float8_e8m0fnu"])
def test_a_jax_float_dtype_no_policy_holds_is_named_as_such(name):
  if not hasattr(jnp, name):
    pytest.skip(f"JAX {jax.__version__} has no {name}")
  message = _error(f"p=f32,c={name}")
  assert f"{name!r} in part 'c={name}'" in message
  assert "is a JAX floating dtype that no policy holds" in message
  assert "float8_e4m3fn (f8)" in message
  _assert_lists_valid_names(message)


def test_unknown_key_message_says_unknown_key():
  assert "Unknown key 'x=f16'" in _error("p=f32,x=f16")


@pytest.mark.parametrize("spec", ["p=f16,p=f32", "p=f16,params=f32",
                                  "c=bf16,compute=bf16", "o=f32,c=f16,output=f16"])
def test_duplicate_keys_are_rejected(spec):
  message = _error(spec)
  assert "Duplicate key" in message
  assert "params|p" in message


@pytest.mark.parametrize("value", [None, 32, jnp.float32, np.dtype("float32"),
                                   ["p=f32"]])
def test_non_string_raises_type_error(value):
  with pytest.raises(TypeError, match="get_policy expects a policy string"):
    get_policy(value)


def test_policy_is_returned_as_is():
  policy = Policy(np.float32, np.float16, np.float32)
  assert get_policy(policy) is policy


def test_jmp_policy_is_converted():
  converted = get_policy(jmp.get_policy("p=f32,c=bf16,o=f16"))
  assert type(converted) is Policy
  assert dtypes(converted) == (F32, BF16, F16)


# --- Policy: fields, equality, str ------------------------------------------


def test_fields_keep_the_given_dtype_objects():
  policy = Policy(np.float16, jnp.bfloat16, np.dtype("float32"))
  assert policy.param_dtype is np.float16
  assert policy.compute_dtype is jnp.bfloat16
  assert policy.output_dtype == np.dtype("float32")
  assert policy.compute_dtype == jnp.bfloat16 and policy.param_dtype == jnp.float16


def test_equal_and_same_hash_across_dtype_spellings():
  a = Policy(jnp.float32, jnp.bfloat16, jnp.float32)
  b = Policy(np.float32, np.dtype(jnp.bfloat16), np.dtype("float32"))
  assert a == b and hash(a) == hash(b)
  assert len({a, b}) == 1
  assert a != Policy(jnp.float32, jnp.float16, jnp.float32)


def test_policy_is_frozen():
  policy = get_policy("full")
  with pytest.raises(AttributeError):
    policy.param_dtype = jnp.float16  # type: ignore[misc]


def test_with_output_dtype_returns_a_copy():
  policy = get_policy("c=bf16")
  other = policy.with_output_dtype(jnp.float32)
  assert dtypes(other) == (F32, BF16, F32)
  assert dtypes(policy) == (F32, BF16, BF16)


@pytest.mark.parametrize("bad", [np.int32, jnp.bool_])
def test_non_float_dtype_is_rejected(bad):
  with pytest.raises(ValueError, match="floating dtype"):
    Policy(bad, jnp.float32, jnp.float32)


def test_non_dtype_is_rejected():
  with pytest.raises(TypeError, match="must be a dtype"):
    Policy(object(), jnp.float32, jnp.float32)


@pytest.mark.parametrize("f32,bf16,f16", [
    (np.float32, jnp.bfloat16, np.float16),
    (np.dtype("float32"), np.dtype(jnp.bfloat16), np.dtype("float16")),
    (jnp.float32, jnp.bfloat16, jnp.float16),
])
def test_str_for_every_dtype_spelling(f32, bf16, f16):
  policy = Policy(f32, bf16, f16)
  assert str(policy) == "p=f32,c=bf16,o=f16"
  assert get_policy(str(policy)) == policy


@pytest.mark.parametrize("spec", ["full", "f64", "c=bf16", "p=f16,c=f32",
                                  "p=bf16,c=f16,o=f64"])
def test_str_round_trips_through_get_policy(spec):
  policy = get_policy(spec)
  assert get_policy(str(policy)) == policy


def test_repr_names_dtypes():
  assert repr(get_policy("c=bf16")) == (
      "Policy(param_dtype=float32, compute_dtype=bfloat16, "
      "output_dtype=bfloat16)")


def test_policy_pickles():
  policy = get_policy("p=f32,c=bf16,o=f16")
  assert pickle.loads(pickle.dumps(policy)) == policy


# --- Policy.matmul_format ----------------------------------------------------

FORMAT_SPECS = {"fp8": "p=f32,c=f8,o=bf16", "mxfp8": "p=f32,c=mxfp8,o=f32",
                "mxfp4": "p=bf16,c=mxfp4,o=bf16", "nvfp4": "p=f32,c=nvfp4,o=f16"}


def test_matmul_format_is_a_field_after_output_dtype_default_none():
  names = [f.name for f in dataclasses.fields(Policy)]
  assert names == ["param_dtype", "compute_dtype", "output_dtype",
                   "matmul_format"]
  assert Policy(jnp.float32, jnp.bfloat16, jnp.float32).matmul_format is None
  assert get_policy("c=bf16").matmul_format is None


@pytest.mark.parametrize("fmt,spec", FORMAT_SPECS.items())
def test_a_format_computes_in_bfloat16_and_round_trips(fmt, spec):
  policy = get_policy(spec)
  assert policy.compute_dtype is jnp.bfloat16
  assert policy.matmul_format == fmt
  assert str(policy) == spec and get_policy(str(policy)) == policy
  assert pickle.loads(pickle.dumps(policy)) == policy
  assert Policy(policy.param_dtype, jnp.bfloat16, policy.output_dtype,
                fmt) == policy
  assert policy.cast_to_compute(jnp.ones(2)).dtype == BF16


@pytest.mark.parametrize("compute", [
    jnp.float8_e4m3fn, np.dtype(jnp.float8_e4m3fn), "f8", "float8_e4m3fn",
    "fp8"])
def test_float8_compute_dtype_is_read_as_the_fp8_format(compute):
  policy = Policy(jnp.float32, compute, jnp.bfloat16)
  assert policy.compute_dtype is jnp.bfloat16
  assert policy.matmul_format == "fp8"
  assert policy == get_policy("c=f8")
  assert hash(policy) == hash(get_policy("c=f8"))


def test_jmp_policy_with_float8_compute_is_the_fp8_format():
  converted = get_policy(jmp.Policy(jnp.float32, jnp.float8_e4m3fn,
                                    jnp.bfloat16))
  assert converted == get_policy("p=f32,c=f8,o=bf16")


def test_equality_and_hash_include_the_format():
  plain = Policy(jnp.float32, jnp.bfloat16, jnp.bfloat16)
  policies = [plain] + [Policy(jnp.float32, jnp.bfloat16, jnp.bfloat16, f)
                        for f in FORMAT_SPECS]
  assert len(set(policies)) == len({hash(p) for p in policies}) == 5
  assert all(p != plain for p in policies[1:])


def test_unknown_matmul_format_lists_the_allowed_ones():
  with pytest.raises(ValueError) as info:
    Policy(jnp.float32, jnp.bfloat16, jnp.bfloat16, "mxfp6")
  assert str(info.value) == (
      "Unknown Policy.matmul_format 'mxfp6': expected None (matmuls compute "
      "in compute_dtype) or one of 'fp8', 'mxfp8', 'mxfp4', 'nvfp4', 'int8'.")


def test_a_format_needs_a_bfloat16_compute_dtype():
  with pytest.raises(ValueError, match=(
      "matmul_format 'fp8' computes everything but its matmuls in bfloat16, "
      "but compute_dtype is float16")):
    Policy(jnp.float32, jnp.float16, jnp.bfloat16, "fp8")


def test_two_different_formats_are_an_error():
  with pytest.raises(ValueError, match=(
      "names two matmul formats: 'mxfp8' as its compute_dtype and 'nvfp4' "
      "as its matmul_format")):
    Policy(jnp.float32, "mxfp8", jnp.bfloat16, matmul_format="nvfp4")
  assert Policy(jnp.float32, "mxfp8", jnp.bfloat16,
                matmul_format="mxfp8") == get_policy("c=mxfp8")


def test_copies_keep_the_format_until_the_compute_dtype_changes():
  policy = get_policy("p=f32,c=nvfp4,o=bf16")
  assert str(policy.with_output_dtype(jnp.float32)) == "p=f32,c=nvfp4,o=f32"
  assert str(dataclasses.replace(policy, param_dtype=jnp.bfloat16)) == (
      "p=bf16,c=nvfp4,o=bf16")
  with pytest.raises(ValueError, match="or matmul_format=None for matmuls"):
    dataclasses.replace(policy, compute_dtype=jnp.float16)
  assert str(dataclasses.replace(policy, compute_dtype=jnp.float16,
                                 matmul_format=None)) == "p=f32,c=f16,o=bf16"
  assert str(dataclasses.replace(policy, matmul_format="mxfp8")) == (
      "p=f32,c=mxfp8,o=bf16")


# --- Casting ------------------------------------------------------------------


class _Opaque:
  pass


def _mixed_tree():
  return {
      "jax_f32": jnp.ones(3),
      "jax_bf16": jnp.ones(2, jnp.bfloat16),
      "np_f32": np.ones(2, np.float32),
      "np_f64": np.ones(2, np.float64),
      "jax_i32": jnp.arange(3),
      "np_i64": np.arange(3),
      "jax_bool": jnp.array([True, False]),
      "py_int": 3,
      "py_float": 1.5,
      "py_bool": True,
      "np_scalar": np.float32(2.0),
      "none": None,
      "object": _Opaque(),
      "string": "name",
  }


_UNTOUCHED = ("jax_i32", "np_i64", "jax_bool", "py_int", "py_float", "py_bool",
              "np_scalar", "object", "string")


@pytest.mark.parametrize("method,field", [
    ("cast_to_param", "param_dtype"), ("cast_to_compute", "compute_dtype"),
    ("cast_to_output", "output_dtype")])
def test_casts_only_floating_array_leaves(method, field):
  policy = Policy(jnp.float16, jnp.bfloat16, jnp.float32)
  target = np.dtype(getattr(policy, field))
  tree = _mixed_tree()
  out = getattr(policy, method)(tree)
  for key in ("jax_f32", "jax_bf16", "np_f32", "np_f64"):
    assert out[key].dtype == target, key
    np.testing.assert_array_equal(np.asarray(out[key], np.float32), 1.0)
  for key in _UNTOUCHED:
    assert out[key] is tree[key], key
  assert out["none"] is None


def test_numpy_leaves_stay_numpy_and_jax_leaves_stay_jax():
  out = get_policy("c=bf16").cast_to_compute(
      {"np": np.ones(2, np.float32), "jax": jnp.ones(2)})
  assert type(out["np"]) is np.ndarray and out["np"].dtype == BF16
  assert isinstance(out["jax"], jax.Array) and out["jax"].dtype == BF16


def test_leaf_already_in_target_dtype_is_returned_as_is():
  x = jnp.ones(2, jnp.bfloat16)
  assert get_policy("c=bf16").cast_to_compute(x) is x


def test_cast_matches_jmp():
  tree = _mixed_tree()
  ours = Policy(jnp.float32, jnp.bfloat16, jnp.float16).cast_to_compute(tree)
  theirs = jmp.Policy(jnp.float32, jnp.bfloat16, jnp.float16).cast_to_compute(
      tree)
  for key in tree:
    assert type(ours[key]) is type(theirs[key]), key
    if hasattr(theirs[key], "dtype"):
      assert ours[key].dtype == theirs[key].dtype, key


def test_cast_works_under_jit():
  policy = get_policy("c=bf16")
  out = jax.jit(policy.cast_to_compute)({"x": jnp.ones(2), "i": jnp.arange(2)})
  assert out["x"].dtype == BF16 and out["i"].dtype == jnp.int32


def test_cast_to_full_and_half():
  half = np.dtype(policy_lib.half_dtype())
  tree = {"h": jnp.ones(2, half), "f": jnp.ones(2), "i": jnp.arange(2), "n": 1.}
  full = policy_lib.cast_to_full(tree)
  assert full["h"].dtype == F32 and full["f"].dtype == F32
  assert full["i"] is tree["i"] and full["n"] == 1.
  halved = policy_lib.cast_to_half(tree)
  assert halved["h"].dtype == half and halved["f"].dtype == half
  assert halved["i"] is tree["i"]


# --- half_dtype and helpers ---------------------------------------------------


class _FakeDevice:

  def __init__(self, platform, compute_capability=None):
    self.platform = platform
    if compute_capability is not None:
      self.compute_capability = compute_capability


@pytest.mark.parametrize("device, expected", [
    (_FakeDevice("cpu"), jnp.bfloat16),
    (_FakeDevice("tpu"), jnp.bfloat16),
    (_FakeDevice("gpu", "8.0"), jnp.bfloat16),
    (_FakeDevice("cuda", "9.0"), jnp.bfloat16),
    (_FakeDevice("gpu", "7.5"), jnp.float16),
    (_FakeDevice("gpu", "unknown"), jnp.float16),
    (_FakeDevice("rocm"), jnp.float16),
])
def test_half_dtype_follows_the_backend(monkeypatch, device, expected):
  monkeypatch.setattr(jax, "local_devices", lambda: [device])
  assert policy_lib.half_dtype() is expected


def test_half_dtype_on_this_machine():
  device = jax.local_devices()[0]
  if device.platform in ("cpu", "tpu"):
    assert policy_lib.half_dtype() is jnp.bfloat16
  else:
    major = int(str(device.compute_capability).split(".")[0])
    expected = jnp.bfloat16 if major >= 8 else jnp.float16
    assert policy_lib.half_dtype() is expected


def test_is_float_array():
  assert policy_lib.is_float_array(np.ones(2, np.float16))
  assert policy_lib.is_float_array(jnp.ones(2, jnp.bfloat16))
  assert not policy_lib.is_float_array(jnp.arange(2))
  assert not policy_lib.is_float_array(np.array([True]))
  assert not policy_lib.is_float_array(1.0)
  assert not policy_lib.is_float_array(np.float32(1.0))
  assert not policy_lib.is_float_array(None)


def test_is_float_array_sees_tracers():
  seen = []
  jax.jit(lambda x: seen.append(policy_lib.is_float_array(x)))(jnp.ones(2))
  assert seen == [True]


@pytest.mark.parametrize("dtype,name", [
    (jnp.float32, "f32"), (np.float32, "f32"), (np.dtype("float32"), "f32"),
    (jnp.bfloat16, "bf16"), (np.dtype(jnp.bfloat16), "bf16"),
    (jnp.float16, "f16"), (np.float16, "f16"), (np.float64, "f64"),
    (jnp.int32, "int32"),
])
def test_dtype_name(dtype, name):
  assert policy_lib.dtype_name(dtype) == name


def test_jmp_name_tables_match_str():
  for dtype in (np.float16, jnp.float16, jnp.bfloat16, np.float32,
                jnp.float32):
    policy = policy_lib.Policy(dtype, dtype, dtype)
    expected = policy_lib.dtype_to_names[dtype][0]
    assert str(policy) == f"p={expected},c={expected},o={expected}"
    assert policy_lib.name_to_dtype[expected] == dtype
