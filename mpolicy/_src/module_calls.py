"""The module calls being traced: one call stack and one interceptor.

Every framework with a method hook (Haiku, Flax linen) routes each module
method call through an `Interceptor`, which takes the same steps for all:

1. a method that configures the module (a constructor, linen's ``setup``)
   runs as written;
2. the framework's own check of the module runs (`Interceptor.before`);
3. what governs the call site is found: the enclosing module call, or
   else the named scopes around it;
4. inside a `full_precision()` block nothing decides;
5. otherwise `class_lookup` says which registry entry governs the call;
6. a call nothing governs runs as written (on the stack, as ``None``);
7. its floating inputs are cast to the compute dtype;
8. it runs on the stack and under its region's marker, inside what the
   framework adds (`Interceptor.running`: linen's dtype fields);
9. its floating outputs are cast to the output dtype, unless the policy
   is inherited from the enclosing call, which casts at its own boundary.

The stack is shared by the frameworks: `current_policy` reads it, and the
Haiku bridge's creator, getter and setter read its innermost entry. This
module imports no framework; each record (`frameworks`) says how its
modules' full names read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
import contextlib
from typing import Any, Optional

from mpolicy._src import class_lookup
from mpolicy._src import frameworks
from mpolicy._src import jax_compat
from mpolicy._src import policy as policy_lib
from mpolicy._src import regions
from mpolicy._src import registry

CALLS = regions.CallStack()  # The module calls being traced.


def current_policy() -> Optional[policy_lib.Policy]:
  """The policy in force in the module call being traced, else ``None``.

  That is a Haiku module call inside `transform_amp` (or `with_policies`),
  or a Haiku or Flax linen module call that `amp` traces.

  >>> import haiku as hk, jax, jax.numpy as jnp, mpolicy
  >>> mpolicy.set_policy(hk.Linear, "p=f32,c=bf16,o=f32")
  >>> class Probe(hk.Linear):
  ...   def __call__(self, x):
  ...     print(mpolicy.current_policy())
  ...     return super().__call__(x)
  >>> f = mpolicy.transform_amp(lambda x: Probe(2)(x))
  >>> params = f.init(jax.random.PRNGKey(0), jnp.ones([1, 3]))
  p=f32,c=bf16,o=f32
  >>> mpolicy.current_policy() is None
  True
  >>> mpolicy.clear_policies()

  See also: `explain_policy`, `set_policy`.
  """
  region = CALLS.innermost()
  return region.policy if region is not None else None


def enclosing_region() -> Optional[regions.Region]:
  """What governs the point of tracing where a module is about to be called.

  Inside a module call that is the call's region. Outside any, it is the
  innermost named scope a pattern matches, or a `full_precision()` block.
  """
  if CALLS.active:
    return CALLS.innermost()
  return registry.region_for_scopes(jax_compat.current_scope_names())


def _in_full_precision(enclosing: Optional[regions.Region]) -> bool:
  return ((enclosing is not None and enclosing.full_precision)
          or regions.in_full_precision(jax_compat.current_scope_names()))


class Interceptor:
  """One framework's method interceptor: the steps of every module call.

  An instance is the interceptor itself, with the signature Haiku's and
  Flax linen's ``intercept_methods`` both call: ``(next_f, args, kwargs,
  context)``, ``context`` carrying ``module`` and ``method_name``. A bridge
  overrides `before` and `running` for what only its framework needs.

  Args:
    framework: the framework's record (its root class, how module paths
      read, which methods configure).
  """

  def __init__(self, framework: frameworks.Framework):
    self.framework = framework

  def before(self, module: Any) -> None:
    """Runs first for every computing call (step 2); nothing by default."""
    del module

  @contextlib.contextmanager
  def running(self, module: Any,
              policy: policy_lib.Policy) -> Iterator[None]:
    """Wraps the body of a governed call (step 8); nothing by default."""
    del module, policy
    yield

  def __call__(self, next_f: Callable[..., Any], args, kwargs, context):
    if context.method_name in self.framework.configuring:
      return next_f(*args, **kwargs)
    module = context.module
    self.before(module)
    enclosing = enclosing_region()
    region = None
    if not _in_full_precision(enclosing):
      region = class_lookup.region_for_call(
          self.framework.module_path(module), type(module), enclosing,  # type: ignore[misc]
          self.framework.root())
    if region is None:
      with CALLS.entered(None):
        return next_f(*args, **kwargs)
    policy = region.policy
    assert policy is not None  # Only `full_precision()` regions have none.
    with regions.policy_casts("inputs"):
      args, kwargs = policy.cast_to_compute((args, kwargs))
    with CALLS.entered(region), regions.tagged(region):
      with self.running(module, policy):
        out = next_f(*args, **kwargs)
    if region.inherited:
      # Part of the enclosing call: that call casts at its own boundary, so
      # inner layers do not cast to the output dtype and straight back.
      return out
    with regions.policy_casts("outputs"):
      return policy.cast_to_output(out)
