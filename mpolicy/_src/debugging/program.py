"""The computation the debugger checks: a loss, and its gradients.

`Call` holds ``fn`` and its arguments as `amp` splits them (array leaves
traced, the rest static). `Call.program` is the computation as a function
of the array leaves: the loss, then, with ``grad``, the gradients of the
loss times the loss scale with respect to the first argument's floating
leaves, as a training step computes them.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mpolicy._src import amp as amp_lib
from mpolicy._src import dtypes
from mpolicy._src import interpreter
from mpolicy._src import loss_scale as loss_scale_lib
from mpolicy._src import observe
from mpolicy._src import sites
from mpolicy._src import tree_paths
from mpolicy._src.debugging import check

_SCALES = (loss_scale_lib.NoOpLossScale, loss_scale_lib.StaticLossScale,
           loss_scale_lib.DynamicLossScale)


def check_loss_scale(loss_scale: Any, who: str) -> Any:
  """``loss_scale`` as a loss scale object (a number becomes a static one)."""
  if loss_scale is None or isinstance(loss_scale, _SCALES):
    return loss_scale
  if isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool):
    return loss_scale_lib.StaticLossScale(float(loss_scale))
  raise TypeError(
      f"{who}: loss_scale must be None, a number or an mpolicy loss scale "
      f"(NoOpLossScale, StaticLossScale, DynamicLossScale, as the training "
      f"step uses); got {loss_scale!r} of type {type(loss_scale).__name__}.")


class Call:
  """``fn(*args)`` split for tracing.

  Attributes:
    arrays: the array leaves of the arguments, in order.
    paths: each array leaf's path (``"0/linear/w"``: argument 0's
      ``["linear"]["w"]``).
    wrt: the indices (into ``arrays``) of the first argument's floating
      leaves: what the gradients are taken with respect to.
  """

  def __init__(self, fn: Callable[..., Any], args: tuple, who: str):
    if not callable(fn):
      raise TypeError(f"{who}: fn must be a function returning a scalar "
                      f"loss; got {fn!r}.")
    if not args:
      raise TypeError(f"{who}: pass fn's arguments too, e.g. "
                      f"{who}(loss_fn, params, batch).")
    self.fn, self.who = fn, who
    self.static, self.arrays = amp_lib.split_arguments(args, {})
    leaves = jax.tree_util.tree_flatten_with_path(args)[0]
    self.paths = [tree_paths.path_str(p) for p, x in leaves if _traced(x)]
    n_first = len(amp_lib.split_arguments((args[0],), {})[1])
    self.wrt = [i for i in range(n_first) if dtypes.float_value(self.arrays[i])]

  def value(self, *arrays) -> jax.Array:
    """``fn``'s loss on these array leaves (checked to be a scalar)."""
    args, kwargs = amp_lib.join_arguments(self.static, arrays)
    out = self.fn(*args, **kwargs)
    if (not hasattr(out, "dtype") or np.ndim(out) != 0
        or not dtypes.float_value(out)):
      raise TypeError(
          f"{self.who}: fn must return a scalar floating loss; it returned "
          f"{jax.tree_util.tree_map(jax.typeof, out)}. Wrap it, e.g. "
          f"lambda p, x: loss_fn(p, x)[0] for a (loss, aux) pair.")
    return out

  def program(self, grad: bool, loss_scale: Any = None,
              unscale: bool = False) -> Callable[..., list]:
    """``arrays -> [loss, *gradients]`` (just ``[loss]`` without ``grad``).

    The gradients are those of the loss times ``loss_scale``'s scale (if
    one is given), as a training step's backward pass computes them; with
    ``unscale``, divided by it after, as the step applies them."""
    if not grad:
      return lambda *arrays: [self.value(*arrays)]

    def program(*arrays):
      def scaled(wrt):
        merged = list(arrays)
        for i, x in zip(self.wrt, wrt):
          merged[i] = x
        loss = self.value(*merged)
        return (loss if loss_scale is None else loss_scale.scale(loss)), loss

      (_, loss), grads = jax.value_and_grad(scaled, has_aux=True)(
          [arrays[i] for i in self.wrt])
      if unscale and loss_scale is not None:
        grads = loss_scale.unscale(grads)
      return [loss, *grads]

    return program

  def output_names(self, grad: bool) -> list[str]:
    """What each output of `program` is: ``"loss"``, then the gradients,
    named by their parameter's path in the first argument."""
    names = [self.param_path(i) for i in self.wrt] if grad else []
    return ["loss"] + [f"gradient of {n}" if n else "gradient" for n in names]

  def param_path(self, i: int) -> str:
    """The path of array leaf ``i`` of the first argument within it
    (``"linear/w"``; ``""`` for an argument that is itself an array)."""
    return self.paths[i].partition("/")[2]


@dataclasses.dataclass
class Run:
  """One run of a program, op by op (see `run`).

  Attributes:
    outs: the program's results.
    out_ids: their value ids in the checker's log.
    checker: the `check.Checker` that watched it, with its log and checks.
    sites: the ops of the user's code, as the trace named them.
    jaxpr: the program as traced.
    observer: the checker's watcher, if one was asked for.
  """
  outs: list
  out_ids: list
  checker: check.Checker
  sites: list
  jaxpr: Any
  observer: Any = None


def run(call: Call, program: Callable[..., list], *, in_float32=frozenset(),
        checking: bool = True, observer=None) -> Run:
  """Traces ``program`` with every op of ``call``'s function named
  (`sites.tagging`, ``in_float32`` as there), and replays it op by op
  (`interpreter.replay`) under a `check.Checker`.

  Args:
    call: the function and its arguments.
    program: a function of ``call.arrays`` (see `Call.program`).
    in_float32: the sites to run in float32, or `sites.EVERY`.
    checking: whether every result is checked for non-finite values.
    observer: a class; ``observer(events, sites)`` watches the checker and
      is told the program's results at the end (``finish(out_ids)``).
  """
  with sites.tagging(in_float32=in_float32) as found:
    closed = jax.make_jaxpr(program)(*call.arrays)
  checker = check.Checker(checking=checking)
  watching = observer(checker.events, found) if observer is not None else None
  checker.watcher = watching
  checker.inputs(call.arrays, call.paths)
  with observe.watching(checker):
    outs = interpreter.replay(closed, call.arrays)
  out_ids = [checker.vid(o) for o in outs]
  if watching is not None:
    watching.finish(out_ids)
  return Run(outs, out_ids, checker, found, closed, watching)


def _traced(leaf) -> bool:
  """Whether `amp` traces this argument leaf (an array), as it splits."""
  return bool(amp_lib.split_arguments((leaf,), {})[1])


def all_finite(values) -> bool:
  """Whether every floating leaf of ``values`` is finite (on the host)."""
  return all(bool(np.all(np.isfinite(np.asarray(v, np.float32)
                                     if jnp.issubdtype(v.dtype, jnp.floating)
                                     else np.asarray(v))))
             for v in jax.tree_util.tree_leaves(values)
             if dtypes.float_value(v))


def leaf_dtype_name(x) -> str:
  return np.dtype(dtypes.dtype_of(x)).name

