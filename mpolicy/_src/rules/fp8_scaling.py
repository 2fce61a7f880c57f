"""Float8 current scaling: scales computed in the step from the operands.

Under a policy whose matmul format is ``fp8`` (``c=f8``), the matmul and
convolution families run their ops in float8 (`matmul`, `conv`). Each
operand is quantized with a scale computed from the operand itself::

  scale = amax(|x|) / 448        (1 where amax is 0)
  x_f8  = convert(clamp(x / scale, -448, 448), float8_e4m3fn)

The product of float8 operands accumulates in float32 and is rescaled, one
scale at a time (their product could underflow), into bfloat16 (or a wider
dtype the op asked for). The backward pass quantizes the incoming cotangent
to ``float8_e5m2`` (wider range, for gradients: scale = amax / 57344). The
scales are treated as constants (straight-through), as in Transformer
Engine. XLA:GPU runs a float8 product as a cuBLASLt float8 gemm on Hopper;
elsewhere XLA runs it correctly, emulated.
"""

from __future__ import annotations

from typing import Any

from jax import lax
import jax.numpy as jnp
import numpy as np

from mpolicy._src import observe as observe_lib


FORWARD_DTYPE = np.dtype(jnp.float8_e4m3fn)
BACKWARD_DTYPE = np.dtype(jnp.float8_e5m2)
DEFAULT_OUT_DTYPE = np.dtype(jnp.bfloat16)


def quantize(x, dtype: Any = FORWARD_DTYPE, axes=None, mesh_axes=(),
             observe=None):
  """Quantizes ``x`` to a float8 ``dtype`` with a scale per tensor or slice.

  The scale is ``amax(|x|) / max(dtype)`` (448 for float8_e4m3fn, 57344
  for float8_e5m2), computed from ``x`` itself over ``axes`` (all of them by
  default: one scale), and 1 where that part of ``x`` is all zeros (or
  empty). Values are divided by the scale, clamped to the dtype's range and
  converted. A non-finite ``x`` gives non-finite values back, so a
  loss-scale overflow is still seen downstream.

  >>> import jax.numpy as jnp
  >>> q, scale = quantize(jnp.array([1., -2., 896.]))
  >>> q.dtype, float(scale), [float(v) for v in q.astype(jnp.float32)]
  (dtype(float8_e4m3fn), 2.0, [0.5, -1.0, 448.0])
  >>> _, rows = quantize(jnp.array([[1., 448.], [1e-6, 0.]]), axes=-1)
  >>> rows.shape, [round(float(v) * 448, 6) for v in rows[:, 0]]
  ((2, 1), [448.0, 1e-06])

  Args:
    x: a floating array.
    dtype: the float8 dtype to quantize to.
    axes: the axes each scale covers (an int or a tuple); ``None``: all.
    mesh_axes: `shard_map` mesh axes whose devices share each scale: the
      amax is their maximum (`jax.lax.pmax`); empty: this device's own.
    observe: ``(label, role)`` of the float8 op this quantization belongs
      to, told to the observers (`observe.quantized`; ``None``: not told).

  Returns:
    ``(q, scale)``: ``q`` in ``dtype``, ``scale`` float32 with
    ``x ~= q * scale``: a scalar for ``axes=None``, else with ``x``'s rank
    and size 1 along ``axes``.
  """
  dtype = np.dtype(dtype)
  fmax = float(jnp.finfo(dtype).max)
  # `initial=0` gives 0 for an empty array (and empty slices): scale 1.
  amax = jnp.max(jnp.abs(x), axis=axes, keepdims=axes is not None,
                 initial=0).astype(jnp.float32)
  if mesh_axes:
    amax = lax.pmax(amax, tuple(mesh_axes))
  scale = jnp.where(amax == 0, jnp.float32(1), amax / fmax)
  q = jnp.clip(x.astype(jnp.float32) / scale, -fmax, fmax).astype(dtype)
  if observe is not None:
    label, role = observe
    observe_lib.quantized(label, observe_lib.Quantization(
        role, dtype.name, x, q, scale, fmax))
  return q, scale


def rescale(out, scales, dtype):
  """``out`` times each of ``scales``, cast to ``dtype``.

  One scale at a time: the product of two small scales can underflow
  float32 (amax(x) * amax(w) below ~2e-33) where each factor does not.
  """
  for scale in scales:
    out = out * scale
  return out.astype(dtype)
