"""The leaves of a checkpoint: JAX arrays (typed keys included), numpy
values and Python numbers (host values, which a `jax.eval_shape` template
gets back as saved), and in a template `jax.ShapeDtypeStruct`s."""

import functools
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from mpolicy._src import jax_compat

_NUMBERS = (bool, int, float)


def is_key(x: Any) -> bool:
  dtype = getattr(x, "dtype", None)
  return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


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
    return str(dtype), [int(d) for d in np.shape(leaf)]
  raise TypeError(
      f"{what}: leaf {key} is of type {type(leaf).__name__}; a checkpoint "
      "holds arrays (jax or numpy, any dtype, typed PRNG keys included), "
      "jax.ShapeDtypeStruct (in a template) and Python numbers.")


def flatten(tree: Any, what: str):
  """`({keystr: leaf}, {keystr: (dtype, shape)}, treedef)`."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  flat, described = {}, {}
  for path, leaf in leaves:
    key = jax.tree_util.keystr(path)
    if key in flat:
      raise ValueError(f"{what}: two leaves share the path {key!r}; give "
                       "them distinct keys.")
    described[key] = describe(key, leaf, what)
    flat[key] = leaf
  return flat, described, treedef


def host_kind(leaf: Any) -> Optional[str]:
  """How a host value was saved: numpy array or scalar, or which number."""
  kinds = ((np.ndarray, "ndarray"), (np.generic, "generic"),
           (_NUMBERS, type(leaf).__name__))
  return next((kind for t, kind in kinds if isinstance(leaf, t)), None)


def held_whole(leaf: Any) -> bool:
  """Whether each process holds the whole leaf (in a multi-process run)."""
  return (leaf.is_fully_addressable if isinstance(leaf, jax.Array)
          else host_kind(leaf) is not None)


@functools.lru_cache(maxsize=None)
def replicated() -> jax.sharding.NamedSharding:
  """Every device of the run holds the whole value."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("all",))
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def to_global(leaf: jax.Array) -> jax.Array:
  """A leaf each process holds whole, as one array on every device (so
  that orbax writes it once)."""
  sharding = replicated()
  mine = [d for d in sharding.mesh.devices.flat
          if d.process_index == jax.process_index()]  # In the mesh's order.
  shards = [jax.device_put(leaf, d) for d in mine]
  return jax.make_array_from_single_device_arrays(leaf.shape, sharding, shards)


def abstract_mismatch(saved_dtype: str, template: Any) -> bool:
  """Whether a host value saved in `saved_dtype` cannot fill an abstract
  leaf (whose dtype JAX canonicalized: float64 -> float32 without x64)."""
  return jax.dtypes.canonicalize_dtype(saved_dtype) != template.dtype


def restore_target(leaf: Any, kind: Optional[str], saved_dtype: str,
                   saved_sharding: Callable[[], Any]) -> Any:
  """What orbax restores `leaf` from: its shape, dtype and sharding. A
  `ShapeDtypeStruct` without a sharding gets `saved_sharding()`, or,
  where that is None, `replicated()`."""
  if isinstance(leaf, np.generic):
    return np.asarray(leaf)
  if isinstance(leaf, jax.ShapeDtypeStruct) and leaf.sharding is None:
    if kind is not None:
      return np.zeros(leaf.shape, np.dtype(saved_dtype))  # Back as saved.
    struct = lambda s: jax.ShapeDtypeStruct(
        leaf.shape, leaf.dtype, sharding=s, weak_type=leaf.weak_type)
    try:
      return struct(saved_sharding() or replicated())
    except ValueError:  # Saved for another rank (orbax pads scalars' specs).
      return struct(replicated())
  if isinstance(leaf, jax.Array):
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)
  return leaf  # ShapeDtypeStruct, numpy arrays and numbers restore as such.


def restored_like(template: Any, restored: Any, kind: Optional[str]) -> Any:
  """The restored leaf, of the kind the template leaf is."""
  if (isinstance(template, jax.ShapeDtypeStruct) and template.sharding is None
      and kind is not None):  # Back as saved.
    template = {"ndarray": np.zeros(0), "generic": np.float32(0),
                "bool": False, "int": 0, "float": 0.}[kind]
  if isinstance(template, _NUMBERS):
    return type(template)(np.asarray(restored).item())
  if isinstance(template, (np.generic, np.ndarray)):
    value = np.asarray(restored)
    return value[()] if isinstance(template, np.generic) else value
  sharding = getattr(template, "sharding", None)
  if not isinstance(restored, jax.Array):  # A number saved, an array wanted.
    restored = jnp.asarray(restored, template.dtype)
    if sharding is not None:
      restored = jax.device_put(restored, sharding)
  if (isinstance(template, jax.Array) and not template.committed
      and jax.device_count() > 1):  # Free, as a fresh array, to join others.
    restored = jax.random.wrap_key_data(
        np.asarray(jax.random.key_data(restored)),
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
