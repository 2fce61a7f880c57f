"""Float32 computations stored in half, with derivatives that keep half.

A float32 op on a half input whose result is rounded back to half
(``convert(f(convert(x, f32)), bf16)``) is exact up to that last rounding,
but under `jax.grad` JAX saves what the float32 op's derivative needs in
float32: ``exp`` saves its float32 result, ``x ** 3`` saves ``3 x^2`` in
float32. These wrappers give the same forward values with a derivative
that keeps only half values (and small float32 statistics) for the
backward pass. They are `custom_jvp`s, so forward and reverse mode both
work at every order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from mpolicy._src import staged
from mpolicy._src import widen


def unary_in_float32(fn, x, store_dtype):
  """``fn(x)`` computed in float32, stored in ``store_dtype``.

  ``fn`` acts element by element on one float32 array. Its derivative is
  rounded to ``store_dtype`` too, so under grad the backward pass keeps a
  half array, as it would for an op run in half.
  """
  store_dtype = np.dtype(store_dtype)

  @jax.custom_jvp
  def op(x):
    return fn(widen.widen(x, jnp.float32)).astype(store_dtype)

  @op.defjvp
  def op_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    wide = widen.widen(x, jnp.float32)
    y, slope = jax.jvp(fn, (wide,), (jnp.ones_like(wide),))
    return (y.astype(store_dtype),
            slope.astype(store_dtype) * t.astype(store_dtype))

  return op(x)


def scale_in_float32(kind, x, s, store_dtype, x_first=True):
  """``x * s`` or ``x / s`` in float32, stored in ``store_dtype``.

  ``x`` is a half array, ``s`` a float32 statistic (a sum, a norm), usually
  broadcast along some axes (``kind`` is ``"mul"`` or ``"div"``; a division
  is always ``x / s``). Under grad the backward pass keeps ``x`` or the
  half result, and ``s``.
  """
  store_dtype = np.dtype(store_dtype)
  if kind not in ("mul", "div"):
    raise ValueError(f"kind must be 'mul' or 'div', got {kind!r}")

  def wide(x, s):
    x = widen.widen(x, jnp.float32)
    if kind == "div":
      return jnp.divide(x, s)
    return jnp.multiply(x, s) if x_first else jnp.multiply(s, x)

  @jax.custom_jvp
  def op(x, s):
    return wide(x, s).astype(store_dtype)

  @op.defjvp
  def op_jvp(primals, tangents):
    (x, s), (tx, ts) = primals, tangents
    out = op(x, s)
    from_x = wide(tx, s).astype(store_dtype)
    if kind == "mul":
      from_s = jnp.multiply(x, ts.astype(store_dtype))
    else:  # d(x / s) = dx / s - (x / s) * ds / s
      from_s = -jnp.multiply(out, jnp.divide(ts, s).astype(store_dtype))
    return out, (from_x + from_s).astype(store_dtype)

  return op(x, s)


def primitive_in_float32(primitive, params: dict, args, i: int, store_dtype):
  """`unary_in_float32` of ``primitive`` on ``args``, acting on ``args[i]``.

  The same op at the same signature is one cached function (see `staged`):
  under `jax.grad` its derivative is traced once, not once per layer.
  """
  try:
    fn = _primitive_fn(primitive, tuple(sorted(params.items())), i,
                       np.dtype(store_dtype))
  except TypeError:  # An unhashable param.
    fn = functools.partial(_primitive_in_float32, primitive, params, i,
                           np.dtype(store_dtype))
    return fn(*args)
  return staged.call(fn, *args)


@functools.lru_cache(maxsize=4096)
def _primitive_fn(primitive, params: tuple, i: int, store_dtype):
  return functools.partial(_primitive_in_float32, primitive, dict(params), i,
                           store_dtype)


def _primitive_in_float32(primitive, params, i, store_dtype, *args):
  def fn(v):
    return primitive.bind(*args[:i], v, *args[i + 1:], **params)
  return unary_in_float32(fn, args[i], store_dtype)


def scaled_in_float32(kind, x, s, store_dtype, x_first=True):
  """`scale_in_float32`, one cached function per signature (see `staged`)."""
  return staged.call(_scale_fn(kind, np.dtype(store_dtype), x_first), x, s)


@functools.lru_cache(maxsize=64)
def _scale_fn(kind, store_dtype, x_first):
  return functools.partial(_scale, kind, store_dtype, x_first)


def _scale(kind, store_dtype, x_first, x, s):
  return scale_in_float32(kind, x, s, store_dtype, x_first)
