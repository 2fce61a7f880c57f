"""Checks of what a public function was given, made at the call that got it.

Each raises a `TypeError` naming the function, the argument, what it got
and what is accepted, as `jax.jit(3)` does, instead of an `AttributeError`
from deep inside a later call.

>>> require_callable(len, "amp", "fn", "the function to run")
>>> require_callable(3, "amp", "fn", "the function to run")
Traceback (most recent call last):
...
TypeError: amp: fn must be a callable (the function to run), got 3 (int).
"""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def describe(x: Any) -> str:
  """``x`` in a few words: ``3 (int)``, ``a float32[2] array (ArrayImpl)``.

  >>> import jax.numpy as jnp
  >>> describe(jnp.ones(2)), describe(None)
  ('a float32[2] array (ArrayImpl)', 'None (NoneType)')
  """
  dtype = getattr(x, "dtype", None)
  if dtype is not None and hasattr(x, "shape"):
    name = getattr(dtype, "name", None) or np.dtype(dtype).name  # key<fry>.
    what = f"a {name}{list(np.shape(x))} array"
  else:
    text = repr(x)
    what = text if len(text) <= 60 else text[:57] + "..."
  return f"{what} ({type(x).__name__})"


def require_callable(fn: Any, who: str, arg: str, what: str) -> None:
  """Raises a `TypeError` unless ``fn`` is callable.

  Args:
    fn: what was passed.
    who: the public function that got it, e.g. ``"amp"``.
    arg: the argument's name.
    what: what the argument is for, e.g. ``"the function to run"``.
  """
  if callable(fn):
    return
  hint = ""
  if isinstance(fn, str):
    hint = (f" A string comes after the function: {who}(fn, "
            f"{fn!r}) if it is a policy.") if who == "amp" else ""
  raise TypeError(f"{who}: {arg} must be a callable ({what}), got "
                  f"{describe(fn)}.{hint}")


def require_transformation(tx: Any, who: str, arg: str = "transform") -> None:
  """Raises a `TypeError` unless ``tx`` has optax's ``init`` and ``update``.

  >>> import optax
  >>> require_transformation(optax.adam, "skip_nonfinite")  # doctest: +ELLIPSIS
  Traceback (most recent call last):
  ...
  TypeError: skip_nonfinite: transform must be an optax GradientTransformation (an object with init and update methods, e.g. optax.adam(1e-3)), got <function adam at ...> (function). It is a function that makes one: call it, e.g. optax.adam(1e-3).
  """
  if all(callable(getattr(tx, m, None)) for m in ("init", "update")):
    return
  hint = (" It is a function that makes one: call it, e.g. optax.adam(1e-3)."
          if callable(tx) else "")
  raise TypeError(
      f"{who}: {arg} must be an optax GradientTransformation (an object "
      "with init and update methods, e.g. optax.adam(1e-3)), got "
      f"{describe(tx)}.{hint}")


def require_whole(value: Any, least: int, what: str, more: str = "") -> int:
  """``value`` as an int >= ``least``; a `TypeError` (not a whole number:
  bools and floats included) or `ValueError` (too small) naming ``what``.

  >>> require_whole(3, 1, "f: steps")
  3
  >>> require_whole(2.0, 1, "f: steps", ", or None")
  Traceback (most recent call last):
  ...
  TypeError: f: steps must be a whole number >= 1, or None; got 2.0.
  """
  error = f"{what} must be a whole number >= {least}{more}; got {value!r}."
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise TypeError(error)
  if value < least:
    raise ValueError(error)
  return int(value)


def require_key(key: Any, who: str, arg: str = "key") -> None:
  """Raises a `TypeError` unless ``key`` is one JAX PRNG key: a typed key of
  shape () (``jax.random.key(seed)``) or a raw uint32 one
  (``jax.random.PRNGKey(seed)``), traced or not.

  >>> require_key(0, "fake_quantize")
  Traceback (most recent call last):
  ...
  TypeError: fake_quantize: key must be one JAX PRNG key, jax.random.key(seed) or jax.random.PRNGKey(seed), got 0 (int). An int is a seed: pass jax.random.key(0).
  """
  dtype, shape = getattr(key, "dtype", None), np.shape(key)
  if dtype is not None and (
      (jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) and shape == ())
      or (dtype == np.uint32 and len(shape) == 1)):
    return
  seed = isinstance(key, numbers.Integral) and not isinstance(key, bool)
  raise TypeError(
      f"{who}: {arg} must be one JAX PRNG key, jax.random.key(seed) or "
      f"jax.random.PRNGKey(seed), got {describe(key)}."
      + (f" An int is a seed: pass jax.random.key({key})." if seed else ""))


_FLOATING = "float16, bfloat16, float32, float64 or a float8 dtype"


def require_float_dtype(dtype: Any, who: str, arg: str, *,
                        none_ok: bool = False, none_means: str = "") -> Any:
  """``dtype`` as a ``np.dtype`` if it is a real floating dtype.

  Raises a `TypeError` if ``dtype`` is not a dtype at all, and a
  `ValueError` if it is one that is not real floating (an integer or bool
  dtype truncates the values cast to it: most gradients become 0; a complex
  one is not a precision).

  Args:
    dtype: what was passed.
    who: the public function that got it, e.g. ``"make_train_step"``.
    arg: the argument's name.
    none_ok: whether None is accepted (then returned as None).
    none_means: what None does, for the message.

  >>> require_float_dtype("bfloat16", "f", "grad_dtype")
  dtype(bfloat16)
  >>> require_float_dtype(jnp.int32, "f", "grad_dtype", none_ok=True,
  ...                     none_means="keeps each leaf's dtype")
  Traceback (most recent call last):
  ...
  ValueError: f: grad_dtype must be a floating dtype (float16, bfloat16, float32, float64 or a float8 dtype), or None (keeps each leaf's dtype); got int32, which is not floating: values cast to it are truncated (a gradient of 0.001 becomes 0).
  """
  if dtype is None and none_ok:
    return None
  allowed = f"a floating dtype ({_FLOATING})" + (
      f", or None ({none_means})" if none_ok and none_means
      else ", or None" if none_ok else "")
  try:
    # np.dtype(None) is float64: None is never read as a dtype here.
    as_dtype = None if dtype is None else np.dtype(dtype)
  except TypeError:
    as_dtype = None
  if as_dtype is None:
    raise TypeError(f"{who}: {arg} must be {allowed}; got {describe(dtype)}.")
  if jnp.issubdtype(as_dtype, jnp.floating):
    return as_dtype
  why = ("a complex dtype is not a precision for real values"
         if jnp.issubdtype(as_dtype, jnp.complexfloating) else
         "values cast to it are truncated (a gradient of 0.001 becomes 0)")
  raise ValueError(f"{who}: {arg} must be {allowed}; got {as_dtype.name}, "
                   f"which is not floating: {why}.")
