"""One record per module framework, and the hooks `amp` enters for them.

Everything mpolicy knows of Haiku, Flax linen, Flax NNX and Equinox is a
`Framework` record here: its import name, its root module class, how a
module's full name (the path name patterns match) reads, which methods
configure a module rather than compute, and which mpolicy module installs
its interceptor. The registry asks these records whether a class can key
it and how to write a class's name; the bridges ask them for the root
class and the module path.

A framework's bridge is loaded only when the user has already imported the
framework (it is in `sys.modules`), so mpolicy itself never imports an
optional framework: a program that never imports Flax never loads the Flax
bridge. The Haiku bridge's hook serves a plain ``hk.transform`` traced by
`amp` (``amp(hk.transform(f).apply)``); inside `transform_amp` its own hooks
apply and the `amp` hook stands aside. This module imports no framework and
no other module of mpolicy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
import contextlib
import dataclasses
import importlib
import sys
import threading
from typing import Any, Optional


def _haiku_path(module: Any) -> str:
  """A Haiku module's full name (``encoder/~/mlp/~/linear_1``)."""
  return module.module_name


def _linen_path(module: Any) -> str:
  """A linen module's full name: its path from the root, ``/``-joined.

  The root module's is ``""``, which only the pattern ``"*"`` matches.

  >>> import flax.linen as nn, jax, jax.numpy as jnp
  >>> class Net(nn.Module):
  ...   @nn.compact
  ...   def __call__(self, x):
  ...     return nn.Dense(2, name="head")(nn.Dense(3)(x))
  >>> names = []
  >>> def record(next_f, args, kwargs, context):
  ...   names.append(_linen_path(context.module))
  ...   return next_f(*args, **kwargs)
  >>> with nn.intercept_methods(record):
  ...   _ = Net().init(jax.random.PRNGKey(0), jnp.ones([1, 4]))
  >>> names
  ['', 'Dense_0', 'head']
  """
  try:
    path = module.path
  except Exception:  # pylint: disable=broad-except
    return module.name or ""  # Unbound: no scope, so no path.
  return "/".join(str(part) for part in path)


@dataclasses.dataclass(frozen=True)
class Framework:
  """What mpolicy knows of one module framework.

  Attributes:
    name: the framework's name in messages (``"Flax linen"``).
    module: its import name (``"flax.linen"``); the framework counts as
      loaded once this is in `sys.modules`.
    install: the package to ``pip install`` for it.
    alias: how its classes are written (``nn`` in ``nn.Dense``).
    module_path: reads a module instance's full name, the one registry
      name patterns match; ``None`` where no hook sees module calls.
    path_example: such a name, for messages and docs.
    configuring: methods that configure a module rather than compute (an
      interceptor passes them through).
    interceptor: the mpolicy module whose ``module_policies()`` installs
      the framework's method interceptor while `amp` traces, or ``None``
      where the framework has no method hook: then its classes cannot key
      the registry, and per-layer policies come from name patterns over
      `jax.named_scope` paths.
    objects: the mpolicy module that passes the framework's objects
      through `amp` as `nnx.jit` does (see `ObjectArguments`), if any.
  """
  name: str
  module: str
  install: str
  alias: str
  module_path: Optional[Callable[[Any], str]] = None
  path_example: str = ""
  configuring: frozenset = frozenset()
  interceptor: Optional[str] = None
  objects: Optional[str] = None

  def loaded(self) -> bool:
    """Whether the user's program has imported the framework."""
    return self.module in sys.modules

  def root(self) -> Optional[type]:
    """The root module class (``Module``), if the framework is loaded.

    Nothing is imported: if the framework has not been imported, no class
    can subclass its root, so ``None`` answers every question about one.
    """
    base = getattr(sys.modules.get(self.module), "Module", None)
    return base if isinstance(base, type) else None

  def owns(self, cls: type) -> bool:
    """Whether ``cls`` is a module class of this framework."""
    base = self.root()
    return (base is not None and isinstance(cls, type)
            and issubclass(cls, base))

  @property
  def class_policies(self) -> bool:
    """Whether its module classes can key the registry."""
    return self.interceptor is not None


HAIKU = Framework(
    name="Haiku", module="haiku", install="dm-haiku", alias="hk",
    module_path=_haiku_path, path_example="encoder/~/mlp/~/linear_1",
    configuring=frozenset({"__init__"}),
    interceptor="mpolicy._src.haiku_bridge")
LINEN = Framework(
    name="Flax linen", module="flax.linen", install="flax", alias="nn",
    module_path=_linen_path, path_example="encoder/Dense_0",
    configuring=frozenset({"setup", "__init__", "__post_init__"}),
    interceptor="mpolicy._src.flax_bridge")
NNX = Framework(
    name="Flax NNX", module="flax.nnx", install="flax", alias="nnx",
    objects="mpolicy._src.nnx_bridge")
EQUINOX = Framework(name="Equinox", module="equinox", install="equinox",
                    alias="eqx")

FRAMEWORKS = (HAIKU, LINEN, NNX, EQUINOX)
WITH_CLASS_POLICIES = tuple(f for f in FRAMEWORKS if f.class_policies)


def framework_of(cls: Any) -> Optional[Framework]:
  """The framework whose root class ``cls`` subclasses, else ``None``.

  >>> framework_of(dict) is None
  True
  """
  for framework in FRAMEWORKS:
    if framework.owns(cls):
      return framework
  return None


def class_name(cls: type) -> str:
  """``cls`` as users write it (``hk.Linear``, ``nn.Dense``).

  Read off ``__module__``, so nothing is imported. The classes of a
  framework with class policies get its alias; any other class is written
  with its module and qualified name (an Equinox layer's qualified name
  lacks the ``nn`` of ``eqx.nn.Linear``).

  >>> class_name(dict)
  'builtins.dict'
  """
  module = cls.__module__
  for framework in WITH_CLASS_POLICIES:
    if module == framework.module or module.startswith(framework.module + "."):
      return f"{framework.alias}.{cls.__qualname__}"
  return f"{module}.{cls.__qualname__}"


def loaded_bridges() -> list:
  """The interceptor modules of the frameworks imported so far.

  >>> import sys
  >>> ("flax.linen" in sys.modules) == any(
  ...     bridge.__name__ == "mpolicy._src.flax_bridge"
  ...     for bridge in loaded_bridges())
  True
  """
  return [importlib.import_module(framework.interceptor)
          for framework in WITH_CLASS_POLICIES
          if framework.loaded() and framework.interceptor is not None]


@contextlib.contextmanager
def module_policies() -> Iterator[None]:
  """Applies the registry's class policies in every imported framework."""
  with contextlib.ExitStack() as stack:
    for bridge in loaded_bridges():
      stack.enter_context(bridge.module_policies())
    yield


def explained(error: Exception) -> Optional[Exception]:
  """A clearer error for one a loaded framework raised in `amp`'s trace.

  Asks the objects bridge of every loaded framework (``trace_error``);
  ``None`` when none has a better one.
  """
  for framework in FRAMEWORKS:
    if framework.objects is not None and framework.loaded():
      better = importlib.import_module(framework.objects).trace_error(error)
      if better is not None:
        return better
  return None


class ObjectArguments:
  """How one `amp`-ed function passes framework objects updated in place.

  A Flax NNX argument (a module, `nnx.Rngs`, `nnx.Optimizer`, a bare
  `nnx.Variable`) is split with all the others in one graph before the
  trace, rebuilt inside it and written back after the call, as `nnx.jit`
  does (see `nnx_bridge`). Without Flax NNX imported every step passes its
  value through. `amp` keeps one instance per interpreted function.

  >>> objects = ObjectArguments()
  >>> with objects.outside(((1.0,), {})) as (pure, finish):
  ...   print(finish(objects.inside_done(objects.inside(pure), "out")))
  out
  """

  def __init__(self):
    self._lock = threading.Lock()
    self._calls = None

  def _bridge_calls(self):
    """The NNX bridge's per-function tracker, once Flax NNX is imported."""
    if self._calls is None and NNX.loaded():
      bridge = importlib.import_module(NNX.objects)
      with self._lock:
        if self._calls is None:
          self._calls = bridge.Calls()
    return self._calls

  @contextlib.contextmanager
  def outside(self, tree) -> Iterator[tuple[Any, Callable[[Any], Any]]]:
    """Yields ``(pure, finish)`` for the call's ``(args, kwargs)``.

    ``pure`` is a pytree of arrays and static leaves for `amp` to trace
    (`inside` turns it back into ``(args, kwargs)``); ``finish`` turns
    what `inside_done` returned into the call's output.
    """
    calls = self._bridge_calls()
    if calls is None:
      yield tree, lambda pair: pair[1]
    else:
      with calls.outside(tree) as pair:
        yield pair

  def inside(self, pure):
    """Inside the trace: the objects rebuilt from ``pure``."""
    calls = self._bridge_calls()
    return pure if calls is None else calls.inside(pure)

  def inside_done(self, tree, out) -> tuple[Any, Any]:
    """After the call: ``(the objects' state, out)``, as pure pytrees."""
    calls = self._bridge_calls()
    return (None, out) if calls is None else calls.inside_done(tree, out)

  def is_state(self, x) -> bool:
    """Whether ``x`` in a pure output is an object's state (not cast)."""
    calls = self._bridge_calls()
    return calls is not None and calls.is_state(x)
