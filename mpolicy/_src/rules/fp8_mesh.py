"""Float8 scales across `shard_map` devices: which mesh axes share a scale.

Under `jax.jit` with sharded operands the amax is a reduction over the
global array, which XLA computes across devices: nothing to do. Inside a
`shard_map` body each device sees its shard, so an amax is local; the
float8 matmul shares it with `jax.lax.pmax` over mesh axes:

* a per-tensor scale (an operand under ``scaling="per_tensor"``, the right
  operand and the cotangent of a plain matmul) over every axis the value
  varies over: the amax of the global array;
* a row's scale (the left operand under ``scaling="per_row"``) spans the
  contraction K, which is split only over axes both operands' data vary
  over (row-parallel: ``x`` and ``w`` both split along K). Data parallel
  (only ``x`` varies) and column-parallel (``x`` and ``w`` vary over
  different axes) share nothing: each device holds whole rows;
* per-batch-element scales (batched matmuls: attention, experts) stay on
  their device: the batch is what is split there.

JAX marks a replicated operand as varying where it meets a varying one
(`pvary`); such an operand's data do not vary, so the rule looks through
`pvary` to the axes the data vary over. A value that the code replicated by
other means (``all_gather``'s result is typed as varying) counts as
varying. Outside `shard_map`, or with ``check_vma=False``, nothing is
typed as varying and every scale is the device's own.
"""

from __future__ import annotations

from mpolicy._src import jax_compat
from mpolicy._src.rules import base
from mpolicy._src.rules import facts

_SOURCES = "_fp8_pvary_sources"  # Env attribute: id(out) -> pvary's input.


def _sources(env) -> dict:
  sources = getattr(env, _SOURCES, None)
  if sources is None:
    sources = {}
    setattr(env, _SOURCES, sources)
  return sources


def record_pvary(op: base.Op, outs: list) -> list:
  """Records the inputs of a `pvary` (run by `collectives`), its results."""
  if len(outs) == len(op.args):
    for x, out in zip(op.args, outs):
      _sources(op.env)[id(out)] = x
  return outs


def data_varying_axes(env, x) -> frozenset:
  """The mesh axes ``x``'s data vary over: its type's, less those a `pvary`
  (or a cast of a `pvary`'s result) added."""
  sources = _sources(env)
  seen = set()
  while id(x) not in seen:
    seen.add(id(x))
    x = sources.get(id(x), env.wider_source(x))
  return jax_compat.varying_axes(x)


def contraction_axes(env, lhs, rhs) -> tuple:
  """The axes a plain matmul's contraction may be split over: those both
  operands' data vary over."""
  return tuple(sorted(data_varying_axes(env, lhs)
                      & data_varying_axes(env, rhs)))


def scale_axes(a, b, per_tensor: bool, batched: bool,
               contraction=None) -> tuple[tuple, tuple]:
  """The axes each operand's scales are shared over (module doc).

  Args:
    a, b: the ``[B,] M, K`` and ``[B,] K, N`` operands.
    per_tensor: one scale per operand.
    batched: whether there is a batch dimension.
    contraction: the axes the contraction is split over; ``None``: those
      both operands vary over.
  """
  va, vb = jax_compat.varying_axes(a), jax_compat.varying_axes(b)
  if per_tensor:
    return tuple(sorted(va)), tuple(sorted(vb))
  if batched:
    return (), ()
  rows = va & vb if contraction is None else va & frozenset(contraction)
  return tuple(sorted(rows)), tuple(sorted(vb))


def cotangent_axes(g, per_tensor: bool, batched: bool) -> tuple:
  """A per-tensor cotangent scale is shared over the axes it varies over."""
  if batched and not per_tensor:
    return ()
  return tuple(sorted(jax_compat.varying_axes(g)))


# A replicated parameter made varying is still a parameter.
facts.register("pvary", keeps_param=True)
