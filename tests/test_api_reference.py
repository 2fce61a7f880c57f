"""The API reference and the type hints a user's tools read.

Every public name (`mpolicy.__all__` and the doors' `__all__`) has an entry
in docs/api/ (`bash .ci/run docs` builds it; this checks the sources
without Sphinx), every docs page is in the reference's table of contents,
every public function and method is annotated, and `mpolicy/py.typed`
ships with the package (PEP 561).
"""

import configparser
import importlib.util
import inspect
import pathlib
import re

import mpolicy

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def _conf():
  spec = importlib.util.spec_from_file_location("_docs_conf", DOCS / "conf.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _documented() -> set:
  """The full names the docs/api/ pages give an entry."""
  found = set()
  for page in (DOCS / "api").glob("*.rst"):
    for kind, name in re.findall(r"^\.\. auto(\w+):: ([\w.]+)$",
                                 page.read_text(), flags=re.M):
      found.add(name if kind == "module" else f"mpolicy.{name}")
  return found


def test_every_public_name_has_a_reference_entry():
  assert _conf().missing_entries(_documented()) == []


def test_the_entry_check_names_what_is_missing():
  documented = _documented() - {"mpolicy.amp", "mpolicy.debug"}
  assert _conf().missing_entries(documented) == ["mpolicy.amp",
                                                 "mpolicy.debug"]


def test_every_docs_page_is_in_the_reference():
  index = (DOCS / "index.rst").read_text()
  listed = set(re.findall(r"^   (\w+)$", index, flags=re.M))
  missing = [p.name for p in DOCS.glob("*.md") if p.stem not in listed]
  assert not missing, f"docs/index.rst's toctree lacks {missing}"


def _unannotated(fn) -> list:
  """What ``fn`` leaves unannotated: parameter names and ``"return"``."""
  sig = inspect.signature(inspect.unwrap(fn))
  bare = [name for name, p in sig.parameters.items()
          if p.annotation is inspect.Parameter.empty
          and name not in ("self", "cls")]
  if sig.return_annotation is inspect.Signature.empty:
    bare.append("return")
  return bare


def _public_functions():
  """(name, function) for each public function and each public method
  (or ``__init__``/``__call__``) that mpolicy defines on a public class."""
  for name in sorted(set(mpolicy.__all__)):
    obj = getattr(mpolicy, name)
    if inspect.isclass(obj):
      for attr, value in vars(obj).items():
        if attr.startswith("_") and attr not in ("__init__", "__call__"):
          continue
        value = getattr(value, "__func__", value)  # class/static methods
        value = getattr(value, "fget", value)  # properties
        if (inspect.isfunction(value)
            and value.__module__.startswith("mpolicy")):
          yield f"{name}.{attr}", value
    elif inspect.isfunction(inspect.unwrap(obj)):
      yield name, obj


def test_every_public_function_and_method_is_annotated():
  found = dict(_public_functions())
  assert {"amp", "make_train_step", "Policy.cast_to_compute",
          "DynamicLossScale.adjust", "OpRules.with_rule"} <= set(found)
  bare = {name: b for name, fn in found.items() if (b := _unannotated(fn))}
  assert not bare, f"unannotated: {bare}"


def test_the_annotation_check_sees_a_missing_return_and_parameter():
  def typed(x: int, *args: int) -> int:
    return x
  def untyped(x, *args: int):
    return x
  assert _unannotated(typed) == []
  assert _unannotated(untyped) == ["x", "return"]


def test_py_typed_ships_with_the_package():
  assert (ROOT / "mpolicy" / "py.typed").is_file()
  cfg = configparser.ConfigParser()
  cfg.read(ROOT / "setup.cfg")
  assert cfg["options.package_data"]["mpolicy"].split() == ["py.typed"]
  # The type check is configured in the repository, without a blanket
  # ignore.
  assert cfg["mypy"]["files"] == "mpolicy"
  assert "ignore_errors" not in cfg["mypy"]
