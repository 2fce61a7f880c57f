"""Loss scaling: keep small half-precision gradients from flushing to zero.

Three immutable loss scales with one interface (`loss_scale`, `scale`,
`unscale`, `adjust`), each a pytree, plus `all_finite` and `select_tree`.
Scaling runs in float32 or wider and returns each leaf in its own dtype
(float8 included), so a scale that a float16 cannot hold still unscales
float16 gradients, and a value that overflows its leaf's dtype is never
saturated to a finite one (`loss_scale_ops`); constructors reject values
that would silently lose gradients (zero, negative, inf or nan scales, a
floor above the scale: `loss_scale_checks`).

>>> import jax.numpy as jnp
>>> ls = DynamicLossScale(jnp.float32(2. ** 15))
>>> grads = ls.unscale(ls.scale({"w": jnp.ones(2, jnp.float16)}))
>>> grads["w"].dtype, bool(all_finite(grads))
(dtype('float16'), True)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, TypeVar, Union
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from mpolicy._src import arguments
from mpolicy._src import loss_scale_checks as checks
from mpolicy._src import loss_scale_ops as ops

# The arithmetic and the checks live in their own modules; these names are
# part of this module's interface (`all_finite`, `select_tree` are public).
all_finite = ops.all_finite
select_tree = ops.select_tree
_cast_narrow = ops.cast_narrow

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class NoOpLossScale:
  """A loss scale that does nothing: `scale` and `unscale` return the tree.

  For code that takes a loss scale but runs without one (float32 or
  bfloat16 training). An empty pytree; `loss_scale` is 1.

  >>> NoOpLossScale().scale({"loss": 2.0})
  {'loss': 2.0}

  See also: `StaticLossScale`, `DynamicLossScale`.
  """

  @property
  def loss_scale(self) -> int:
    return 1

  def scale(self, tree: T) -> T:
    """Returns `tree` itself."""
    return tree

  def unscale(self, tree: T) -> T:
    """Returns `tree` itself."""
    return tree

  def adjust(self, grads_finite: Any) -> NoOpLossScale:
    """Returns `self`."""
    del grads_finite
    return self


class _StaticValue:
  """Hashable pytree metadata holding a concrete number or array."""

  __slots__ = ("value", "_key")

  def __init__(self, value):
    self.value = value
    try:
      a = np.asarray(value)
      self._key = (a.dtype.str, a.shape, a.tobytes())
    except Exception:  # pylint: disable=broad-except  # A tracer: by identity.
      self._key = ("id", id(value))

  def __eq__(self, other):
    return isinstance(other, _StaticValue) and self._key == other._key

  def __hash__(self):
    return hash(self._key)


@dataclasses.dataclass(frozen=True)
class StaticLossScale:
  """Scales by a fixed `loss_scale` and unscales by its inverse.

  An empty pytree: the scale is static metadata, so a jitted step retraces
  when it changes. `scale` and `unscale` multiply/divide the floating leaves
  (arrays, numpy scalars, Python floats) and return arrays in each leaf's
  own dtype; integer and other leaves pass through unchanged. The
  arithmetic runs in float32 (or wider), so a scale beyond the leaf dtype's
  range (2 ** 17 for float16) still unscales float16 gradients correctly;
  the result is rounded to nearest in the leaf's dtype, and only a true
  overflow of that dtype is non-finite: inf, or nan in float8_e4m3fn (which
  has no inf), never its largest finite value, so `all_finite` sees it.

  Args:
    loss_scale: a non-negative, finite scalar (a Python number or a scalar
      array); 0, which jmp accepts, warns: it erases every gradient.

  Raises:
    TypeError, ValueError: `loss_scale` is not such a number; the message
      names it.

  >>> import jax.numpy as jnp
  >>> StaticLossScale(128.).unscale({"g": jnp.full(2, 256., jnp.bfloat16)})["g"]
  Array([2, 2], dtype=bfloat16)

  See also: `DynamicLossScale`, `NoOpLossScale`.
  """
  loss_scale: Any

  def __post_init__(self):
    value = checks.check_positive_number("StaticLossScale", "loss_scale",
                                         self.loss_scale, zero_ok=True)
    if value is not None and not np.any(value):
      warnings.warn(
          "StaticLossScale(0) scales every gradient to zero, and unscaling "
          "them gives nan: no step will be finite. Accepted as jmp accepts "
          "it; use NoOpLossScale() for no scaling.", stacklevel=3)

  def scale(self, tree: T) -> T:
    """Multiplies the floating leaves of `tree` by `loss_scale`."""
    return ops.scale(tree, self.loss_scale, "StaticLossScale.scale")

  def unscale(self, tree: T) -> T:
    """Divides the floating leaves of `tree` by `loss_scale`."""
    return ops.unscale(tree, self.loss_scale, "StaticLossScale.unscale")

  def adjust(self, grads_finite: Any) -> StaticLossScale:
    """Returns `self`: a static scale never changes."""
    del grads_finite
    return self


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
  """A loss scale that grows while gradients stay finite and backs off if not.

  `adjust(grads_finite)` returns the next scale: after `period` consecutive
  finite steps the scale is multiplied by `factor`, unless that would
  overflow the scale's dtype (then it stays); on a non-finite step it is
  divided by `factor` but never goes below `min_loss_scale` (and never
  rises: a scale already below the floor stays where it is), and the count
  restarts. `counter` counts finite steps since the last change, and the
  growth happens on the step where it would reach `period`.

  Pytree leaves are `loss_scale` and `counter`, always strongly typed JAX
  arrays: Python numbers become float32 / int32, and `adjust` keeps their
  dtypes, so a jitted step taking the loss scale compiles once. `period`,
  `factor` and `min_loss_scale` are static metadata that survive
  flattening. `scale` and `unscale` compute in float32 (or wider) and
  return floating leaves in their own dtype, so a scale such as 2 ** 20
  unscales float16 gradients correctly; integer and other leaves pass
  through. A result beyond the leaf dtype's range is inf (nan in
  float8_e4m3fn, which has no inf), never saturated, so the step shows as
  not finite and the scale backs off: a float8_e5m2 gradient of 4 scaled
  by 2 ** 15 overflows (its largest value is 57344).

  Args:
    loss_scale: the initial scale: a positive, finite number of any float
      dtype (float16, bfloat16, ...) or an integer dtype (with a warning:
      backing off rounds down). A stack of scalars (one per device or model,
      with `counter` alike) may be mapped over with `vmap` or `pmap`;
      `scale` and `unscale` need a scalar one.
    counter: finite steps since the last change, a non-negative int.
    period: finite steps before the scale grows, a positive int that the
      counter's dtype holds (at most 2 ** 31 - 1 for int32).
    factor: what the scale is multiplied and divided by, a finite number > 1.
    min_loss_scale: the floor for backing off, non-negative, finite and at
      most `loss_scale` (and >= 1 for an integer scale). The scale also never
      backs off below its dtype's smallest normal number (6.1e-05 for
      float16, 1.2e-38 for float32 and bfloat16), so it never reaches 0;
      a floor of 0, as jmp allows, means that one alone.

  Raises:
    TypeError, ValueError: a concrete argument breaks the rules above (traced
      values pass unchecked); the message names it.

  >>> import jax.numpy as jnp
  >>> ls = DynamicLossScale(2. ** 15, period=2)
  >>> ls = ls.adjust(jnp.bool_(True)).adjust(jnp.bool_(True))
  >>> float(ls.loss_scale), int(ls.counter)
  (65536.0, 0)
  >>> float(ls.adjust(jnp.bool_(False)).loss_scale)
  32768.0

  See also: `all_finite`, `select_tree`, `StaticLossScale`.
  """
  loss_scale: jax.Array
  counter: jax.Array | int = 0
  period: int = 2000
  factor: int | float = 2
  min_loss_scale: Any = 1.0

  def __post_init__(self):
    # Only the public constructor validates; unflattening bypasses it, so
    # placeholders (None, object(), tracers) from JAX pass through untouched.
    cls = "DynamicLossScale"
    scale = checks.check_positive_number(cls, "loss_scale", self.loss_scale,
                                         scalar=False)
    checks.check_counter(self.counter)
    if checks.concrete(self.min_loss_scale) is None:
      raise TypeError(f"{cls}: min_loss_scale is static pytree metadata and "
                      "must be a concrete number, got a traced value.")
    floor = checks.check_positive_number(cls, "min_loss_scale",
                                         self.min_loss_scale, zero_ok=True)
    period = checks.check_period(self.period)
    factor = checks.check_factor(self.factor)
    if scale is not None and np.any(scale < floor):
      raise ValueError(
          f"{cls}: min_loss_scale ({self.min_loss_scale!r}) must not exceed "
          f"loss_scale ({self.loss_scale!r}): it is the floor the scale backs "
          "off to. Lower min_loss_scale or start from a larger loss_scale.")
    dtype = getattr(self.loss_scale, "dtype", None)
    if (dtype is not None and jnp.issubdtype(dtype, jnp.integer)
        and floor < 1):
      raise ValueError(
          f"{cls}: with an integer loss_scale ({dtype}), min_loss_scale must "
          f"be >= 1, got {self.min_loss_scale!r}: backing off rounds down, "
          "and a scale of 0 would make unscaled gradients inf.")
    checks.warn_if_not_floating(self.loss_scale, "loss_scale")
    checks.warn_if_not_floating(self.min_loss_scale, "min_loss_scale")
    set_ = functools.partial(object.__setattr__, self)
    set_("loss_scale", checks.strong_array(self.loss_scale, jnp.float32))
    set_("counter", checks.strong_array(self.counter, jnp.int32))
    counter_max = int(jnp.iinfo(jnp.result_type(self.counter)).max)
    if period > counter_max:
      raise ValueError(
          f"{cls}: period ({period}) must fit the counter's dtype "
          f"({jnp.result_type(self.counter)}, at most {counter_max}): the "
          "counter counts up to it. Use a smaller period (2000 is usual) or "
          "an int64 counter under jax_enable_x64.")
    set_("period", period)
    set_("factor", factor)
    if not isinstance(self.min_loss_scale, (int, float, np.generic)):
      set_("min_loss_scale", floor[()])

  def tree_flatten(self) -> tuple[tuple, tuple]:
    return ((self.loss_scale, self.counter),
            (self.period, self.factor, self.min_loss_scale))

  @classmethod
  def tree_unflatten(cls, aux: tuple, children: tuple) -> DynamicLossScale:
    obj = object.__new__(cls)
    for name, value in zip(("loss_scale", "counter"), children):
      object.__setattr__(obj, name, value)
    for name, value in zip(("period", "factor", "min_loss_scale"), aux):
      object.__setattr__(obj, name, value)
    return obj

  def scale(self, tree: T) -> T:
    """Multiplies the floating leaves of `tree` by `loss_scale`."""
    return ops.scale(tree, self.loss_scale, "DynamicLossScale.scale")

  def unscale(self, tree: T) -> T:
    """Divides the floating leaves of `tree` by `loss_scale`."""
    return ops.unscale(tree, self.loss_scale, "DynamicLossScale.unscale")

  def adjust(self, grads_finite: Any) -> DynamicLossScale:
    """The next loss scale, given whether this step's gradients were finite.

    Args:
      grads_finite: a boolean scalar, e.g. from `all_finite(grads)`.

    Returns:
      A new `DynamicLossScale` with the same dtypes. On a non-finite step
      the scale never goes up, whatever `min_loss_scale` says.

    Raises:
      AssertionError: `grads_finite` is not a boolean scalar.

    >>> import jax.numpy as jnp
    >>> ls = DynamicLossScale(jnp.float16(2. ** 15), period=1)
    >>> float(ls.adjust(jnp.bool_(True)).loss_scale)  # 2 ** 16 is inf in f16.
    32768.0

    See also: `all_finite` to compute `grads_finite`.
    """
    grads_finite = ops.require_scalar_bool(grads_finite, "grads_finite")
    dtype = jnp.result_type(self.loss_scale)
    work = (ops.work_dtype(dtype) if jnp.issubdtype(dtype, jnp.floating)
            else jnp.float32)
    scale = jnp.asarray(self.loss_scale).astype(work)

    grown = scale * self.factor
    if jnp.issubdtype(dtype, jnp.floating):
      grown_fits = jnp.isfinite(ops.cast_narrow(grown, dtype))
    else:
      grown_fits = grown < float(jnp.iinfo(dtype).max) + 1
    grow = self.counter >= self.period - 1
    finite_scale = jnp.where(grow & grown_fits, grown, scale)
    floor = jnp.asarray(self.min_loss_scale).astype(work)
    if jnp.issubdtype(dtype, jnp.floating):
      # Never below the dtype's smallest normal number: a scale that
      # underflows to 0 (or whose reciprocal overflows) makes every
      # unscaled gradient inf, forever. A floor of 0 means no other floor.
      floor = jnp.maximum(floor, jnp.asarray(jnp.finfo(dtype).tiny, work))
    floor = jnp.minimum(floor, scale)
    backed_off = jnp.maximum(scale / self.factor, floor)
    loss_scale = jnp.where(grads_finite, finite_scale, backed_off)

    counter = jnp.asarray(self.counter)
    counter = jnp.where(grads_finite & ~grow, counter + 1,
                        jnp.zeros_like(counter)).astype(counter.dtype)
    # Rebuild without the constructor: the leaves are already arrays of the
    # right dtypes, and an integer scale should warn once, not every step.
    return self.tree_unflatten(self.tree_flatten()[1],
                               (loss_scale.astype(dtype), counter))


def _static_flatten(ls: StaticLossScale):
  return (), _StaticValue(ls.loss_scale)


def _static_unflatten(aux: _StaticValue, children) -> StaticLossScale:
  del children
  obj = object.__new__(StaticLossScale)  # Checked when first constructed.
  object.__setattr__(obj, "loss_scale", aux.value)
  return obj


jax.tree_util.register_pytree_node(
    NoOpLossScale, lambda ls: ((), None), lambda aux, children: NoOpLossScale())
jax.tree_util.register_pytree_node(
    StaticLossScale, _static_flatten, _static_unflatten)
jax.tree_util.register_pytree_node_class(DynamicLossScale)

LossScale = Union[NoOpLossScale, StaticLossScale, DynamicLossScale]


def require_loss_scale(x: Any, who: str, call: str) -> None:
  """Raises a `TypeError` unless ``x`` is a loss scale.

  A loss scale is one of the three classes, or any object with their
  `scale`, `unscale` and `adjust` methods (such as jmp's). A number or an
  array is not: the message says which class holds it. Anything else is
  most often a forgotten loss scale (the arguments shifted by one).

  Args:
    x: what was passed as the loss scale.
    who: the function that got it, e.g. ``"scaled_value_and_grad"``.
    call: how the function is called, e.g. ``"g(loss_scale, *args)"``.

  >>> require_loss_scale(2. ** 15, "step", "step(loss_scale, x)")
  Traceback (most recent call last):
  ...
  TypeError: step: loss_scale must be a loss scale (mpolicy.NoOpLossScale(), StaticLossScale(value) or DynamicLossScale(value)), got 32768.0 (float); call it as step(loss_scale, x). To scale by this number, pass StaticLossScale(32768.0), or DynamicLossScale(32768.0) to adjust it as training goes.
  """
  if all(callable(getattr(x, m, None)) for m in ("scale", "unscale", "adjust")):
    return
  if isinstance(x, (int, float, np.generic)) and not isinstance(x, bool):
    hint = (f" To scale by this number, pass StaticLossScale({x!r}), or "
            f"DynamicLossScale({x!r}) to adjust it as training goes.")
  elif getattr(x, "dtype", None) is not None and np.ndim(x) == 0:
    hint = (" To scale by this number, wrap it: StaticLossScale(x), or "
            "DynamicLossScale(x) to adjust it as training goes.")
  else:
    hint = (" Was the loss scale left out? It comes before the other "
            "arguments; pass NoOpLossScale() for no scaling.")
  raise TypeError(
      f"{who}: loss_scale must be a loss scale (mpolicy.NoOpLossScale(), "
      "StaticLossScale(value) or DynamicLossScale(value)), got "
      f"{arguments.describe(x)}; call it as {call}.{hint}")
