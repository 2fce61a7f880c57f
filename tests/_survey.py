"""A survey of JAX's primitives: which may carry a sub-computation (a test
helper: it reads JAX's private rule tables, which mpolicy itself never needs).

Whether an equation carries a sub-computation shows in its params (see
`jax_compat.hijax.sub_computations`, the runtime guard's question). Which *primitives*
may is asked of JAX's own registrations, so a test can check that each is
handled before a program meets it:

* the names its rules take: an abstract evaluation, implementation,
  lowering, batching, JVP, transpose or DCE rule with a parameter such as
  ``jaxpr``, ``branches``, ``call_jaxpr``, ``callback`` or ``_prim``;
* a DCE rule of its own (JAX gives one to primitives whose sub-jaxprs it
  prunes);
* its class: JAX's call and map primitives.
"""

from __future__ import annotations

from collections.abc import Iterable
import functools
import importlib
import inspect
import pkgutil
import re

from jax._src import core as _core
from jax._src.interpreters import ad as _ad
from jax._src.interpreters import batching as _batching
from jax._src.interpreters import mlir as _mlir
from jax._src.interpreters import partial_eval as _pe

from mpolicy._src.jax_compat import internals as _i

MODULES = (
    "jax.lax", "jax._src.lax", "jax._src.interpreters",
    "jax._src.ad_checkpoint", "jax._src.custom_derivatives",
    "jax._src.custom_batching", "jax._src.custom_transpose",
    "jax._src.custom_partitioning", "jax._src.callback",
    "jax._src.buffer_callback", "jax._src.debugging", "jax._src.shard_map",
    "jax._src.pjit", "jax._src.core", "jax._src.hijax", "jax._src.state",
    "jax._src.compute_on", "jax._src.xla_metadata", "jax._src.program_order",
    "jax._src.pallas", "jax._src.cudnn", "jax._src.checkify",
)
"""The JAX modules (and all their submodules) whose primitives the
survey walks: control flow, checkpointing, custom derivatives and
batching, callbacks, sharding, state, Pallas, ... Those a JAX version
lacks are skipped."""

_CALL_CLASSES = tuple(getattr(_core, n) for n in ("CallPrimitive",
                                                  "MapPrimitive")
                      if hasattr(_core, n))

# Rule parameters that hold, or produce, a sub-computation.
_SUB_PARAMS = re.compile(
    r"jaxprs?$|^branches$|^_prim$|callback$|^callee$|thunk$|^computation$|"
    r"^bwd$|^fwd$|^call$|^rule$|^fun$")


def _import_all(name: str) -> bool:
  """Imports module ``name`` and, for a package, all its submodules (those
  that fail to import, for want of a backend's libraries, are skipped)."""
  try:
    module = importlib.import_module(name)
  except ImportError:
    return False
  for info in pkgutil.walk_packages(getattr(module, "__path__", ()),
                                    name + "."):
    try:
      importlib.import_module(info.name)
    except Exception:  # pylint: disable=broad-except
      pass
  return True


def primitives_in(modules: Iterable[str] = MODULES) -> list:
  """The `Primitive` objects at the top level of ``modules`` and of all
  their submodules (a module this JAX lacks is skipped)."""
  loaded = tuple(name for name in modules if _import_all(name))
  return sorted(_i.loaded_primitives(loaded), key=lambda p: p.name)


def _rules_of(primitive) -> list:
  rules = [getattr(primitive, "impl", None),
           getattr(primitive, "abstract_eval", None)]
  for table in (_mlir._lowerings, _batching.primitive_batchers,  # pylint: disable=protected-access
                _batching.fancy_primitive_batchers, _ad.primitive_jvps,
                _ad.primitive_transposes, _ad.fancy_transposes,
                _pe.dce_rules, _pe.partial_eval_jaxpr_custom_rules):
    try:
      rules.append(table.get(primitive))
    except (TypeError, AttributeError):
      pass
  return [r for r in rules if r is not None]


def _parameter_names(fn) -> set:
  names = set()
  while isinstance(fn, functools.partial):
    names |= set(fn.keywords)
    fn = fn.func
  try:
    names |= set(inspect.signature(inspect.unwrap(fn)).parameters)
  except (TypeError, ValueError):
    pass
  return names


def may_carry_sub_computations(primitive) -> bool:
  """Whether JAX's registrations of ``primitive`` suggest that its params
  may carry a sub-computation (see the module's docstring)."""
  if isinstance(primitive, _CALL_CLASSES):
    return True
  if primitive in _pe.dce_rules and primitive.name != "free_ref":
    return True
  return any(_SUB_PARAMS.search(n) for rule in _rules_of(primitive)
             for n in _parameter_names(rule))


__all__ = ["may_carry_sub_computations", "primitives_in"]
