"""`jax_compat` is the only module of mpolicy that touches JAX internals."""

import ast
import pathlib

import mpolicy

_PACKAGE = pathlib.Path(mpolicy.__file__).parent
_INTERNAL = ("jax._src", "jax.extend", "jax.core", "jax.interpreters",
             "jaxlib")
_DOOR = _PACKAGE / "_src" / "jax_compat.py"


def _internal_uses(path: pathlib.Path) -> list[str]:
  """Imports of, and dotted references to, JAX internals in one file."""
  found = []
  tree = ast.parse(path.read_text(), filename=str(path))
  for node in ast.walk(tree):
    names = []
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module:
      names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    elif isinstance(node, ast.Attribute):
      parts, value = [node.attr], node.value
      while isinstance(value, ast.Attribute):
        parts.append(value.attr)
        value = value.value
      if isinstance(value, ast.Name):
        names = [".".join([value.id, *reversed(parts)])]
    for name in names:
      if any(name == p or name.startswith(p + ".") for p in _INTERNAL):
        found.append(f"{path.name}:{node.lineno}: {name}")
  return found


def test_only_the_compatibility_module_touches_jax_internals():
  files = sorted(p for p in _PACKAGE.rglob("*.py") if p != _DOOR)
  assert len(files) > 10
  uses = [u for f in files for u in _internal_uses(f)]
  assert not uses, ("JAX internals used outside mpolicy/_src/jax_compat.py "
                    "(route them through it):\n" + "\n".join(uses))


def test_the_checker_sees_internal_imports_and_references(tmp_path):
  bad = tmp_path / "bad.py"
  bad.write_text("import jax\nfrom jax._src import core\n"
                 "from jax.extend import core as c2\n"
                 "x = jax.core.Tracer\n")
  uses = _internal_uses(bad)
  assert any("jax._src" in u for u in uses)
  assert any("jax.extend" in u for u in uses)
  assert any("jax.core.Tracer" in u for u in uses)
  assert _internal_uses(_DOOR)  # The door itself does use them.
