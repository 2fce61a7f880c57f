"""`export_quantized`: a function trained under ``c=int8``, as a serving
artifact whose weights are stored in int8.

The function is run twice through the interpreter, each time with an
`int8_matmul.Weights` in its top environment (`Env.int8`). The first run
(traced only) finds the parameter leaves that only int8 matmuls read,
each contracting the same axes. The second, exported with `jax.export`,
takes those leaves as int8 codes and float32 scales, quantized once here
by the function the int8 rule quantizes with, and tells the rule to use
them instead of quantizing the weight; every other operation is the one
the trained function runs, so its outputs are those of the trained
function, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from mpolicy._src import amp as amp_lib
from mpolicy._src import environment
from mpolicy._src.blocks import int8
from mpolicy._src.rules import int8_matmul

CODES, SCALE = "int8", "scale"
"""The keys of a weight stored in int8: ``{"int8": q, "scale": s}``, with
``q`` of the weight's shape and ``s`` of its rank (size 1 along the axes
its matmul contracts): the weight is about ``q * s``."""


def _runner(fn) -> Callable[..., Any]:
  run = getattr(fn, amp_lib.RUN_ATTRIBUTE, None)
  if run is None:
    raise TypeError(
        f"export_quantized(fn={fn!r}): fn must be what the model is "
        "evaluated with, an amp-ed function (mpolicy.amp(f, 'p=f32,c=int8,"
        "o=f32') or amp(f) under set_policy) or a transform_amp apply, "
        "called as fn(params, *args).")
  return run


def _environment(given=None) -> tuple[environment.Env, int8_matmul.Weights]:
  env = environment.Env()
  env.int8 = int8_matmul.Weights(given)
  return env, env.int8


def _int8_leaves(run, params, example_args) -> dict[int, tuple[int, ...]]:
  """Leaf index of ``params`` -> the axes its int8 matmuls contract, for
  the leaves only int8 matmuls read."""
  found: dict[int, tuple[int, ...]] = {}

  def probe(p, *args):
    env, hook = _environment()
    out = run(env, p, *args)
    for i, leaf in enumerate(jax.tree_util.tree_leaves(p)):
      axes = hook.only_int8(leaf)
      if axes is not None:
        found[i] = axes
    return out

  try:
    jax.eval_shape(probe, params, *example_args)
  except (TypeError, ValueError) as e:
    shapes = jax.tree_util.tree_map(np.shape, (params, example_args))
    raise ValueError(
        "export_quantized: fn(params, *example_args) cannot be traced with "
        f"these shapes {shapes}; give example args of the shapes the "
        f"params expect (as for jax.jit(fn)(params, *args)). JAX said: {e}"
    ) from e
  return found


def export_quantized(fn: Callable[..., Any], params: Any,
                     *example_args: Any) -> tuple[Any, Any]:
  """Exports ``fn`` with the weights its int8 matmuls read stored in int8.

  ``fn(params, *args)`` is the function you evaluate: an `amp`-ed function
  or a `transform_amp` apply, whose matmuls run under ``c=int8``. The
  parameter leaves read only by int8 matmuls (each through the same
  contracting axes) are quantized once, per output channel, as the int8
  matmul quantizes them, and stored as ``{"int8": q, "scale": s}`` in
  ``serving_params``; every other leaf is stored as in ``params``, among
  them a weight ``fn`` reads only inside a sub-computation (``hk.remat``,
  `jax.checkpoint`, `jax.jit`, a scan), quantized in the program as in
  training. The
  exported program reads the stored codes instead of quantizing the
  weights, and computes everything else as ``fn`` does, so
  ``exported.call(serving_params, *args)`` equals
  ``jax.jit(fn)(params, *args)`` bit for bit, for args of the example
  shapes and dtypes.

  >>> import jax, jax.numpy as jnp, mpolicy
  >>> fn = mpolicy.amp(lambda p, x: x @ p["w"], "p=f32,c=int8,o=f32",
  ...                  rules=mpolicy.DEFAULT_RULES.with_fp8(min_size=0))
  >>> params = {"w": jnp.linspace(-1.0, 1.0, 32).reshape(8, 4)}
  >>> x = jnp.ones((2, 8))
  >>> exported, serving = export_quantized(fn, params, x)
  >>> serving["w"]["int8"].dtype, serving["w"]["scale"].shape
  (dtype('int8'), (1, 4))
  >>> bool(jnp.all(exported.call(serving, x) == jax.jit(fn)(params, x)))
  True

  ``exported.serialize()`` needs ``params`` and the args in containers
  `jax.export` can serialize (dicts, lists, tuples, None; others can be
  registered with `jax.export.register_pytree_node_serialization`).

  Args:
    fn: the function, as you evaluate it.
    params: its first argument: the trained parameters.
    *example_args: its other arguments, or arrays of their shapes and
      dtypes (the exported program takes those shapes).

  Returns:
    ``(exported, serving_params)``: a `jax.export.Exported` and the params
    it is called with.

  Raises:
    TypeError: ``fn`` is not an `amp`-ed function or `transform_amp` apply.
    ValueError: ``fn`` cannot be traced at the example shapes, or no int8
      matmul reads a leaf of ``params``.

  See also: `amp`, `explain` (which matmuls ran in int8).
  """
  run = _runner(fn)
  found = _int8_leaves(run, params, example_args)
  if not found:
    raise ValueError(
        "export_quantized: no int8 matmul of fn reads a leaf of params "
        "(only those are stored in int8). Is fn amp-ed under a c=int8 policy "
        "(e.g. 'p=f32,c=int8,o=f32', or set_policy on its dense layers), "
        "and are its matmuls above the size threshold "
        "(OpRules.with_fp8(min_size=0) admits all)? Does fn read its "
        "weights inside a sub-computation (hk.remat, jax.checkpoint, "
        "jax.jit, a scan)? Only weights fn itself reads are found: export "
        "the same model built without them (its params are the same). "
        "mpolicy.explain(fn, params, *args) shows where each matmul ran.")
  leaves, treedef = jax.tree_util.tree_flatten(params)
  stored = list(leaves)
  for i, axes in found.items():
    q, s = jax.jit(int8.quantize, static_argnums=1)(leaves[i], axes)
    stored[i] = {CODES: q, SCALE: s}
  serving_params = jax.tree_util.tree_unflatten(treedef, stored)

  def serve(serving, *args):
    parts = treedef.flatten_up_to(serving)
    given, stand_ins = {}, []
    for i, part in enumerate(parts):
      if i in found:
        q, s = part[CODES], part[SCALE]
        part = (q.astype(np.float32) * s).astype(leaves[i].dtype)
        given[id(part)] = (q, s, found[i])
      stand_ins.append(part)
    env, _ = _environment(given)
    return run(env, jax.tree_util.tree_unflatten(treedef, stand_ins), *args)

  exported = jax.export.export(jax.jit(serve))(serving_params, *example_args)
  return exported, serving_params
