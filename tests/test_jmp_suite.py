"""jmp's own shipped tests, run against mpolicy in place of jmp.

jmp installs its test modules (`jmp/_src/loss_scale_test.py`,
`policy_test.py`); each is executed here with its `jmp` bound to mpolicy
(plus the `dtype_to_names` table, which mpolicy keeps in
`mpolicy._src.policy`). Every test passes except the ones listed in
`EXCLUDED`, which differ by design (docs/compatibility.md, "With jmp") and must still fail,
so the list cannot go stale.
"""

import os
import re
import types
import unittest
import warnings

import pytest

import mpolicy
from mpolicy._src import policy as policy_lib

jmp = pytest.importorskip("jmp")

EXCLUDED = {
    "test_half_dtype": "half_dtype() is bfloat16 on CPU, TPU and GPUs with "
                       "compute capability 8.0 or newer (jmp: float16)",
}


def _as_jmp():
  namespace = dict(vars(mpolicy))
  namespace["dtype_to_names"] = policy_lib.dtype_to_names
  namespace["name_to_dtype"] = policy_lib.name_to_dtype
  return types.SimpleNamespace(**namespace)


def _run(module_name):
  path = os.path.join(os.path.dirname(jmp.__file__), "_src",
                      module_name + ".py")
  with open(path) as f:
    source = f.read()
  source, n = re.subn(r"^from jmp\._src import \w+ as jmp$",
                      "jmp = __mpolicy_as_jmp__", source, flags=re.M)
  assert n == 1, f"{path} no longer imports jmp as this test expects"
  module = types.ModuleType("jmp_suite_" + module_name)
  module.__dict__["__mpolicy_as_jmp__"] = _as_jmp()
  exec(compile(source, path, "exec"), module.__dict__)  # pylint: disable=exec-used
  suite = unittest.defaultTestLoader.loadTestsFromModule(module)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    with open(os.devnull, "w") as devnull:
      result = unittest.TextTestRunner(stream=devnull, verbosity=0).run(suite)
  failed = {test.id().split(".")[-1].split(" ")[0]: tb
            for test, tb in result.failures + result.errors}
  return result.testsRun, failed


def _base_name(name):
  return re.sub(r"\d+$", "", name)


@pytest.mark.parametrize("module_name", ["loss_scale_test", "policy_test"])
def test_jmp_shipped_tests_pass_against_mpolicy(module_name):
  ran, failed = _run(module_name)
  assert ran > 20, f"only {ran} tests found in jmp's {module_name}"
  unexpected = {name: tb for name, tb in failed.items()
                if _base_name(name) not in EXCLUDED}
  assert not unexpected, "\n\n".join(
      f"{name}:\n{tb}" for name, tb in unexpected.items())


def test_the_exclusions_still_differ():
  _, failed = _run("policy_test")
  for name in EXCLUDED:
    assert name in failed, (f"{name} now passes: drop it from EXCLUDED "
                            f"({EXCLUDED[name]})")
