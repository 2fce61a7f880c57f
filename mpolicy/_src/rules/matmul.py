"""The matmul family: `dot_general` and `ragged_dot_general`.

This file owns all a matmul needs: its ``lower`` rule, the
`amp_dot_general` primitive (half operands, float32 accumulation) with its
per-backend lowerings, transposes and batching, and the float8 matmul run
under ``c=f8``.

`amp_dot_general` lowers, on GPU and TPU, to the half dot asking for its
result dtype directly (the matrix units accumulate in float32; a float32
result is a native half x half -> float32 gemm). On CPU it asks for a
float32 result and casts it. XLA:CPU runs a half x half -> float32 dot only
when its left operand contracts its last dimension (any other form fails at
run time: "Unsupported element type for DotThunk"), so the CPU lowering lays
the left operand out that way behind an optimization barrier, which keeps
XLA from folding a transpose back into the dot.

The float8 matmul gives the left operand one scale per row (each token,
each example of a batch, so a row far below the batch's largest keeps its
digits, as under `vmap`) and the right operand one per batch element (one
per tensor for a plain matmul); see `fp8_scaling`. Under a block format
(``c=mxfp8``, ``c=mxfp4``, ``c=nvfp4``) the same matmuls run in
`block_matmul` instead. Its backward rule is a
`jax.custom_vjp`, so reverse mode works at any depth of `jit`, `scan`,
`checkpoint` and `vmap`, but forward mode (`jax.jvp`) through a float8 op
raises JAX's "can't apply forward-mode autodiff (jvp) to a custom_vjp
function". Backward matmuls are true mixed float8 products.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple, Optional

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from mpolicy._src import jax_compat
from mpolicy._src import observe
from mpolicy._src.blocks import formats as block_formats
from mpolicy._src.blocks import recipe
from mpolicy._src.rules import amp_primitive
from mpolicy._src.rules import base
from mpolicy._src.rules import block_matmul
from mpolicy._src.rules import collectives
from mpolicy._src.rules import facts
from mpolicy._src.rules import fp8_mesh
from mpolicy._src.rules import fp8_placement
from mpolicy._src.rules import fp8_scaling
from mpolicy._src.rules import int8_matmul

amp_dot_general_p = jax_compat.new_primitive("amp_dot_general")

_cast = amp_primitive.cast

# --- One canonical form -------------------------------------------------------


def _order(ndim, batch, first, second) -> tuple[list[int], bool]:
  """Dims as batch + first + second, unless batch + second + first is
  already the identity (then no transpose is needed). The flag says whether
  ``first`` comes first."""
  swapped = [*batch, *second, *first]
  if swapped == list(range(ndim)):
    return swapped, False
  return [*batch, *first, *second], True


def _permute(x, perm):
  return x if list(perm) == list(range(x.ndim)) else lax.transpose(x, perm)


def canonical_form(lhs, rhs, dimension_numbers, *, lhs_mk=False, rhs_kn=False):
  """``dot_general``'s operands as one (batched) matrix product.

  Batch, free and contracting dimensions are each merged into one by
  reshapes, transposing only where a group is not already contiguous, so
  the product is ``[B, M, K] x [B, K, N]`` (or with ``[K, M]``/``[N, K]``
  operands where that needs no transpose). ``lhs_mk`` and ``rhs_kn`` force
  the ``[B, M, K]`` and ``[B, K, N]`` layouts.

  Returns:
    ``(a, b, dims, out_shape)``: the operands, the dimension numbers of
    their product, and the shape of the original ``dot_general``'s result
    (the product's reshapes to it).
  """
  (lc, rc), (lb, rb) = dimension_numbers
  lf = [d for d in range(lhs.ndim) if d not in lc and d not in lb]
  rf = [d for d in range(rhs.ndim) if d not in rc and d not in rb]
  batch = [lhs.shape[d] for d in lb]
  lead = [math.prod(batch)] if lb else []
  m = math.prod(lhs.shape[d] for d in lf)
  k = math.prod(lhs.shape[d] for d in lc)
  n = math.prod(rhs.shape[d] for d in rf)
  lperm, mk = (([*lb, *lf, *lc], True) if lhs_mk
               else _order(lhs.ndim, lb, lf, lc))
  rperm, kn = (([*rb, *rc, *rf], True) if rhs_kn
               else _order(rhs.ndim, rb, rc, rf))
  a = _permute(lhs, lperm).reshape(lead + ([m, k] if mk else [k, m]))
  b = _permute(rhs, rperm).reshape(lead + ([k, n] if kn else [n, k]))
  nb = len(lead)
  dims = (((nb + (1 if mk else 0),), (nb + (0 if kn else 1),)),
          (tuple(range(nb)), tuple(range(nb))))
  out_shape = batch + [lhs.shape[d] for d in lf] + [rhs.shape[d] for d in rf]
  return a, b, dims, out_shape


# --- amp_dot_general ----------------------------------------------------------

def amp_dot_general(lhs, rhs, *, dimension_numbers, precision=None,
                    out_dtype: Any, compute_dtype: Any = None,
                    out_sharding: Any = None, reduction_order: Any = None,
                    sum_dtype: Any = None):
  """``dot_general`` in ``compute_dtype``, float32 accumulation, cast.

  The operands are cast to ``compute_dtype`` (default: ``lhs``'s dtype)
  inside the primitive. So a float32 parameter can be passed as it is: the
  forward pass multiplies its half copy, and its gradient comes straight
  from the float32 accumulator instead of being rounded to half and back.
  ``out_sharding`` (explicit sharding) and ``reduction_order`` (the order
  the float32 accumulator sums the products in, JAX 0.12.1) are
  `dot_general`'s; ``sum_dtype`` asks GPUs and TPUs for a result in that
  dtype, cast after, so that the sums XLA's partitioner places on the
  result (a sharded contracting dimension under `jax.jit`) run in it, in
  this dot and in its transposes (`OpRules.with_collectives`); each param
  is bound only when given.

  >>> import jax.numpy as jnp
  >>> x, w = jnp.ones((2, 3)), jnp.ones((3, 4))
  >>> y = amp_dot_general(x, w, dimension_numbers=(((1,), (0,)), ((), ())),
  ...                     out_dtype=jnp.float32, compute_dtype=jnp.bfloat16)
  >>> y.dtype, float(y[0, 0])
  (dtype('float32'), 3.0)
  """
  compute_dtype = np.dtype(lhs.dtype if compute_dtype is None
                           else compute_dtype)
  extra = {k: v for k, v in (("out_sharding", out_sharding),
                             ("reduction_order", reduction_order),
                             ("sum_dtype", sum_dtype))
           if v is not None}
  return amp_primitive.bind(amp_dot_general_p, lhs, rhs,
                            dimension_numbers=dimension_numbers,
                            precision=precision, out_dtype=np.dtype(out_dtype),
                            compute_dtype=compute_dtype, **extra)


def _dot_composite(lhs, rhs, *, dimension_numbers, precision, out_dtype,
                   compute_dtype, out_sharding=None, reduction_order=None,
                   sum_dtype=None, pin_lhs=False):
  del sum_dtype  # The result is the float32 accumulator already.
  lhs, rhs = _cast(lhs, compute_dtype), _cast(rhs, compute_dtype)
  if out_sharding is None and reduction_order is None:
    a, b, dims, out_shape = canonical_form(lhs, rhs, dimension_numbers,
                                           lhs_mk=pin_lhs)
    if pin_lhs:
      a = lax.optimization_barrier(a)
    out = lax.dot_general(a, b, dims, precision=precision,
                          preferred_element_type=jnp.float32)
    out = out.reshape(out_shape)
  else:
    # With an output sharding or a reduction order the operands keep their
    # layout (merging a sharded dimension is not always expressible, and a
    # composite order names the result's dimensions); they are widened
    # instead, which gives the same products (a product of two half values
    # is exact in float32) and float32 accumulation on every backend.
    out = lax.dot_general(
        _cast(lhs, jnp.float32), _cast(rhs, jnp.float32), dimension_numbers,
        precision=precision, preferred_element_type=jnp.float32,
        out_sharding=out_sharding, **_order_kw(reduction_order))
  return _cast(out, out_dtype)


def _order_kw(reduction_order) -> dict:
  return {} if reduction_order is None else {"reduction_order":
                                             reduction_order}


def _dot_accelerator(lhs, rhs, *, dimension_numbers, precision, out_dtype,
                     compute_dtype, out_sharding=None, reduction_order=None,
                     sum_dtype=None):
  """GPU/TPU: the half dot asked for ``out_dtype`` directly; with a
  reduction order, for float32 (an order sums in the result's dtype); with
  a ``sum_dtype``, for that."""
  wide = jnp.float32 if reduction_order is not None else sum_dtype
  out = lax.dot_general(
      _cast(lhs, compute_dtype), _cast(rhs, compute_dtype), dimension_numbers,
      precision=precision,
      preferred_element_type=out_dtype if wide is None else wide,
      out_sharding=out_sharding, **_order_kw(reduction_order))
  return _cast(out, out_dtype)


def _free_dims(ndim, contracting, batch) -> list[int]:
  return [d for d in range(ndim) if d not in contracting and d not in batch]


def _ndim(x) -> int:
  """Rank of an array or of an undefined primal (which has only an aval)."""
  aval = getattr(x, "aval", None)
  return len(aval.shape) if aval is not None else np.ndim(x)


def _dot_transpose(side, ct, x, y, *, dimension_numbers, precision, out_dtype,
                   compute_dtype, out_sharding=None, reduction_order=None,
                   sum_dtype=None):
  """The cotangent of one operand: another amp dot (half x half, float32
  accumulation), so backward matmuls keep the rules at every order.

  It contracts the cotangent's dims that belong to the other operand's free
  dims. Of the two operand orders, ``dot(ct, other)`` and ``dot(other, ct)``,
  it takes one whose result is already in the operand's layout (the weight
  gradient of ``x @ w`` is ``dot(x, ct)``), so no transpose is needed.
  A reduction order is the forward contraction's: as in JAX's own
  transposes, the backward products (summing over other dimensions) take
  none. A ``sum_dtype`` is theirs too (a weight gradient contracts the
  batch, which data parallelism shards).
  """
  del out_dtype, out_sharding, reduction_order
  operand, other = amp_primitive.operands(side, x, y)
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
    return amp_dot_general(
        other, ct, dimension_numbers=dims, precision=precision,
        out_dtype=operand.aval.dtype, compute_dtype=compute_dtype,
        out_sharding=amp_primitive.sharding_for(operand.aval, order),
        sum_dtype=sum_dtype)
  dims = ((ct_other, tuple(other_f)), (batch, tuple(other_b)))
  order = sorted(range(ndim), key=lambda d: ct_first[d])
  out = amp_dot_general(
      ct, other, dimension_numbers=dims, precision=precision,
      out_dtype=operand.aval.dtype, compute_dtype=compute_dtype,
      out_sharding=amp_primitive.sharding_for(operand.aval, order),
      sum_dtype=sum_dtype)
  perm = tuple(ct_first[d] for d in range(ndim))
  return out if perm == identity else lax.transpose(out, perm)


def _dot_batch(batched_args, batch_dims, *, dimension_numbers, precision,
               out_dtype, compute_dtype, out_sharding=None,
               reduction_order=None, sum_dtype=None):
  del out_sharding  # vmap of an explicitly sharded dot: JAX's own rule.
  lhs, rhs = batched_args
  if not jax_compat.is_leaf_order(reduction_order):
    # A composite order names the result's dimensions: JAX's own batching
    # of the (widened) dot moves them.
    composite = functools.partial(
        _dot_composite, dimension_numbers=dimension_numbers,
        precision=precision, out_dtype=out_dtype, compute_dtype=compute_dtype,
        reduction_order=reduction_order, sum_dtype=sum_dtype)
    return jax.vmap(composite, in_axes=tuple(batch_dims))(lhs, rhs), 0
  new_dims, out_dim = jax_compat.dot_general_batch_dim_nums(
      (np.ndim(lhs), np.ndim(rhs)), tuple(batch_dims), dimension_numbers)
  out = amp_dot_general(lhs, rhs, dimension_numbers=new_dims,
                        precision=precision, out_dtype=out_dtype,
                        compute_dtype=compute_dtype,
                        reduction_order=reduction_order, sum_dtype=sum_dtype)
  return out, out_dim


def _as_dot_general(*, dimension_numbers, precision, out_dtype,
                    compute_dtype, out_sharding=None, reduction_order=None,
                    sum_dtype=None):
  """What remat policies see (``dots_saveable`` and co.): the
  ``dot_general`` it stands for."""
  del compute_dtype, sum_dtype
  return lax.dot_general_p, dict(
      dimension_numbers=dimension_numbers, precision=precision,
      preferred_element_type=np.dtype(out_dtype), out_sharding=out_sharding,
      **_order_kw(reduction_order))


amp_primitive.define(
    amp_dot_general_p, _dot_composite, _dot_accelerator,
    functools.partial(_dot_transpose, "lhs"),
    functools.partial(_dot_transpose, "rhs"), _dot_batch,
    cpu_composite=functools.partial(_dot_composite, pin_lhs=True))
jax_compat.define_remat_view(amp_dot_general_p, _as_dot_general)


# --- The float8 matmul --------------------------------------------------------


class _Fp8Config(NamedTuple):
  batched: bool
  out_dtype: np.dtype
  lhs_dtype: np.dtype
  rhs_dtype: np.dtype
  per_tensor: bool = False
  lhs_mesh: tuple = ()  # `shard_map` axes the lhs scales are shared over.
  rhs_mesh: tuple = ()
  label: Optional[str] = None  # `observe.quantization_site`'s.

  def observe(self, role: str):
    return None if self.label is None else (self.label, role)


def _mm(a, b, batched):
  """``[B,] M, K`` x ``[B,] K, N`` -> float32 ``[B,] M, N``."""
  nb = 1 if batched else 0
  dims = (((nb + 1,), (nb,)), ((0,), (0,)) if batched else ((), ()))
  return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _scaled_mm_fwd(a, b, config: _Fp8Config):
  # Per row: the left operand gets one scale per row (rows are free
  # dimensions, so their scales factor out of the sum) and the right one
  # per batch element. Per tensor: one scale each.
  nb = 1 if config.batched else 0
  per_batch = (nb, nb + 1) if nb else None
  aq, sa = fp8_scaling.quantize(
      a, fp8_scaling.FORWARD_DTYPE, axes=None if config.per_tensor else -1,
      mesh_axes=config.lhs_mesh, observe=config.observe("lhs"))
  bq, sb = fp8_scaling.quantize(
      b, fp8_scaling.FORWARD_DTYPE,
      axes=None if config.per_tensor else per_batch, mesh_axes=config.rhs_mesh,
      observe=config.observe("rhs"))
  out = fp8_scaling.rescale(_mm(aq, bq, config.batched), (sa, sb),
                            config.out_dtype)
  return out, (aq, sa, bq, sb)


def _scaled_mm_bwd(config: _Fp8Config, residuals, g):
  aq, sa, bq, sb = residuals
  nb = 1 if config.batched else 0
  per_batch = None if config.per_tensor or not nb else (nb, nb + 1)
  mesh = fp8_mesh.cotangent_axes(g, config.per_tensor, config.batched)
  gq, sg = fp8_scaling.quantize(g, fp8_scaling.BACKWARD_DTYPE, axes=per_batch,
                                mesh_axes=mesh,
                                observe=config.observe("cotangent"))
  batch = ((0,), (0,)) if config.batched else ((), ())
  # Each result takes its operand's layout, and under explicit sharding its
  # sharding too (the weight gradient contracts a sharded batch).
  # d lhs [B,M,K] = g [B,M,N] . rhs [B,K,N] over N.
  da = lax.dot_general(gq, bq, (((nb + 1,), (nb + 1,)), batch),
                       preferred_element_type=jnp.float32,
                       out_sharding=amp_primitive.explicit_sharding(aq))
  if config.per_tensor:
    # One lhs scale: it factors out of the weight gradient's sum too.
    hq, sh = gq, (sa, sg)  # type: tuple[Any, tuple]
  else:
    # d rhs [B,K,N] = lhs [B,M,K] . g [B,M,N] over M. The rows' scales sit
    # inside this sum, so they are folded into the cotangent first.
    h = g.astype(jnp.float32) * sa
    hq, s = fp8_scaling.quantize(h, fp8_scaling.BACKWARD_DTYPE, axes=per_batch,
                                 mesh_axes=fp8_mesh.cotangent_axes(
                                     h, False, config.batched))
    sh = (s,)
  db = lax.dot_general(aq, hq, (((nb,), (nb,)), batch),
                       preferred_element_type=jnp.float32,
                       out_sharding=amp_primitive.explicit_sharding(bq))
  return (fp8_scaling.rescale(da, (sg, sb), config.lhs_dtype),
          fp8_scaling.rescale(db, sh, config.rhs_dtype))


_scaled_mm = jax.custom_vjp(
    lambda a, b, config: _scaled_mm_fwd(a, b, config)[0], nondiff_argnums=(2,))
_scaled_mm.defvjp(_scaled_mm_fwd, _scaled_mm_bwd)


def fp8_dot_general(lhs, rhs, dimension_numbers, *,
                    out_dtype: Optional[Any] = None,
                    scaling: str = "per_row", contraction_axes=None,
                    label: Optional[str] = None):
  """`jax.lax.dot_general` in float8 with current scaling (module doc).

  The operands are brought to ``[batch, M, K] x [batch, K, N]``, quantized
  to float8_e4m3fn, multiplied with float32 accumulation, rescaled and cast
  to ``out_dtype``; the result has `dot_general`'s shape. Differentiable in
  reverse mode, with the cotangent quantized to float8_e5m2.

  >>> import jax, jax.numpy as jnp
  >>> x = jax.random.normal(jax.random.PRNGKey(0), (64, 128))
  >>> w = jax.random.normal(jax.random.PRNGKey(1), (128, 32))
  >>> y = fp8_dot_general(x, w, (((1,), (0,)), ((), ())))
  >>> y.dtype, bool(jnp.linalg.norm(y - x @ w) / jnp.linalg.norm(x @ w) < 0.05)
  (dtype(bfloat16), True)

  Args:
    lhs, rhs: floating arrays (any float dtype; float32 parameters can be
      passed as they are).
    dimension_numbers: as for `jax.lax.dot_general`.
    out_dtype: the result dtype; bfloat16 if ``None``.
    scaling: ``"per_row"``: one scale per row of ``lhs``, one per batch
      element of ``rhs`` and of the cotangent; ``"per_tensor"``: one scale
      per operand and per cotangent. Inside `jax.shard_map` (with
      ``check_vma``) scales are shared across devices as `fp8_mesh` says.
    contraction_axes: the `shard_map` mesh axes the contraction is split
      over (the rows' scales are shared over them); ``None``: the axes both
      operands vary over.
    label: what its quantizations are told to observers by
      (`observe.quantization_site`).

  Returns:
    The product, in ``out_dtype``.
  """
  if scaling not in fp8_placement.SCALINGS:
    raise ValueError(f"fp8_dot_general(scaling={scaling!r}): must be one of "
                     f"{fp8_placement.SCALINGS}")
  out_dtype = (fp8_scaling.DEFAULT_OUT_DTYPE if out_dtype is None
               else np.dtype(out_dtype))
  a, b, _, out_shape = canonical_form(lhs, rhs, dimension_numbers,
                                      lhs_mk=True, rhs_kn=True)
  _, (lb, _) = dimension_numbers
  per_tensor = scaling == "per_tensor"
  config = _Fp8Config(bool(lb), out_dtype, np.dtype(lhs.dtype),
                      np.dtype(rhs.dtype), per_tensor,
                      *fp8_mesh.scale_axes(a, b, per_tensor, bool(lb),
                                           contraction_axes), label)
  return _scaled_mm(a, b, config).reshape(out_shape)


def block_dot_general(lhs, rhs, dimension_numbers, fmt, *,
                      out_dtype: Optional[Any] = None,
                      lhs_param: bool = False, rhs_param: bool = False,
                      options=None, key=None,
                      label: Optional[str] = None):
  """`jax.lax.dot_general` in block format ``fmt`` (see `block_matmul`).

  The blocks run along the left operand's minor-most contracting dimension
  and its partner in the right operand, never across another contracting
  dimension (see `block_matmul.along_one_dimension`); the result has
  `dot_general`'s shape, in ``out_dtype`` (bfloat16 if ``None``).
  ``lhs_param``/``rhs_param``: the operand is a weight (nvfp4 quantizes
  it in 16 x 16 tiles). ``options``: an
  `Fp8Options` (the NVFP4 recipe's parts; ``None``: all on); ``key``: the
  recipe's key (``None``: ``PRNGKey(0)``). ``label``: what its
  quantizations are told to observers by (`observe.quantization_site`).

  >>> import jax, jax.numpy as jnp
  >>> x = jax.random.normal(jax.random.PRNGKey(0), (8, 64))
  >>> w = jax.random.normal(jax.random.PRNGKey(1), (64, 16))
  >>> y = block_dot_general(x, w, (((1,), (0,)), ((), ())), "nvfp4")
  >>> y.dtype, bool(jnp.linalg.norm(y - x @ w) / jnp.linalg.norm(x @ w) < 0.2)
  (dtype(bfloat16), True)
  """
  fmt = block_formats.get_format(fmt)
  out_dtype = (fp8_scaling.DEFAULT_OUT_DTYPE if out_dtype is None
               else np.dtype(out_dtype))
  a, b, blocked = block_matmul.along_one_dimension(lhs, rhs, dimension_numbers,
                                                   fmt.block_size)
  a, b, _, out_shape = canonical_form(a, b, blocked, lhs_mk=True, rhs_kn=True)
  _, (lb, _) = dimension_numbers
  config = block_matmul.config_for(fmt, lhs, rhs, bool(lb), out_dtype,
                                   lhs_param, rhs_param, options, label)
  key = jax.random.PRNGKey(0) if key is None else key
  return block_matmul.blocked_mm(a, b, key, config).reshape(out_shape)


# --- The rules ----------------------------------------------------------------


def _lower_dot(op: base.Op, compute, out_dtype) -> list:
  """`amp_dot_general`. Operands cast down from float32 (a parameter,
  typically) go in as float32: the primitive casts them itself, and their
  gradients then come from its float32 accumulator, not rounded to half and
  back. Only parameters and inputs: they are kept alive anyway, whereas
  saving a float32 activation for the backward pass would double the memory
  its half copy needs."""
  env = op.env
  base.check_params(op.eqn, DOT_PARAMS)
  lhs, rhs = (w if env.is_param(w := env.wider_source(a)) else a
              for a in op.args)
  dimension_numbers, precision = jax_compat.dot_params(op.eqn)
  order = jax_compat.reduction_order(op.eqn)
  if order is not None:
    op.why += f"; reduction_order={order!r} kept (float32 accumulator)"
  sums = collectives.partitioned_sum_dtype(op, out_dtype)
  return [amp_dot_general(
      lhs, rhs, dimension_numbers=dimension_numbers, precision=precision,
      out_dtype=out_dtype, compute_dtype=compute,
      out_sharding=jax_compat.out_sharding(op.eqn), reduction_order=order,
      sum_dtype=sums)]


DOT_PARAMS = ("dimension_numbers", "precision", "preferred_element_type",
              "out_sharding", "reduction_order")
"""The `dot_general` params the half matmul carries (``preferred_element_type``
is the one it decides: float32 accumulation)."""


FP8_REASON = ("{} scaled float8_e4m3fn operands (scale = amax/448), float32 "
              "accumulation; backward cotangent in float8_e5m2")
_SCALING_TEXT = {"per_row": "per-row/per-tensor", "per_tensor": "per-tensor"}


def _dot_sizes(eqn) -> tuple[int, ...]:
  """``(M, K, N)``, or ``(B, M, K, N)`` for a batched ``dot_general``."""
  (lc, rc), (lb, rb) = jax_compat.dot_params(eqn)[0]
  lhs, rhs = (tuple(v.aval.shape) for v in eqn.invars)
  size = lambda shape, dims: math.prod(shape[d] for d in dims)
  m = size(lhs, _free_dims(len(lhs), lc, lb))
  n = size(rhs, _free_dims(len(rhs), rc, rb))
  mkn = (m, size(lhs, lc), n)
  return (size(lhs, lb), *mkn) if lb else mkn


def _lower_dot_fp8(op: base.Op) -> Optional[list]:
  """The float8 matmul, where `fp8_placement.admit` lets it run (not for a
  dot that names a reduction order: scaled float8 products sum as the
  format's kernel does, so it runs as under bfloat16, keeping the order)."""
  if op.matmul_format == "int8":
    return int8_matmul.lower(op, _dot_sizes(op.eqn), functools.partial(
        amp_dot_general, compute_dtype=jnp.bfloat16))
  if jax_compat.reduction_order(op.eqn) is not None:
    return None
  fmt = block_matmul.format_of_op(op)
  options = op.rules.fp8
  admitted = fp8_placement.admit(
      op, "dot", _dot_sizes(op.eqn),
      FP8_REASON.format(_SCALING_TEXT[options.scaling]) if fmt is None
      else block_matmul.reason(fmt, options))
  if admitted is None:
    return None
  lhs, rhs, out_dtype, label = admitted
  dimension_numbers, _ = jax_compat.dot_params(op.eqn)
  if fmt is not None:
    op.env.places[0] += 1
    key = recipe.op_key(options.seed, op.env.places[0] - 1,
                        op.env.step, recipe.current_iterations())
    if op.env.step is None and block_matmul.draws(fmt, options):
      observe.drew_without_step()
    return [block_dot_general(lhs, rhs, dimension_numbers, fmt,
                              out_dtype=out_dtype,
                              lhs_param=op.env.is_param(lhs),
                              rhs_param=op.env.is_param(rhs),
                              options=options, key=key, label=label)]
  return [fp8_dot_general(
      lhs, rhs, dimension_numbers, out_dtype=out_dtype,
      scaling=options.scaling,
      contraction_axes=fp8_mesh.contraction_axes(op.env, *op.args),
      label=label)]


def _lower_ragged(op: base.Op, compute, out_dtype) -> list:
  """Half operands, float32 accumulation, cast to ``out_dtype``. Under grad
  JAX's own transposes take the float32 cotangent: the backward ragged
  products multiply float32 by half (no amp primitive for ragged dots)."""
  del compute
  out = base.bind(op.eqn, op.args, jax_compat.params_with_result_dtype(
      op.eqn, jnp.float32))
  return [op.env.cast(o, out_dtype) for o in out]


_MATMUL = ("matmul family: half inputs, float32 accumulation (autocast fp16 "
           "list)")
facts.register(jax_compat.dot_general_p, op_class=facts.LOWER, reason=_MATMUL,
               accumulates=True, lower=_lower_dot, lower_fp8=_lower_dot_fp8)
facts.register("ragged_dot_general", op_class=facts.LOWER,
               reason=_MATMUL + "; backward products float32 x half",
               accumulates=True, lower=_lower_ragged)
