"""`jax_compat` is the only package of mpolicy that touches JAX internals
or reads a primitive's params by key."""

import ast
import pathlib

import mpolicy

_PACKAGE = pathlib.Path(mpolicy.__file__).parent
_INTERNAL = ("jax._src", "jax.extend", "jax.core", "jax.interpreters",
             "jaxlib")
_DOOR = _PACKAGE / "_src" / "jax_compat"


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


def _outside_the_door() -> list[pathlib.Path]:
  return sorted(p for p in _PACKAGE.rglob("*.py") if _DOOR not in p.parents)


def test_only_the_compatibility_module_touches_jax_internals():
  files = _outside_the_door()
  assert len(files) > 10
  uses = [u for f in files for u in _internal_uses(f)]
  assert not uses, ("JAX internals used outside mpolicy/_src/jax_compat/ "
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
  assert _internal_uses(_DOOR / "internals.py")  # The door does use them.


def _is_params(node) -> bool:
  """``x.params``, a name ``params``, or a call of a ``*params`` reader."""
  if isinstance(node, ast.Call):
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(
        func, "id", "")
    return name.endswith("params")
  return ((isinstance(node, ast.Attribute) and node.attr == "params")
          or (isinstance(node, ast.Name) and node.id == "params"))


def _param_reads(path: pathlib.Path) -> list[str]:
  """Reads of an equation's params by key: ``eqn.params["k"]``,
  ``params.get("k")``, ``dict(eqn.params, k=...)``, ``"k" in params``."""
  found = []
  for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
    hit = None
    if (isinstance(node, ast.Subscript) and _is_params(node.value)
        and isinstance(node.slice, ast.Constant)
        and isinstance(node.slice.value, str)):
      hit = f"params[{node.slice.value!r}]"
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
          and node.func.attr == "get" and _is_params(node.func.value)):
      hit = "params.get(...)"
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
          and node.func.id == "dict" and node.args
          and _is_params(node.args[0]) and node.keywords):
      hit = "dict(params, key=...)"
    elif (isinstance(node, ast.Compare) and len(node.comparators) == 1
          and _is_params(node.comparators[0])
          and isinstance(node.left, ast.Constant)):
      hit = f"{node.left.value!r} in params"
    if hit:
      found.append(f"{path.name}:{node.lineno}: {hit}")
  return found


def test_only_the_compatibility_module_reads_params_by_key():
  reads = [r for f in _outside_the_door() for r in _param_reads(f)]
  assert not reads, ("primitive params read by key outside "
                     "mpolicy/_src/jax_compat/ (add a reader there):\n"
                     + "\n".join(reads))


def test_the_params_checker_sees_each_form(tmp_path):
  bad = tmp_path / "bad.py"
  bad.write_text("a = eqn.params['jaxpr']\nb = params.get('num_consts')\n"
                 "c = dict(eqn.params, jaxpr=None)\nd = 'ft_in' in params\n"
                 "e = x['jaxpr']\nf = jax_compat.conv_params(eqn)['padding']\n")
  assert [r.split(": ")[1] for r in _param_reads(bad)] == [
      "params['jaxpr']", "params.get(...)", "dict(params, key=...)",
      "'ft_in' in params", "params['padding']"]
  assert _param_reads(_DOOR / "params.py")  # The door itself reads them.
