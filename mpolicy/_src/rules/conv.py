"""The convolution family: `conv_general_dilated`.

This file owns all a convolution needs: its ``lower`` rule, the
`amp_conv_general_dilated` primitive (half operands, float32 accumulation)
with its per-backend lowerings, transposes and batching, and the float8
convolution run under ``c=f8``.

On GPU and TPU the amp convolution lowers to the half convolution asking
for a half result (the hardware accumulates in float32): cuDNN has no
half-in, float32-out convolution, and asked for one XLA runs the whole
convolution in float32. Elsewhere it asks for a float32 result and casts.

JAX's convolution transpose and batching rules hold the bookkeeping
(flipped kernels, transposed specs, VJP paddings, group axes reshaped in and
out); rather than copy it, both the amp and the float8 convolution trace
JAX's rule and replay it with each convolution it makes bound as they need
(`replay_convs`).

The float8 convolution gives each operand one scale (see `fp8_scaling`).
JAX requires both operands of a convolution to have one dtype, so its
backward convolutions (float8_e5m2 cotangent, float8_e4m3fn operand) take
the two quantized values converted, exactly, to bfloat16, with float32
accumulation.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from mpolicy._src import jax_compat
from mpolicy._src.rules import amp_primitive
from mpolicy._src.rules import base
from mpolicy._src.rules import collectives
from mpolicy._src.rules import facts
from mpolicy._src.rules import fp8_placement
from mpolicy._src.rules import fp8_scaling
from mpolicy._src.rules import int8_matmul

amp_conv_general_dilated_p = jax_compat.new_primitive("amp_conv_general_dilated")

_cast = amp_primitive.cast


def replay_convs(closed, args, bind_conv):
  """Evaluates ``closed`` on ``args`` through the interpreter, binding each
  ``conv_general_dilated`` with ``bind_conv(eqn, invals)`` (its one output)
  and the rest as written."""
  conv = lambda eqn, invals: [bind_conv(eqn, invals)]
  return amp_primitive.replay(
      closed, args, {jax_compat.conv_general_dilated_p: conv})[0]


def _traced(fn, args):
  return jax_compat.trace_to_closed_jaxpr(
      lambda *a: [fn(*a)], [jax_compat.aval_of(a) for a in args])


def transposed(side, params, ct, known, operand_aval, bind_conv):
  """The cotangent of one operand by JAX's own transpose rule, traced at
  the dtypes of ``ct`` and ``known`` (which agree) and replayed with
  ``bind_conv`` for each convolution it makes."""
  if np.size(ct) == 0:  # JAX's rule gives a symbolic zero here.
    return jnp.zeros(operand_aval.shape, ct.dtype)
  # Under a mesh with explicit axes, JAX's rule names the operand's
  # sharding as the result's (a kernel's gradient contracts a sharded
  # batch): a kernel on no mesh is taken as replicated over it.
  aval = amp_primitive.on_mesh(
      jax_compat.with_dtype(operand_aval, ct.dtype))

  def transpose(ct, known):
    # No preferred type: the convolutions come out in the operands' dtype.
    return jax_compat.conv_transpose(side, ct, known, aval, **params,
                                     preferred_element_type=None,
                                     out_sharding=None)

  return replay_convs(_traced(transpose, (ct, known)), (ct, known), bind_conv)


# --- amp_conv_general_dilated -------------------------------------------------


def amp_conv_general_dilated(lhs, rhs, *, window_strides, padding,
                             lhs_dilation=None, rhs_dilation=None,
                             dimension_numbers=None, feature_group_count=1,
                             batch_group_count=1, precision=None,
                             out_dtype: Any, out_sharding: Any = None,
                             sum_dtype: Any = None):
  """``conv_general_dilated`` of half ``lhs``, ``rhs``, f32 accumulation, cast.

  Takes `jax.lax.conv_general_dilated`'s arguments (string paddings, lists,
  dimension-number strings too: they are put in the hashable canonical form
  a jaxpr equation holds, which the transpose and batching rules need).
  ``out_sharding`` is the convolution's (explicit sharding); ``sum_dtype``
  asks GPUs and TPUs for the result in that dtype (see
  `matmul.amp_dot_general`; cuDNN then runs the whole convolution in it);
  each param is bound only when given.

  >>> import jax.numpy as jnp
  >>> x, k = jnp.ones((1, 2, 4, 4), jnp.bfloat16), jnp.ones((3, 2, 3, 3), jnp.bfloat16)
  >>> y = amp_conv_general_dilated(x, k, window_strides=(1, 1),
  ...                              padding="VALID", out_dtype=jnp.float32)
  >>> y.shape, y.dtype, float(y[0, 0, 0, 0])
  ((1, 3, 2, 2), dtype('float32'), 18.0)
  """
  params = dict(window_strides=window_strides, padding=padding,
                lhs_dilation=lhs_dilation, rhs_dilation=rhs_dilation,
                dimension_numbers=dimension_numbers,
                feature_group_count=feature_group_count,
                batch_group_count=batch_group_count, precision=precision)
  canonical = isinstance(dimension_numbers, jax.lax.ConvDimensionNumbers) and all(
      isinstance(v, tuple) for v in (window_strides, padding, lhs_dilation,
                                     rhs_dilation))
  if not canonical:
    params = jax_compat.canonical_conv_params(np.shape(lhs), np.shape(rhs),
                                              **params)
  extra = {k: v for k, v in (("out_sharding", out_sharding),
                             ("sum_dtype", sum_dtype)) if v is not None}
  return amp_primitive.bind(amp_conv_general_dilated_p, lhs, rhs, **params,
                            out_dtype=np.dtype(out_dtype), **extra)


def _conv_composite(lhs, rhs, *, out_dtype, out_sharding=None,
                    sum_dtype=None, **params):
  del sum_dtype  # The result is the float32 accumulator already.
  out = jax_compat.bind_conv(lhs, rhs, params, jnp.float32, out_sharding)
  return out.astype(out_dtype)


def _conv_accelerator(lhs, rhs, *, out_dtype, out_sharding=None,
                      sum_dtype=None, **params):
  """GPU/TPU: the half convolution, half result, then cast. Not asked for
  a float32 result unless ``sum_dtype`` says so: cuDNN has no such half
  kernel and XLA runs the whole convolution in float32."""
  return jax_compat.bind_conv(lhs, rhs, params, sum_dtype,
                              out_sharding=out_sharding).astype(out_dtype)


def _as_amp(out_dtype=None, sum_dtype=None):
  """Binds a replayed convolution as an amp one in ``out_dtype`` (None: the
  dtype it produced), so higher-order AD and vmap of the transposes keep
  the half x half form (and the ``sum_dtype`` asked)."""
  def bind_conv(eqn, invals):
    dtype = out_dtype if out_dtype is not None else eqn.outvars[0].aval.dtype
    extra = {k: v for k, v in (("out_sharding", jax_compat.out_sharding(eqn)),
                               ("sum_dtype", sum_dtype)) if v is not None}
    return amp_conv_general_dilated_p.bind(
        *invals, **jax_compat.conv_params(eqn), out_dtype=np.dtype(dtype),
        **extra)
  return bind_conv


def _conv_transpose(side, ct, lhs, rhs, *, out_dtype, out_sharding=None,
                    sum_dtype=None, **params):
  del out_dtype, out_sharding
  operand, other = amp_primitive.operands(side, lhs, rhs)
  out = transposed(side, params, _cast(ct, other.dtype), other, operand.aval,
                   _as_amp(sum_dtype=sum_dtype))
  return _cast(out, operand.aval.dtype)


def _conv_batch(batched_args, batch_dims, *, out_dtype, out_sharding=None,
                sum_dtype=None, **params):
  del out_sharding  # vmap of an explicitly sharded convolution: JAX's rule.
  out_dim = []

  def batched(lhs, rhs):
    out, dim = jax_compat.conv_batch((lhs, rhs), batch_dims, **params,
                                     preferred_element_type=None,
                                     out_sharding=None)
    out_dim.append(dim)
    return out

  out = replay_convs(_traced(batched, batched_args), batched_args,
                     _as_amp(out_dtype, sum_dtype))
  return _cast(out, out_dtype), out_dim[0]


def _as_conv(*, out_dtype, sum_dtype=None, **shape):
  """What remat policies see (``dots_saveable``): the
  ``conv_general_dilated`` it stands for."""
  del sum_dtype
  return jax.lax.conv_general_dilated_p, {
      **shape, "preferred_element_type": np.dtype(out_dtype)}


amp_primitive.define(amp_conv_general_dilated_p, _conv_composite,
                     _conv_accelerator,
                     functools.partial(_conv_transpose, "lhs"),
                     functools.partial(_conv_transpose, "rhs"), _conv_batch)
jax_compat.define_remat_view(amp_conv_general_dilated_p, _as_conv)


# --- The float8 convolution -----------------------------------------------------


class _Fp8Config(NamedTuple):
  params: tuple  # Sorted (name, value) pairs: the convolution's shape params.
  out_dtype: np.dtype
  lhs_dtype: np.dtype
  rhs_dtype: np.dtype
  lhs_mesh: tuple = ()  # `shard_map` axes each per-tensor scale spans.
  rhs_mesh: tuple = ()
  label: Optional[str] = None  # `observe.quantization_site`'s.

  def observe(self, role: str):
    return None if self.label is None else (self.label, role)


def _varying(x) -> tuple:
  """Every axis ``x`` varies over: a per-tensor scale spans them all."""
  return tuple(sorted(jax_compat.varying_axes(x)))


def _scaled_conv_fwd(a, b, config: _Fp8Config):
  aq, sa = fp8_scaling.quantize(a, fp8_scaling.FORWARD_DTYPE,
                                mesh_axes=config.lhs_mesh,
                                observe=config.observe("lhs"))
  bq, sb = fp8_scaling.quantize(b, fp8_scaling.FORWARD_DTYPE,
                                mesh_axes=config.rhs_mesh,
                                observe=config.observe("rhs"))
  out = jax_compat.bind_conv(aq, bq, dict(config.params), jnp.float32)
  return fp8_scaling.rescale(out, (sa, sb), config.out_dtype), (aq, sa, bq, sb)


def _f32_accumulating(eqn, invals):
  return jax_compat.bind_conv(*invals, jax_compat.conv_params(eqn),
                              jnp.float32, jax_compat.out_sharding(eqn))


def _scaled_conv_bwd(config: _Fp8Config, residuals, g):
  aq, sa, bq, sb = residuals
  params = dict(config.params)
  gq, sg = fp8_scaling.quantize(g, fp8_scaling.BACKWARD_DTYPE,
                                mesh_axes=_varying(g),
                                observe=config.observe("cotangent"))
  bf16 = jnp.bfloat16  # Holds float8_e4m3fn and float8_e5m2 values exactly.
  g16, a16, b16 = gq.astype(bf16), aq.astype(bf16), bq.astype(bf16)
  da = transposed("lhs", params, g16, b16, jax_compat.aval_of(aq),
                  _f32_accumulating)
  db = transposed("rhs", params, g16, a16, jax_compat.aval_of(bq),
                  _f32_accumulating)
  return (fp8_scaling.rescale(da, (sg, sb), config.lhs_dtype),
          fp8_scaling.rescale(db, (sa, sg), config.rhs_dtype))


_scaled_conv = jax.custom_vjp(
    lambda a, b, config: _scaled_conv_fwd(a, b, config)[0],
    nondiff_argnums=(2,))
_scaled_conv.defvjp(_scaled_conv_fwd, _scaled_conv_bwd)


def fp8_conv_general_dilated(lhs, rhs, *, out_dtype: Optional[Any] = None,
                             label: Optional[str] = None, **params):
  """`conv_general_dilated` in float8 with per-tensor scales (module doc).

  ``params`` are the shape params of a ``conv_general_dilated`` jaxpr
  equation (canonical ``window_strides``, ``padding``, ``lhs_dilation``,
  ``rhs_dilation``, ``dimension_numbers``, ``feature_group_count``,
  ``batch_group_count``; see `jax_compat.conv_params`).

  >>> import jax, jax.numpy as jnp
  >>> from jax import lax
  >>> x, k = jnp.ones((1, 4, 8, 8)), jnp.ones((2, 4, 3, 3))
  >>> dn = lax.conv_dimension_numbers(x.shape, k.shape, ("NCHW", "OIHW", "NCHW"))
  >>> y = fp8_conv_general_dilated(x, k, window_strides=(1, 1),
  ...     padding=((0, 0), (0, 0)), lhs_dilation=(1, 1), rhs_dilation=(1, 1),
  ...     dimension_numbers=dn, feature_group_count=1, batch_group_count=1)
  >>> y.dtype, float(y[0, 0, 0, 0])
  (dtype(bfloat16), 36.0)

  Args:
    lhs, rhs: the input and the kernel, floating arrays.
    out_dtype: the result dtype; bfloat16 if ``None``.
    label: what its quantizations are told to observers by
      (`observe.quantization_site`).
    **params: the convolution's shape params, as described above.

  Returns:
    The convolution, in ``out_dtype``.
  """
  out_dtype = (fp8_scaling.DEFAULT_OUT_DTYPE if out_dtype is None
               else np.dtype(out_dtype))
  kept = tuple(sorted(jax_compat.conv_params(params, precision=False).items()))
  config = _Fp8Config(kept, out_dtype, np.dtype(lhs.dtype),
                      np.dtype(rhs.dtype), _varying(lhs), _varying(rhs),
                      label)
  return _scaled_conv(lhs, rhs, config)


# --- The rules ----------------------------------------------------------------


CONV_PARAMS = ("window_strides", "padding", "lhs_dilation", "rhs_dilation",
               "dimension_numbers", "feature_group_count", "batch_group_count",
               "precision", "preferred_element_type", "out_sharding")
"""The `conv_general_dilated` params the half convolution carries
(``preferred_element_type`` is the one it decides)."""


def _lower_conv(op: base.Op, compute, out_dtype) -> list:
  del compute
  base.check_params(op.eqn, CONV_PARAMS)
  return [amp_conv_general_dilated(
      *op.args, **jax_compat.conv_params(op.eqn), out_dtype=out_dtype,
      out_sharding=jax_compat.out_sharding(op.eqn),
      sum_dtype=collectives.partitioned_sum_dtype(op, out_dtype))]


FP8_REASON = ("per-tensor scaled float8_e4m3fn operands (scale = amax/448), "
              "float32 accumulation; backward cotangent in float8_e5m2")


def _conv_sizes(eqn) -> tuple[int, int, int]:
  """The convolution as a matmul: ``(M, K, N)`` = (output positions,
  multiply-adds per output element, output features)."""
  out = tuple(eqn.outvars[0].aval.shape)
  rhs = tuple(eqn.invars[1].aval.shape)
  dn = jax_compat.conv_dimension_numbers(eqn)
  features = out[dn.out_spec[1]]
  m = math.prod(out) // max(features, 1)
  return m, math.prod(rhs) // max(rhs[dn.rhs_spec[0]], 1), features


def _lower_conv_fp8(op: base.Op) -> Optional[list]:
  """The float8 convolution, where `fp8_placement.admit` lets it run."""
  name = fp8_placement.low_precision_name(op)
  if op.matmul_format == "int8":
    int8_matmul.decline(op, "is a convolution: int8 covers matmuls "
                        "(dot_general)")
    return None
  if op.matmul_format != "fp8":
    op.note = (f", not {name}: block formats cover matmuls (dot_general), "
               "not convolutions")
    return None
  admitted = fp8_placement.admit(op, "convolution", _conv_sizes(op.eqn),
                                 FP8_REASON)
  if admitted is None:
    return None
  lhs, rhs, out_dtype, label = admitted
  return [fp8_conv_general_dilated(lhs, rhs, out_dtype=out_dtype, label=label,
                                   **jax_compat.conv_params(op.eqn))]


facts.register(
    jax_compat.conv_general_dilated_p, op_class=facts.LOWER,
    reason="convolution: half inputs, float32 accumulation (autocast fp16 "
           "list)",
    accumulates=True, lower=_lower_conv, lower_fp8=_lower_conv_fp8)
