"""Mixed precision policies: which dtype parameters, compute and outputs use.

A `Policy` is three dtypes and three casts, and optionally the format its
matmuls are quantized to. `get_policy` parses policy strings
(`"p=f32,c=bf16,o=f32"`), and `str(policy)` writes them back.

A quantized matmul format (`c=f8`, `c=mxfp8`, ...) is held apart, in
`Policy.matmul_format`; everything else computes in `compute_dtype`,
bfloat16 (see `rules.fp8_scaling`, `blocks.quantize`).

>>> policy = get_policy("p=f32,c=bf16,o=f32")
>>> policy.cast_to_compute({"x": jnp.ones(2)})["x"].dtype
dtype(bfloat16)
>>> policy = get_policy("c=mxfp8")
>>> policy.compute_dtype == jnp.bfloat16, policy.matmul_format
(True, 'mxfp8')
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Optional, TYPE_CHECKING, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from mpolicy._src import dtypes
from mpolicy._src.blocks import formats as block_formats

T = TypeVar("T")

# Dtype names of the policy grammar, the first of each row is the short name
# that `str(policy)` writes. "half" is not a row: it depends on the backend.
_DTYPE_NAMES: tuple[tuple[Any, tuple[str, ...]], ...] = (
    (jnp.float32, ("f32", "full", "float32")),
    (jnp.bfloat16, ("bf16", "bfloat16")),
    (jnp.float16, ("f16", "float16")),
    (jnp.float64, ("f64", "float64")),
    (jnp.float8_e4m3fn, ("f8", "float8", "e4m3", "float8_e4m3fn")),
)
_NAME_TO_DTYPE = {name: dt for dt, names in _DTYPE_NAMES for name in names}
_SHORT_NAME = {np.dtype(dt): names[0] for dt, names in _DTYPE_NAMES}

# The grammar's tables, public under the names jmp's policy module uses, for
# code that reads them; the first name of each dtype is the one `str` writes.
dtype_to_names = dict(_DTYPE_NAMES)
name_to_dtype = dict(_NAME_TO_DTYPE)

_KEYS = {"p": "param", "params": "param",
         "c": "compute", "compute": "compute",
         "o": "output", "output": "output"}

_VALID_KEYS = "params|p, compute|c, output|o"
# The quantized matmul formats (`Policy.matmul_format`), each with the names
# the grammar reads it by as a compute dtype; `str` writes the first.
MATMUL_FORMATS: dict[str, tuple[str, ...]] = {
    "fp8": ("f8", "float8", "e4m3", "float8_e4m3fn"),
    **{name: (name,) for name in block_formats.NAMES},
    "int8": ("int8",),
}
_FORMAT_OF_NAME = {name: fmt for fmt, names in MATMUL_FORMATS.items()
                   for name in (fmt, *names)}

# The dtype every op but the quantized matmuls computes in under a format.
FORMAT_COMPUTE = jnp.bfloat16
# The float8 dtype `fp8` quantizes matmul operands to.
FP8_COMPUTE = np.dtype(jnp.float8_e4m3fn)

_VALID_DTYPES = ("full|f32|float32, half, bf16|bfloat16, f16|float16, f64|"
                 "float64, " + ", ".join("|".join(names) for names in MATMUL_FORMATS.values())
                 + " (quantized matmul formats, compute only)")


def is_fp8(dtype: Any) -> bool:
  """Whether `dtype` is a float8 dtype (any of JAX's float8 variants).

  Args:
    dtype: anything `np.dtype` accepts; other values give False.

  Returns:
    True for float8 dtypes, else False.

  >>> import jax.numpy as jnp
  >>> is_fp8(jnp.float8_e4m3fn), is_fp8(jnp.bfloat16)
  (True, False)

  It is a test of a dtype, not of a policy: whether a policy quantizes
  its matmuls is `Policy.matmul_format`.
  """
  try:
    dt = np.dtype(dtype)
  except TypeError:
    return False
  return dt.name.startswith("float8")


def elementwise_dtype(policy: Policy) -> np.dtype:
  """The dtype `policy` computes in outside matmuls: its compute dtype.

  Kept for older code: `Policy.compute_dtype` is always a dtype values are
  computed in (bfloat16 under a matmul format), so this is
  ``np.dtype(policy.compute_dtype)``.

  >>> str(elementwise_dtype(get_policy("p=f32,c=f8,o=bf16")))
  'bfloat16'
  >>> str(elementwise_dtype(get_policy("c=f16")))
  'float16'

  See also: `Policy.cast_to_compute`, which casts to this dtype.
  """
  return np.dtype(policy.compute_dtype)


def is_float_array(x: Any) -> bool:
  """Whether `x` is a numpy or JAX array (or tracer) with a floating dtype.

  Args:
    x: any value.

  Returns:
    True for floating arrays; False for Python scalars, numpy scalars,
    non-floating arrays and everything else.

  >>> import numpy as np
  >>> is_float_array(np.ones(2)), is_float_array(np.ones(2, int)), is_float_array(1.)
  (True, False, False)

  See also: `Policy.cast_to_compute`, which casts exactly these leaves.
  """
  return isinstance(x, (np.ndarray, jax.Array)) and dtypes.is_float(x.dtype)


def dtype_name(dtype: Any) -> str:
  """The short policy-grammar name of a dtype ('f32', 'bf16', 'f16', 'f64').

  Args:
    dtype: a numpy type, an `np.dtype` or a jnp type.

  Returns:
    The grammar's short name ('f8' for `float8_e4m3fn`); numpy's name for
    dtypes the grammar does not know.

  >>> import jax.numpy as jnp, numpy as np
  >>> dtype_name(jnp.bfloat16), dtype_name(np.dtype("float32"))
  ('bf16', 'f32')

  See also: `get_policy`, which reads these names back.
  """
  dt = np.dtype(dtype)
  return _SHORT_NAME.get(dt, dt.name)


def _cast_floating(tree: T, dtype: Any) -> T:
  """Casts the floating array leaves of `tree` to `dtype`, keeps the rest."""
  target = np.dtype(dtype)

  def cast(x):
    if is_float_array(x) and x.dtype != target:
      return x.astype(target)  # numpy stays numpy, jax stays jax.
    return x

  return jax.tree_util.tree_map(cast, tree)


def _format_in(value: Any) -> Optional[str]:
  """The matmul format ``value`` names as a compute dtype (a grammar or
  format name, a `BlockFormat`, float8_e4m3fn), else ``None``."""
  if isinstance(value, block_formats.BlockFormat):
    return value.name
  if isinstance(value, str):
    return _FORMAT_OF_NAME.get(value)
  try:
    return "fp8" if np.dtype(value) == FP8_COMPUTE else None
  except TypeError:
    return None


def _as_format(value: Any) -> Optional[str]:
  """``Policy.matmul_format`` checked: ``None`` or a format's name."""
  if isinstance(value, block_formats.BlockFormat):
    value = value.name
  if value is None or (isinstance(value, str) and value in MATMUL_FORMATS):
    return value
  allowed = ", ".join(repr(n) for n in MATMUL_FORMATS)
  raise ValueError(f"Unknown Policy.matmul_format {value!r}: expected None "
                   f"(matmuls compute in compute_dtype) or one of {allowed}.")


def _as_float_dtype(value: Any, field: str) -> np.dtype:
  fmt = _format_in(value)
  if fmt is not None and isinstance(value, (str, block_formats.BlockFormat)):
    raise ValueError(
        f"Policy.{field} cannot be {value}: a quantized matmul format is "
        "only a compute dtype (its values need their scales, which stored "
        f"params and outputs would not carry). Use e.g. "
        f"'p=f32,c={MATMUL_FORMATS[fmt][0]},o=bf16'.")
  try:
    dt = np.dtype(value)
  except TypeError as e:
    raise TypeError(f"Policy.{field} must be a dtype (e.g. jnp.bfloat16), "
                    f"got {value!r}.") from e
  if not jnp.issubdtype(dt, jnp.floating):
    raise ValueError(f"Policy.{field} must be a floating dtype, got {dt.name}.")
  if is_fp8(dt):
    raise ValueError(
        f"Policy.{field} cannot be {dt.name}: float8 is only a compute dtype, "
        "and only float8_e4m3fn (matmul operands need a per-tensor scale, "
        "which stored params and outputs would not carry). Use e.g. "
        "'p=f32,c=f8,o=bf16'.")
  return dt


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class Policy:
  """Dtypes for parameters, computation and outputs, with casts to each.

  The fields keep the dtype objects they were given (`jnp.bfloat16`,
  `np.float16`, `np.dtype("float32")`, ...), so
  `policy.compute_dtype == jnp.bfloat16` reads naturally. Equality and hash
  compare the dtypes themselves (and the matmul format):
  `Policy(np.float32, ...)` equals `Policy(jnp.float32, ...)`. A
  `jmp.Policy` is a different type and never equal; convert it with
  `get_policy`.

  The casts touch only floating-point array leaves (numpy or JAX arrays);
  ints, bools, integer arrays, Python scalars, None and other objects pass
  through unchanged. A numpy leaf stays a numpy array.

  A quantized matmul format is no dtype values are computed in, so it is
  a field of its own, `matmul_format`, and `compute_dtype` is what every
  other op computes in, bfloat16 (`nn.Dense(dtype=policy.compute_dtype)`
  computes in bfloat16, not in unscaled float8). `c=f8` too: format
  ``"fp8"`` (`explain` reports its matmuls as run in float8_e4m3fn). A
  format given as the compute dtype (``jnp.float8_e4m3fn``, ``"mxfp8"``, a
  `BlockFormat`) is read as bfloat16 with that format. `dataclasses.replace`
  and `with_output_dtype` keep the format; a compute dtype other than
  bfloat16 with it is an error (pass ``matmul_format=None`` too).

  Attributes:
    param_dtype: the dtype parameters are created and stored in.
    compute_dtype: the dtype computation runs in (bfloat16 under a format).
    output_dtype: the dtype outputs are cast to.
    matmul_format: the quantized matmul format, or ``None``.

  Raises:
    TypeError: a field is not a dtype.
    ValueError: a field is not a floating dtype, a float8 dtype other
      than a `float8_e4m3fn` compute dtype, an unknown format, a format
      with a compute dtype other than bfloat16, or two different formats.

  >>> import jax.numpy as jnp
  >>> policy = Policy(jnp.float32, jnp.bfloat16, jnp.float32)
  >>> str(policy)
  'p=f32,c=bf16,o=f32'
  >>> policy.cast_to_compute({"w": jnp.ones(2), "step": 3})["w"].dtype
  dtype(bfloat16)

  See also: `get_policy`, `cast_to_full`, `cast_to_half`.
  """
  param_dtype: Any
  compute_dtype: Any
  output_dtype: Any
  matmul_format: Optional[str] = None
  """``"fp8"``, ``"mxfp8"``, ``"mxfp4"`` or ``"nvfp4"``: what the matmuls
  the float8 placement picks are quantized to; ``None``: matmuls compute in
  ``compute_dtype``. `str` writes it as the compute dtype (``c=mxfp8``)."""
  if TYPE_CHECKING:  # Set by __post_init__.
    _dtypes: tuple = dataclasses.field(init=False)
    _hash: int = dataclasses.field(init=False)

  def __post_init__(self):
    fmt = _as_format(self.matmul_format)
    named = _format_in(self.compute_dtype)
    if named is not None:
      if fmt is not None and fmt != named:
        raise ValueError(
            f"Policy names two matmul formats: {named!r} as its compute_dtype "
            f"and {fmt!r} as its matmul_format. Give one, as matmul_format, "
            f"with compute_dtype=jnp.bfloat16.")
      fmt = named
      object.__setattr__(self, "compute_dtype", FORMAT_COMPUTE)
    object.__setattr__(self, "matmul_format", fmt)
    key = tuple(_as_float_dtype(getattr(self, field), field)
                for field in ("param_dtype", "compute_dtype", "output_dtype"))
    if fmt is not None and key[1] != FORMAT_COMPUTE:
      raise ValueError(
          f"Policy.matmul_format {fmt!r} computes everything but its "
          f"matmuls in bfloat16, but compute_dtype is {key[1].name}. Use "
          f"compute_dtype=jnp.bfloat16, or matmul_format=None for matmuls "
          f"in {key[1].name}.")
    # The dtypes, normalised once: a deep model compares and hashes its
    # policies tens of thousands of times per trace.
    key += (fmt,)
    object.__setattr__(self, "_dtypes", key)
    object.__setattr__(self, "_hash", hash(key))

  def _key(self) -> tuple[np.dtype, np.dtype, np.dtype]:
    return self._dtypes[:3]

  def __eq__(self, other):
    if self is other:
      return True
    if not isinstance(other, Policy):
      return NotImplemented
    return self._dtypes == other._dtypes

  def __hash__(self):
    return self._hash

  def __reduce__(self):  # Rebuilt by the constructor (a hash is per process).
    return (type(self), (self.param_dtype, self.compute_dtype,
                         self.output_dtype, self.matmul_format))

  def __repr__(self):
    p, c, o = (dt.name for dt in self._key())
    fmt = ("" if self.matmul_format is None
           else f", matmul_format={self.matmul_format!r}")
    return (f"Policy(param_dtype={p}, compute_dtype={c}, output_dtype={o}"
            f"{fmt})")

  def __str__(self):
    p, c, o = (dtype_name(dt) for dt in self._key())
    if self.matmul_format is not None:
      c = MATMUL_FORMATS[self.matmul_format][0]
    return f"p={p},c={c},o={o}"

  def cast_to_param(self, tree: T) -> T:
    """Casts the floating array leaves of `tree` to `param_dtype`.

    >>> import jax.numpy as jnp
    >>> get_policy("p=f16,c=f32").cast_to_param(jnp.ones(2)).dtype
    dtype('float16')

    See also: `Policy.cast_to_compute`, `Policy.cast_to_output`.
    """
    return _cast_floating(tree, self.param_dtype)

  def cast_to_compute(self, tree: T) -> T:
    """Casts the floating array leaves of `tree` to `compute_dtype`.

    Under a matmul format (`c=f8`, `c=mxfp8`, ...) that is bfloat16: a
    quantized copy without its scales would lose most values, and the
    quantized matmuls quantize their own operands.

    >>> import jax.numpy as jnp
    >>> get_policy("c=bf16").cast_to_compute((jnp.ones(2), 1.5))[1]
    1.5
    >>> get_policy("p=f32,c=f8,o=bf16").cast_to_compute(jnp.ones(2)).dtype
    dtype(bfloat16)

    See also: `Policy.cast_to_param`, `Policy.cast_to_output`.
    """
    return _cast_floating(tree, self.compute_dtype)

  def cast_to_output(self, tree: T) -> T:
    """Casts the floating array leaves of `tree` to `output_dtype`.

    >>> import jax.numpy as jnp
    >>> get_policy("c=bf16,o=f32").cast_to_output(jnp.ones(2, jnp.bfloat16)).dtype
    dtype('float32')

    See also: `Policy.cast_to_param`, `Policy.cast_to_compute`.
    """
    return _cast_floating(tree, self.output_dtype)

  def with_output_dtype(self, output_dtype: Any) -> Policy:
    """A copy of this policy with another `output_dtype`.

    >>> import jax.numpy as jnp
    >>> str(get_policy("c=bf16").with_output_dtype(jnp.float32))
    'p=f32,c=bf16,o=f32'
    >>> str(get_policy("c=mxfp4").with_output_dtype(jnp.float32))
    'p=f32,c=mxfp4,o=f32'

    See also: `dataclasses.replace` for the other fields.
    """
    return dataclasses.replace(self, output_dtype=output_dtype)


def require_x64(policy: Policy, where: str) -> None:
  """Raises a `ValueError` if ``policy`` names float64 while x64 is off.

  JAX would compute and return float32 where the policy says float64, with
  only a truncation warning; the policy is refused where it is applied, as
  the function is traced. `get_policy` itself parses `f64` either way.

  Args:
    policy: the policy about to govern a computation.
    where: what applies it, e.g. ``"amp(policy=...)"``.

  >>> import jax
  >>> with jax.enable_x64(False):
  ...   require_x64(get_policy("p=f32,c=f64"), "amp(policy=...)")
  Traceback (most recent call last):
  ...
  ValueError: amp(policy=...): the policy p=f32,c=f64,o=f64 asks for float64, but jax_enable_x64 is off, so JAX would compute and return float32. Turn float64 on at the start of the program, jax.config.update("jax_enable_x64", True) (or JAX_ENABLE_X64=1), or use a policy without f64, such as "full".
  """
  named = (policy.param_dtype, policy.compute_dtype, policy.output_dtype)
  if (all(np.dtype(d) != np.float64 for d in named)
      or jax.dtypes.canonicalize_dtype(np.float64) == np.float64):
    return
  raise ValueError(
      f"{where}: the policy {policy} asks for float64, but jax_enable_x64 is "
      "off, so JAX would compute and return float32. Turn float64 on at the "
      'start of the program, jax.config.update("jax_enable_x64", True) (or '
      'JAX_ENABLE_X64=1), or use a policy without f64, such as "full".')


def half_dtype() -> Any:
  """The half precision dtype for the default backend.

  Returns:
    bfloat16 on TPU, on CPU and on GPUs with bfloat16 support (NVIDIA
    compute capability 8.0 or newer); float16 on older GPUs and unknown
    backends. bfloat16 is preferred where it is fast: it has float32's
    range, so it needs no loss scaling.

  >>> import jax, jax.numpy as jnp
  >>> half_dtype() == jnp.bfloat16 or jax.default_backend() == "gpu"
  True

  See also: `cast_to_half`, `get_policy("half")`.
  """
  device = jax.local_devices()[0]
  if device.platform in ("tpu", "cpu"):
    return jnp.bfloat16
  if device.platform in ("gpu", "cuda"):
    capability = getattr(device, "compute_capability", None)
    try:
      major = int(str(capability).split(".")[0])
    except ValueError:
      return jnp.float16
    return jnp.bfloat16 if major >= 8 else jnp.float16
  return jnp.float16


def cast_to_full(tree: T) -> T:
  """Casts the floating array leaves of `tree` to float32; keeps the rest.

  >>> import jax.numpy as jnp
  >>> cast_to_full({"h": jnp.ones(2, jnp.bfloat16), "i": 1})["h"].dtype
  dtype('float32')

  See also: `cast_to_half`, `Policy.cast_to_param`.
  """
  return _cast_floating(tree, jnp.float32)


def cast_to_half(tree: T) -> T:
  """Casts the floating array leaves of `tree` to `half_dtype()`; keeps the rest.

  >>> import jax.numpy as jnp
  >>> cast_to_half(jnp.ones(2)).dtype == half_dtype()
  True

  See also: `cast_to_full`, `half_dtype`.
  """
  return _cast_floating(tree, half_dtype())


def _parse_dtype(name: str, part: str, spec: str) -> Any:
  if name == "half":
    return half_dtype()
  if name in _FORMAT_OF_NAME:
    return _FORMAT_OF_NAME[name]  # A format's name: `Policy` places it.
  try:
    return _NAME_TO_DTYPE[name]
  except KeyError:
    if _is_jax_float_name(name):
      raise ValueError(
          f"{name!r} in part {part!r} of policy {spec!r} is a JAX floating "
          f"dtype that no policy holds: params and outputs are float32, "
          f"bfloat16, float16 or float64, and float8 computes as "
          f"float8_e4m3fn (f8) with scales, or in a block format. Valid "
          f"dtype names: {_VALID_DTYPES}; valid keys: {_VALID_KEYS}."
      ) from None
    raise ValueError(
        f"Unknown dtype {name!r} in part {part!r} of policy {spec!r}. "
        f"Valid dtype names: {_VALID_DTYPES}; valid keys: {_VALID_KEYS}."
    ) from None


def _is_jax_float_name(name: str) -> bool:
  """Whether ``name`` names one of the installed JAX's floating dtypes
  (``float8_e5m2``, JAX 0.12.1's ``float8_e5m3fnu``, ``float4_e2m1fn``,
  ...)."""
  dt = getattr(jnp, name, None)
  try:
    return dt is not None and jnp.issubdtype(np.dtype(dt), jnp.floating)
  except TypeError:
    return False


def _reject_fp8_storage(name: str, part: str, spec: str):
  raise ValueError(
      f"{name!r} in part {part!r} of policy {spec!r} is only a compute "
      "dtype (a quantized matmul format): params and outputs need a dtype that "
      "holds values without a scale (e.g. 'p=f32,c=f8,o=bf16'). Valid dtype "
      f"names: {_VALID_DTYPES}; valid keys: {_VALID_KEYS}.")


def _from_jmp(spec: Any) -> Policy | None:
  jmp = sys.modules.get("jmp")  # Only a jmp that is imported can have made it.
  jmp_policy = getattr(jmp, "Policy", None)
  if jmp_policy is not None and isinstance(spec, jmp_policy):
    return Policy(spec.param_dtype, spec.compute_dtype, spec.output_dtype)
  return None


def get_policy(spec: str | Policy | Any) -> Policy:
  """Parses a policy string; passes policies through.

  The string is comma-separated `key=dtype` parts, keys `params|p`,
  `compute|c`, `output|o`, dtype names `full|f32|float32`, `half`
  (= `half_dtype()`), `bf16|bfloat16`, `f16|float16`, `f64|float64`; or a
  single dtype name for all three. Unset parts default: params float32,
  compute follows params, output follows compute. Spaces around parts, keys
  and names are ignored; names are case-sensitive. A key given twice
  (`"p=f16,params=f32"`) is an error.

  The quantized matmul formats are written as compute dtypes only and
  become `Policy.matmul_format`, with bfloat16 as the compute dtype (and
  as an unset output): `f8|float8|e4m3|float8_e4m3fn` (format ``"fp8"``,
  `str` writes `f8`): matmuls and convolutions run in float8 with
  per-tensor scales; the block-scaled `mxfp8`, `mxfp4` and `nvfp4`: the
  matmuls float8 would take run with both operands quantized in blocks
  along the contracting dimension; `int8`: they run as int8 x int8
  products summed in int32 (`blocks.int8`). Everything else computes in
  bfloat16.

  >>> str(get_policy("c=bf16"))
  'p=f32,c=bf16,o=bf16'
  >>> str(get_policy("params=float32, compute=f16, output=full"))
  'p=f32,c=f16,o=f32'
  >>> str(get_policy("c=e4m3"))
  'p=f32,c=f8,o=bf16'
  >>> str(get_policy("p=f32,c=nvfp4"))
  'p=f32,c=nvfp4,o=bf16'
  >>> policy = get_policy("c=f8")
  >>> str(np.dtype(policy.compute_dtype)), policy.matmul_format
  ('bfloat16', 'fp8')

  Args:
    spec: a policy string, a `Policy` (returned as is) or a `jmp.Policy`
      (converted).

  Returns:
    The `Policy`.

  Raises:
    ValueError: for a malformed string; the message quotes the bad part and
      lists the valid keys and dtype names.
    TypeError: for anything that is not a string or a policy.

  See also: `Policy.__str__`, which writes strings this reads.
  """
  if isinstance(spec, Policy):
    return spec
  converted = _from_jmp(spec)
  if converted is not None:
    return converted
  if not isinstance(spec, str):
    raise TypeError("get_policy expects a policy string, an mpolicy.Policy or "
                    f"a jmp.Policy, got {type(spec).__name__}: {spec!r}.")

  if "=" not in spec:
    name = spec.strip()
    dtype = _parse_dtype(name, name, spec)
    if isinstance(dtype, str):
      _reject_fp8_storage(name, name, spec)
    return Policy(dtype, dtype, dtype)

  chosen = {}
  for raw_part in spec.split(","):
    part = raw_part.strip()
    pieces = part.split("=")
    key = pieces[0].strip()
    if len(pieces) != 2 or key not in _KEYS:
      what = "Unknown key" if len(pieces) == 2 else "Malformed part"
      raise ValueError(
          f"{what} {part!r} in policy {spec!r}: expected 'key=dtype' with "
          f"key one of {_VALID_KEYS} and dtype one of {_VALID_DTYPES}.")
    field = _KEYS[key]
    if field in chosen:
      raise ValueError(
          f"Duplicate key in part {part!r} of policy {spec!r}: the "
          f"{field} dtype is already set. Valid keys: {_VALID_KEYS}.")
    chosen[field] = _parse_dtype(pieces[1].strip(), part, spec)
    if field != "compute" and isinstance(chosen[field], str):
      _reject_fp8_storage(pieces[1].strip(), part, spec)

  param = chosen.get("param", jnp.float32)
  compute = chosen.get("compute", param)
  # Under a matmul format the output follows the compute dtype, bfloat16.
  output = chosen.get("output", FORMAT_COMPUTE if isinstance(compute, str)
                      else compute)
  return Policy(param, compute, output)
