"""The Haiku bridge: applies the registry to module calls inside a transform.

Four Haiku hooks do the work while the forward function is traced:

- a method interceptor (the `module_calls.Interceptor` every framework
  shares) resolves the policy of each module call, casts its floating
  inputs to the compute dtype, tags the call's region for the interpreter,
  and casts its floating outputs to the output dtype;
- a creator makes parameters and state in the param dtype;
- a getter hands parameters and state to the module in the compute dtype;
- a setter stores state (e.g. BatchNorm's moving averages) back in the param
  dtype, so it never drifts into the compute dtype.

`transform_amp` wraps the forward in these hooks and runs `apply` through the
interpreter, which adds the op-level rules inside each tagged region. `amp`
installs the same hooks (`module_policies`) while it traces a plain
``hk.transform``, so ``amp(hk.transform(f).apply)`` gets the same policies.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
import contextlib
import functools
import sys
import threading
from typing import Any, Optional
import warnings

import haiku as hk

from mpolicy._src import amp as amp_lib
from mpolicy._src import dtypes
from mpolicy._src import frameworks
from mpolicy._src import module_calls
from mpolicy._src import op_rules as op_rules_lib
from mpolicy._src import regions
from mpolicy._src import registry


# Without flax, Haiku puts a stand-in module at `haiku.experimental.flax`
# whose every attribute raises ImportError, `__warningregistry__` included.
# `unittest`'s assertWarns reads that attribute on every loaded module, so
# any test using it failed once haiku was imported. An empty registry on
# the stand-in answers the read; nothing else changes.
# (No module-level reference to the stand-in: tools that walk a module's
# globals, like doctest, would trip over it the same way.)
def _answer_warningregistry_on_flax_stand_in() -> None:
  stand_in = sys.modules.get("haiku.experimental.flax")
  if stand_in is not None and type(stand_in).__name__ == "FlaxNotInstalled":
    stand_in.__warningregistry__ = {}  # type: ignore[attr-defined]


_answer_warningregistry_on_flax_stand_in()


class HaikuPolicyWarning(UserWarning):
  """Haiku's own mixed precision registry also holds a policy."""


_warned_lock = threading.Lock()
_warned_classes: set = set()


def _haiku_policy_of(cls: type) -> Any:
  """The policy `hk.mixed_precision.set_policy` gave ``cls``, or ``None``."""
  try:
    return hk.mixed_precision.get_policy(cls)
  except Exception:  # pylint: disable=broad-except
    return None  # A Haiku without this API applies no policy of its own.


def _warn_if_haiku_policy(cls: type) -> None:
  """Warns once per class when Haiku's own registry has a policy for it.

  Haiku applies such a policy itself (its own interceptor), on top of
  mpolicy's: both registries would cast the module's parameters, inputs
  and outputs, which is never what a ported script means.
  """
  policy = _haiku_policy_of(cls)
  if policy is None:
    return
  with _warned_lock:
    if cls in _warned_classes:
      return
    _warned_classes.add(cls)
  name = registry.key_name(cls)
  warnings.warn(
      f"hk.mixed_precision has a policy for {name} ({policy}) as well as "
      "mpolicy: inside transform_amp both apply to its calls. Remove it "
      f"with hk.mixed_precision.clear_policy({name}) and set it with "
      f"mpolicy.set_policy({name}, ...) instead.",
      HaikuPolicyWarning, stacklevel=2)


class _Interceptor(module_calls.Interceptor):
  """The shared module-call steps, plus Haiku's own policy check."""

  def before(self, module: hk.Module) -> None:
    _warn_if_haiku_policy(type(module))


_interceptor = _Interceptor(frameworks.HAIKU)


def _creator(next_creator, shape, dtype, init, context):
  del context
  region = module_calls.CALLS.innermost()
  if region is None or not dtypes.is_float(dtype):
    return next_creator(shape, dtype, init)
  return next_creator(shape, region.policy.param_dtype, init)


def _getter(next_getter, value, context):
  del context
  region = module_calls.CALLS.innermost()
  if region is not None:
    with regions.policy_casts("parameters"):
      value = region.policy.cast_to_compute(value)
  return next_getter(value)


def _setter(next_setter, value, context):
  del context
  region = module_calls.CALLS.innermost()
  if region is not None:
    with regions.policy_casts("state"):
      value = region.policy.cast_to_param(value)
  return next_setter(value)


class _Hooks(threading.local):
  """Which of this bridge's hooks are installed in this thread.

  ``by`` is ``"with_policies"`` while a forward wrapped by `with_policies`
  (so by `transform_amp`) runs: it installs every hook itself. It is
  ``"amp"`` inside the outermost module call of a plain Haiku transform
  traced by `amp`, where `module_policies` installed the value hooks.
  """

  def __init__(self):
    super().__init__()
    self.by: Optional[str] = None

  @contextlib.contextmanager
  def installed(self, by: str):
    previous, self.by = self.by, by
    try:
      yield
    finally:
      self.by = previous


_HOOKS = _Hooks()


def _value_hooks() -> contextlib.ExitStack:
  """The creator, getter and setter (inside a transform only)."""
  stack = contextlib.ExitStack()
  stack.enter_context(hk.custom_creator(_creator, params=True, state=True))
  stack.enter_context(hk.custom_getter(_getter, params=True, state=True))
  stack.enter_context(hk.custom_setter(_setter))
  return stack


def with_policies(fn: Callable[..., Any]) -> Callable[..., Any]:
  """Runs a Haiku forward function with the registry's hooks installed.

  Use it inside your own `hk.transform` when you do not want the op-level
  interpreter: module-level policies (casts of params, state, inputs and
  outputs) still apply.

  >>> import haiku as hk, jax, jax.numpy as jnp, mpolicy
  >>> mpolicy.set_policy(hk.Linear, "p=f32,c=bf16,o=bf16")
  >>> f = hk.transform(mpolicy.with_policies(lambda x: hk.Linear(2)(x)))
  >>> params = f.init(jax.random.PRNGKey(0), jnp.ones([1, 3]))
  >>> f.apply(params, None, jnp.ones([1, 3])).dtype
  dtype(bfloat16)
  >>> mpolicy.clear_policies()

  See also: `transform_amp`.
  """

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    with contextlib.ExitStack() as stack:
      stack.enter_context(_HOOKS.installed("with_policies"))
      stack.enter_context(hk.intercept_methods(_interceptor))
      stack.enter_context(_value_hooks())
      return fn(*args, **kwargs)

  return wrapped


def _check_forward(fn: Any, name: str) -> None:
  """Raises a `TypeError` unless ``fn`` is a forward function to transform."""
  if isinstance(fn, (hk.Transformed, hk.TransformedWithState,
                     hk.MultiTransformed, hk.MultiTransformedWithState)):
    raise TypeError(
        f"{name} takes the forward function itself, as hk.transform does, "
        f"not an already transformed one: call {name}(f), not "
        f"{name}(hk.transform(f)); got {type(fn).__name__}. (To run an "
        "existing hk.transform's apply under the op rules and the "
        "registry's policies, use mpolicy.amp(transformed.apply).)")
  if not callable(fn):
    raise TypeError(f"{name} takes a forward function, got {fn!r} of type "
                    f"{type(fn).__name__}.")


def transform_amp(fn: Callable[..., Any], *,
                  rules: Optional[op_rules_lib.OpRules] = None
                  ) -> hk.Transformed:
  """Like `hk.transform`, with the registry's policies and the op rules.

  For every module call a policy governs, parameters are created and stored
  in the param dtype; inside the call parameters, state and floating inputs
  are seen in the compute dtype; the call's floating outputs are cast to the
  output dtype. A module that inherits its policy from the enclosing call
  (rule 3) is part of that call: its outputs are left for the enclosing call
  to cast. State is stored in the param dtype. On top of that, `apply` runs
  through the interpreter, so each primitive runs in the dtype its op rule
  gives it (matmuls in half with float32 accumulation, exp/log/sums in
  float32). Policies are read when ``init`` or ``apply`` is traced; the
  registry's state is part of `jax.jit`'s cache key, so after a
  `set_policy` (or under another thread's `push_policy`) a jitted ``apply``
  is retraced rather than reused. A module class that also has a policy in
  ``hk.mixed_precision`` (which Haiku would apply on top) gets a
  `HaikuPolicyWarning`, once per class.

  >>> import haiku as hk, jax, jax.numpy as jnp, mpolicy
  >>> mpolicy.set_policy(hk.Module, "p=f32,c=bf16,o=f32")
  >>> f = mpolicy.transform_amp(lambda x: hk.nets.MLP([8, 2])(x))
  >>> params = f.init(jax.random.PRNGKey(0), jnp.ones([4, 3]))
  >>> params["mlp/~/linear_0"]["w"].dtype
  dtype('float32')
  >>> f.apply(params, None, jnp.ones([4, 3])).dtype
  dtype('float32')
  >>> mpolicy.clear_policies()

  Args:
    fn: a Haiku forward function, as for `hk.transform`.
    rules: an `OpRules` table; `DEFAULT_RULES` if ``None``.

  Returns:
    An `hk.Transformed` with Haiku's `init` and `apply` signatures.

  Raises:
    TypeError: if ``fn`` is already transformed (``hk.transform(f)``):
      pass the forward function ``f`` itself.

  See also: `transform_amp_with_state`, `set_policy`, `explain`.
  """
  _check_forward(fn, "transform_amp")
  transformed = hk.transform(with_policies(fn))
  apply = amp_lib.interpret(transformed.apply, rules=rules,
                                cast_outputs=False)
  return hk.Transformed(init=transformed.init, apply=apply)


def transform_amp_with_state(fn: Callable[..., Any], *,
                             rules: Optional[op_rules_lib.OpRules] = None
                             ) -> hk.TransformedWithState:
  """Like `hk.transform_with_state`, with policies and op rules.

  State such as BatchNorm's moving averages is created and stored in the
  governing policy's param dtype.

  >>> import haiku as hk, jax, jax.numpy as jnp, mpolicy
  >>> mpolicy.set_policy(hk.Module, "p=f32,c=bf16,o=f32")
  >>> def forward(x):
  ...   return hk.BatchNorm(True, True, 0.9)(x, is_training=True)
  >>> f = mpolicy.transform_amp_with_state(forward)
  >>> params, state = f.init(jax.random.PRNGKey(0), jnp.ones([4, 3]))
  >>> out, state = f.apply(params, state, None, jnp.ones([4, 3]))
  >>> state["batch_norm/~/mean_ema"]["average"].dtype
  dtype('float32')
  >>> mpolicy.clear_policies()

  See also: `transform_amp`.
  """
  _check_forward(fn, "transform_amp_with_state")
  transformed = hk.transform_with_state(with_policies(fn))
  apply = amp_lib.interpret(transformed.apply, rules=rules,
                                cast_outputs=False)
  return hk.TransformedWithState(init=transformed.init, apply=apply)


def _amp_interceptor(next_f, args, kwargs, context: hk.MethodContext):
  """`amp`'s hook for a plain Haiku transform traced inside it."""
  if _HOOKS.by == "with_policies":
    return next_f(*args, **kwargs)  # transform_amp's hooks apply already.
  if _HOOKS.by == "amp" or context.method_name == "__init__":
    return _interceptor(next_f, args, kwargs, context)
  # The outermost module call: the value hooks go on for its duration
  # (Haiku's own mixed precision does the same).
  with _HOOKS.installed("amp"), _value_hooks():
    return _interceptor(next_f, args, kwargs, context)


@contextlib.contextmanager
def module_policies() -> Iterator[None]:
  """Applies the registry to Haiku module calls that `amp` traces.

  `amp` enters it while it traces (through `frameworks`), so
  ``amp(hk.transform(f).apply)`` honours class and name-pattern entries
  as ``transform_amp(f).apply`` does: the same casts of inputs,
  parameters, state and outputs, the same region markers, so the same op
  rules (`explain` rows match). Parameters are as ``init`` made them:
  ``amp`` cannot change what a plain ``hk.transform(f).init`` stored
  (``transform_amp(f).init`` creates them in the param dtype). Inside a
  `transform_amp` (or `with_policies`) forward it does nothing: those
  hooks apply already. With an empty registry nothing is installed.

  >>> import haiku as hk, jax, jax.numpy as jnp, mpolicy
  >>> mpolicy.set_policy(hk.Linear, "p=f32,c=bf16,o=bf16")
  >>> f = hk.transform(lambda x: hk.Linear(2)(x))
  >>> params = f.init(jax.random.PRNGKey(0), jnp.ones([1, 3]))
  >>> mpolicy.amp(f.apply)(params, None, jnp.ones([1, 3])).dtype
  dtype(bfloat16)
  >>> mpolicy.clear_policies()
  """
  if not registry.snapshot():
    yield
    return
  with hk.intercept_methods(_amp_interceptor):
    yield
