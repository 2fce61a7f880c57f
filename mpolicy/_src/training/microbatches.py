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
from typing import Any

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


def check_batch_argnums(batch_argnums: Any, where: str):
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
  """`x` as `k` microbatches along a new leading axis, strided."""
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


def split(args: Sequence[Any], k: int, batch_argnums: tuple | None,
          names: Sequence[str] | None, where: str):
  """The batched leaves of `args` as `k` stacked microbatches.

  Args:
    args: the data arguments of the step (after params and model state).
    k: how many microbatches.
    batch_argnums: positions in `args` of the batched arguments; None for
      every argument.
    names: loss_fn's names for `args`, for messages; None if unknown.
    where: the caller, for messages.

  Returns:
    `(xs, rebuild)`: `xs` a list of arrays of shape `(k, n // k, ...)`,
    `rebuild(leaves)` the arguments with the batched leaves replaced by
    `leaves` (one microbatch's) and the others as they were.

  Raises:
    ValueError: `k` does not divide a batched leaf's leading axis, or
      `batch_argnums` names a position that is not there.
  """
  if batch_argnums is None:
    batched = range(len(args))
  else:
    bad = [i for i in batch_argnums if not -len(args) <= i < len(args)]
    if bad:
      raise ValueError(
          f"{where}: batch_argnums={batch_argnums!r} names position(s) "
          f"{bad}, but the step got {len(args)} data argument(s) after "
          "params and model state.")
    batched = sorted({i % len(args) for i in batch_argnums})
  flat, treedefs, chosen = [], [], []
  for i, arg in enumerate(args):
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(arg)
    flat.append([leaf for _, leaf in with_paths])
    treedefs.append(treedef)
    for j, (path, leaf) in enumerate(with_paths):
      if i in batched and splits(leaf):
        n = np.shape(leaf)[0]
        if n % k:
          raise ValueError(
              f"{where}: microbatches={k} does not divide the leading axis "
              f"of {_describe(i, path, names)}, of size {n} (shape "
              f"{tuple(np.shape(leaf))}). Use a batch whose size is a "
              f"multiple of {k}, or microbatches in {_divisors(n)}; if this "
              "argument is not batched, name the batched ones with "
              "batch_argnums (0-d arrays and typed PRNG keys are always "
              "passed whole).")
        chosen.append((i, j))
  xs = [_strided(flat[i][j], k) for i, j in chosen]

  def rebuild(leaves: Sequence[Any]) -> tuple:
    new = [list(f) for f in flat]
    for (i, j), leaf in zip(chosen, leaves):
      new[i][j] = leaf
    return tuple(jax.tree_util.tree_unflatten(t, f)
                 for t, f in zip(treedefs, new))

  return xs, rebuild
