"""Counts the private JAX names mpolicy uses (run as a script to print them).

A name is counted as:

* ``from jax._src.X import Y`` -> ``jax._src.X.Y``;
* ``import jax._src.X`` -> ``jax._src.X``;
* a dotted ``jax._src.`` reference anywhere else in a file (code, strings,
  comments and docstrings), and a module-and-attribute pair of strings
  ``("jax._src.X", "Y")`` as handed to an importlib lookup -> ``jax._src.X.Y``.

``python tests/jax_compat/_private_names.py`` prints each distinct name
with the files using it, and the count.
"""

import ast
import collections
import pathlib
import re
import sys

_DOTTED = re.compile(r"jax\._src(?:\.\w+)+")
_PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "mpolicy"


def _module_attr_pairs(tree: ast.AST) -> set[tuple[int, str]]:
  """``f("jax._src.X", "Y")`` calls: (line, "jax._src.X.Y")."""
  found = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Call) and len(node.args) >= 2:
      mod, attr = node.args[0], node.args[1]
      if (isinstance(mod, ast.Constant) and isinstance(mod.value, str)
          and isinstance(attr, ast.Constant) and isinstance(attr.value, str)
          and (mod.value == "jax._src" or mod.value.startswith("jax._src."))):
        found.add((node.lineno, f"{mod.value}.{attr.value}"))
  return found


def names_in_source(source: str) -> set[str]:
  """The private JAX names one file's source uses, by the rules above."""
  tree = ast.parse(source)
  names, import_lines = set(), set()
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module and (
        node.module == "jax._src" or node.module.startswith("jax._src.")):
      names.update(f"{node.module}.{a.name}" for a in node.names)
      import_lines.update(range(node.lineno, node.end_lineno + 1))
    elif isinstance(node, ast.Import):
      private = [a.name for a in node.names if a.name.startswith("jax._src.")]
      names.update(private)
      if private:
        import_lines.update(range(node.lineno, node.end_lineno + 1))
  pairs = _module_attr_pairs(tree)
  pair_lines = {line for line, _ in pairs}
  names.update(name for _, name in pairs)
  for lineno, line in enumerate(source.splitlines(), start=1):
    if lineno in import_lines or lineno in pair_lines:
      continue
    names.update(_DOTTED.findall(line))
  return names


def private_names(package: pathlib.Path = _PACKAGE) -> dict[str, list[str]]:
  """Each distinct private name under ``package`` -> the files using it."""
  users = collections.defaultdict(list)
  for path in sorted(package.rglob("*.py")):
    for name in names_in_source(path.read_text()):
      users[name].append(str(path.relative_to(package.parent)))
  return dict(sorted(users.items()))


def main() -> int:
  names = private_names()
  for name, files in names.items():
    print(f"{name}: {', '.join(files)}")
  print(f"{len(names)} distinct private JAX names")
  return 0


if __name__ == "__main__":
  sys.exit(main())
