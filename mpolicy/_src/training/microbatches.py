"""Splitting a batch into microbatches: strided, along the leading axis.

Microbatch `i` of `k` holds rows `i, i + k, i + 2k, ...` of every batched
array. A batch sharded along its leading axis in contiguous blocks (one per
device, each a multiple of `k` rows) then splits on every device without
communication, and microbatch `i` holds the same rows whatever the number
of devices: on each device the local rows `i, i + k, ...` are global rows
`i (mod k)`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import inspect
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any


def check_microbatches(microbatches: Any, where: str) -> int:
  """`microbatches` as an int >= 1, or a TypeError / ValueError."""
  is_int = (isinstance(microbatches, (int, np.integer))
            and not isinstance(microbatches, (bool, np.bool_)))
  if not is_int or microbatches < 1:
    raise (ValueError if is_int else TypeError)(
        f"{where}: microbatches must be a positive int (how many microbatches "
        "to split the batch into; 1 for no accumulation), got "
        f"{microbatches!r}.")
  return int(microbatches)


def check_batch_argnums(batch_argnums: Any, where: str) -> tuple | None:
  """`batch_argnums` as a tuple of ints, or None."""
  if batch_argnums is None:
    return None
  nums = ((batch_argnums,) if isinstance(batch_argnums, (int, np.integer))
          else batch_argnums)
  try:
    nums = tuple(nums)
  except TypeError:
    nums = None
  if nums is None or not all(
      isinstance(i, (int, np.integer)) and not isinstance(i, (bool, np.bool_))
      for i in nums):
    raise TypeError(
        f"{where}: batch_argnums must be None (every array argument with an "
        "axis is batched), an int or a sequence of ints (the positions, "
        "among the data arguments after params and model state, of the "
        f"batched ones), got {batch_argnums!r}.")
  return tuple(int(i) for i in nums)


def arg_names(fun: Callable[..., Any], skip: int) -> list[str] | None:
  """The names of `fun`'s positional parameters after the first `skip`."""
  try:
    params = list(inspect.signature(fun).parameters.values())
  except (TypeError, ValueError):
    return None
  if any(p.kind == p.VAR_POSITIONAL for p in params[:skip]):
    return None
  return [p.name for p in params[skip:]
          if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def _is_key(x: Any) -> bool:
  return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def splits(x: Any) -> bool:
  """Whether a leaf of a batch argument is split: an array with an axis
  that is not a typed PRNG key."""
  return (hasattr(x, "shape") and hasattr(x, "dtype") and np.ndim(x) >= 1
          and not _is_key(x))


def _strided(x: Any, k: int) -> jax.Array:
  """`x` as `k` microbatches along a new leading axis, strided.

  The values are those of optax's `microbatching.reshape_batch_axis(x,
  n // k)` (a column-major reshape), but that reshape lowers to a
  transpose of every axis on each side of the reshape, which XLA compiles
  to an extra transpose and copy of the whole batch; this one is a single
  swap of the two leading axes.
  """
  x = jnp.asarray(x)
  n = x.shape[0]
  return jnp.swapaxes(x.reshape((n // k, k) + x.shape[1:]), 0, 1)


def _divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def _describe(i: int, path: Any, names: Sequence[str] | None) -> str:
  where = f"args[{i}]{jax.tree_util.keystr(path)}"
  if names is not None and i < len(names):
    where += f" (loss_fn's `{names[i]}`)"
  return where


class Split(NamedTuple):
  """A batch split into microbatches (see `split`)."""
  xs: list[jax.Array]
  rebuild: Callable[[Sequence[Any]], tuple]
  whole: tuple[str, ...]


def split(args: Sequence[Any], kwargs: dict[str, Any], k: int,
          batch_argnums: tuple | None, names: Sequence[str] | None,
          where: str) -> Split:
  """The batched leaves of `args` as `k` stacked microbatches.

  Args:
    args: the data arguments of the step (after params and model state).
    kwargs: the step's keyword arguments (passed whole, never split).
    k: how many microbatches.
    batch_argnums: positions in `args` of the batched arguments; None for
      every argument.
    names: loss_fn's names for `args`, for messages; None if unknown.
    where: the caller, for messages.

  Returns:
    A `Split`: `xs` a list of arrays of shape `(k, n // k, ...)`,
    `rebuild(leaves)` the arguments with the batched leaves replaced by
    `leaves` (one microbatch's) and the others as they were, and `whole`
    the arrays passed whole whose leading axis is the batch's (keyword
    arguments among them), described for a message if the loss fails.

  Raises:
    ValueError: `k` does not divide a batched leaf's leading axis; the
      batched leaves do not share one leading axis; `batch_argnums` names
      a position that is not there or an argument with nothing to split; or
      `k > 1` and nothing is split at all.
  """
  batched = _batched(args, batch_argnums, where)
  flat, treedefs, chosen, whole = [], [], [], []
  for i, arg in enumerate(args):
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(arg)
    flat.append([leaf for _, leaf in with_paths])
    treedefs.append(treedef)
    for j, (path, leaf) in enumerate(with_paths):
      what = _describe(i, path, names)
      if i in batched and splits(leaf):
        _check_divides(leaf, k, what, where)
        chosen.append((i, j, what))
      elif splits(leaf):
        whole.append((what + " (not in batch_argnums)", leaf))
    if i in batched and flat[-1] and not any(c[0] == i for c in chosen):
      _nothing_to_split(i, args[i], batch_argnums, names, where)
  whole += [(f"keyword argument {name!r} (kwargs[{name!r}]"
             f"{jax.tree_util.keystr(path)}, passed whole: keyword arguments "
             "are never split)", leaf)
            for name, value in kwargs.items()
            for path, leaf in jax.tree_util.tree_flatten_with_path(value)[0]
            if splits(leaf)]
  n = _batch_size([(what, flat[i][j]) for i, j, what in chosen], k, whole,
                  batch_argnums, where)
  xs = [_strided(flat[i][j], k) for i, j, _ in chosen]

  def rebuild(leaves: Sequence[Any]) -> tuple:
    new = [list(f) for f in flat]
    for (i, j, _), leaf in zip(chosen, leaves):
      new[i][j] = leaf
    return tuple(jax.tree_util.tree_unflatten(t, f)
                 for t, f in zip(treedefs, new))

  return Split(xs, rebuild, tuple(
      f"{what} has leading axis {n}, the batch's" for what, leaf in whole
      if np.shape(leaf)[0] == n))


def _batched(args: Sequence[Any], batch_argnums: tuple | None,
             where: str) -> Sequence[int]:
  """The positions of the batched arguments among `args`."""
  if batch_argnums is None:
    return range(len(args))
  bad = [i for i in batch_argnums if not -len(args) <= i < len(args)]
  if bad:
    raise ValueError(
        f"{where}: batch_argnums={batch_argnums!r} names position(s) "
        f"{bad}, but the step got {len(args)} data argument(s) after "
        "params and model state.")
  return sorted({i % len(args) for i in batch_argnums})


def _check_divides(leaf: Any, k: int, what: str, where: str) -> None:
  n = np.shape(leaf)[0]
  if n % k:
    raise ValueError(
        f"{where}: microbatches={k} does not divide the leading axis "
        f"of {what}, of size {n} (shape {tuple(np.shape(leaf))}). Use a "
        f"batch whose size is a multiple of {k}, or microbatches in "
        f"{_divisors(n)}; if this argument is not batched, name the batched "
        "ones with batch_argnums (0-d arrays and typed PRNG keys are always "
        "passed whole).")


def _nothing_to_split(i: int, arg: Any, batch_argnums: tuple | None,
                      names: Sequence[str] | None, where: str) -> None:
  """Raises for a batched argument that holds leaves but no array with an
  axis: most often `batch_argnums` counted from the wrong place."""
  if batch_argnums is None:
    return
  leaves = jax.tree_util.tree_leaves(arg)
  got = ", ".join(_leaf_desc(x) for x in leaves[:3]) + (
      ", ..." if len(leaves) > 3 else "")
  raise ValueError(
      f"{where}: batch_argnums={batch_argnums!r} names "
      f"{_describe(i, (), names)} as batched, but it holds no array with an "
      f"axis to split ({got}). batch_argnums counts the data arguments after "
      "params (and model state): 0 is the first argument after them. Name "
      "the arguments whose leading axis is the batch.")


def _batch_size(chosen: list[tuple[str, Any]], k: int,
                whole: list[tuple[str, Any]], batch_argnums: tuple | None,
                where: str) -> int | None:
  """The leading axis the split leaves share (None if none is split)."""
  sizes = [np.shape(leaf)[0] for _, leaf in chosen]
  if not sizes:
    if k > 1:
      shown = "; ".join(f"{w}: {_leaf_desc(x)}" for w, x in whole[:4])
      raise ValueError(
          f"{where}: microbatches={k}, but no array is split: no batched "
          "positional data argument holds an array with an axis (0-d arrays "
          "and typed PRNG keys are passed whole, and so are keyword "
          "arguments)" + (f"; passed whole: {shown}" if shown else "")
          + ". Pass the batch positionally, after params (and model state).")
    return None
  n = max(set(sizes), key=sizes.count)
  odd = [(w, x) for w, x in chosen if np.shape(x)[0] != n]
  if odd and k > 1:
    shown = "; ".join(f"{w}: leading axis {np.shape(x)[0]} (shape "
                      f"{tuple(np.shape(x))})" for w, x in odd[:4])
    raise ValueError(
        f"{where}: the batched arrays must share their leading axis (the "
        f"batch, {n} here), so that microbatch i holds the same examples of "
        f"each; but {shown}. "
        + ("batch_argnums is None, so every array argument with an axis is "
           "split: name the batched ones with batch_argnums (positions among"
           " the data arguments after params and model state)."
           if batch_argnums is None else
           f"batch_argnums={batch_argnums!r} counts the data arguments after "
           "params (and model state), 0 for the first: is it off by one?"))
  return n


def _leaf_desc(x: Any) -> str:
  dtype = getattr(x, "dtype", None)
  if dtype is None:
    return type(x).__name__
  if _is_key(x):
    return f"a PRNG key{list(np.shape(x))}"
  return f"{np.dtype(dtype).name}{list(np.shape(x))}"
