"""Only the Haiku bridge needs Haiku: the interpreter layer runs without it.

Importing a module of mpolicy runs ``mpolicy/__init__``, which imports the
bridge, so whether the interpreter needs Haiku cannot be seen by importing
it. The check is static: every module under ``mpolicy/_src`` is parsed, the
graph of which of them each imports (at module level or inside functions)
is built, and no module outside `HAIKU_MODULES` may reach, through that
graph, a module that imports Haiku.
"""

import ast
import collections
import pathlib

import mpolicy

_SRC = pathlib.Path(mpolicy.__file__).parent / "_src"
_PREFIX = "mpolicy._src"
# The public package: its __init__ imports the bridge, so a module that
# imports `mpolicy` itself needs Haiku. It is a node of the graph too.
_PUBLIC = "mpolicy"

# The modules of mpolicy/_src that may import Haiku: the bridge and its
# class lookup. Every other module is interpreter layer, new ones included.
HAIKU_MODULES = frozenset({"haiku_bridge"})


def _is_haiku(name: str) -> bool:
  return name == "haiku" or name.startswith("haiku.")


def _module_name(path: pathlib.Path, src: pathlib.Path) -> str:
  parts = list(path.relative_to(src).with_suffix("").parts)
  if parts[-1] == "__init__":
    parts.pop()
  return ".".join(parts)


def _internal(dotted: str) -> str | None:
  """``x`` for ``mpolicy._src.x`` (or ``mpolicy._src.x.y``), ``mpolicy``
  for the public package or a name in it, else ``None``."""
  if dotted.startswith(_PREFIX + "."):
    return dotted[len(_PREFIX) + 1:]
  if dotted == _PUBLIC or (dotted.startswith(_PUBLIC + ".")
                           and dotted != _PREFIX):
    return _PUBLIC
  return None


def _imports(path: pathlib.Path, this: str,
             known: set[str]) -> tuple[set[str], bool]:
  """The modules of ``known`` that the file of module ``this`` imports, and
  whether it imports Haiku, from ``import`` statements anywhere in it."""
  full = (_PUBLIC if this == _PUBLIC else f"{_PREFIX}.{this}").split(".")
  # The package that relative imports start from.
  package = full if path.name == "__init__.py" else full[:-1]
  modules: set[str] = set()
  haiku = False

  def add(dotted: str):
    """Records an absolute name: a module, or a name inside one."""
    nonlocal haiku
    haiku |= _is_haiku(dotted)
    inner = _internal(dotted)
    if inner == _PUBLIC:
      modules.add(_PUBLIC)
      return
    # `mpolicy._src.a.b` may name module `a.b` or a name `b` in module `a`;
    # importing module `a.b` runs package `a` first.
    while inner:
      if inner in known:
        modules.add(inner)
      inner = inner.rpartition(".")[0]

  for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
    if isinstance(node, ast.Import):
      for alias in node.names:
        add(alias.name)
    elif isinstance(node, ast.ImportFrom):
      if node.level:  # Relative: `from . import x`, `from .x import y`.
        base = ".".join(package[:len(package) - node.level + 1]
                        + ([node.module] if node.module else []))
      else:
        base = node.module or ""
      add(base)
      for alias in node.names:
        add(f"{base}.{alias.name}")
  modules.discard(this)
  return modules, haiku


def import_graph(src: pathlib.Path) -> tuple[dict[str, set[str]], set[str]]:
  """Which modules under ``src`` each imports, and which import Haiku.

  The public package's ``__init__.py`` (beside ``src``), if there is one,
  is the node ``mpolicy``.
  """
  files = {_module_name(p, src): p for p in sorted(src.rglob("*.py"))}
  files.pop("", None)  # The package's own __init__.
  known = set(files) | {_PUBLIC}
  graph, haiku = {}, set()
  public_init = src.parent / "__init__.py"
  if public_init.exists():
    files[_PUBLIC] = public_init
  for name, path in files.items():
    graph[name], imports_haiku = _imports(path, name, known)
    if imports_haiku:
      haiku.add(name)
  return graph, haiku


def haiku_chains(src: pathlib.Path,
                 allowed: frozenset[str]) -> dict[str, list[str]]:
  """For each module outside ``allowed`` that reaches a Haiku import, the
  shortest chain of imports from it to a module that imports Haiku."""
  graph, haiku = import_graph(src)
  chains = {}
  for start in sorted(set(graph) - allowed - {_PUBLIC}):
    parent = {start: None}
    queue = collections.deque([start])
    while queue:
      module = queue.popleft()
      if module in haiku:
        chain = []
        while module is not None:
          chain.append(module)
          module = parent[module]
        chains[start] = chain[::-1]
        break
      for nxt in sorted(graph.get(module, ())):
        if nxt not in parent:
          parent[nxt] = module
          queue.append(nxt)
  return chains


def test_only_the_haiku_modules_reach_haiku():
  graph, _ = import_graph(_SRC)
  assert {"interpreter", "registry"} <= set(graph)  # The walk saw them.
  assert "registry" in graph["interpreter"]  # ...and their imports.
  # Subpackages are walked too: their modules are dotted names, and
  # importing one runs its package's __init__ first.
  assert {"training", "training.scaling", "training._trees"} <= set(graph)
  assert {"distributed", "training", "training._trees"} <= (
      graph["training.scaling"])
  assert "training.attribution" in graph["training.scaling"]
  chains = haiku_chains(_SRC, HAIKU_MODULES)
  assert not chains, (
      "These modules of mpolicy/_src need Haiku through their imports; only "
      f"{sorted(HAIKU_MODULES)} may:\n" + "\n".join(
          " -> ".join(chain) + " (imports haiku)"
          for chain in chains.values()))


def test_the_bridge_does_import_haiku():
  graph, haiku = import_graph(_SRC)
  assert haiku == HAIKU_MODULES  # The allow-list names no stale module.
  assert "module_calls" in graph["haiku_bridge"]


def _write(root: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
  for name, text in files.items():
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
  return root


def test_the_checker_follows_every_import_form_to_haiku(tmp_path):
  _write(tmp_path, {"__init__.py": ("from mpolicy._src.clean import f\n"
                                    "from ._src.leaf import g\n")})
  src = _write(tmp_path / "_src", {
      "__init__.py": "",
      "top.py": "from mpolicy._src import middle as m\n",
      "middle.py": "def f():\n  import mpolicy._src.low.deep\n",
      "low/__init__.py": "",
      "low/deep.py": "from mpolicy._src.leaf import thing\n",
      "leaf.py": "def g():\n  from haiku import Module\n",
      "relative.py": "from . import leaf\n",
      "dotted.py": "import haiku.experimental\n",
      "clean.py": "import jax\nfrom mpolicy._src import other\n",
      "other.py": "'''import haiku  (a docstring, not an import)'''\n",
      "public.py": "def h():\n  import mpolicy\n",
  })
  graph, haiku = import_graph(src)
  assert graph["top"] == {"middle"}
  assert graph["middle"] == {"low", "low.deep"}
  assert graph["low.deep"] == {"leaf"}
  assert haiku == {"leaf", "dotted"}
  assert graph["mpolicy"] == {"clean", "leaf"}
  assert graph["public"] == {"mpolicy"}
  chains = haiku_chains(src, frozenset())
  assert chains["top"] == ["top", "middle", "low.deep", "leaf"]
  assert chains["relative"] == ["relative", "leaf"]
  assert chains["dotted"] == ["dotted"]
  assert chains["public"] == ["public", "mpolicy", "leaf"]
  assert "clean" not in chains and "other" not in chains
  # Allowing the Haiku importers themselves does not excuse their users.
  chains = haiku_chains(src, frozenset({"leaf", "dotted"}))
  assert set(chains) == {"top", "middle", "low.deep", "relative", "public"}


# Flax is optional: only its bridge imports it, and no module imports the
# bridge (`amp` loads it through `frameworks` once the user imported Flax).
FLAX_MODULES = frozenset({"flax_bridge", "nnx_bridge"})


def _imports_flax(path: pathlib.Path) -> bool:
  for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
    names = []
    if isinstance(node, ast.Import):
      names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and not node.level:
      names = [node.module or ""]
    if any(n == "flax" or n.startswith("flax.") for n in names):
      return True
  return False


def test_only_the_flax_bridge_imports_flax_and_nothing_imports_it():
  files = {_module_name(p, _SRC): p for p in sorted(_SRC.rglob("*.py"))}
  files[_PUBLIC] = _SRC.parent / "__init__.py"
  assert {name for name, path in files.items()
          if _imports_flax(path)} == FLAX_MODULES
  graph, _ = import_graph(_SRC)
  importers = {name for name, imports in graph.items()
               if imports & FLAX_MODULES}
  assert not importers, (
      f"{sorted(importers)} import the Flax bridge, so mpolicy would need "
      "Flax; name it in its frameworks record instead.")
