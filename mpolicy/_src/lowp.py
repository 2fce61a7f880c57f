"""A matmul primitive that stays half-in, float32-accumulate under AD.

The obvious rewrite of a half matmul, ``convert(dot(a_h, b_h,
preferred_element_type=f32), h)``, is right in the forward pass but not under
`jax.grad`: the transpose of ``convert`` hands the cotangent to the backward
dots in float32, so they multiply float32 by half, mixed operands that XLA
upcasts and runs in float32 throughout.

`amp_dot_general` is one primitive for "half inputs, float32 accumulation,
result cast to ``out_dtype``". It is bilinear, so its JVP is two more
`amp_dot_general`s and its transpose rules are dots of the (half) cotangent
with the other (half) operand, accumulated in float32 and cast to the
operand's dtype. Every matmul of the backward pass is then half x half with
float32 accumulation, and `jax.jvp` and `jax.jacfwd` keep working (a
`custom_vjp` would break them).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpolicy._src import jax_compat

amp_dot_general_p = jax_compat.new_primitive("amp_dot_general")


def amp_dot_general(lhs, rhs, *, dimension_numbers, precision=None,
                    out_dtype: Any):
  """``dot_general`` of half ``lhs``, ``rhs``, float32 accumulation, cast."""
  return amp_dot_general_p.bind(lhs, rhs, dimension_numbers=dimension_numbers,
                                precision=precision, out_dtype=np.dtype(out_dtype))


def _composite(lhs, rhs, *, dimension_numbers, precision, out_dtype):
  out = jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                            preferred_element_type=jnp.float32)
  return out.astype(out_dtype)


def _abstract_eval(lhs, rhs, *, dimension_numbers, precision, out_dtype):
  out = jax.eval_shape(
      functools.partial(_composite, dimension_numbers=dimension_numbers,
                        precision=precision, out_dtype=out_dtype),
      jax.ShapeDtypeStruct(lhs.shape, lhs.dtype),
      jax.ShapeDtypeStruct(rhs.shape, rhs.dtype))
  return jax_compat.shaped_array(out.shape, out.dtype)


def _transpose(side, ct, x, y, *, dimension_numbers, precision, out_dtype):
  del out_dtype
  operand = x if side == "lhs" else y
  other = y if side == "lhs" else x
  dtype = operand.aval.dtype
  ct = ct.astype(other.dtype) if ct.dtype != other.dtype else ct
  rule = (jax_compat.dot_general_transpose_lhs if side == "lhs"
          else jax_compat.dot_general_transpose_rhs)
  out = rule(ct, x, y, dimension_numbers=dimension_numbers,
             precision=precision, preferred_element_type=jnp.float32,
             out_sharding=None)
  return out.astype(dtype) if out.dtype != dtype else out


def _batch(batched_args, batch_dims, *, dimension_numbers, precision,
           out_dtype):
  lhs, rhs = batched_args
  lbd, rbd = batch_dims
  new_dims, out_dim = jax_compat.dot_general_batch_dim_nums(
      (np.ndim(lhs), np.ndim(rhs)), (lbd, rbd), dimension_numbers)
  out = amp_dot_general(lhs, rhs, dimension_numbers=new_dims,
                        precision=precision, out_dtype=out_dtype)
  return out, out_dim


amp_dot_general_p.def_impl(_composite)
amp_dot_general_p.def_abstract_eval(_abstract_eval)
jax_compat.define_lowering(amp_dot_general_p, _composite)
jax_compat.define_bilinear(amp_dot_general_p,
                           functools.partial(_transpose, "lhs"),
                           functools.partial(_transpose, "rhs"))
jax_compat.define_batching(amp_dot_general_p, _batch)
