"""What the half matmul and convolution primitives share.

The obvious rewrite of a half matmul, ``convert(dot(a_h, b_h,
preferred_element_type=f32), h)``, is right in the forward pass but not under
`jax.grad`: the transpose of ``convert`` hands the cotangent to the backward
dots in float32, so they multiply float32 by half, mixed operands that XLA
upcasts and runs in float32 throughout. Convolutions have the same problem.

So each family (`matmul`, `conv`) defines one primitive for "half inputs,
float32 accumulation, result cast to ``out_dtype``". They are bilinear, so
their JVPs are two more of themselves and their transpose rules take the
(half) cotangent and the other (half) operand, accumulate in float32 and
cast to the operand's dtype. Every matmul and convolution of the backward
pass is then half x half with float32 accumulation, and `jax.jvp` and
`jax.jacfwd` keep working (a `custom_vjp` would break them).

How float32 accumulation is asked for depends on the backend. GPUs and TPUs
accumulate half products in float32 in their matrix units, so there the
primitives lower to the half op asking for the half result: cuBLAS, cuDNN and
the MXU run their half kernels and no float32 activation is written. On CPU
(and any other backend) the lowering asks for a float32 result and casts it.
"""

from __future__ import annotations

import functools

import jax

from mpolicy._src import jax_compat
from mpolicy._src import staged

# Backends whose half matmul/convolution units accumulate in float32.
ACCELERATORS = ("cuda", "rocm", "tpu")
# The interpreter's `replay_binding`, which it installs as it is imported
# (the rules cannot import the interpreter: it imports them).
_REPLAY: list = []


def install_replay(replay) -> None:
  _REPLAY[:] = [replay]


def replay(closed, args, binds) -> list:
  """``closed`` run on ``args`` by the interpreter, each primitive of
  ``binds`` bound as it says (`interpreter.replay_binding`)."""
  return _REPLAY[0](closed, args, binds)


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


def define(primitive, composite, accelerator_composite, lhs_transpose,
           rhs_transpose, batch, cpu_composite=None):
  """Gives ``primitive`` its meaning (``composite``), per-backend lowerings,
  bilinear JVP and transposes, and batching rule."""
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


def bind(primitive, lhs, rhs, **params):
  """Binds a half matmul or convolution primitive (see `staged`: under
  `jax.grad` its linearization is made once per signature)."""
  return staged.bind(primitive, lhs, rhs, **params)


def operands(side, x, y):
  """``(operand, other)``: the one being transposed for, the known one."""
  return (x, y) if side == "lhs" else (y, x)


def cast(x, dtype):
  return x.astype(dtype) if x.dtype != dtype else x


def _explicit(mesh) -> bool:
  """Whether ``mesh`` is a mesh with at least one explicit axis."""
  if mesh is None or getattr(mesh, "empty", True):
    return False
  explicit = jax.sharding.AxisType.Explicit
  return any(t == explicit for t in getattr(mesh, "axis_types", ()))


def sharding_for(aval, dims_order):
  """The sharding of a dot whose output holds ``aval``'s dims in
  ``dims_order``, where ``aval`` lives on a mesh with explicit axes; None
  otherwise (then JAX needs none).

  An ``aval`` on no mesh (a parameter left on one device) under a mesh
  with explicit axes in use (`jax.set_mesh`) gets a result replicated over
  that mesh, as JAX's own `dot_general` transpose gives it: its gradient
  contracts a batch sharded over the mesh, whose sharding JAX cannot guess.
  """
  sharding = getattr(aval, "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if mesh is None or getattr(mesh, "empty", True):
    current = jax.sharding.get_abstract_mesh()
    if not _explicit(current):
      return None
    return jax.sharding.NamedSharding(
        current, jax.sharding.PartitionSpec(*(None,) * len(aval.shape)))
  if not _explicit(mesh):
    return None
  parts = tuple(sharding.spec) + (None,) * (len(aval.shape) - len(sharding.spec))
  return sharding.update(spec=jax.sharding.PartitionSpec(
      *(parts[d] for d in dims_order)))


def on_mesh(aval):
  """``aval`` as JAX's transposes treat an operand's: one on no mesh, under
  a mesh with explicit axes in use, is replicated over that mesh (see
  `sharding_for`); any other is returned as it is."""
  sharding = sharding_for(aval, range(len(aval.shape)))
  if sharding is None or sharding == getattr(aval, "sharding", None):
    return aval
  return jax_compat.with_sharding(aval, sharding)


def explicit_sharding(x):
  """The sharding a dot producing an array laid out like ``x`` must name:
  ``x``'s own on a mesh with explicit axes, else None."""
  aval = jax.typeof(x)
  return sharding_for(aval, range(len(aval.shape)))
