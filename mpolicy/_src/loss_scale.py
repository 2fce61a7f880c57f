"""Loss scaling: keep small half-precision gradients from flushing to zero.

Three immutable loss scales with one interface (`loss_scale`, `scale`,
`unscale`, `adjust`), each a pytree, plus `all_finite` and `select_tree`.
Scaling runs in float32 or wider and returns each leaf in its own dtype
(float8 included), so a scale that a float16 cannot hold still unscales
float16 gradients, and a value that overflows its leaf's dtype is never
saturated to a finite one;
constructors reject values that would silently lose gradients (zero,
negative, inf or nan scales, a floor above the scale).

>>> import jax.numpy as jnp
>>> ls = DynamicLossScale(jnp.float32(2. ** 15))
>>> grads = ls.unscale(ls.scale({"w": jnp.ones(2, jnp.float16)}))
>>> grads["w"].dtype, bool(all_finite(grads))
(dtype('float16'), True)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, TypeVar, Union
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from mpolicy._src import arguments
from mpolicy._src import dtypes
from mpolicy._src import jax_compat

T = TypeVar("T")


def _is_floating_leaf(x: Any) -> bool:
  if isinstance(x, bool):
    return False
  if isinstance(x, float):
    return True
  return dtypes.is_float(getattr(x, "dtype", None))


def _scale_dtype(loss_scale: Any) -> Any:
  """The dtype a loss scale's own value calls for: its float dtype, or f32."""
  dtype = getattr(loss_scale, "dtype", None)
  if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
    return jnp.float32
  return jax.dtypes.canonicalize_dtype(dtype)


def _work_dtype(*floats: Any) -> np.dtype:
  """float32, or float64 where one of the float dtypes ``floats`` is.

  Narrower dtypes (float16, bfloat16, float8) work in float32, widened
  explicitly: JAX's promotion refuses float8 with float32.

  >>> _work_dtype(jnp.float8_e4m3fn, jnp.bfloat16)
  dtype('float32')
  """
  wide = [d for d in floats if np.dtype(d).itemsize > 4]
  return np.dtype(jax.dtypes.canonicalize_dtype(wide[0] if wide
                                                 else jnp.float32))


@functools.lru_cache(maxsize=None)
def _float8_overflow(dtype: np.dtype) -> tuple[float, bool, Any, Any]:
  """``(limit, inclusive, +special, -special)`` for casting to ``dtype``.

  A float32 value overflows ``dtype`` where its magnitude reaches ``limit``
  (halfway past the largest finite value; a tie rounds to even, so whether
  ``limit`` itself overflows depends on the dtype: ``inclusive``). It then
  becomes ``±special``: inf where the dtype has one, else nan.
  """
  info = jnp.finfo(dtype)
  largest = float(info.max)
  half_ulp = 2.0 ** (np.floor(np.log2(largest)) - info.nmant - 1)
  limit = np.float32(largest + half_ulp)
  inclusive = not np.isfinite(float(limit.astype(dtype)))
  specials = np.array([np.inf, -np.inf], np.float32).astype(dtype)
  if np.isfinite(specials.astype(np.float32)).any():
    raise TypeError(
        f"loss scaling: {np.dtype(dtype).name} has neither inf nor nan, so "
        "an overflow would be a finite, wrong value that no finiteness check "
        "sees; keep such leaves in float8_e4m3fn, float8_e5m2 or wider.")
  return float(limit), inclusive, specials[0], specials[1]


def _cast_narrow(y: jax.Array, dtype: Any) -> jax.Array:
  """``y`` in ``dtype``, rounded to nearest, where an overflow is non-finite.

  For float8 dtypes the overflow is made explicit, whatever the backend's
  conversion does (some saturate): a value beyond the largest finite one
  becomes inf (float8_e5m2) or nan (float8_e4m3fn, which has no inf), so
  `all_finite` sees it and a dynamic loss scale backs off. A saturated
  value would be a wrong gradient that looks finite. Other dtypes convert
  as JAX does (IEEE: overflow to inf).

  >>> y = jnp.array([1.5, 500., -1e6])
  >>> _cast_narrow(y, jnp.float8_e4m3fn), _cast_narrow(y, jnp.float8_e5m2)
  (Array([1.5, nan, nan], dtype=float8_e4m3fn), Array([1.5, 512, -inf], dtype=float8_e5m2))
  """
  out = y.astype(dtype)
  if np.dtype(dtype).itemsize != 1:
    return out
  limit, inclusive, pos, neg = _float8_overflow(np.dtype(dtype))
  size = jnp.abs(y)
  over = size >= limit if inclusive else size > limit
  return jnp.where(over, jnp.where(y < 0, neg, pos), out)


def _apply_scale(tree: T, loss_scale: Any, op, who: str) -> T:
  """`op(leaf, loss_scale)` on the floating leaves, each back in its dtype.

  The arithmetic runs in float32 (or wider, if the leaf or the scale is):
  a scale such as 2 ** 17 does not exist in float16, and dividing a float16
  gradient by it in float16 would give 0. Only a result that overflows the
  leaf's own dtype becomes non-finite (see `_cast_narrow` for float8).
  """
  if np.ndim(loss_scale) != 0:
    raise ValueError(
        f"{who}: loss_scale must be a scalar, got shape "
        f"{tuple(np.shape(loss_scale))}; a non-scalar scale would broadcast "
        "and change the shape of every leaf. To keep one loss scale per "
        "device or per model, map over them with `jax.vmap` / `jax.pmap`.")
  scale_dtype = _scale_dtype(loss_scale)
  cast_scales = {}

  def apply(x):
    if not _is_floating_leaf(x):
      return x
    dtype = getattr(x, "dtype", None)
    if dtype is None and not hasattr(loss_scale, "dtype"):
      return op(x, loss_scale)  # Python numbers: exact enough, no overflow.
    work = _work_dtype(scale_dtype, *(() if dtype is None else (dtype,)))
    if work not in cast_scales:
      cast_scales[work] = jnp.asarray(loss_scale).astype(work)
    y = op(jnp.asarray(x).astype(work), cast_scales[work])
    return y if dtype is None else _cast_narrow(y, dtype)

  return jax.tree_util.tree_map(apply, tree)


def _scale(tree: T, loss_scale: Any, who: str) -> T:
  return _apply_scale(tree, loss_scale, lambda x, s: x * s, who)


def _unscale(tree: T, loss_scale: Any, who: str) -> T:
  return _apply_scale(tree, loss_scale, lambda x, s: x / s, who)


# --- Validation of concrete values --------------------------------------------
# Only the public constructors validate, and only concrete values: tracers
# (a loss scale built inside `jit`) pass unchecked, and unflattening never
# goes through here, so JAX's placeholders (None, object()) pass too.

_NUMBER_HINT = ("a positive, finite real number (a Python float or int, or a "
                "scalar array of a floating or integer dtype)")


def _concrete(x: Any) -> np.ndarray | None:
  """`x` as a numpy array, or None if it is a tracer (not known yet)."""
  if isinstance(x, jax_compat.Tracer):
    return None
  try:
    return np.asarray(x)
  except (jax.errors.ConcretizationTypeError,
          jax.errors.TracerArrayConversionError):
    return None


def _check_positive_number(cls: str, name: str, x: Any,
                           scalar: bool = True,
                           zero_ok: bool = False) -> np.ndarray | None:
  """Checks a loss scale or floor; returns its concrete value (or None).

  ``zero_ok`` also accepts 0 (a floor of 0: no floor; jmp's zero static
  scale)."""
  if isinstance(x, (bool, np.bool_)) or isinstance(x, (str, bytes)):
    raise TypeError(f"{cls}: {name} must be {_NUMBER_HINT}, got {x!r} "
                    f"({type(x).__name__}).")
  a = _concrete(x)
  if a is None:
    return None
  if not (jnp.issubdtype(a.dtype, jnp.floating)
          or jnp.issubdtype(a.dtype, jnp.integer)):
    raise TypeError(f"{cls}: {name} must be {_NUMBER_HINT}, got {x!r} "
                    f"(dtype {a.dtype}).")
  if scalar and a.ndim != 0:
    raise ValueError(f"{cls}: {name} must be a scalar, got shape {a.shape}; "
                     "a non-scalar scale would broadcast and change the "
                     "shape of every leaf it scales.")
  with np.errstate(invalid="ignore"):
    ok = np.all(np.isfinite(a.astype(np.float64))
                & ((a >= 0) if zero_ok else (a > 0)))
  if not ok:
    hint = (_NUMBER_HINT.replace("a positive", "a non-negative") if zero_ok
            else _NUMBER_HINT)
    raise ValueError(
        f"{cls}: {name} must be {hint}, got {x!r}. "
        + ("Negative" if zero_ok else "Zero or negative")
        + " scales flip or erase the gradients, and an inf or nan scale never "
        "recovers" + ("; 1.0 is the usual floor." if name == "min_loss_scale"
                      else "; 2. ** 15 is a usual start."))
  return a


def _check_period(period: Any) -> int:
  if (isinstance(period, (float, np.floating)) and np.isfinite(period)
      and float(period).is_integer()):
    period = int(period)  # A whole-number float, as jmp accepts (5.0).
  if isinstance(period, (bool, np.bool_)) or not isinstance(
      period, (int, np.integer)):
    raise TypeError(
        "DynamicLossScale: period must be a positive int (the number of "
        f"finite steps before the scale grows), got {period!r} "
        f"({type(period).__name__}).")
  if period < 1:
    raise ValueError("DynamicLossScale: period must be a positive int (the "
                     "number of finite steps before the scale grows), got "
                     f"{period}.")
  return int(period)


def _check_factor(factor: Any) -> int | float:
  bad_type = (isinstance(factor, (bool, np.bool_, str, bytes))
              or _concrete(factor) is None)
  a = None if bad_type else _concrete(factor)
  if bad_type or a.ndim != 0 or not (
      jnp.issubdtype(a.dtype, jnp.floating)
      or jnp.issubdtype(a.dtype, jnp.integer)):
    raise TypeError(
        "DynamicLossScale: factor must be a finite real number > 1 (what the "
        f"scale is multiplied and divided by, e.g. 2), got {factor!r} "
        f"({type(factor).__name__}).")
  if not (np.isfinite(a.astype(np.float64)) and a > 1):
    raise ValueError(
        "DynamicLossScale: factor must be a finite real number > 1 (what the "
        f"scale is multiplied and divided by, e.g. 2), got {factor!r}; with "
        "a factor <= 1 an overflow would never lower the scale.")
  return a.item()


def _require_scalar_bool(pred: Any, name: str) -> jax.Array:
  pred = jnp.asarray(pred)
  if pred.ndim != 0 or pred.dtype != jnp.bool_:
    # AssertionError is the documented error; raised explicitly, not with
    # `assert`, so the check also runs under `python -O`.
    raise AssertionError(f"{name}: expected boolean scalar, got "
                         f"{pred.dtype} of shape {pred.shape}.")
  return pred


@dataclasses.dataclass(frozen=True)
class NoOpLossScale:
  """A loss scale that does nothing: `scale` and `unscale` return the tree.

  For code that takes a loss scale but runs without one (float32 or
  bfloat16 training). An empty pytree; `loss_scale` is 1.

  >>> NoOpLossScale().scale({"loss": 2.0})
  {'loss': 2.0}

  See also: `StaticLossScale`, `DynamicLossScale`.
  """

  @property
  def loss_scale(self) -> int:
    return 1

  def scale(self, tree: T) -> T:
    """Returns `tree` itself."""
    return tree

  def unscale(self, tree: T) -> T:
    """Returns `tree` itself."""
    return tree

  def adjust(self, grads_finite: Any) -> NoOpLossScale:
    """Returns `self`."""
    del grads_finite
    return self


class _StaticValue:
  """Hashable pytree metadata holding a concrete number or array."""

  __slots__ = ("value", "_key")

  def __init__(self, value):
    self.value = value
    try:
      a = np.asarray(value)
      self._key = (a.dtype.str, a.shape, a.tobytes())
    except Exception:  # pylint: disable=broad-except  # A tracer: by identity.
      self._key = ("id", id(value))

  def __eq__(self, other):
    return isinstance(other, _StaticValue) and self._key == other._key

  def __hash__(self):
    return hash(self._key)


@dataclasses.dataclass(frozen=True)
class StaticLossScale:
  """Scales by a fixed `loss_scale` and unscales by its inverse.

  An empty pytree: the scale is static metadata, so a jitted step retraces
  when it changes. `scale` and `unscale` multiply/divide the floating leaves
  (arrays, numpy scalars, Python floats) and return arrays in each leaf's
  own dtype; integer and other leaves pass through unchanged. The
  arithmetic runs in float32 (or wider), so a scale beyond the leaf dtype's
  range (2 ** 17 for float16) still unscales float16 gradients correctly;
  the result is rounded to nearest in the leaf's dtype, and only a true
  overflow of that dtype is non-finite: inf, or nan in float8_e4m3fn (which
  has no inf), never its largest finite value, so `all_finite` sees it.

  Args:
    loss_scale: a non-negative, finite scalar (a Python number or a scalar
      array); 0, which jmp accepts, warns: it erases every gradient.

  Raises:
    TypeError, ValueError: `loss_scale` is not such a number; the message
      names it.

  >>> import jax.numpy as jnp
  >>> StaticLossScale(128.).unscale({"g": jnp.full(2, 256., jnp.bfloat16)})["g"]
  Array([2, 2], dtype=bfloat16)

  See also: `DynamicLossScale`, `NoOpLossScale`.
  """
  loss_scale: Any

  def __post_init__(self):
    value = _check_positive_number("StaticLossScale", "loss_scale",
                                   self.loss_scale, zero_ok=True)
    if value is not None and not np.any(value):
      warnings.warn(
          "StaticLossScale(0) scales every gradient to zero, and unscaling "
          "them gives nan: no step will be finite. Accepted as jmp accepts "
          "it; use NoOpLossScale() for no scaling.", stacklevel=3)

  def scale(self, tree: T) -> T:
    """Multiplies the floating leaves of `tree` by `loss_scale`."""
    return _scale(tree, self.loss_scale, "StaticLossScale.scale")

  def unscale(self, tree: T) -> T:
    """Divides the floating leaves of `tree` by `loss_scale`."""
    return _unscale(tree, self.loss_scale, "StaticLossScale.unscale")

  def adjust(self, grads_finite: Any) -> StaticLossScale:
    """Returns `self`: a static scale never changes."""
    del grads_finite
    return self


def _strong_array(x: Any, default_dtype: Any) -> jax.Array:
  """`x` as a strongly typed JAX array; Python numbers get `default_dtype`."""
  if isinstance(x, (bool, int, float)):
    return jnp.asarray(x, default_dtype)
  x = jnp.asarray(x)
  if getattr(x, "weak_type", False):
    x = jax.lax.convert_element_type(x, x.dtype)  # Drops the weak type.
  return x


def _warn_if_not_floating(x: Any, name: str) -> None:
  dtype = getattr(x, "dtype", None)
  if dtype is not None and not jnp.issubdtype(dtype, jnp.floating):
    warnings.warn(f"Expected floating type for {name}, got {dtype}; it works, "
                  "but backing off rounds down to whole numbers.", stacklevel=3)


def _check_counter(counter: Any) -> None:
  if isinstance(counter, (bool, np.bool_)):
    raise TypeError("DynamicLossScale: counter must be a non-negative int, "
                    f"got {counter!r}.")
  a = _concrete(counter)
  if a is None:
    return
  if not jnp.issubdtype(a.dtype, jnp.integer):
    raise TypeError("DynamicLossScale: counter must be a non-negative int "
                    f"(finite steps since the last change), got {counter!r} "
                    f"(dtype {a.dtype}).")
  if np.any(a < 0):
    raise ValueError("DynamicLossScale: counter must be a non-negative int "
                     f"(finite steps since the last change), got {counter!r}.")


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
  """A loss scale that grows while gradients stay finite and backs off if not.

  `adjust(grads_finite)` returns the next scale: after `period` consecutive
  finite steps the scale is multiplied by `factor`, unless that would
  overflow the scale's dtype (then it stays); on a non-finite step it is
  divided by `factor` but never goes below `min_loss_scale` (and never
  rises: a scale already below the floor stays where it is), and the count
  restarts. `counter` counts finite steps since the last change, and the
  growth happens on the step where it would reach `period`.

  Pytree leaves are `loss_scale` and `counter`, always strongly typed JAX
  arrays: Python numbers become float32 / int32, and `adjust` keeps their
  dtypes, so a jitted step taking the loss scale compiles once. `period`,
  `factor` and `min_loss_scale` are static metadata that survive
  flattening. `scale` and `unscale` compute in float32 (or wider) and
  return floating leaves in their own dtype, so a scale such as 2 ** 20
  unscales float16 gradients correctly; integer and other leaves pass
  through. A result beyond the leaf dtype's range is inf (nan in
  float8_e4m3fn, which has no inf), never saturated, so the step shows as
  not finite and the scale backs off: a float8_e5m2 gradient of 4 scaled
  by 2 ** 15 overflows (its largest value is 57344).

  Args:
    loss_scale: the initial scale: a positive, finite number of any float
      dtype (float16, bfloat16, ...) or an integer dtype (with a warning:
      backing off rounds down). A stack of scalars (one per device or model,
      with `counter` alike) may be mapped over with `vmap` or `pmap`;
      `scale` and `unscale` need a scalar one.
    counter: finite steps since the last change, a non-negative int.
    period: finite steps before the scale grows, a positive int that the
      counter's dtype holds (at most 2 ** 31 - 1 for int32).
    factor: what the scale is multiplied and divided by, a finite number > 1.
    min_loss_scale: the floor for backing off, non-negative, finite and at
      most `loss_scale` (and >= 1 for an integer scale). The scale also never
      backs off below its dtype's smallest normal number (6.1e-05 for
      float16, 1.2e-38 for float32 and bfloat16), so it never reaches 0;
      a floor of 0, as jmp allows, means that one alone.

  Raises:
    TypeError, ValueError: a concrete argument breaks the rules above (traced
      values pass unchecked); the message names it.

  >>> import jax.numpy as jnp
  >>> ls = DynamicLossScale(2. ** 15, period=2)
  >>> ls = ls.adjust(jnp.bool_(True)).adjust(jnp.bool_(True))
  >>> float(ls.loss_scale), int(ls.counter)
  (65536.0, 0)
  >>> float(ls.adjust(jnp.bool_(False)).loss_scale)
  32768.0

  See also: `all_finite`, `select_tree`, `StaticLossScale`.
  """
  loss_scale: jax.Array
  counter: jax.Array = 0
  period: int = 2000
  factor: int | float = 2
  min_loss_scale: Any = 1.0

  def __post_init__(self):
    # Only the public constructor validates; unflattening bypasses it, so
    # placeholders (None, object(), tracers) from JAX pass through untouched.
    cls = "DynamicLossScale"
    scale = _check_positive_number(cls, "loss_scale", self.loss_scale,
                                   scalar=False)
    _check_counter(self.counter)
    if _concrete(self.min_loss_scale) is None:
      raise TypeError(f"{cls}: min_loss_scale is static pytree metadata and "
                      "must be a concrete number, got a traced value.")
    floor = _check_positive_number(cls, "min_loss_scale", self.min_loss_scale,
                                   zero_ok=True)
    period = _check_period(self.period)
    factor = _check_factor(self.factor)
    if scale is not None and np.any(scale < floor):
      raise ValueError(
          f"{cls}: min_loss_scale ({self.min_loss_scale!r}) must not exceed "
          f"loss_scale ({self.loss_scale!r}): it is the floor the scale backs "
          "off to. Lower min_loss_scale or start from a larger loss_scale.")
    dtype = getattr(self.loss_scale, "dtype", None)
    if (dtype is not None and jnp.issubdtype(dtype, jnp.integer)
        and floor < 1):
      raise ValueError(
          f"{cls}: with an integer loss_scale ({dtype}), min_loss_scale must "
          f"be >= 1, got {self.min_loss_scale!r}: backing off rounds down, "
          "and a scale of 0 would make unscaled gradients inf.")
    _warn_if_not_floating(self.loss_scale, "loss_scale")
    _warn_if_not_floating(self.min_loss_scale, "min_loss_scale")
    set_ = functools.partial(object.__setattr__, self)
    set_("loss_scale", _strong_array(self.loss_scale, jnp.float32))
    set_("counter", _strong_array(self.counter, jnp.int32))
    counter_max = int(jnp.iinfo(jnp.result_type(self.counter)).max)
    if period > counter_max:
      raise ValueError(
          f"{cls}: period ({period}) must fit the counter's dtype "
          f"({jnp.result_type(self.counter)}, at most {counter_max}): the "
          "counter counts up to it. Use a smaller period (2000 is usual) or "
          "an int64 counter under jax_enable_x64.")
    set_("period", period)
    set_("factor", factor)
    if not isinstance(self.min_loss_scale, (int, float, np.generic)):
      set_("min_loss_scale", floor[()])

  def tree_flatten(self):
    return ((self.loss_scale, self.counter),
            (self.period, self.factor, self.min_loss_scale))

  @classmethod
  def tree_unflatten(cls, aux, children) -> DynamicLossScale:
    obj = object.__new__(cls)
    for name, value in zip(("loss_scale", "counter"), children):
      object.__setattr__(obj, name, value)
    for name, value in zip(("period", "factor", "min_loss_scale"), aux):
      object.__setattr__(obj, name, value)
    return obj

  def scale(self, tree: T) -> T:
    """Multiplies the floating leaves of `tree` by `loss_scale`."""
    return _scale(tree, self.loss_scale, "DynamicLossScale.scale")

  def unscale(self, tree: T) -> T:
    """Divides the floating leaves of `tree` by `loss_scale`."""
    return _unscale(tree, self.loss_scale, "DynamicLossScale.unscale")

  def adjust(self, grads_finite: Any) -> DynamicLossScale:
    """The next loss scale, given whether this step's gradients were finite.

    Args:
      grads_finite: a boolean scalar, e.g. from `all_finite(grads)`.

    Returns:
      A new `DynamicLossScale` with the same dtypes. On a non-finite step
      the scale never goes up, whatever `min_loss_scale` says.

    Raises:
      AssertionError: `grads_finite` is not a boolean scalar.

    >>> import jax.numpy as jnp
    >>> ls = DynamicLossScale(jnp.float16(2. ** 15), period=1)
    >>> float(ls.adjust(jnp.bool_(True)).loss_scale)  # 2 ** 16 is inf in f16.
    32768.0

    See also: `all_finite` to compute `grads_finite`.
    """
    grads_finite = _require_scalar_bool(grads_finite, "grads_finite")
    dtype = jnp.result_type(self.loss_scale)
    work = (_work_dtype(dtype) if jnp.issubdtype(dtype, jnp.floating)
            else jnp.float32)
    scale = jnp.asarray(self.loss_scale).astype(work)

    grown = scale * self.factor
    if jnp.issubdtype(dtype, jnp.floating):
      grown_fits = jnp.isfinite(_cast_narrow(grown, dtype))
    else:
      grown_fits = grown < float(jnp.iinfo(dtype).max) + 1
    grow = self.counter >= self.period - 1
    finite_scale = jnp.where(grow & grown_fits, grown, scale)
    floor = jnp.asarray(self.min_loss_scale).astype(work)
    if jnp.issubdtype(dtype, jnp.floating):
      # Never below the dtype's smallest normal number: a scale that
      # underflows to 0 (or whose reciprocal overflows) makes every
      # unscaled gradient inf, forever. A floor of 0 means no other floor.
      floor = jnp.maximum(floor, jnp.asarray(jnp.finfo(dtype).tiny, work))
    floor = jnp.minimum(floor, scale)
    backed_off = jnp.maximum(scale / self.factor, floor)
    loss_scale = jnp.where(grads_finite, finite_scale, backed_off)

    counter = jnp.asarray(self.counter)
    counter = jnp.where(grads_finite & ~grow, counter + 1,
                        jnp.zeros_like(counter)).astype(counter.dtype)
    # Rebuild without the constructor: the leaves are already arrays of the
    # right dtypes, and an integer scale should warn once, not every step.
    return self.tree_unflatten(self.tree_flatten()[1],
                               (loss_scale.astype(dtype), counter))


def _static_flatten(ls: StaticLossScale):
  return (), _StaticValue(ls.loss_scale)


def _static_unflatten(aux: _StaticValue, children) -> StaticLossScale:
  del children
  obj = object.__new__(StaticLossScale)  # Checked when first constructed.
  object.__setattr__(obj, "loss_scale", aux.value)
  return obj


jax.tree_util.register_pytree_node(
    NoOpLossScale, lambda ls: ((), None), lambda aux, children: NoOpLossScale())
jax.tree_util.register_pytree_node(
    StaticLossScale, _static_flatten, _static_unflatten)
jax.tree_util.register_pytree_node_class(DynamicLossScale)

LossScale = Union[NoOpLossScale, StaticLossScale, DynamicLossScale]


def require_loss_scale(x: Any, who: str, call: str) -> None:
  """Raises a `TypeError` unless ``x`` is a loss scale.

  A loss scale is one of the three classes, or any object with their
  `scale`, `unscale` and `adjust` methods (such as jmp's). A number or an
  array is not: the message says which class holds it. Anything else is
  most often a forgotten loss scale (the arguments shifted by one).

  Args:
    x: what was passed as the loss scale.
    who: the function that got it, e.g. ``"scaled_value_and_grad"``.
    call: how the function is called, e.g. ``"g(loss_scale, *args)"``.

  >>> require_loss_scale(2. ** 15, "step", "step(loss_scale, x)")
  Traceback (most recent call last):
  ...
  TypeError: step: loss_scale must be a loss scale (mpolicy.NoOpLossScale(), StaticLossScale(value) or DynamicLossScale(value)), got 32768.0 (float); call it as step(loss_scale, x). To scale by this number, pass StaticLossScale(32768.0), or DynamicLossScale(32768.0) to adjust it as training goes.
  """
  if all(callable(getattr(x, m, None)) for m in ("scale", "unscale", "adjust")):
    return
  if isinstance(x, (int, float, np.generic)) and not isinstance(x, bool):
    hint = (f" To scale by this number, pass StaticLossScale({x!r}), or "
            f"DynamicLossScale({x!r}) to adjust it as training goes.")
  elif getattr(x, "dtype", None) is not None and np.ndim(x) == 0:
    hint = (" To scale by this number, wrap it: StaticLossScale(x), or "
            "DynamicLossScale(x) to adjust it as training goes.")
  else:
    hint = (" Was the loss scale left out? It comes before the other "
            "arguments; pass NoOpLossScale() for no scaling.")
  raise TypeError(
      f"{who}: loss_scale must be a loss scale (mpolicy.NoOpLossScale(), "
      "StaticLossScale(value) or DynamicLossScale(value)), got "
      f"{arguments.describe(x)}; call it as {call}.{hint}")


def all_finite(tree: Any) -> jax.Array:
  """Whether every leaf of `tree` is finite, as a boolean scalar array.

  Args:
    tree: a pytree of arrays or numbers.

  Returns:
    A boolean scalar; True for a tree without leaves. Integer and bool
    leaves are always finite.

  >>> import jax.numpy as jnp
  >>> bool(all_finite({"a": jnp.ones(2), "b": jnp.array([1., jnp.inf])}))
  False

  See also: `DynamicLossScale.adjust`, `select_tree`.
  """
  leaves = jax.tree_util.tree_leaves(tree)
  if not leaves:
    return jnp.array(True)
  return jnp.stack([jnp.isfinite(x).all() for x in leaves]).all()


def select_tree(pred: Any, a: T, b: T) -> T:
  """`a` where `pred` is True, else `b`, leaf by leaf (`jax.lax.select`).

  Args:
    pred: a boolean scalar.
    a, b: pytrees with the same structure, shapes and dtypes.

  Returns:
    `a` if `pred`, else `b`.

  Raises:
    AssertionError: `pred` is not a boolean scalar.
    ValueError, TypeError: from JAX, if `a` and `b` do not match.

  >>> import jax.numpy as jnp
  >>> select_tree(jnp.bool_(False), {"w": jnp.ones(2)}, {"w": jnp.zeros(2)})
  {'w': Array([0., 0.], dtype=float32)}

  See also: `all_finite`, to skip an update whose gradients overflowed.
  """
  pred = _require_scalar_bool(pred, "select_tree")
  return jax.tree_util.tree_map(functools.partial(jax.lax.select, pred), a, b)
