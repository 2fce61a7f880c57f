"""The Flax linen bridge: applies the registry to linen module calls in `amp`.

While `amp` traces a function it installs `module_policies`, a
``flax.linen.intercept_methods`` interceptor (Flax's public hook, the one
Haiku's ``hk.intercept_methods`` is to the Haiku bridge). For each linen
module method call a policy governs (the steps every framework shares are in
`module_calls`; precedence is in `class_lookup`):

- floating inputs are cast to the compute dtype;
- the module runs with its ``dtype`` field set to the compute dtype and its
  ``param_dtype`` field set to the param dtype, for that call only: linen
  layers promote their parameters to ``dtype`` before computing, so they see
  their parameters in the compute dtype and create new ones in the param
  dtype (a field that holds a non-floating dtype is left alone);
- variables the module itself holds in a mutable collection (BatchNorm's
  ``batch_stats``, or ``params`` during ``init``) are stored back in the
  param dtype;
- floating outputs are cast to the output dtype, unless the policy is
  inherited from the enclosing call, which casts at its own boundary.

The call is traced under its region's marker, so the interpreter's op rules
and `explain` see which policy governs each primitive. Only this module
imports Flax; `amp` loads it through `frameworks` once Flax is imported.
"""

from __future__ import annotations

from collections.abc import Iterator
import contextlib
import dataclasses
from typing import Any

import flax.linen as nn
import jax

from mpolicy._src import dtypes
from mpolicy._src import frameworks
from mpolicy._src import jax_compat
from mpolicy._src import module_calls
from mpolicy._src import policy as policy_lib
from mpolicy._src import regions


def _field_overrides(module: nn.Module,
                     policy: policy_lib.Policy) -> dict[str, Any]:
  """The ``dtype``/``param_dtype`` field values the policy gives a module."""
  wanted = {"dtype": policy.compute_dtype,
            "param_dtype": policy.param_dtype}
  names = {f.name for f in dataclasses.fields(module)}
  overrides = {}
  for name, value in wanted.items():
    if name not in names:
      continue
    current = getattr(module, name)
    if current is None or dtypes.is_float(current):
      overrides[name] = value
  return overrides


@contextlib.contextmanager
def _fields_set(module: nn.Module, overrides: dict[str, Any]) -> Iterator[None]:
  """Sets dataclass fields of one module instance for the body's duration.

  Linen modules are frozen dataclasses, so the fields are written with
  `object.__setattr__`; the instance is the one bound for this apply, and
  every field is restored on exit, even on error.
  """
  saved = {name: getattr(module, name) for name in overrides}
  try:
    for name, value in overrides.items():
      object.__setattr__(module, name, value)
    yield
  finally:
    for name, value in saved.items():
      object.__setattr__(module, name, value)


def _store_in_param_dtype(module: nn.Module,
                          policy: policy_lib.Policy) -> None:
  """Writes the module's own floating variables back in the param dtype.

  Only collections this call may mutate, and only the module's own array
  variables: a nested dict is a child module's scope, which its own call
  stores.
  """
  for collection, values in module.variables.items():
    if not module.is_mutable_collection(collection):
      continue
    what = "parameters" if collection == "params" else "state"
    for name, value in values.items():
      if not isinstance(value, (jax.Array, jax_compat.Tracer)):
        continue
      if (dtypes.is_float(value.dtype)
          and value.dtype != policy.param_dtype):
        with regions.policy_casts(what):
          module.put_variable(collection, name,
                              policy.cast_to_param(value))


class _Interceptor(module_calls.Interceptor):
  """The shared module-call steps; a governed call runs with the policy's
  dtype fields and stores its own variables in the param dtype."""

  @contextlib.contextmanager
  def running(self, module: nn.Module,
              policy: policy_lib.Policy) -> Iterator[None]:
    with _fields_set(module, _field_overrides(module, policy)):
      yield
    _store_in_param_dtype(module, policy)


_interceptor = _Interceptor(frameworks.LINEN)


@contextlib.contextmanager
def module_policies() -> Iterator[None]:
  """Applies the registry to linen module calls traced inside the block.

  `amp` enters it while tracing once Flax is imported; nothing else needs
  to.

  >>> import flax.linen as nn, jax, jax.numpy as jnp, mpolicy
  >>> mpolicy.set_policy(nn.Dense, "p=f32,c=bf16,o=bf16")
  >>> model = nn.Dense(2)
  >>> variables = model.init(jax.random.PRNGKey(0), jnp.ones([1, 3]))
  >>> with module_policies():
  ...   print(model.apply(variables, jnp.ones([1, 3])).dtype)
  bfloat16
  >>> mpolicy.clear_policies()
  """
  with nn.intercept_methods(_interceptor):
    yield
