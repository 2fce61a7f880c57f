"""Float8 matmuls and convolutions with scales computed from the operands.

Under a policy whose compute dtype is float8 (`c=f8`), the interpreter sends
every ``dot_general`` and ``conv_general_dilated`` here. Each operand is
quantized with scales computed in the same step from the operand itself
(current scaling)::

  scale = amax(|x|) / 448        (1 where amax is 0)
  x_f8  = convert(clamp(x / scale, -448, 448), float8_e4m3fn)

A matmul's left operand has one scale per row (each token, each example of
a batch, so a row far below the batch's largest keeps its digits, as under
`vmap`), its right operand one per batch element (one per tensor for a
plain matmul); a convolution's operands one each. The product of the float8
operands accumulates in float32 and is rescaled, one scale at a time (their
product could underflow), into bfloat16 (or a wider dtype the op asked
for). XLA:GPU runs the float8 product as a cuBLASLt float8 gemm on Hopper;
elsewhere XLA runs it correctly, emulated.

The backward pass quantizes the incoming cotangent to ``float8_e5m2`` (wider
range, for gradients: scale = amax / 57344) and multiplies it with the other
operand's forward ``float8_e4m3fn`` quantization, again accumulating in
float32; each gradient is rescaled and returned in its operand's dtype (a
float32 parameter gets a float32 gradient). The scales are treated as
constants (straight-through), as in Transformer Engine.

The backward rule is a `jax.custom_vjp`, so reverse mode (`grad`, `vjp`)
works at any depth of `jit`, `scan`, `checkpoint` and `vmap`, but forward
mode (`jax.jvp`, `jax.jacfwd`) through a float8 op raises JAX's
"can't apply forward-mode autodiff (jvp) to a custom_vjp function".

JAX requires both operands of a convolution to have one dtype, so the
backward convolutions (float8_e5m2 cotangent, float8_e4m3fn operand) take
the two quantized values converted, exactly, to bfloat16, with float32
accumulation. Backward matmuls are true mixed float8 products.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple, Optional

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from mpolicy._src import dtypes
from mpolicy._src import jax_compat
from mpolicy._src import lowp

FORWARD_DTYPE = np.dtype(jnp.float8_e4m3fn)
BACKWARD_DTYPE = np.dtype(jnp.float8_e5m2)
DEFAULT_OUT_DTYPE = np.dtype(jnp.bfloat16)

REASON = ("per-tensor scaled float8_e4m3fn operands (scale = amax/448), "
          "float32 accumulation; backward cotangent in float8_e5m2")

# Params of the traced equations that the float8 ops set themselves.
_OWN_PARAMS = ("preferred_element_type", "out_sharding", "precision")


def quantize(x, dtype: Any = FORWARD_DTYPE, axes=None):
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

  Returns:
    ``(q, scale)``: ``q`` in ``dtype``, ``scale`` float32 with
    ``x ~= q * scale``: a scalar for ``axes=None``, else with ``x``'s rank
    and size 1 along ``axes``.

  See also: `dot_general`, `conv_general_dilated`.
  """
  dtype = np.dtype(dtype)
  fmax = float(jnp.finfo(dtype).max)
  # `initial=0` gives 0 for an empty array (and empty slices): scale 1.
  amax = jnp.max(jnp.abs(x), axis=axes, keepdims=axes is not None,
                 initial=0).astype(jnp.float32)
  scale = jnp.where(amax == 0, jnp.float32(1), amax / fmax)
  scaled = jnp.clip(x.astype(jnp.float32) / scale, -fmax, fmax)
  return scaled.astype(dtype), scale


def _rescale(out, scales, dtype):
  # One scale at a time: the product of two small scales can underflow
  # float32 (amax(x) * amax(w) below ~2e-33) where each factor does not.
  for scale in scales:
    out = out * scale
  return out.astype(dtype)


# --- dot_general ---------------------------------------------------------------


class _MatmulConfig(NamedTuple):
  batched: bool
  out_dtype: np.dtype
  lhs_dtype: np.dtype
  rhs_dtype: np.dtype


def _mm(a, b, batched):
  """``[B,] M, K`` x ``[B,] K, N`` -> float32 ``[B,] M, N``."""
  nb = 1 if batched else 0
  dims = (((nb + 1,), (nb,)), ((0,), (0,)) if batched else ((), ()))
  return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _scaled_mm_fwd(a, b, config: _MatmulConfig):
  # The left operand gets one scale per row (per example of a batch, per
  # token): a row far below the batch's largest keeps its digits, as it
  # would if the matmul were vmapped. Rows are free dimensions, so their
  # scales factor out of the sum. The right operand gets one scale per
  # batch element.
  nb = 1 if config.batched else 0
  aq, sa = quantize(a, FORWARD_DTYPE, axes=-1)
  bq, sb = quantize(b, FORWARD_DTYPE, axes=(nb, nb + 1) if nb else None)
  out = _rescale(_mm(aq, bq, config.batched), (sa, sb), config.out_dtype)
  return out, (aq, sa, bq, sb)


def _scaled_mm_bwd(config: _MatmulConfig, residuals, g):
  aq, sa, bq, sb = residuals
  nb = 1 if config.batched else 0
  per_batch = (nb, nb + 1) if nb else None
  gq, sg = quantize(g, BACKWARD_DTYPE, axes=per_batch)
  batch = ((0,), (0,)) if config.batched else ((), ())
  # Each result takes its operand's layout, and under explicit sharding its
  # sharding too (the weight gradient contracts a sharded batch).
  # d lhs [B,M,K] = g [B,M,N] . rhs [B,K,N] over N.
  da = lax.dot_general(gq, bq, (((nb + 1,), (nb + 1,)), batch),
                       preferred_element_type=jnp.float32,
                       out_sharding=lowp.explicit_sharding(aq))
  # d rhs [B,K,N] = lhs [B,M,K] . g [B,M,N] over M. The rows' scales sit
  # inside this sum, so they are folded into the cotangent first.
  hq, sh = quantize(g.astype(jnp.float32) * sa, BACKWARD_DTYPE, axes=per_batch)
  db = lax.dot_general(aq, hq, (((nb,), (nb,)), batch),
                       preferred_element_type=jnp.float32,
                       out_sharding=lowp.explicit_sharding(bq))
  return (_rescale(da, (sg, sb), config.lhs_dtype),
          _rescale(db, (sh,), config.rhs_dtype))


_scaled_mm = jax.custom_vjp(
    lambda a, b, config: _scaled_mm_fwd(a, b, config)[0], nondiff_argnums=(2,))
_scaled_mm.defvjp(_scaled_mm_fwd, _scaled_mm_bwd)


def _permute(x, perm):
  return x if list(perm) == list(range(x.ndim)) else lax.transpose(x, perm)


def dot_general(lhs, rhs, dimension_numbers, *, out_dtype: Optional[Any] = None):
  """`jax.lax.dot_general` in float8 with per-tensor scales (see module doc).

  The operands are brought to ``[batch, M, K] x [batch, K, N]`` (transposes
  only where a group of dimensions is not already in place), quantized to
  float8_e4m3fn, multiplied with float32 accumulation, rescaled and cast to
  ``out_dtype``; the result has `dot_general`'s shape. Differentiable in
  reverse mode, with the cotangent quantized to float8_e5m2.

  >>> import jax, jax.numpy as jnp
  >>> x = jax.random.normal(jax.random.PRNGKey(0), (64, 128))
  >>> w = jax.random.normal(jax.random.PRNGKey(1), (128, 32))
  >>> y = dot_general(x, w, (((1,), (0,)), ((), ())))
  >>> y.dtype, bool(jnp.linalg.norm(y - x @ w) / jnp.linalg.norm(x @ w) < 0.05)
  (dtype(bfloat16), True)

  Args:
    lhs, rhs: floating arrays (any float dtype; float32 parameters can be
      passed as they are).
    dimension_numbers: as for `jax.lax.dot_general`.
    out_dtype: the result dtype; bfloat16 if ``None``.

  Returns:
    The product, in ``out_dtype``.

  See also: `conv_general_dilated`, `quantize`.
  """
  out_dtype = DEFAULT_OUT_DTYPE if out_dtype is None else np.dtype(out_dtype)
  (lc, rc), (lb, rb) = dimension_numbers
  lf = [d for d in range(lhs.ndim) if d not in lc and d not in lb]
  rf = [d for d in range(rhs.ndim) if d not in rc and d not in rb]
  batch_shape = [lhs.shape[d] for d in lb]
  m = math.prod(lhs.shape[d] for d in lf)
  k = math.prod(lhs.shape[d] for d in lc)
  n = math.prod(rhs.shape[d] for d in rf)
  lead = [math.prod(batch_shape)] if lb else []
  a = _permute(lhs, [*lb, *lf, *lc]).reshape(lead + [m, k])
  b = _permute(rhs, [*rb, *rc, *rf]).reshape(lead + [k, n])
  config = _MatmulConfig(bool(lb), out_dtype, np.dtype(lhs.dtype),
                         np.dtype(rhs.dtype))
  out = _scaled_mm(a, b, config)
  return out.reshape(batch_shape + [lhs.shape[d] for d in lf]
                     + [rhs.shape[d] for d in rf])


# --- conv_general_dilated -----------------------------------------------------


class _ConvConfig(NamedTuple):
  params: tuple  # Sorted (name, value) pairs of conv_general_dilated's params.
  out_dtype: np.dtype
  lhs_dtype: np.dtype
  rhs_dtype: np.dtype


def _conv(a, b, params):
  return lax.conv_general_dilated_p.bind(
      a, b, **params, preferred_element_type=np.dtype(jnp.float32),
      **_conv_extra_params())


@functools.lru_cache(maxsize=None)
def _conv_extra_params_cached():
  """Params the installed JAX's conv primitive needs besides the rest."""
  probe = jax.make_jaxpr(lambda a, b: lax.conv(a, b, (1,), "VALID"))(
      jax.ShapeDtypeStruct((1, 1, 1), jnp.float32),
      jax.ShapeDtypeStruct((1, 1, 1), jnp.float32))
  return tuple(k for k in probe.eqns[0].params
               if k in _OWN_PARAMS and k != "preferred_element_type")


def _conv_extra_params() -> dict:
  return dict.fromkeys(_conv_extra_params_cached())


def _scaled_conv_fwd(a, b, config: _ConvConfig):
  params = dict(config.params)
  aq, sa = quantize(a, FORWARD_DTYPE)
  bq, sb = quantize(b, FORWARD_DTYPE)
  out = _rescale(_conv(aq, bq, params), (sa, sb), config.out_dtype)
  return out, (aq, sa, bq, sb)


def _replay(closed, args):
  """Evaluates ``closed`` on ``args``, its convolutions accumulating in
  float32 (the jaxpr is JAX's own convolution transpose, traced in float32:
  its reversals, reshapes and convolutions are scale-free)."""
  f32 = np.dtype(jnp.float32)
  return lowp.replay_convs(closed, args, lambda eqn, invals: jax_compat.bind(
      eqn.primitive, invals, dict(eqn.params, preferred_element_type=f32)))


def _conv_transpose(side, params, g, known, operand_shape):
  """The cotangent of one conv operand, by JAX's own transpose rule."""
  f32 = jnp.float32

  def transpose(g, known):
    def linear(x):
      a, b = (x, known) if side == "lhs" else (known, x)
      return lax.conv_general_dilated_p.bind(
          a, b, **params, preferred_element_type=None, **_conv_extra_params())
    return jax.linear_transpose(
        linear, jax.ShapeDtypeStruct(operand_shape, f32))(g)[0]

  closed = jax.make_jaxpr(transpose)(jax.ShapeDtypeStruct(g.shape, f32),
                                     jax.ShapeDtypeStruct(known.shape, f32))
  return _replay(closed, [g, known])


def _scaled_conv_bwd(config: _ConvConfig, residuals, g):
  aq, sa, bq, sb = residuals
  params = dict(config.params)
  gq, sg = quantize(g, BACKWARD_DTYPE)
  bf16 = jnp.bfloat16  # Holds float8_e4m3fn and float8_e5m2 values exactly.
  g16, a16, b16 = gq.astype(bf16), aq.astype(bf16), bq.astype(bf16)
  da = _conv_transpose("lhs", params, g16, b16, aq.shape)
  db = _conv_transpose("rhs", params, g16, a16, bq.shape)
  return (_rescale(da, (sg, sb), config.lhs_dtype),
          _rescale(db, (sa, sg), config.rhs_dtype))


_scaled_conv = jax.custom_vjp(
    lambda a, b, config: _scaled_conv_fwd(a, b, config)[0],
    nondiff_argnums=(2,))
_scaled_conv.defvjp(_scaled_conv_fwd, _scaled_conv_bwd)


def conv_general_dilated(lhs, rhs, *, out_dtype: Optional[Any] = None,
                         **params):
  """`conv_general_dilated` in float8 with per-tensor scales (module doc).

  ``params`` are those of a ``conv_general_dilated`` jaxpr equation
  (canonical ``window_strides``, ``padding``, ``lhs_dilation``,
  ``rhs_dilation``, ``dimension_numbers``, ``feature_group_count``,
  ``batch_group_count``); ``precision``, ``preferred_element_type`` and
  ``out_sharding`` are ignored.

  >>> import jax, jax.numpy as jnp
  >>> from jax import lax
  >>> x, k = jnp.ones((1, 4, 8, 8)), jnp.ones((2, 4, 3, 3))
  >>> dn = lax.conv_dimension_numbers(x.shape, k.shape, ("NCHW", "OIHW", "NCHW"))
  >>> y = conv_general_dilated(x, k, window_strides=(1, 1),
  ...     padding=((0, 0), (0, 0)), lhs_dilation=(1, 1), rhs_dilation=(1, 1),
  ...     dimension_numbers=dn, feature_group_count=1, batch_group_count=1)
  >>> y.dtype, float(y[0, 0, 0, 0])
  (dtype(bfloat16), 36.0)

  Args:
    lhs, rhs: the input and the kernel, floating arrays.
    out_dtype: the result dtype; bfloat16 if ``None``.
    **params: the convolution's params, as described above.

  Returns:
    The convolution, in ``out_dtype``.

  See also: `dot_general`, `quantize`.
  """
  out_dtype = DEFAULT_OUT_DTYPE if out_dtype is None else np.dtype(out_dtype)
  kept = tuple(sorted((k, v) for k, v in params.items()
                      if k not in _OWN_PARAMS))
  config = _ConvConfig(kept, out_dtype, np.dtype(lhs.dtype),
                       np.dtype(rhs.dtype))
  return _scaled_conv(lhs, rhs, config)


# --- The interpreter's entry --------------------------------------------------


def handles(eqn, args) -> bool:
  """Whether the equation is a matmul or convolution this module runs."""
  if eqn.primitive not in (lax.dot_general_p, lax.conv_general_dilated_p):
    return False
  if eqn.params.get("out_sharding") is not None:
    return False  # The scaled ops do not carry an output sharding.
  return all(dtypes.float_value(a) for a in args)


def run_equation(eqn, args, out_dtype) -> list:
  """Runs a ``dot_general`` or ``conv_general_dilated`` equation in float8.

  The result is ``out_dtype`` (the policy's bfloat16), or the equation's
  ``preferred_element_type`` where the traced code asked for a result wider
  than its inputs (and than ``out_dtype``).
  """
  out_dtype = np.dtype(out_dtype)
  pet = eqn.params.get("preferred_element_type")
  traced_in = np.dtype(eqn.invars[0].aval.dtype)
  if (pet is not None and np.dtype(pet).itemsize > traced_in.itemsize
      and np.dtype(pet).itemsize > out_dtype.itemsize):
    out_dtype = np.dtype(pet)
  lhs, rhs = args
  if eqn.primitive is lax.dot_general_p:
    return [dot_general(lhs, rhs, eqn.params["dimension_numbers"],
                        out_dtype=out_dtype)]
  return [conv_general_dilated(lhs, rhs, out_dtype=out_dtype, **eqn.params)]
