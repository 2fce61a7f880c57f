"""Matmul and convolution primitives: half in, float32 accumulate, under AD.

The obvious rewrite of a half matmul, ``convert(dot(a_h, b_h,
preferred_element_type=f32), h)``, is right in the forward pass but not under
`jax.grad`: the transpose of ``convert`` hands the cotangent to the backward
dots in float32, so they multiply float32 by half, mixed operands that XLA
upcasts and runs in float32 throughout. Convolutions have the same problem.

`amp_dot_general` and `amp_conv_general_dilated` are each one primitive for
"half inputs, float32 accumulation, result cast to ``out_dtype``". They are
bilinear, so their JVPs are two more of themselves and their transpose rules
take the (half) cotangent and the other (half) operand, accumulate in
float32 and cast to the operand's dtype. Every matmul and convolution of the
backward pass is then half x half with float32 accumulation, and `jax.jvp`
and `jax.jacfwd` keep working (a `custom_vjp` would break them).

How float32 accumulation is asked for depends on the backend. GPUs and TPUs
accumulate half products in float32 in their matrix units, so there the
primitives lower to the half op asking for the half result: cuBLAS, cuDNN and
the MXU run their half kernels and no float32 activation is written (cuDNN
has no half-in, float32-out convolution: asked for one, XLA runs the whole
convolution in float32). A dot whose result is wanted in float32 (the
gradient of a float32 parameter) is a half x half -> float32 gemm, which
cuBLAS runs natively. On CPU (and any other backend) the lowering asks for
a float32 result and casts it. XLA:CPU runs a half x half -> float32 dot
only when its left operand contracts its last dimension (any other form
fails at run time: "Unsupported element type for DotThunk"), so the CPU
lowering lays the left operand out that way behind an optimization barrier,
which keeps XLA from folding a transpose back into the dot.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpolicy._src import jax_compat
from mpolicy._src import widen

amp_dot_general_p = jax_compat.new_primitive("amp_dot_general")
amp_conv_general_dilated_p = jax_compat.new_primitive("amp_conv_general_dilated")


# --- Shared by both primitives ----------------------------------------------

# Backends whose half matmul/convolution units accumulate in float32.
ACCELERATORS = ("cuda", "rocm", "tpu")

def _abstract_eval(composite, lhs, rhs, **params):
  """The aval of ``composite`` (the primitive's meaning in plain JAX).

  Traced at the operands' own avals, so what they carry besides shape and
  dtype (inside `shard_map`: the mesh axes they vary over) carries over.
  A deep model asks the same question at every layer: the answer is cached
  by the avals and params (both hashable; anything else is traced afresh).
  """
  try:
    return _cached_abstract_eval(composite, lhs, rhs,
                                 tuple(sorted(params.items())))
  except TypeError:  # An unhashable param.
    return _trace_out_aval(composite, lhs, rhs, params)


@functools.lru_cache(maxsize=4096)
def _cached_abstract_eval(composite, lhs, rhs, params):
  return _trace_out_aval(composite, lhs, rhs, dict(params))


def _trace_out_aval(composite, lhs, rhs, params):
  closed = jax_compat.trace_to_closed_jaxpr(
      lambda a, b: [composite(a, b, **params)], [lhs, rhs])
  return closed.out_avals[0]


def _define(primitive, composite, accelerator_composite, lhs_transpose,
            rhs_transpose, batch, cpu_composite=None):
  primitive.def_impl(composite)
  primitive.def_abstract_eval(functools.partial(_abstract_eval, composite))
  jax_compat.define_lowering(primitive, composite)
  if cpu_composite is not None:
    jax_compat.define_lowering(primitive, cpu_composite, platform="cpu")
  for platform in ACCELERATORS:
    jax_compat.define_lowering(primitive, accelerator_composite,
                               platform=platform)
  jax_compat.define_bilinear(primitive, lhs_transpose, rhs_transpose)
  jax_compat.define_batching(primitive, batch)


def _operands(side, x, y):
  """``(operand, other)``: the one being transposed for, the known one."""
  return (x, y) if side == "lhs" else (y, x)


def _cast(x, dtype):
  return x.astype(dtype) if x.dtype != dtype else x


# --- amp_dot_general ----------------------------------------------------------

def amp_dot_general(lhs, rhs, *, dimension_numbers, precision=None,
                    out_dtype: Any, compute_dtype: Any = None,
                    out_sharding: Any = None):
  """``dot_general`` in ``compute_dtype``, float32 accumulation, cast.

  The operands are cast to ``compute_dtype`` (default: ``lhs``'s dtype)
  inside the primitive. So a float32 parameter can be passed as it is: the
  forward pass multiplies its half copy, and its gradient comes straight
  from the float32 accumulator instead of being rounded to half and back.
  ``out_sharding`` is `dot_general`'s (explicit sharding); the param is
  bound only when given.
  """
  compute_dtype = np.dtype(lhs.dtype if compute_dtype is None
                           else compute_dtype)
  extra = {} if out_sharding is None else {"out_sharding": out_sharding}
  return amp_dot_general_p.bind(lhs, rhs, dimension_numbers=dimension_numbers,
                                precision=precision,
                                out_dtype=np.dtype(out_dtype),
                                compute_dtype=compute_dtype, **extra)


def _dot_order(ndim, batch, first, second) -> tuple[list[int], bool]:
  """Dims as batch + first + second, unless batch + second + first is
  already the identity (then no transpose is needed). The flag says whether
  ``first`` comes first."""
  swapped = [*batch, *second, *first]
  if swapped == list(range(ndim)):
    return swapped, False
  return [*batch, *first, *second], True


def _canonical_dot(lhs, rhs, dimension_numbers, precision, pin_lhs=True):
  """``dot_general`` as one (batched) matrix product, float32 accumulation.

  Batch, free and contracting dimensions are each merged into one by
  reshapes (transposing only where a group is not already contiguous), so
  XLA sees a plain ``[B, M, K] x [B, K, N]`` product. With ``pin_lhs`` the
  left operand is always ``[B, M, K]`` (contracting its last dimension) and
  passes through an optimization barrier, so XLA cannot fold the transpose
  into the dot: that is the only half x half -> float32 dot XLA:CPU runs.
  """
  (lc, rc), (lb, rb) = dimension_numbers
  lf = [d for d in range(lhs.ndim) if d not in lc and d not in lb]
  rf = [d for d in range(rhs.ndim) if d not in rc and d not in rb]
  batch = [lhs.shape[d] for d in lb]
  merged_batch = [math.prod(batch)] if lb else []
  m = math.prod(lhs.shape[d] for d in lf)
  k = math.prod(lhs.shape[d] for d in lc)
  n = math.prod(rhs.shape[d] for d in rf)
  free_sizes = ([lhs.shape[d] for d in lf] + [rhs.shape[d] for d in rf])
  lperm, lhs_free_first = _dot_order(lhs.ndim, lb, lf, lc)
  if pin_lhs:
    lperm, lhs_free_first = [*lb, *lf, *lc], True
  rperm, rhs_contract_first = _dot_order(rhs.ndim, rb, rc, rf)
  if lperm != list(range(lhs.ndim)):
    lhs = jax.lax.transpose(lhs, lperm)
  if rperm != list(range(rhs.ndim)):
    rhs = jax.lax.transpose(rhs, rperm)
  lhs = lhs.reshape(merged_batch + ([m, k] if lhs_free_first else [k, m]))
  rhs = rhs.reshape(merged_batch + ([k, n] if rhs_contract_first else [n, k]))
  if pin_lhs:
    lhs = jax.lax.optimization_barrier(lhs)
  nb = len(merged_batch)
  dims = (((nb + (1 if lhs_free_first else 0),),
           (nb + (0 if rhs_contract_first else 1),)),
          (tuple(range(nb)), tuple(range(nb))))
  out = jax.lax.dot_general(lhs, rhs, dims, precision=precision,
                            preferred_element_type=jnp.float32)
  return out.reshape(batch + free_sizes)


def _dot_composite(lhs, rhs, *, dimension_numbers, precision, out_dtype,
                   compute_dtype, out_sharding=None, pin_lhs=False):
  lhs, rhs = _cast(lhs, compute_dtype), _cast(rhs, compute_dtype)
  if out_sharding is None:
    out = _canonical_dot(lhs, rhs, dimension_numbers, precision,
                         pin_lhs=pin_lhs)
  else:
    # With an output sharding the operands keep their layout (merging a
    # sharded dimension is not always expressible); they are widened
    # instead, which gives the same products (a product of two half values
    # is exact in float32) and float32 accumulation on every backend.
    out = jax.lax.dot_general(
        _cast(lhs, jnp.float32), _cast(rhs, jnp.float32), dimension_numbers,
        precision=precision, preferred_element_type=jnp.float32,
        out_sharding=out_sharding)
  return out.astype(out_dtype)


_dot_cpu = functools.partial(_dot_composite, pin_lhs=True)


def _dot_accelerator(lhs, rhs, *, dimension_numbers, precision, out_dtype,
                     compute_dtype, out_sharding=None):
  """GPU/TPU: the half dot asked for ``out_dtype`` directly (the hardware
  accumulates in float32; a float32 ``out_dtype`` is a native half x half ->
  float32 gemm)."""
  return jax.lax.dot_general(
      _cast(lhs, compute_dtype), _cast(rhs, compute_dtype), dimension_numbers,
      precision=precision, preferred_element_type=out_dtype,
      out_sharding=out_sharding)


def _free_dims(ndim, contracting, batch) -> list[int]:
  return [d for d in range(ndim) if d not in contracting and d not in batch]


def _ndim(x) -> int:
  """Rank of an array or of an undefined primal (which has only an aval)."""
  aval = getattr(x, "aval", None)
  return len(aval.shape) if aval is not None else np.ndim(x)


def _explicit_sharding(aval, dims_order):
  """The sharding of a dot whose output holds ``aval``'s dims in
  ``dims_order``, where ``aval`` lives on a mesh with explicit axes; None
  otherwise (then JAX needs none)."""
  sharding = getattr(aval, "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if mesh is None or getattr(mesh, "empty", True):
    return None
  explicit = jax.sharding.AxisType.Explicit
  if not any(t == explicit for t in getattr(mesh, "axis_types", ())):
    return None
  parts = tuple(sharding.spec) + (None,) * (len(aval.shape) - len(sharding.spec))
  return sharding.update(spec=jax.sharding.PartitionSpec(
      *(parts[d] for d in dims_order)))


def explicit_sharding(x):
  """The sharding a dot producing an array laid out like ``x`` must name:
  ``x``'s own on a mesh with explicit axes, else None."""
  aval = jax.typeof(x)
  return _explicit_sharding(aval, range(len(aval.shape)))


def _dot_transpose(side, ct, x, y, *, dimension_numbers, precision, out_dtype,
                   compute_dtype, out_sharding=None):
  """The cotangent of one operand: another amp dot (half x half, float32
  accumulation), so backward matmuls keep the rules at every order.

  It contracts the cotangent's dims that belong to the other operand's free
  dims. Of the two operand orders, ``dot(ct, other)`` and ``dot(other, ct)``,
  it takes one whose result is already in the operand's layout (the weight
  gradient of ``x @ w`` is ``dot(x, ct)``), so no transpose is needed.
  """
  del out_dtype, out_sharding
  operand, other = _operands(side, x, y)
  (lc, rc), (lb, rb) = dimension_numbers
  lf = _free_dims(_ndim(x), lc, lb)
  rf = _free_dims(_ndim(y), rc, rb)
  nb = len(lb)
  ct_lf = tuple(range(nb, nb + len(lf)))
  ct_rf = tuple(range(nb + len(lf), nb + len(lf) + len(rf)))
  if side == "lhs":
    own_b, own_f, own_c, other_b, other_f, other_c, ct_other = (
        lb, lf, lc, rb, rf, rc, ct_rf)
  else:
    own_b, own_f, own_c, other_b, other_f, other_c, ct_other = (
        rb, rf, rc, lb, lf, lc, ct_lf)
  batch = tuple(range(nb))
  rest = sorted(other_c)  # The other operand's dims left in the result.
  position = {d: i for i, d in enumerate(own_b)}
  # dot(ct, other): batch, then the operand's free dims, then the rest.
  ct_first = dict(position)
  ct_first.update({d: nb + i for i, d in enumerate(own_f)})
  ct_first.update({d: nb + len(own_f) + rest.index(o)
                   for d, o in zip(own_c, other_c)})
  # dot(other, ct): batch, then the rest, then the operand's free dims.
  other_first = dict(position)
  other_first.update({d: nb + rest.index(o) for d, o in zip(own_c, other_c)})
  other_first.update({d: nb + len(own_c) + i for i, d in enumerate(own_f)})
  ndim = _ndim(operand)
  identity = tuple(range(ndim))
  ct = _cast(ct, compute_dtype)
  # Under explicit sharding the result takes the operand's sharding (the
  # weight gradient contracts the sharded batch: JAX cannot guess it).
  order = sorted(range(ndim), key=lambda d: other_first[d])
  if tuple(other_first[d] for d in range(ndim)) == identity:
    dims = ((tuple(other_f), ct_other), (tuple(other_b), batch))
    return amp_dot_general(other, ct, dimension_numbers=dims,
                           precision=precision, out_dtype=operand.aval.dtype,
                           compute_dtype=compute_dtype,
                           out_sharding=_explicit_sharding(operand.aval, order))
  dims = ((ct_other, tuple(other_f)), (batch, tuple(other_b)))
  order = sorted(range(ndim), key=lambda d: ct_first[d])
  out = amp_dot_general(ct, other, dimension_numbers=dims, precision=precision,
                        out_dtype=operand.aval.dtype,
                        compute_dtype=compute_dtype,
                        out_sharding=_explicit_sharding(operand.aval, order))
  perm = tuple(ct_first[d] for d in range(ndim))
  return out if perm == identity else jax.lax.transpose(out, perm)


def _dot_batch(batched_args, batch_dims, *, dimension_numbers, precision,
               out_dtype, compute_dtype, out_sharding=None):
  del out_sharding  # vmap of an explicitly sharded dot: JAX's own rule.
  lhs, rhs = batched_args
  new_dims, out_dim = jax_compat.dot_general_batch_dim_nums(
      (np.ndim(lhs), np.ndim(rhs)), tuple(batch_dims), dimension_numbers)
  out = amp_dot_general(lhs, rhs, dimension_numbers=new_dims,
                        precision=precision, out_dtype=out_dtype,
                        compute_dtype=compute_dtype)
  return out, out_dim


_define(amp_dot_general_p, _dot_composite, _dot_accelerator,
        functools.partial(_dot_transpose, "lhs"),
        functools.partial(_dot_transpose, "rhs"), _dot_batch, _dot_cpu)


# --- amp_conv_general_dilated -------------------------------------------------

# Params of conv_general_dilated that amp_conv_general_dilated replaces by
# ``out_dtype`` (float32 accumulation is its meaning; sharding is left to
# the caller).
_CONV_OWN_PARAMS = ("preferred_element_type", "out_sharding")


def amp_conv_general_dilated(lhs, rhs, *, window_strides, padding,
                             lhs_dilation=None, rhs_dilation=None,
                             dimension_numbers=None, feature_group_count=1,
                             batch_group_count=1, precision=None,
                             out_dtype: Any):
  """``conv_general_dilated`` of half ``lhs``, ``rhs``, f32 accumulation, cast.

  Takes `jax.lax.conv_general_dilated`'s arguments (string paddings, lists,
  dimension-number strings too: they are put in the hashable canonical form
  a jaxpr equation holds, which the transpose and batching rules need).
  """
  params = dict(window_strides=window_strides, padding=padding,
                lhs_dilation=lhs_dilation, rhs_dilation=rhs_dilation,
                dimension_numbers=dimension_numbers,
                feature_group_count=feature_group_count,
                batch_group_count=batch_group_count, precision=precision)
  if not (isinstance(dimension_numbers, jax.lax.ConvDimensionNumbers)
          and all(isinstance(params[k], tuple) for k in (
              "window_strides", "padding", "lhs_dilation", "rhs_dilation"))):
    params = _canonical_conv_params(lhs, rhs, params)
  return amp_conv_general_dilated_p.bind(lhs, rhs, **params,
                                         out_dtype=np.dtype(out_dtype))


def _canonical_conv_params(lhs, rhs, params):
  """The params JAX's own ``conv_general_dilated`` equation would hold."""
  closed = jax.make_jaxpr(functools.partial(jax.lax.conv_general_dilated,
                                            **params))(
      jax.ShapeDtypeStruct(np.shape(lhs), jnp.result_type(lhs)),
      jax.ShapeDtypeStruct(np.shape(rhs), jnp.result_type(rhs)))
  (eqn,) = [e for e in closed.jaxpr.eqns
            if e.primitive is jax_compat.conv_general_dilated_p]
  return {k: v for k, v in eqn.params.items() if k not in _CONV_OWN_PARAMS}


def _conv_composite(lhs, rhs, *, out_dtype, **params):
  out = jax.lax.conv_general_dilated(lhs, rhs, **params,
                                     preferred_element_type=jnp.float32)
  return out.astype(out_dtype)


def _conv_accelerator(lhs, rhs, *, out_dtype, **params):
  """GPU/TPU: the half convolution, half result (the hardware accumulates in
  float32), then cast. Never asked for a float32 result: cuDNN has no such
  half kernel and XLA would run the whole convolution in float32."""
  out = jax.lax.conv_general_dilated(lhs, rhs, **params,
                                     preferred_element_type=None)
  return out.astype(out_dtype)


def _with_amp_convs(fn, args, out_dtype=None):
  """``fn(*args)``, each convolution it makes run as an amp one.

  JAX's convolution transpose and batching rules hold the bookkeeping
  (flipped kernels, transposed specs, VJP paddings, group axes reshaped in
  and out); rather than copy it, ``fn`` (which calls them) is traced and
  replayed with every ``conv_general_dilated`` rebound as
  ``amp_conv_general_dilated`` in ``out_dtype`` (None: the dtype that
  convolution produced). Replayed convolutions are amp ones again, so
  higher-order AD and vmap of the transposes keep the half x half form.
  """
  closed = jax_compat.trace_to_closed_jaxpr(
      lambda *a: [fn(*a)], [jax_compat.aval_of(a) for a in args])

  def bind_conv(eqn, invals):
    params = {k: v for k, v in eqn.params.items()
              if k not in _CONV_OWN_PARAMS}
    dtype = out_dtype if out_dtype is not None else eqn.outvars[0].aval.dtype
    return amp_conv_general_dilated_p.bind(*invals, **params,
                                           out_dtype=np.dtype(dtype))

  return replay_convs(closed, args, bind_conv)


def replay_convs(closed, args, bind_conv):
  """Evaluates ``closed`` on ``args``, binding each ``conv_general_dilated``
  with ``bind_conv(eqn, invals)`` (its one output) and the rest as traced."""
  jaxpr = closed.jaxpr
  env = dict(zip(jaxpr.constvars, closed.consts))
  env.update(zip(jaxpr.invars, args))
  read = lambda v: v.val if isinstance(v, jax_compat.Literal) else env[v]
  for eqn in jaxpr.eqns:
    invals = [read(v) for v in eqn.invars]
    if eqn.primitive is jax_compat.conv_general_dilated_p:
      outs = [bind_conv(eqn, invals)]
    else:
      outs = jax_compat.bind(eqn.primitive, invals, eqn.params)
      outs = outs if eqn.primitive.multiple_results else [outs]
    env.update(zip(eqn.outvars, outs))
  return read(jaxpr.outvars[0])


def _conv_transpose(side, ct, lhs, rhs, *, out_dtype, **params):
  del out_dtype
  operand, other = _operands(side, lhs, rhs)
  aval = operand.aval
  if np.size(ct) == 0:  # JAX's rhs rule gives a symbolic zero here.
    return jnp.zeros(aval.shape, aval.dtype)
  rule = (jax_compat.conv_transpose_lhs if side == "lhs"
          else jax_compat.conv_transpose_rhs)

  def transpose(ct, known):
    x, y = (operand, known) if side == "lhs" else (known, operand)
    # No preferred type: the convs come out half (the ct and the other
    # operand are), which `_with_amp_convs` makes f32-accumulated.
    return rule(ct, x, y, **params, preferred_element_type=None,
                out_sharding=None)

  out = _with_amp_convs(transpose, (_cast(ct, other.dtype), other))
  return _cast(out, aval.dtype)


def _conv_batch(batched_args, batch_dims, *, out_dtype, **params):
  out_dim = []

  def batched(lhs, rhs):
    out, dim = jax_compat.conv_batch((lhs, rhs), batch_dims, **params,
                                     preferred_element_type=None,
                                     out_sharding=None)
    out_dim.append(dim)
    return out

  out = _with_amp_convs(batched, batched_args, out_dtype)
  return _cast(out, out_dtype), out_dim[0]


_define(amp_conv_general_dilated_p, _conv_composite, _conv_accelerator,
        functools.partial(_conv_transpose, "lhs"),
        functools.partial(_conv_transpose, "rhs"), _conv_batch)


# --- Float32 computations stored in half ---------------------------------------
#
# A float32 op on a half input whose result is rounded back to half
# (``convert(f(convert(x, f32)), bf16)``) is exact up to that last rounding,
# but under `jax.grad` JAX saves what the float32 op's derivative needs in
# float32: ``exp`` saves its float32 result, ``x ** 3`` saves ``3 x^2`` in
# float32. These wrappers give the same forward values with a derivative
# that keeps only half values (and small float32 statistics) for the
# backward pass. They are `custom_jvp`s, so forward and reverse mode both
# work at every order.


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
