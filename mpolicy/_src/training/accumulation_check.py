"""Checking a step's gradient accumulation on your own model and devices.

`check_accumulation` runs one training step on one batch several ways (at
several `microbatches`, and with the batch sharded over the devices where
there are several) and compares every leaf of what each returns with the
one-device, one-batch step, in units in the last place (ulps) of the
leaf's dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import dataclasses
from typing import Any

import jax
import numpy as np

from mpolicy._src.training import attribution
from mpolicy._src.training import microbatches as microbatches_lib

PyTree = Any


def ulp_distance(a: Any, b: Any) -> float:
  """How far `a` is from `b`, in ulps of the dtype at `b`'s largest element.

  The largest difference over the elements, divided by the spacing of the
  dtype at the largest magnitude in `a` or `b` (one ulp there): an element
  that is 0 in one array and 1e-9 in the other counts as the tiny
  difference it is next to the leaf's other values, not as the billions of
  ulps between 0 and 1e-9. Both must have one dtype and shape (else `inf`);
  NaN where the other is not counts as `inf`. Integer and bool arrays count
  the difference itself; typed PRNG keys 0 if equal, else `inf`.
  """
  a, b = np.asarray(_key_data(a)), np.asarray(_key_data(b))
  if a.shape != b.shape or a.dtype != b.dtype:
    return float("inf")
  if a.size == 0:
    return 0.0
  if np.issubdtype(a.dtype, np.complexfloating):
    return max(ulp_distance(a.real, b.real), ulp_distance(a.imag, b.imag))
  x, y = a.astype(np.float64), b.astype(np.float64)
  if a.dtype == np.bool_ or np.issubdtype(a.dtype, np.integer):
    return float(np.max(np.abs(x - y)))
  nan_x, nan_y = np.isnan(x), np.isnan(y)
  if np.any(nan_x != nan_y):
    return float("inf")
  same = (x == y) | nan_x
  if np.all(same):
    return 0.0
  diff = np.max(np.where(same, 0.0, np.abs(x - y)))
  if not np.isfinite(diff):
    return float("inf")
  largest = np.max(np.where(nan_x, 0.0, np.maximum(np.abs(x), np.abs(y))))
  return float(diff / _ulp(largest, a.dtype))


def _ulp(magnitude: float, dtype: Any) -> float:
  """The spacing of `dtype` at `magnitude` (its smallest at 0)."""
  info = jax.numpy.finfo(dtype)
  tiny = float(info.smallest_subnormal)
  if magnitude <= float(info.smallest_normal):
    return tiny
  return max(2.0 ** (np.floor(np.log2(magnitude)) - info.nmant), tiny)


def _key_data(x: Any) -> Any:
  if hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype,
                                                    jax.dtypes.prng_key):
    return jax.random.key_data(x)
  return x


@dataclasses.dataclass(frozen=True)
class AccumulationCheck:
  """What `check_accumulation` found.

  Attributes:
    runs: the labels of the runs compared with the reference (`"k=8"`,
      `"8 devices, k=1"`, ...), in order.
    leaves: `(path, dtype)` of each leaf compared: `params/...`,
      `opt_state/...`, `model_state/...`, `value/...`, `loss_scale/...`.
    ulps: `ulps[run][path]`, the largest difference between the run's
      leaf and the reference's, in ulps of the leaf's dtype at its largest
      element (see `ulp_distance`).
    finite: `finite[run]`, whether that run's step was applied (the
      reference's under `"reference"`).
    reference: the reference run's label.
  """
  runs: tuple[str, ...]
  leaves: tuple[tuple[str, str], ...]
  ulps: dict[str, dict[str, float]]
  finite: dict[str, bool]
  reference: str

  def max_ulps(self, run: str | None = None, prefix: str = "") -> float:
    """The largest distance over the leaves whose path starts with
    `prefix`, in one run or (None) in all of them."""
    runs = self.runs if run is None else (run,)
    return max((u for r in runs for path, u in self.ulps[r].items()
                if path.startswith(prefix)), default=0.0)

  def __str__(self) -> str:
    head = (f"Each leaf against {self.reference}: the largest difference, "
            "in ulps of the leaf's dtype at its largest element.")
    cols = "| leaf | dtype | " + " | ".join(self.runs) + " |"
    rule = "|---|---|" + "---|" * len(self.runs)
    rows = [f"| {path} | {dtype} | " + " | ".join(
        _show(self.ulps[r][path]) for r in self.runs) + " |"
            for path, dtype in self.leaves]
    skipped = [r for r in ("reference", *self.runs) if not self.finite[r]]
    tail = ([f"Not finite (step skipped): {', '.join(skipped)}."]
            if skipped else [])
    return "\n".join([head, cols, rule, *rows, *tail])


def _show(u: float) -> str:
  return "inf" if u == float("inf") else f"{u:.3g}"


def _flat(result: Any) -> list[tuple[str, Any]]:
  """`(path, leaf)` of what a step returns that a check compares."""
  out = []
  for name in ("params", "opt_state", "model_state", "value", "loss_scale"):
    tree = getattr(result, name, None)
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
      out.append(("/".join([name] + ([attribution.path_str(path)]
                                     if path else [])), leaf))
  return out


def _replicated(tree: PyTree, sharding: Any) -> PyTree:
  return jax.tree_util.tree_map(lambda x: jax.device_put(x, sharding), tree)


def _sharded_batch(args: Sequence[Any], mesh: Any, n: int) -> tuple:
  """Each array with an axis divisible by `n` split along it over `mesh`."""
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
  split, whole = NamedSharding(mesh, P("batch")), NamedSharding(mesh, P())

  def place(x):
    if microbatches_lib.splits(x) and np.shape(x)[0] % n == 0:
      return jax.device_put(x, split)
    return jax.device_put(x, whole) if hasattr(x, "shape") else x
  return tuple(jax.tree_util.tree_map(place, a) for a in args)


def check_accumulation(
    make_step: Callable[[int], Callable[..., Any]],
    *step_args: Any,
    microbatches: Sequence[int] = (2, 8),
    devices: Sequence[Any] | None = None,
    **step_kwargs: Any,
) -> AccumulationCheck:
  """Runs a training step at several `microbatches` and compares, leaf by leaf.

  Builds `make_step(1)` and `make_step(k)` for each `k` in `microbatches`,
  jits each, runs it once on `step_args` (the arguments of one step: params,
  [model state,] optimizer state, loss scale and one batch), and compares
  every leaf of the result (params, optimizer state, model state, value,
  loss scale) with the one-device `make_step(1)` run, in units in the last
  place of the leaf's dtype. With several devices (all of
  `jax.devices()` by default; pass `devices=()` for none) it runs each `k`
  again, and `k=1`, under `jax.jit` with the batch sharded along its
  leading axis over them (a 1-D mesh; params and state replicated), so
  `make_step` must then build a step for `jax.jit` (no `axis_name`).

  What to expect: float32 leaves within a few ulps (the order of the sums
  changes), half-precision compute within its own rounding, a step skipped
  in one run and applied in another as `inf`. Integer leaves (step counts)
  should match exactly.

  Args:
    make_step: `make_step(k)` returns the step to check at `microbatches=k`,
      e.g. `lambda k: make_train_step(loss_fn, tx, microbatches=k)`.
    *step_args: the step's positional arguments, with one batch.
    microbatches: the `k`s to compare with `k=1`; each must divide the
      batch.
    devices: the devices to shard the batch over; None for all, if there
      are more than one.
    **step_kwargs: the step's keyword arguments (passed whole).

  Returns:
    An `AccumulationCheck`: `str()` of it is a table, leaves by runs;
    `max_ulps()` the largest distance.

  >>> import jax.numpy as jnp, optax, mpolicy
  >>> loss_fn = lambda p, x, y: jnp.mean((x @ p["w"] - y) ** 2)
  >>> tx = optax.adam(1e-3)
  >>> params = {"w": jnp.zeros((3, 1))}
  >>> x, y = jnp.linspace(0.1, 1., 24).reshape(8, 3), jnp.ones((8, 1))
  >>> check = mpolicy.check_accumulation(
  ...     lambda k: mpolicy.make_train_step(loss_fn, tx, microbatches=k),
  ...     params, tx.init(params), mpolicy.NoOpLossScale(), x, y,
  ...     microbatches=(2, 4))
  >>> check.runs, check.max_ulps("k=4", "params") <= 4
  (('k=2', 'k=4'), True)

  See also: `make_train_step` (`microbatches=`), `TrainStepResult`.
  """
  microbatches = tuple(microbatches_lib.check_microbatches(
      k, "check_accumulation") for k in microbatches)
  batch_at = _batch_start(step_args)
  if devices is None:
    devices = jax.devices() if jax.device_count() > 1 else ()
  devices = tuple(devices)

  def run(k, args):
    return jax.jit(make_step(k))(*args, **step_kwargs)

  results = {"reference": run(1, step_args)}
  results.update({f"k={k}": run(k, step_args) for k in microbatches})
  if len(devices) > 1:
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
    mesh, n = Mesh(np.array(devices), ("batch",)), len(devices)
    # What comes before the batch (params, state, loss scale) is replicated.
    args = (_replicated(step_args[:batch_at], NamedSharding(mesh, P()))
            + _sharded_batch(step_args[batch_at:], mesh, n))
    for k in (1, *microbatches):
      results[f"{n} devices, k={k}"] = run(k, args)
  reference = _flat(results["reference"])
  runs = tuple(results)[1:]
  ulps = {r: {path: ulp_distance(mine, ref) for (path, mine), (_, ref)
              in zip(_flat(results[r]), reference)} for r in runs}
  finite = {r: bool(np.all(np.asarray(res.grads_finite)))
            for r, res in results.items()}
  return AccumulationCheck(
      runs=runs,
      leaves=tuple((path, str(np.asarray(_key_data(leaf)).dtype))
                   for path, leaf in reference),
      ulps=ulps, finite=finite, reference="k=1 on one device")


def _batch_start(step_args: Sequence[Any]) -> int:
  """Where the batch starts in a step's arguments: after the loss scale."""
  from mpolicy._src import loss_scale as loss_scale_lib  # pylint: disable=g-import-not-at-top
  kinds = (loss_scale_lib.NoOpLossScale, loss_scale_lib.StaticLossScale,
           loss_scale_lib.DynamicLossScale)
  for i, arg in enumerate(step_args):
    if isinstance(arg, kinds) or hasattr(arg, "adjust"):
      return i + 1
  raise ValueError(
      "check_accumulation: found no loss scale among the step's arguments "
      "(params, [model_state,] opt_state, loss_scale, *batch): pass one, "
      "e.g. mpolicy.NoOpLossScale().")
