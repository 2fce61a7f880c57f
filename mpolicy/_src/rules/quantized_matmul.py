"""One quantized matmul: float8 (per row, per tensor), block formats, int8.

A matmul format is a value (`Format`), one per format in `FORMATS`, keyed
as `Policy.matmul_format` names it (and, for ``fp8``, by the ``scaling``
option of `OpRules.with_fp8`). Each value knows how it quantizes the
operands of a matmul and its backward matmuls (scales, elements, rounding
to nearest or stochastic with a key), whether it takes the NVFP4 recipe's
options and draws a key, its native kernel, and what `explain` says of it.
`quantized_dot_general` is the one entry point, and `_matmul` the one
`jax.custom_vjp`, for every format: it lays the operands out as the value
asks (``[B,] M, K`` x ``[B,] K, N`` for float8 and the block formats; the
dot's own layout for int8), runs the value's forward product and, in
reverse mode, its backward: the block formats quantize the backward
operands along their own contracting dimension, float8 quantizes the
cotangent to float8_e5m2, int8 is straight-through (the bfloat16 matmul's
gradients). `lower` is the rule of every quantized ``dot_general``: it
asks the format value, never a format's name.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from mpolicy._src import jax_compat
from mpolicy._src import observe
from mpolicy._src.blocks import formats as block_formats
from mpolicy._src.blocks import int8
from mpolicy._src.blocks import recipe
from mpolicy._src.rules import amp_primitive
from mpolicy._src.rules import base
from mpolicy._src.rules import block_matmul
from mpolicy._src.rules import fp8_mesh
from mpolicy._src.rules import fp8_placement
from mpolicy._src.rules import fp8_scaling
from mpolicy._src.rules import int8_matmul

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


# --- What one matmul needs besides its operands -------------------------------


class Spec(NamedTuple):
  """A quantized matmul's static part (hashable): its format value and
  what that value reads. ``dims``: the dimension numbers of the operands
  the matmul gets (``None``: ``[B,] M, K`` x ``[B,] K, N``, batched as
  ``batched`` says)."""
  fmt: Any
  out_dtype: Any
  lhs_dtype: Any
  rhs_dtype: Any
  batched: bool = False
  dims: Any = None
  lhs_tiles: bool = False  # nvfp4: 16 x 16 tiles (the operand is a weight).
  rhs_tiles: bool = False
  sr: bool = False  # Stochastic rounding of the cotangent.
  hadamard: bool = False  # Random Hadamard rotation of the wgrad operands.
  lhs_mesh: tuple = ()  # `shard_map` axes the lhs scales are shared over.
  rhs_mesh: tuple = ()
  weight: str = "rhs"  # int8: the operand scaled per output channel.
  backward: Any = None  # Straight-through: ``(lhs, rhs) -> result``.
  label: Optional[str] = None  # `observe.quantization_site`'s.

  def observe(self, role: str):
    return None if self.label is None else (self.label, role)


class Format:
  """A quantized matmul format (the module doc): the defaults below, and
  the forward and backward products its subclass gives.

  Attributes:
    name: `Policy.matmul_format`'s name of it.
    ran_in: what `explain` says the matmul ran in.
    keyed: whether each matmul takes a place and a key (`recipe.op_key`).
    recipe_options: the `OpRules.with_fp8` recipe options it reads.
    native: its native kernel's name, ``None`` if none.
  """
  name: str = ""
  ran_in: str = ""
  keyed = False
  recipe_options: tuple[str, ...] = ()
  native: Optional[str] = None

  def reason(self, options) -> str:
    """`explain`'s reason for a matmul in this format."""
    raise NotImplementedError

  def draws(self, options) -> bool:
    """Whether its matmuls under ``options`` draw random numbers."""
    return False

  def keep_order(self, op: base.Op, order) -> None:
    """A dot naming a reduction order runs as under bfloat16, keeping it."""
    del op, order

  def declines_convolution(self, op: base.Op) -> bool:
    """Whether a convolution stays out of the format (saying why on
    ``op``); here: it does, the format covers matmuls only."""
    op.note = (f", not {self.ran_in}: block formats cover matmuls "
               "(dot_general), not convolutions")
    return True

  def given(self, op: base.Op, lhs, rhs, dims, label):
    """Operands given quantized (``((q, s) or None, (q, s) or None)``,
    forward only), else ``None``; here a format tells the observers what
    it quantizes outside the matmul."""
    del op, lhs, rhs, dims, label

  def layout(self, lhs, rhs, dims):
    """``(a, b, out_shape)``: the operands as its product takes them
    (here ``[B,] M, K`` x ``[B,] K, N``) and the shape its result is
    reshaped to (``None``: it has the dot's shape)."""
    a, b, _, out_shape = canonical_form(lhs, rhs, dims, lhs_mk=True,
                                        rhs_kn=True)
    return a, b, out_shape

  def spec(self, a, b, lhs, rhs, dims, *, out_dtype, options, lhs_param,
           rhs_param, contraction_axes, label, backward) -> Spec:
    """The `Spec` of a matmul of ``lhs`` and ``rhs`` laid out as ``a, b``."""
    raise NotImplementedError

  def forward(self, a, b, key, spec: Spec, given=None):
    """``(result in spec.out_dtype, residuals)``."""
    raise NotImplementedError

  def backward(self, spec: Spec, residuals, g):
    """The operands' cotangents, in their dtypes."""
    raise NotImplementedError


def _mm(a, b, batched):
  """``[B,] M, K`` x ``[B,] K, N`` -> float32 ``[B,] M, N``."""
  nb = 1 if batched else 0
  dims = (((nb + 1,), (nb,)), ((0,), (0,)) if batched else ((), ()))
  return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


class Float8(Format):
  """``fp8``: float8_e4m3fn operands under current scaling
  (`fp8_scaling`), per row (the left operand one scale per row, the right
  one per batch element) or per tensor, shared across `shard_map` devices
  as `fp8_mesh` says; the cotangent in float8_e5m2, the forward's
  quantized operands reused by the backward matmuls."""
  name = "fp8"
  ran_in = fp8_scaling.FORWARD_DTYPE.name
  native = "XLA's float8 gemm (cuBLASLt on Hopper)"

  def __init__(self, scaling: str):
    self.scaling, self.per_tensor = scaling, scaling == "per_tensor"

  def declines_convolution(self, op: base.Op) -> bool:
    return False

  def reason(self, options) -> str:
    text = {"per_row": "per-row/per-tensor", "per_tensor": "per-tensor"}
    return (f"{text[self.scaling]} scaled float8_e4m3fn operands (scale = "
            "amax/448), float32 accumulation; backward cotangent in "
            "float8_e5m2")

  def spec(self, a, b, lhs, rhs, dims, *, out_dtype, options, lhs_param,
           rhs_param, contraction_axes, label, backward) -> Spec:
    del options, lhs_param, rhs_param, backward
    batched = bool(dims[1][0])
    lhs_mesh, rhs_mesh = fp8_mesh.scale_axes(a, b, self.per_tensor, batched,
                                             contraction_axes)
    return Spec(self, out_dtype, np.dtype(lhs.dtype), np.dtype(rhs.dtype),
                batched, lhs_mesh=lhs_mesh, rhs_mesh=rhs_mesh, label=label)

  def forward(self, a, b, key, spec: Spec, given=None):
    del key, given
    nb = 1 if spec.batched else 0
    per_batch = (nb, nb + 1) if nb else None
    aq, sa = fp8_scaling.quantize(
        a, fp8_scaling.FORWARD_DTYPE, axes=None if self.per_tensor else -1,
        mesh_axes=spec.lhs_mesh, observe=spec.observe("lhs"))
    bq, sb = fp8_scaling.quantize(
        b, fp8_scaling.FORWARD_DTYPE,
        axes=None if self.per_tensor else per_batch, mesh_axes=spec.rhs_mesh,
        observe=spec.observe("rhs"))
    out = fp8_scaling.rescale(_mm(aq, bq, spec.batched), (sa, sb),
                              spec.out_dtype)
    return out, (aq, sa, bq, sb)

  def backward(self, spec: Spec, residuals, g):
    aq, sa, bq, sb = residuals
    nb = 1 if spec.batched else 0
    per_batch = None if self.per_tensor or not nb else (nb, nb + 1)
    mesh = fp8_mesh.cotangent_axes(g, self.per_tensor, spec.batched)
    gq, sg = fp8_scaling.quantize(g, fp8_scaling.BACKWARD_DTYPE,
                                  axes=per_batch, mesh_axes=mesh,
                                  observe=spec.observe("cotangent"))
    batch = ((0,), (0,)) if spec.batched else ((), ())
    # Each result takes its operand's layout, and under explicit sharding
    # its sharding too (the weight gradient contracts a sharded batch).
    # d lhs [B,M,K] = g [B,M,N] . rhs [B,K,N] over N.
    da = lax.dot_general(gq, bq, (((nb + 1,), (nb + 1,)), batch),
                         preferred_element_type=jnp.float32,
                         out_sharding=amp_primitive.explicit_sharding(aq))
    if self.per_tensor:
      # One lhs scale: it factors out of the weight gradient's sum too.
      hq, sh = gq, (sa, sg)  # type: tuple[Any, tuple]
    else:
      # d rhs [B,K,N] = lhs [B,M,K] . g [B,M,N] over M. The rows' scales
      # sit inside this sum, so they are folded into the cotangent first.
      h = g.astype(jnp.float32) * sa
      hq, s = fp8_scaling.quantize(
          h, fp8_scaling.BACKWARD_DTYPE, axes=per_batch,
          mesh_axes=fp8_mesh.cotangent_axes(h, False, spec.batched))
      sh = (s,)
    db = lax.dot_general(aq, hq, (((nb,), (nb,)), batch),
                         preferred_element_type=jnp.float32,
                         out_sharding=amp_primitive.explicit_sharding(bq))
    return (fp8_scaling.rescale(da, (sg, sb), spec.lhs_dtype),
            fp8_scaling.rescale(db, sh, spec.rhs_dtype))


class Blocks(Format):
  """A block format (``mxfp8``, ``mxfp4``, ``nvfp4``): both operands
  quantized in blocks along the contracting dimension, the backward
  operands along their own (`block_matmul`); the 4-bit formats take the
  NVFP4 recipe (stochastic rounding with a key, the Hadamard rotation)."""
  keyed = True

  def __init__(self, block: block_formats.BlockFormat):
    self.block = block
    self.name = self.ran_in = block.name
    self.recipe_options = tuple(
        o for o, users in fp8_placement.USED_BY.items() if block.name in users)
    self.native = ("jax.nn.scaled_matmul (cuDNN's block-scaled dot)"
                   if block.native else None)

  def reason(self, options) -> str:
    return block_matmul.reason(self.block, options)

  def draws(self, options) -> bool:
    return block_matmul.draws(self.block, options)

  def layout(self, lhs, rhs, dims):
    return super().layout(*block_matmul.along_one_dimension(
        lhs, rhs, dims, self.block.block_size))

  def spec(self, a, b, lhs, rhs, dims, *, out_dtype, options, lhs_param,
           rhs_param, contraction_axes, label, backward) -> Spec:
    del a, b, contraction_axes, backward
    return Spec(self, out_dtype, np.dtype(lhs.dtype), np.dtype(rhs.dtype),
                bool(dims[1][0]), label=label,
                **block_matmul.recipe_parts(self.block, lhs_param, rhs_param,
                                            options))

  def forward(self, a, b, key, spec: Spec, given=None):
    del given
    return block_matmul.forward(a, b, key, spec)

  def backward(self, spec: Spec, residuals, g):
    return block_matmul.backward(spec, residuals, g)


class Int8(Format):
  """``int8``: int8 x int8 summed in int32 in the dot's own layout, the
  weight scaled per output channel, the other operand per row
  (`blocks.int8`); the backward pass is straight-through (the bfloat16
  matmul's gradients); an export gives it weights stored in int8
  (`int8_matmul.given`)."""
  name = ran_in = int8.NAME

  def reason(self, options) -> str:
    return int8_matmul.REASON

  def keep_order(self, op: base.Op, order) -> None:
    int8_matmul.keep_order(op, order)

  def declines_convolution(self, op: base.Op) -> bool:
    int8_matmul.decline(op, "is a convolution: int8 covers matmuls "
                        "(dot_general)")
    return True

  def given(self, op: base.Op, lhs, rhs, dims, label):
    return int8_matmul.given(op, lhs, rhs, dims, label)

  def layout(self, lhs, rhs, dims):
    return lhs, rhs, None

  def spec(self, a, b, lhs, rhs, dims, *, out_dtype, options, lhs_param,
           rhs_param, contraction_axes, label, backward) -> Spec:
    del a, b, options, contraction_axes
    weight = "lhs" if lhs_param and not rhs_param else "rhs"
    return Spec(self, out_dtype, np.dtype(lhs.dtype), np.dtype(rhs.dtype),
                dims=dims, weight=weight, backward=backward, label=label)

  def forward(self, a, b, key, spec: Spec, given=None):
    del key
    lhs_given, rhs_given = (None, None) if given is None else given
    out = int8.matmul(a, b, spec.dims, spec.out_dtype, weight=spec.weight,
                      lhs_given=lhs_given, rhs_given=rhs_given)
    return out, (a, b)

  def backward(self, spec: Spec, residuals, g):
    _, vjp = jax.vjp(spec.backward, *residuals)
    return vjp(g.astype(spec.out_dtype))


FORMATS: dict[tuple[str, Optional[str]], Format] = {
    ("fp8", "per_row"): Float8("per_row"),
    ("fp8", "per_tensor"): Float8("per_tensor"),
    **{(name, None): Blocks(fmt)
       for name, fmt in block_formats.FORMATS.items()},
    ("int8", None): Int8(),
}
"""Every quantized matmul format, one value each, keyed by
``(Policy.matmul_format, scaling)`` (``scaling`` only for ``fp8``)."""


def lookup(name: str, scaling: str = "per_row") -> Format:
  """The format value of ``name`` (``scaling`` picks fp8's)."""
  fmt = FORMATS.get((name, scaling), FORMATS.get((name, None)))
  if fmt is None:
    names = sorted({n for n, _ in FORMATS})
    raise ValueError(f"Unknown quantized matmul format {name!r}: expected "
                     f"one of {names}.")
  return fmt


# --- The matmul ---------------------------------------------------------------


def _forward(a, b, key, spec: Spec):
  return spec.fmt.forward(a, b, key, spec)


def _backward(spec: Spec, residuals, g):
  return (*spec.fmt.backward(spec, residuals, g), None)


_matmul = jax.custom_vjp(lambda a, b, key, spec: _forward(a, b, key, spec)[0],
                         nondiff_argnums=(3,))
_matmul.defvjp(_forward, _backward)


def matmul(a, b, key, spec: Spec):
  """The quantized product of operands laid out as ``spec.fmt`` takes
  them, differentiable in reverse mode (``key``: the recipe's key, or
  ``None`` for a format that draws none)."""
  return _matmul(a, b, key, spec)


def quantized_dot_general(lhs, rhs, dimension_numbers, fmt: Format, *,
                          out_dtype: Optional[Any] = None, key=None,
                          options=None, lhs_param: bool = False,
                          rhs_param: bool = False, contraction_axes=None,
                          label: Optional[str] = None, backward=None,
                          given=None):
  """`jax.lax.dot_general` in the quantized format ``fmt`` (module doc).

  Args:
    lhs, rhs: floating operands (float32 parameters as they are).
    dimension_numbers: as for `jax.lax.dot_general`.
    fmt: a `Format` value (`FORMATS`).
    out_dtype: the result's dtype; bfloat16 if ``None``.
    key: the recipe's key of a keyed format (``None``: ``PRNGKey(0)``).
    options: the `Fp8Options` (``None``: the defaults).
    lhs_param, rhs_param: the operand is a weight (nvfp4 tiles it; int8
      scales it per output channel).
    contraction_axes: the `shard_map` axes the contraction is split over
      (float8's row scales are shared over them; ``None``: the axes both
      operands vary over).
    label: what its quantizations are told to observers by.
    backward: a straight-through format's ``(lhs, rhs) -> result`` whose
      gradients are the backward pass's.
    given: operands given quantized (`Format.given`): forward only.

  Returns:
    The product, with `dot_general`'s shape, in ``out_dtype``.
  """
  out_dtype = (fp8_scaling.DEFAULT_OUT_DTYPE if out_dtype is None
               else np.dtype(out_dtype))
  if fmt.keyed and key is None:
    key = jax.random.PRNGKey(0)
  a, b, out_shape = fmt.layout(lhs, rhs, dimension_numbers)
  spec = fmt.spec(a, b, lhs, rhs, dimension_numbers, out_dtype=out_dtype,
                  options=options, lhs_param=lhs_param, rhs_param=rhs_param,
                  contraction_axes=contraction_axes, label=label,
                  backward=backward)
  out = (_matmul(a, b, key, spec) if given is None
         else fmt.forward(a, b, None, spec, given)[0])
  return out if out_shape is None else out.reshape(out_shape)


# --- The rule -----------------------------------------------------------------


def format_of(op: base.Op) -> Format:
  """The format value of the policy governing ``op``, decided once."""
  name = op.matmul_format
  assert name is not None, "only ops under a matmul format have a value"
  return lookup(name, op.rules.fp8.scaling)


def _key(op: base.Op, fmt: Format, options):
  """A keyed format's key: its place among the keyed matmuls, folded with
  the step and the loop iterations the environment carries."""
  if not fmt.keyed:
    return None
  env = op.env
  env.places[0] += 1
  key = recipe.op_key(options.seed, env.places[0] - 1, env.step,
                      env.iterations)
  if env.step is None and fmt.draws(options):
    observe.drew_without_step()
  return key


def lower(op: base.Op, sizes: tuple[int, ...], bf16_dot) -> Optional[list]:
  """The quantized matmul of ``op`` in its format, where `fp8_placement`
  admits it, else ``None`` (it runs as under bfloat16). ``sizes``: its
  ``(B,) M, K, N``; ``bf16_dot(lhs, rhs, *, dimension_numbers, precision,
  out_dtype)``: the bfloat16 matmul (a straight-through backward's)."""
  fmt = format_of(op)
  order = jax_compat.reduction_order(op.eqn)
  if order is not None:
    fmt.keep_order(op, order)
    return None
  dims, precision = jax_compat.dot_params(op.eqn)
  options = op.rules.fp8
  admitted = fp8_placement.admit(op, "dot", sizes, fmt.reason(options),
                                 fmt.ran_in)
  if admitted is None:
    return None
  lhs, rhs, out_dtype, label = admitted
  env = op.env
  given = fmt.given(op, lhs, rhs, dims, label)
  key = _key(op, fmt, options)
  backward = (lambda a, b: bf16_dot(a, b, dimension_numbers=dims,
                                    precision=precision, out_dtype=out_dtype))
  return [quantized_dot_general(
      lhs, rhs, dims, fmt, out_dtype=out_dtype, key=key, options=options,
      lhs_param=env.is_param(lhs), rhs_param=env.is_param(rhs),
      contraction_axes=fp8_mesh.contraction_axes(env, *op.args), label=label,
      backward=backward, given=given)]
