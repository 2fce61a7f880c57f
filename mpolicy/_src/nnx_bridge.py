"""Flax NNX objects passed to an `amp` function: `nnx.jit`'s semantics.

An NNX module is a Python object graph: a model and one of its submodules
passed side by side share variables, and what the function writes into them
in place (BatchNorm's running statistics, RNG counters, a counter) must
come back to the caller's objects. `amp` therefore does what `nnx.jit`
does, through Flax's public graph API:

- outside the trace, every NNX object among the arguments (modules,
  `nnx.Rngs`, `nnx.Optimizer`, bare `nnx.Variable`s, at any depth of a
  list, tuple or dict) is split in one graph (`nnx.to_tree`), so a variable
  reachable from two arguments is traced once;
- inside, the objects are rebuilt from the traced state (`nnx.from_tree`),
  sharing intact, and after the call their state, and any NNX object the
  function returns, is split again;
- outside again, `nnx.from_tree` writes every change back into the
  caller's objects (new variables included), and an argument the function
  returns comes back as the same object.

Like the linen bridge, only `frameworks` loads this module, once the user
has imported `flax.nnx`. NNX has no method hook, so NNX classes cannot key
the registry: per-layer policies go through name patterns.
"""

from __future__ import annotations

from collections.abc import Iterator
import contextlib
import dataclasses
import threading
from typing import Any, Optional

from flax import errors as flax_errors
from flax import nnx
import jax


def _is_object(x: Any) -> bool:
  """Whether ``x`` is an NNX object a call may update in place."""
  return isinstance(x, nnx.Variable) or nnx.graph.is_graph_node(x)


def _stops(x: Any) -> bool:
  """Where the search for objects stops: at an object, and at an
  `nnx.State`, which is data (see `Calls`)."""
  return isinstance(x, nnx.State) or _is_object(x)


def _objects_in(tree: Any) -> list:
  """The NNX objects of ``tree``, in order (outside `nnx.State`s)."""
  return [x for x in jax.tree_util.tree_leaves(tree, is_leaf=_stops)
          if _is_object(x)]


@dataclasses.dataclass(frozen=True)
class _Slot:
  """Where the ``index``-th NNX object stood in the arguments."""
  index: int


class Calls(threading.local):
  """The `amp` calls of one interpreted function in progress, in a thread.

  Each entry says whether that call's arguments held NNX objects, so the
  trace inside it (which runs in the call's dynamic extent, in the same
  thread) knows whether to rebuild them. The instance itself is the tag of
  Flax's update context, as the `nnx.jit` object is for `nnx.jit`.

  An `nnx.State` (what `nnx.split` returns) is passed as data, as any
  pytree: the split/merge form returns the state it changes, and works
  where the caller's variables may not be written (inside `jax.grad` of a
  loss that closes over them). `nnx.jit` would write into its variables.
  """

  def __init__(self):
    super().__init__()
    self.lifted: list[bool] = []

  @contextlib.contextmanager
  def outside(self, tree: Any) -> Iterator[tuple[Any, Any]]:
    """Splits the NNX objects of ``tree`` (the call's ``(args, kwargs)``).

    Yields ``(pure, finish)``: ``pure`` is ``tree`` with each NNX object
    replaced by a slot, beside the objects' graph and state (a pytree of
    arrays), and ``finish(out)`` turns what the trace returned
    (`inside_done`'s pair) into the call's output, writing the state back.
    """
    objects = _objects_in(tree)
    self.lifted.append(bool(objects))
    try:
      if not objects:
        yield tree, lambda pair: pair[1]
        return
      slots = iter(range(len(objects)))
      shell = jax.tree_util.tree_map(
          lambda x: _Slot(next(slots)) if _is_object(x) else x, tree,
          is_leaf=_stops)
      with nnx.update_context(self):

        def finish(pair):
          return nnx.from_tree(pair, ctxtag=self, is_inner=False)[1]

        yield (shell, nnx.to_tree(objects, ctxtag=self)), finish
    finally:
      self.lifted.pop()

  def inside(self, pure: Any) -> Any:
    """Inside the trace: the objects rebuilt, sharing as outside."""
    if not self.lifted[-1]:
      return pure
    shell, split = pure
    objects = nnx.from_tree(split, ctxtag=self, is_inner=True)
    return jax.tree_util.tree_map(
        lambda x: objects[x.index] if isinstance(x, _Slot) else x, shell,
        is_leaf=lambda x: isinstance(x, (_Slot, nnx.State)))

  def inside_done(self, tree: Any, out: Any) -> tuple[Any, Any]:
    """After the call: ``(objects' state, out)``, both pure pytrees.

    ``tree`` is what `inside` returned (the objects as the call left
    them). Splitting them with the output, in one graph, lets an output
    that is one of the arguments come back as that object.
    """
    if not self.lifted[-1]:
      return None, out
    return nnx.to_tree((_objects_in(tree), out), ctxtag=self)

  @staticmethod
  def is_state(x: Any) -> bool:
    """Whether ``x`` is the split form of an NNX object (graph and state).

    Its leaves are variables, which `amp` returns in the dtypes they were
    traced in: it does not cast them to the output dtype.
    """
    return isinstance(x, nnx.NodeStates)


_SPLIT_MERGE = """\
  graphdef, params, stats = nnx.split(model, nnx.Param, nnx.BatchStat)

  def forward(params, stats, x):
    model = nnx.merge(graphdef, params, stats)
    return model(x), nnx.state(model, nnx.BatchStat)

  y, stats = mpolicy.amp(forward, policy)(params, stats, x)
  nnx.update(model, stats)"""


def trace_error(error: Exception) -> Optional[TypeError]:
  """What to raise instead of Flax's error in `amp`'s trace, if anything.

  A module closed over by the function cannot update its own variables
  (BatchNorm statistics) inside `amp`'s trace, which is a new trace level:
  Flax raises `TraceContextError`. That becomes a `TypeError` showing the
  split/merge form, which passes the state in and out explicitly.
  """
  if not isinstance(error, flax_errors.TraceContextError):
    return None
  return TypeError(
      "amp: the function updates a Flax NNX variable that was created "
      f"outside the amp call ({error}). amp traces the function on its own, "
      "so a module it closes over cannot update its state (e.g. BatchNorm "
      "statistics) in place. Pass the state in and out explicitly with "
      "nnx.split / nnx.merge (split off every variable type it updates, "
      "e.g. also nnx.RngState for dropout):\n\n" + _SPLIT_MERGE)
