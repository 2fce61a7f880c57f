"""What a checkpoint holds, checked against a template: leaves (arrays,
typed keys, numpy values, numbers; in a template `ShapeDtypeStruct`s too)
and metadata (dtypes, shapes, host values' kinds, checksums, loss scales)."""

import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from mpolicy._src import jax_compat
from mpolicy._src import loss_scale as loss_scale_lib

_NUMBERS = (bool, int, float)


def is_key(x: Any) -> bool:
  return jax.dtypes.issubdtype(getattr(x, "dtype", None) or np.float32,
                               jax.dtypes.prng_key)


def describe(key: str, leaf: Any, what: str) -> tuple[str, list[int]]:
  """`(dtype, shape)` of a leaf; a `TypeError` naming it if unsupported."""
  if isinstance(leaf, jax_compat.Tracer):
    raise TypeError(
        f"{what} needs concrete arrays, but leaf {key} is a traced value "
        f"({type(leaf).__name__}): it was called inside jax.jit (or grad, "
        "vmap, scan). Call it outside jit, on the arrays the jitted step "
        "returns.")
  if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct, np.ndarray, np.generic,
                       *_NUMBERS)):  # A number: the dtype JAX gives it.
    dtype = getattr(leaf, "dtype", None) or jax.dtypes.canonicalize_dtype(
        np.result_type(type(leaf)))
    if 0 in np.shape(leaf):
      raise ValueError(
          f"{what}: leaf {key} has no elements (shape {np.shape(leaf)}), and "
          "orbax stores no zero-size arrays: leave it out of the tree and "
          "rebuild it after restoring.")
    return str(dtype), [int(d) for d in np.shape(leaf)]
  raise TypeError(
      f"{what}: leaf {key} is of type {type(leaf).__name__}; a checkpoint "
      "holds arrays (jax or numpy, any dtype, typed PRNG keys included), "
      "jax.ShapeDtypeStruct (in a template) and Python numbers.")


def flatten(tree: Any, what: str):
  """`({keystr: leaf}, {keystr: (dtype, shape)}, treedef)`."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  keys = [jax.tree_util.keystr(path) for path, _ in leaves]
  flat = dict(zip(keys, (leaf for _, leaf in leaves)))
  if len(flat) < len(keys):
    key = next(k for k in keys if keys.count(k) > 1)
    raise ValueError(f"{what}: two leaves share the path {key!r}; give "
                     "them distinct keys.")
  return flat, {k: describe(k, v, what) for k, v in flat.items()}, treedef


def host_kind(leaf: Any) -> Optional[str]:
  """How a host value was saved: numpy array or scalar, or which number."""
  kinds = ((np.ndarray, "ndarray"), (np.generic, "generic"),
           (_NUMBERS, type(leaf).__name__))
  return next((kind for t, kind in kinds if isinstance(leaf, t)), None)


def restore_plan(leaf: Any, kind: Optional[str],
                 saved_dtype: str) -> tuple[Any, Callable]:
  """`(target, back)`: what orbax restores template `leaf` from (shape,
  dtype, sharding), and `back(restored)`, a leaf of `leaf`'s kind. A
  `ShapeDtypeStruct` without a sharding comes back as saved: a host value
  as such, an array placed by `disk.read`."""
  if isinstance(leaf, jax.ShapeDtypeStruct) and leaf.sharding is None and kind:
    zeros = np.zeros(leaf.shape, np.dtype(saved_dtype))
    leaf = {"ndarray": zeros, "generic": zeros[()], "bool": False, "int": 0,
            "float": 0.}[kind]
  if host_kind(leaf):  # As numpy arrays: orbax takes no numpy scalars.
    return np.asarray(leaf), (np.asarray if isinstance(leaf, np.ndarray)
                              else type(leaf))
  back = functools.partial(_array_like, leaf)
  if isinstance(leaf, jax.Array):
    leaf = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
  return leaf, back


def _array_like(template: Any, restored: Any) -> jax.Array:
  """The restored array, placed and typed as the template's."""
  if not isinstance(restored, jax.Array):  # A number saved, an array wanted.
    restored = jax.device_put(jnp.asarray(restored, template.dtype),
                              template.sharding)
  if (isinstance(template, jax.Array) and not template.committed
      and jax.device_count() > 1):  # Free, as a fresh array, to join others.
    restored = jax.random.wrap_key_data(
        np.asarray(jax.random.key_data(restored)),  # type: ignore[arg-type]  # Any array.
        impl=jax.random.key_impl(restored)) if is_key(restored) else (
            jnp.asarray(np.asarray(restored)))
  if (getattr(template, "weak_type", False) and restored.ndim == 0
      and not is_key(restored)):
    # A weakly typed scalar (`jnp.asarray(1e-3)`) comes back weakly typed.
    weak = jnp.asarray(np.asarray(restored).item())
    if weak.dtype == restored.dtype:
      restored = (jax.device_put(weak, restored.sharding) if restored.committed
                  else weak)
  return restored


FORMAT, VERSION = "mpolicy.checkpoint", 3  # Version 2 had no checksums.
_SETTINGS = {
    loss_scale_lib.DynamicLossScale: ("period", "factor", "min_loss_scale"),
    loss_scale_lib.StaticLossScale: ("loss_scale",),
}


def settings(tree: Any) -> dict[str, dict[str, Any]]:
  """`{keystr: {"type": name, setting: value}}` for each loss scale, whose
  settings flattening drops."""
  is_ls = lambda x: type(x) in _SETTINGS
  nodes = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_ls)[0]
  return {jax.tree_util.keystr(path): dict(type=type(node).__name__, **{
      name: np.asarray(getattr(node, name)).item()
      for name in _SETTINGS[type(node)]})
          for path, node in nodes if is_ls(node)}


def build(tree: Any, flat: dict, described: dict) -> dict:
  kinds = {k: host_kind(v) for k, v in flat.items()}
  return {"format": FORMAT, "version": VERSION, "leaves": described,
          "host_values": {k: v for k, v in kinds.items() if v},
          "loss_scales": settings(tree)}


def _differences(meta: dict, template: Any, flat: dict, described: dict):
  saved, kinds = meta["leaves"], meta.get("host_values", {})
  missing = [k for k in described if k not in saved]
  extra = [k for k in saved if k not in described]
  for where, keys in (("missing from the checkpoint", missing),
                      ("in the checkpoint but not in the template", extra)):
    yield from [f"{where}: " + ", ".join(keys)] * bool(keys)
  for key, (dtype, shape) in described.items():
    s_dtype, s_shape = saved.get(key, (dtype, shape))
    if (s_dtype, s_shape) != (dtype, shape) and not (
        key in kinds and s_shape == shape
        and isinstance(flat[key], jax.ShapeDtypeStruct)
        and jax.dtypes.canonicalize_dtype(s_dtype) == flat[key].dtype):
      # (jax.eval_shape gave a 64-bit host value JAX's dtype: float32.)
      yield (f"{key}: checkpoint has {s_dtype}{s_shape}, template wants "
             f"{dtype}{shape}")
  for key, want in settings(template).items():
    have = meta["loss_scales"].get(key) or want
    for name in sorted(set(want) | set(have)):
      if want.get(name) != have.get(name):
        yield (f"{key or 'the root'}: the checkpoint's {have['type']} has "
               f"{name}={have.get(name)!r}, the template's {want['type']} has "
               f"{name}={want.get(name)!r} (build the template with the "
               "saved settings; change them after restoring if you mean to)")


def check(meta: Any, path: str, template: Any, flat: dict, described: dict,
          what: str) -> None:
  """Raises a `ValueError` unless `meta` is an mpolicy checkpoint's that
  `template` (flattened to `flat` and `described`) matches."""
  if (not isinstance(meta, dict) or meta.get("format") != FORMAT
      or meta.get("version") not in (2, VERSION)):
    raise ValueError(
        f"{what}: {path} is not an mpolicy checkpoint of format {FORMAT!r} "
        f"version {VERSION} (its metadata is {meta!r:.300}).")
  if problems := list(_differences(meta, template, flat, described)):
    raise ValueError("The checkpoint does not match the template: "
                     + "; ".join(problems) + ".")
