"""Loss scaling: keep small half-precision gradients from flushing to zero.

Three immutable loss scales with one interface (`loss_scale`, `scale`,
`unscale`, `adjust`), each a pytree, plus `all_finite` and `select_tree`.
Compatible with jmp; fixes jmp's dropped `min_loss_scale`, its crash on
half or integer scales, and its dtype-promoting `unscale`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, TypeVar, Union
import warnings

import jax
import jax.numpy as jnp
import numpy as np

T = TypeVar("T")


def _is_floating_leaf(x: Any) -> bool:
  if isinstance(x, bool):
    return False
  if isinstance(x, float):
    return True
  dtype = getattr(x, "dtype", None)
  return dtype is not None and jnp.issubdtype(dtype, jnp.floating)


def _map_floating(fn, tree: T) -> T:
  """Applies `fn` to floating leaves, keeping each array leaf's dtype."""

  def apply(x):
    if not _is_floating_leaf(x):
      return x
    y = fn(x)
    dtype = getattr(x, "dtype", None)
    return y if dtype is None else y.astype(dtype)

  return jax.tree_util.tree_map(apply, tree)


def _scale(tree: T, loss_scale: Any) -> T:
  return _map_floating(lambda x: x * loss_scale, tree)


def _unscale(tree: T, loss_scale: Any) -> T:
  return _map_floating(lambda x: x / loss_scale, tree)


def _require_scalar_bool(pred: Any, name: str) -> jax.Array:
  pred = jnp.asarray(pred)
  if pred.ndim != 0 or pred.dtype != jnp.bool_:
    # AssertionError, as jmp raises it, but raised even under `python -O`.
    raise AssertionError(f"{name}: expected boolean scalar, got "
                         f"{pred.dtype} of shape {pred.shape}.")
  return pred


@dataclasses.dataclass(frozen=True)
class NoOpLossScale:
  """A loss scale that does nothing: `scale` and `unscale` return the tree.

  An empty pytree.

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

  An empty pytree, as in jmp: the scale is static metadata, so a jitted step
  retraces when it changes. `scale` and `unscale` multiply/divide the
  floating leaves (arrays, numpy scalars, Python floats) and return arrays
  in each leaf's own dtype; integer and other leaves pass through unchanged.

  >>> import jax.numpy as jnp
  >>> StaticLossScale(128.).unscale({"g": jnp.full(2, 256., jnp.bfloat16)})["g"]
  Array([2, 2], dtype=bfloat16)

  See also: `DynamicLossScale`, `NoOpLossScale`.
  """
  loss_scale: Any

  def scale(self, tree: T) -> T:
    """Multiplies the floating leaves of `tree` by `loss_scale`."""
    return _scale(tree, self.loss_scale)

  def unscale(self, tree: T) -> T:
    """Divides the floating leaves of `tree` by `loss_scale`."""
    return _unscale(tree, self.loss_scale)

  def adjust(self, grads_finite: Any) -> StaticLossScale:
    """Returns `self`: a static scale never changes."""
    del grads_finite
    return self


def _strong_array(x: Any, default_dtype: Any) -> jax.Array:
  """`x` as a strongly typed JAX array; Python numbers get `default_dtype`."""
  if isinstance(x, (bool, int, float)):
    return jnp.asarray(x, default_dtype)
  x = jnp.asarray(x)
  if getattr(x, "weak_type", False):
    x = jax.lax.convert_element_type(x, x.dtype)  # Drops the weak type.
  return x


def _static_number(x: Any, name: str) -> Any:
  if isinstance(x, (int, float, np.generic)):
    return x
  try:
    return np.asarray(x)[()]
  except Exception as e:
    raise TypeError(f"DynamicLossScale.{name} is static pytree metadata and "
                    f"must be a concrete number, got {x!r}.") from e


def _warn_if_not_floating(x: Any, name: str) -> None:
  dtype = getattr(x, "dtype", None)
  if dtype is not None and not jnp.issubdtype(dtype, jnp.floating):
    warnings.warn(f"Expected floating type for {name}, got {dtype}; it works, "
                  "but backing off rounds down to whole numbers.", stacklevel=3)


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
  """A loss scale that grows while gradients stay finite and backs off if not.

  `adjust(grads_finite)` returns the next scale: after `period` consecutive
  finite steps the scale is multiplied by `factor`, unless that would
  overflow the scale's dtype (then it stays); on a non-finite step it is
  divided by `factor` but never goes below `min_loss_scale`, and the count
  restarts. As in jmp, `counter` counts finite steps since the last change,
  and the growth happens on the step where it would reach `period`.

  Pytree leaves are `loss_scale` and `counter` (as jmp's), always strongly
  typed JAX arrays: Python numbers become float32 / int32, and `adjust` keeps
  their dtypes, so a jitted step taking the loss scale compiles once.
  `period`, `factor` and `min_loss_scale` are static metadata that survive
  flattening (jmp loses `min_loss_scale` there). The scale may be any float
  dtype (float16, bfloat16, ...) or an integer dtype (with a warning, as in
  jmp). `scale` and `unscale` return floating leaves in their own dtype and
  pass integer and other leaves through unchanged.

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
  counter: jax.Array = 0
  period: int = 2000
  factor: int | float = 2
  min_loss_scale: Any = 1.0

  def __post_init__(self):
    # Only the public constructor validates; unflattening bypasses it, so
    # placeholders (None, object(), tracers) from JAX pass through untouched.
    _warn_if_not_floating(self.loss_scale, "loss_scale")
    _warn_if_not_floating(self.min_loss_scale, "min_loss_scale")
    set_ = functools.partial(object.__setattr__, self)
    set_("loss_scale", _strong_array(self.loss_scale, jnp.float32))
    set_("counter", _strong_array(self.counter, jnp.int32))
    set_("period", _static_number(self.period, "period"))
    set_("factor", _static_number(self.factor, "factor"))
    set_("min_loss_scale",
         _static_number(self.min_loss_scale, "min_loss_scale"))
    if not self.period >= 1:
      raise ValueError(f"period must be >= 1, got {self.period}.")
    if not self.factor >= 1:
      raise ValueError(f"factor must be >= 1, got {self.factor}.")

  def tree_flatten(self):
    return ((self.loss_scale, self.counter),
            (self.period, self.factor, self.min_loss_scale))

  @classmethod
  def tree_unflatten(cls, aux, children) -> DynamicLossScale:
    obj = object.__new__(cls)
    for name, value in zip(("loss_scale", "counter"), children):
      object.__setattr__(obj, name, value)
    for name, value in zip(("period", "factor", "min_loss_scale"), aux):
      object.__setattr__(obj, name, value)
    return obj

  def scale(self, tree: T) -> T:
    """Multiplies the floating leaves of `tree` by `loss_scale`."""
    return _scale(tree, self.loss_scale)

  def unscale(self, tree: T) -> T:
    """Divides the floating leaves of `tree` by `loss_scale`."""
    return _unscale(tree, self.loss_scale)

  def adjust(self, grads_finite: Any) -> DynamicLossScale:
    """The next loss scale, given whether this step's gradients were finite.

    >>> import jax.numpy as jnp
    >>> ls = DynamicLossScale(jnp.float16(2. ** 15), period=1)
    >>> float(ls.adjust(jnp.bool_(True)).loss_scale)  # 2 ** 16 is inf in f16.
    32768.0

    See also: `all_finite` to compute `grads_finite`.
    """
    grads_finite = _require_scalar_bool(grads_finite, "grads_finite")
    dtype = jnp.result_type(self.loss_scale)
    work = (jnp.promote_types(dtype, jnp.float32)
            if jnp.issubdtype(dtype, jnp.floating) else jnp.float32)
    scale = jnp.asarray(self.loss_scale).astype(work)

    grown = scale * self.factor
    if jnp.issubdtype(dtype, jnp.floating):
      grown_fits = jnp.isfinite(grown.astype(dtype))
    else:
      grown_fits = grown < float(jnp.iinfo(dtype).max) + 1
    grow = self.counter >= self.period - 1
    finite_scale = jnp.where(grow & grown_fits, grown, scale)
    floor = jnp.asarray(self.min_loss_scale).astype(work)
    backed_off = jnp.maximum(scale / self.factor, floor)
    loss_scale = jnp.where(grads_finite, finite_scale, backed_off)

    counter = jnp.asarray(self.counter)
    counter = jnp.where(grads_finite & ~grow, counter + 1,
                        jnp.zeros_like(counter)).astype(counter.dtype)
    # Rebuild without the constructor: the leaves are already arrays of the
    # right dtypes, and an integer scale should warn once, not every step.
    return self.tree_unflatten(self.tree_flatten()[1],
                               (loss_scale.astype(dtype), counter))


jax.tree_util.register_pytree_node(
    NoOpLossScale, lambda ls: ((), None), lambda aux, children: NoOpLossScale())
jax.tree_util.register_pytree_node(
    StaticLossScale,
    lambda ls: ((), _StaticValue(ls.loss_scale)),
    lambda aux, children: StaticLossScale(aux.value))
jax.tree_util.register_pytree_node_class(DynamicLossScale)

LossScale = Union[NoOpLossScale, StaticLossScale, DynamicLossScale]


def all_finite(tree: Any) -> jax.Array:
  """A boolean scalar array: whether every leaf of `tree` is finite.

  True for a tree without leaves. Integer and bool leaves are always finite.

  >>> import jax.numpy as jnp
  >>> bool(all_finite({"a": jnp.ones(2), "b": jnp.array([1., jnp.inf])}))
  False

  See also: `DynamicLossScale.adjust`, `select_tree`.
  """
  leaves = jax.tree_util.tree_leaves(tree)
  if not leaves:
    return jnp.array(True)
  return jnp.stack([jnp.isfinite(x).all() for x in leaves]).all()


def select_tree(pred: Any, a: T, b: T) -> T:
  """`a` where `pred` is True, else `b`, leaf by leaf (`jax.lax.select`).

  `pred` must be a boolean scalar (else AssertionError, as in jmp); `a` and
  `b` must have the same structure, shapes and dtypes (else ValueError or
  TypeError from JAX).

  >>> import jax.numpy as jnp
  >>> select_tree(jnp.bool_(False), {"w": jnp.ones(2)}, {"w": jnp.zeros(2)})
  {'w': Array([0., 0.], dtype=float32)}

  See also: `all_finite`, to skip an update whose gradients overflowed.
  """
  pred = _require_scalar_bool(pred, "select_tree")
  return jax.tree_util.tree_map(functools.partial(jax.lax.select, pred), a, b)
