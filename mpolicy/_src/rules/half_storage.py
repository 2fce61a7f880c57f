"""Float32 and half values whose derivatives are not what JAX would pick.

A float32 op on a half input whose result is rounded back to half
(``convert(f(convert(x, f32)), bf16)``) is exact up to that last rounding,
but under `jax.grad` JAX saves what the float32 op's derivative needs in
float32: ``exp`` saves its float32 result, ``x ** 3`` saves ``3 x^2`` in
float32. `unary_in_float32` gives the same forward values with a derivative
that keeps only half values for the backward pass.

A float32 parameter broadcast along an activation and used in half (a
bias) is cheapest cast first and broadcast in half, but its gradient, the
transpose of the broadcast, is then a sum in half. `cast_after` casts first
and keeps the derivative of broadcasting in float32, so the gradient sums
in float32 and the forward pass converts only the small parameter.

Both are `custom_jvp`s, so forward and reverse mode work at every order.
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


def cast_after(fn, x, dtype):
  """``fn(x).astype(dtype)``, computed in the other order: ``x`` cast
  first, then re-arranged by ``fn``.

  ``fn`` must re-arrange elements only (a broadcast, a reshape), so both
  orders give the same values, and be hashable (one function per
  signature: see `staged`). The derivative keeps the written order: the
  tangent is re-arranged in ``x``'s dtype, then cast, so the transpose
  (for a broadcast, a sum over the broadcast dims) runs in ``x``'s dtype.
  """
  return staged.call(_cast_after_fn(fn, np.dtype(dtype)), x)


@functools.lru_cache(maxsize=1024)
def _cast_after_fn(fn, dtype):
  return functools.partial(_cast_after, fn, dtype)


def _cast_after(fn, dtype, x):
  @jax.custom_jvp
  def op(x):
    return fn(x.astype(dtype))

  @op.defjvp
  def op_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return op(x), fn(t).astype(dtype)

  return op(x)


@functools.lru_cache(maxsize=1024)
def broadcaster(shape: tuple):
  """``x`` broadcast to ``shape`` (of the same rank), one function per
  shape."""
  return functools.partial(_broadcast, shape=shape)


def _broadcast(x, shape):
  return jax.lax.broadcast_in_dim(x, shape, tuple(range(len(shape))))


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
