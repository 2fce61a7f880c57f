"""One record per framework, one interceptor for every module call.

The interceptor is exercised here with a toy framework (a record of its
own, plain Python module objects), so what it does is seen apart from
Haiku's and linen's hooks; the framework tests check it under both.
"""

import dataclasses
import sys
import types

import jax.numpy as jnp
import pytest

import mpolicy
from mpolicy._src import class_lookup
from mpolicy._src import frameworks
from mpolicy._src import module_calls
from mpolicy._src import regions
from mpolicy._src import registry

HALF = "p=f32,c=bf16,o=f16"


class Module:
  """The toy framework's root class."""

  def __init__(self, name):
    self.name = name


class Dense(Module):
  pass


TOY = frameworks.Framework(
    name="Toy", module="toy", install="toy", alias="toy",
    module_path=lambda module: module.name,
    configuring=frozenset({"setup"}))


class _ToyInterceptor(module_calls.Interceptor):
  """Records what the framework hooks see."""

  def __init__(self):
    super().__init__(TOY)
    self.seen = []

  def before(self, module):
    self.seen.append(("before", module.name))

  def running(self, module, policy):
    self.seen.append(("running", module.name, str(policy)))
    return super().running(module, policy)


@pytest.fixture(name="toy")
def _toy(monkeypatch):
  """The toy framework, imported: its package holds the root class."""
  package = types.ModuleType("toy")
  package.Module = Module
  monkeypatch.setitem(sys.modules, "toy", package)
  return _ToyInterceptor()


def _call(interceptor, module, fn, *args, method="__call__"):
  context = types.SimpleNamespace(module=module, method_name=method)
  return interceptor(fn, args, {}, context)


def test_a_governed_call_casts_inputs_and_outputs_and_reports_its_policy(
    toy):
  policies = []

  def body(x):
    policies.append(str(mpolicy.current_policy()))
    return x * 2

  with mpolicy.push_policy("head", HALF):
    out = _call(toy, Dense("head"), body, jnp.ones(3, jnp.float32))
  assert out.dtype == jnp.float16  # The output dtype.
  assert policies == [HALF]  # Seen inside, as the compute dtype was.
  assert toy.seen == [("before", "head"), ("running", "head", HALF)]
  assert mpolicy.current_policy() is None  # The stack is empty again.


def test_configuring_methods_and_ungoverned_calls_run_as_written(toy):
  x = jnp.ones(3, jnp.float32)
  with mpolicy.push_policy("head", HALF):
    assert _call(toy, Dense("head"), lambda x: x, x,
                 method="setup").dtype == jnp.float32
    assert _call(toy, Dense("body"), lambda x: x, x).dtype == jnp.float32
  # `before` sees every computing call; `running` only governed ones.
  assert toy.seen == [("before", "body")]


def test_an_inner_call_inherits_and_leaves_the_cast_to_the_outer_one(toy):
  inner_dtypes = []

  def outer_body(x):
    return _call(toy, Dense("head/inner"), inner_body, x)

  def inner_body(x):
    inner_dtypes.append(x.dtype)
    return x + 1

  with mpolicy.push_policy("head", HALF):
    out = _call(toy, Dense("head"), outer_body, jnp.ones(3, jnp.float32))
  assert inner_dtypes == [jnp.bfloat16]  # Inputs in the compute dtype.
  assert out.dtype == jnp.float16  # Cast once, by the outer call.
  assert ("running", "head/inner", HALF) in toy.seen


def test_full_precision_turns_the_interceptor_off(toy):
  with mpolicy.push_policy("head", HALF), mpolicy.full_precision():
    out = _call(toy, Dense("head"), lambda x: x * 2,
                jnp.ones(3, jnp.float32))
  assert out.dtype == jnp.float32
  assert toy.seen == [("before", "head")]


def test_explain_policy_and_the_interceptor_decide_alike():
  hk = pytest.importorskip("haiku")
  mpolicy.set_policy(hk.Module, "full")
  mpolicy.set_policy(hk.Linear, HALF)
  mpolicy.set_policy("enc/~/linear", "p=f32,c=f16,o=f32")
  for name in ("enc/~/linear", "dec/~/linear", "dec/~/conv"):
    cls = hk.Linear if name.endswith("linear") else hk.Conv2D
    explanation = mpolicy.explain_policy(name, cls)
    region = class_lookup.region_for_call(name, cls, None, hk.Module)
    assert explanation.policy == region.policy
    assert region.decided_by in explanation.reason
  assert [mpolicy.explain_policy(n, hk.Linear).rule
          for n in ("enc/~/linear", "dec/~/linear")] == [1, 2]
  assert mpolicy.explain_policy("dec/~/conv", hk.Conv2D).rule == 4


def test_each_record_finds_its_root_class_once_imported():
  expected = {"haiku": "Module", "flax.linen": "Module",
              "flax.nnx": "Module", "equinox": "Module"}
  for framework in frameworks.FRAMEWORKS:
    package = pytest.importorskip(framework.module)
    assert framework.loaded()
    assert framework.root() is getattr(package, expected[framework.module])
  assert [f.name for f in frameworks.WITH_CLASS_POLICIES] == [
      "Haiku", "Flax linen"]
  assert frameworks.framework_of(dict) is None
  assert not dataclasses.replace(frameworks.HAIKU,
                                 module="not_imported").loaded()


@pytest.mark.parametrize("module, layer", [("flax.nnx", "Linear"),
                                           ("equinox", "nn.Linear")])
def test_a_class_of_a_framework_without_a_hook_cannot_key_the_registry(
    module, layer):
  package = pytest.importorskip(module)
  cls = package
  for part in layer.split("."):
    cls = getattr(cls, part)
  with pytest.raises(TypeError, match=(
      r"module classes \((nnx|eqx)\.Module and its subclasses\) cannot key "
      r"the registry.*jax\.named_scope.*name pattern")):
    mpolicy.set_policy(cls, "half")
  assert registry.snapshot() == {}  # Nothing was registered.
  with pytest.raises(TypeError, match="a Haiku or Flax linen module class"):
    mpolicy.explain_policy(cls)


def test_a_class_is_named_as_its_framework_writes_it():
  hk = pytest.importorskip("haiku")
  nn = pytest.importorskip("flax.linen")
  assert frameworks.class_name(hk.BatchNorm) == "hk.BatchNorm"
  assert frameworks.class_name(nn.Dense) == "nn.Dense"
  assert frameworks.class_name(regions.Region) == (
      "mpolicy._src.regions.Region")
