"""Applying a loss scale: the arithmetic under the loss-scale classes.

Scaling and unscaling run in float32 or wider and return each leaf in its
own dtype; a float8 leaf that overflows becomes inf or nan (never a
saturated finite value), so `all_finite` sees it. `select_tree` picks one
of two trees by a flag, as a skipped step needs.

>>> import jax.numpy as jnp
>>> w = unscale({"w": jnp.full(2, 4., jnp.float16)}, 2. ** 17, "unscale")["w"]
>>> w.dtype, float(w[0]) == 4 / 2 ** 17  # 2 ** 17 itself is inf in float16.
(dtype('float16'), True)
"""

from __future__ import annotations

import functools
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from mpolicy._src import dtypes

T = TypeVar("T")


def _is_floating_leaf(x: Any) -> bool:
  if isinstance(x, bool):
    return False
  if isinstance(x, float):
    return True
  return dtypes.is_float(getattr(x, "dtype", None))


def _scale_dtype(loss_scale: Any) -> Any:
  """The dtype a loss scale's own value calls for: its float dtype, or f32."""
  dtype = getattr(loss_scale, "dtype", None)
  if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
    return jnp.float32
  return jax.dtypes.canonicalize_dtype(dtype)


def work_dtype(*floats: Any) -> np.dtype:
  """float32, or float64 where one of the float dtypes ``floats`` is.

  Narrower dtypes (float16, bfloat16, float8) work in float32, widened
  explicitly: JAX's promotion refuses float8 with float32.

  >>> work_dtype(jnp.float8_e4m3fn, jnp.bfloat16)
  dtype('float32')
  """
  wide = [d for d in floats if np.dtype(d).itemsize > 4]
  return np.dtype(jax.dtypes.canonicalize_dtype(wide[0] if wide
                                                 else jnp.float32))


@functools.lru_cache(maxsize=None)
def _float8_overflow(dtype: np.dtype) -> tuple[float, bool, Any, Any]:
  """``(limit, inclusive, +special, -special)`` for casting to ``dtype``.

  A float32 value overflows ``dtype`` where its magnitude reaches ``limit``
  (halfway past the largest finite value; a tie rounds to even, so whether
  ``limit`` itself overflows depends on the dtype: ``inclusive``). It then
  becomes ``±special``: inf where the dtype has one, else nan.
  """
  info = jnp.finfo(dtype)
  largest = float(info.max)
  half_ulp = 2.0 ** (np.floor(np.log2(largest)) - info.nmant - 1)
  limit = np.float32(largest + half_ulp)
  inclusive = not np.isfinite(float(limit.astype(dtype)))
  specials = np.array([np.inf, -np.inf], np.float32).astype(dtype)
  if np.isfinite(specials.astype(np.float32)).any():
    raise TypeError(
        f"loss scaling: {np.dtype(dtype).name} has neither inf nor nan, so "
        "an overflow would be a finite, wrong value that no finiteness check "
        "sees; keep such leaves in float8_e4m3fn, float8_e5m2 or wider.")
  return float(limit), inclusive, specials[0], specials[1]


def cast_narrow(y: jax.Array, dtype: Any) -> jax.Array:
  """``y`` in ``dtype``, rounded to nearest, where an overflow is non-finite.

  For float8 dtypes the overflow is made explicit, whatever the backend's
  conversion does (some saturate): a value beyond the largest finite one
  becomes inf (float8_e5m2) or nan (float8_e4m3fn, which has no inf), so
  `all_finite` sees it and a dynamic loss scale backs off. A saturated
  value would be a wrong gradient that looks finite. Other dtypes convert
  as JAX does (IEEE: overflow to inf).

  >>> y = jnp.array([1.5, 500., -1e6])
  >>> cast_narrow(y, jnp.float8_e4m3fn), cast_narrow(y, jnp.float8_e5m2)
  (Array([1.5, nan, nan], dtype=float8_e4m3fn), Array([1.5, 512, -inf], dtype=float8_e5m2))
  """
  out = y.astype(dtype)
  if np.dtype(dtype).itemsize != 1:
    return out
  limit, inclusive, pos, neg = _float8_overflow(np.dtype(dtype))
  size = jnp.abs(y)
  over = size >= limit if inclusive else size > limit
  return jnp.where(over, jnp.where(y < 0, neg, pos), out)


def _apply_scale(tree: T, loss_scale: Any, op, who: str) -> T:
  """`op(leaf, loss_scale)` on the floating leaves, each back in its dtype.

  The arithmetic runs in float32 (or wider, if the leaf or the scale is):
  a scale such as 2 ** 17 does not exist in float16, and dividing a float16
  gradient by it in float16 would give 0. Only a result that overflows the
  leaf's own dtype becomes non-finite (see `cast_narrow` for float8).
  """
  if np.ndim(loss_scale) != 0:
    raise ValueError(
        f"{who}: loss_scale must be a scalar, got shape "
        f"{tuple(np.shape(loss_scale))}; a non-scalar scale would broadcast "
        "and change the shape of every leaf. To keep one loss scale per "
        "device or per model, map over them with `jax.vmap` / `jax.pmap`.")
  scale_dtype = _scale_dtype(loss_scale)
  cast_scales = {}

  def apply(x):
    if not _is_floating_leaf(x):
      return x
    dtype = getattr(x, "dtype", None)
    if dtype is None and not hasattr(loss_scale, "dtype"):
      return op(x, loss_scale)  # Python numbers: exact enough, no overflow.
    work = work_dtype(scale_dtype, *(() if dtype is None else (dtype,)))
    if work not in cast_scales:
      cast_scales[work] = jnp.asarray(loss_scale).astype(work)
    y = op(jnp.asarray(x).astype(work), cast_scales[work])
    return y if dtype is None else cast_narrow(y, dtype)

  return jax.tree_util.tree_map(apply, tree)


def scale(tree: T, loss_scale: Any, who: str) -> T:
  return _apply_scale(tree, loss_scale, lambda x, s: x * s, who)


def unscale(tree: T, loss_scale: Any, who: str) -> T:
  return _apply_scale(tree, loss_scale, lambda x, s: x / s, who)


def require_scalar_bool(pred: Any, name: str) -> jax.Array:
  pred = jnp.asarray(pred)
  if pred.ndim != 0 or pred.dtype != jnp.bool_:
    # AssertionError is the documented error; raised explicitly, not with
    # `assert`, so the check also runs under `python -O`.
    raise AssertionError(f"{name}: expected boolean scalar, got "
                         f"{pred.dtype} of shape {pred.shape}.")
  return pred


def all_finite(tree: Any) -> jax.Array:
  """Whether every leaf of `tree` is finite, as a boolean scalar array.

  Args:
    tree: a pytree of arrays or numbers.

  Returns:
    A boolean scalar; True for a tree without leaves. Integer and bool
    leaves are always finite.

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

  Args:
    pred: a boolean scalar.
    a, b: pytrees with the same structure, shapes and dtypes.

  Returns:
    `a` if `pred`, else `b`.

  Raises:
    AssertionError: `pred` is not a boolean scalar.
    ValueError, TypeError: from JAX, if `a` and `b` do not match.

  >>> import jax.numpy as jnp
  >>> select_tree(jnp.bool_(False), {"w": jnp.ones(2)}, {"w": jnp.zeros(2)})
  {'w': Array([0., 0.], dtype=float32)}

  See also: `all_finite`, to skip an update whose gradients overflowed.
  """
  pred = require_scalar_bool(pred, "select_tree")
  return jax.tree_util.tree_map(functools.partial(jax.lax.select, pred), a, b)
