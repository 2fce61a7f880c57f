"""Checks of the values the loss-scale classes are constructed with.

Each raises a `TypeError` or `ValueError` naming the class, the field, what
it got and what is accepted.
"""

from __future__ import annotations

from typing import Any
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from mpolicy._src import jax_compat


# --- Validation of concrete values --------------------------------------------
# Only the public constructors validate, and only concrete values: tracers
# (a loss scale built inside `jit`) pass unchecked, and unflattening never
# goes through here, so JAX's placeholders (None, object()) pass too.

_NUMBER_HINT = ("a positive, finite real number (a Python float or int, or a "
                "scalar array of a floating or integer dtype)")


def concrete(x: Any) -> np.ndarray | None:
  """`x` as a numpy array, or None if it is a tracer (not known yet)."""
  if isinstance(x, jax_compat.Tracer):
    return None
  try:
    return np.asarray(x)
  except (jax.errors.ConcretizationTypeError,
          jax.errors.TracerArrayConversionError):
    return None


def check_positive_number(cls: str, name: str, x: Any,
                           scalar: bool = True,
                           zero_ok: bool = False) -> np.ndarray | None:
  """Checks a loss scale or floor; returns its concrete value (or None).

  ``zero_ok`` also accepts 0 (a floor of 0: no floor; jmp's zero static
  scale)."""
  if isinstance(x, (bool, np.bool_)) or isinstance(x, (str, bytes)):
    raise TypeError(f"{cls}: {name} must be {_NUMBER_HINT}, got {x!r} "
                    f"({type(x).__name__}).")
  a = concrete(x)
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


def check_period(period: Any) -> int:
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


def check_factor(factor: Any) -> int | float:
  bad_type = (isinstance(factor, (bool, np.bool_, str, bytes))
              or concrete(factor) is None)
  a = None if bad_type else concrete(factor)
  if a is None or a.ndim != 0 or not (
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


def strong_array(x: Any, default_dtype: Any) -> jax.Array:
  """`x` as a strongly typed JAX array; Python numbers get `default_dtype`."""
  if isinstance(x, (bool, int, float)):
    return jnp.asarray(x, default_dtype)
  x = jnp.asarray(x)
  if getattr(x, "weak_type", False):
    x = jax.lax.convert_element_type(x, x.dtype)  # Drops the weak type.
  return x


def warn_if_not_floating(x: Any, name: str) -> None:
  dtype = getattr(x, "dtype", None)
  if dtype is not None and not jnp.issubdtype(dtype, jnp.floating):
    warnings.warn(f"Expected floating type for {name}, got {dtype}; it works, "
                  "but backing off rounds down to whole numbers.", stacklevel=3)


def check_counter(counter: Any) -> None:
  if isinstance(counter, (bool, np.bool_)):
    raise TypeError("DynamicLossScale: counter must be a non-negative int, "
                    f"got {counter!r}.")
  a = concrete(counter)
  if a is None:
    return
  if not jnp.issubdtype(a.dtype, jnp.integer):
    raise TypeError("DynamicLossScale: counter must be a non-negative int "
                    f"(finite steps since the last change), got {counter!r} "
                    f"(dtype {a.dtype}).")
  if np.any(a < 0):
    raise ValueError("DynamicLossScale: counter must be a non-negative int "
                     f"(finite steps since the last change), got {counter!r}.")
