"""The layers of mpolicy, checked by reading its imports.

Importing a module of mpolicy runs ``mpolicy/__init__`` first, and the
test process has every optional package loaded, so what a module needs
cannot be seen by importing it. The checks are static: every module under
``mpolicy/_src`` (and the public ``mpolicy/__init__``) is parsed, and the
graph of which of them each imports (at module level or inside functions,
with the line of each import) is built. Imports under ``if TYPE_CHECKING:``
never run and are left out. The rules:

- no import circles;
- each optional package is imported only by the modules that own it
  (Haiku by its bridge, optax by ``training/``, orbax by the checkpoint
  modules, Flax by its two bridges), and no other module reaches one of
  those imports through its own imports; the public package reaches none;
- the interpreter (``interpreter``, ``amp``, ``higher_order``, ``rules/``)
  never reaches the wings: the bridges, training, checkpoints, inspection.

A violation names each file and line of the chain of imports.
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import fnmatch
import pathlib

import pytest

import mpolicy

_SRC = pathlib.Path(mpolicy.__file__).parent / "_src"
_PREFIX = "mpolicy._src"
# The public package: a node of the graph too.
_PUBLIC = "mpolicy"

# Optional package -> the modules of mpolicy/_src that may import it
# (`fnmatch` patterns over dotted module names).
OWNERS = {
    "haiku": ("haiku_bridge",),
    "optax": ("training.*",),
    "orbax": ("checkpoint*",),
    "flax": ("flax_bridge", "nnx_bridge"),
    "equinox": (),
}

# The interpreter layer, and the wings it must never reach.
INTERPRETER = ("interpreter", "amp", "higher_order", "rules", "rules.*")
WINGS = ("*_bridge", "module_calls", "class_lookup", "training",
         "training.*", "checkpoint*", "explain", "fp8_stats",
         "loss_scale*", "distributed")


def _matches(module: str, patterns) -> bool:
  return any(fnmatch.fnmatchcase(module, p) for p in patterns)


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


def _is_type_checking(node: ast.AST) -> bool:
  return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(
      node.test)


def _import_nodes(tree: ast.AST):
  """The import statements of ``tree``, outside ``if TYPE_CHECKING:``."""
  todo = [tree]
  while todo:
    node = todo.pop()
    if isinstance(node, (ast.Import, ast.ImportFrom)):
      yield node
    for child in ast.iter_child_nodes(node):
      if _is_type_checking(child):
        todo.extend(child.orelse)  # The body never runs.
      else:
        todo.append(child)


@dataclasses.dataclass
class Module:
  """One module's imports: internal module -> line, package -> line.

  ``shown`` is its file as the package's users see it
  (``mpolicy/_src/amp.py``).
  """
  shown: str
  imports: dict[str, int] = dataclasses.field(default_factory=dict)
  packages: dict[str, int] = dataclasses.field(default_factory=dict)

  def where(self, target: str) -> str:
    line = self.imports.get(target, self.packages.get(target))
    return f"{self.shown}:{line}"


def _scan(path: pathlib.Path, this: str, known: set[str],
          shown: str) -> Module:
  """The modules of ``known`` and the top-level packages that the file of
  module ``this`` imports, each with the line of its first import."""
  full = (_PUBLIC if this == _PUBLIC else f"{_PREFIX}.{this}").split(".")
  # The package that relative imports start from.
  package = full if path.name == "__init__.py" else full[:-1]
  module = Module(shown)

  def add(dotted: str, line: int):
    """Records an absolute name: a module, or a name inside one."""
    if dotted == _PREFIX:
      return  # The empty `_src` package itself.
    inner = _internal(dotted)
    if inner is None:
      module.packages.setdefault(dotted.split(".")[0], line)
      return
    if inner == _PUBLIC:
      module.imports.setdefault(_PUBLIC, line)
      return
    # `mpolicy._src.a.b` may name module `a.b` or a name `b` in module `a`;
    # importing module `a.b` runs package `a` first.
    while inner:
      if inner in known:
        module.imports.setdefault(inner, line)
      inner = inner.rpartition(".")[0]

  tree = ast.parse(path.read_text(), filename=str(path))
  for node in sorted(_import_nodes(tree), key=lambda n: n.lineno):
    if isinstance(node, ast.Import):
      for alias in node.names:
        add(alias.name, node.lineno)
    else:
      if node.level:  # Relative: `from . import x`, `from .x import y`.
        base = ".".join(package[:len(package) - node.level + 1]
                        + ([node.module] if node.module else []))
      else:
        base = node.module or ""
      add(base, node.lineno)
      if base == _PREFIX or _internal(base) is not None:
        for alias in node.names:
          add(f"{base}.{alias.name}", node.lineno)
  module.imports.pop(this, None)
  return module


def import_graph(src: pathlib.Path) -> dict[str, Module]:
  """Every module under ``src`` with its imports.

  The public package's ``__init__.py`` (beside ``src``), if there is one,
  is the node ``mpolicy``.
  """
  files = {_module_name(p, src): p for p in sorted(src.rglob("*.py"))}
  files.pop("", None)  # The package's own __init__.
  known = set(files) | {_PUBLIC}
  public_init = src.parent / "__init__.py"
  if public_init.exists():
    files[_PUBLIC] = public_init
  return {name: _scan(path, name, known,
                      f"mpolicy/{path.relative_to(src.parent).as_posix()}")
          for name, path in files.items()}


def _chain(graph: dict[str, Module], start: str, stop) -> list[str] | None:
  """The shortest chain of imports from ``start`` to a module for which
  ``stop(module)`` holds (``start`` included), as the modules on it."""
  parent = {start: None}
  queue = collections.deque([start])
  while queue:
    module = queue.popleft()
    if stop(module):
      chain = []
      while module is not None:
        chain.append(module)
        module = parent[module]
      return chain[::-1]
    for nxt in sorted(graph[module].imports):
      if nxt not in parent:
        parent[nxt] = module
        queue.append(nxt)
  return None


def _describe(graph: dict[str, Module], chain: list[str],
              last: str | None = None) -> str:
  """``a.py:3 imports b; b.py:9 imports c; c.py:5 imports haiku``."""
  steps = [f"{graph[a].where(b)} imports {b}"
           for a, b in zip(chain, chain[1:])]
  if last is not None:
    steps.append(f"{graph[chain[-1]].where(last)} imports {last}")
  return "; ".join(steps)


def package_chains(graph: dict[str, Module], package: str,
                   allowed) -> dict[str, str]:
  """For each module outside ``allowed`` (patterns) that imports
  ``package`` or reaches a module that does, the chain, described."""
  found = {}
  for start in sorted(graph):
    if _matches(start, allowed):
      continue
    chain = _chain(graph, start, lambda m: package in graph[m].packages)
    if chain is not None:
      found[start] = _describe(graph, chain, package)
  return found


def circles(graph: dict[str, Module]) -> list[list[str]]:
  """The import circles: groups of modules that import each other.

  An import of a module's own enclosing package is no circle: Python runs
  the package before the module, whatever the module imports.
  """

  def edges(module):
    return [m for m in graph[module].imports
            if not module.startswith(m + ".")]

  index, low, stack, on_stack, found = {}, {}, [], set(), []

  def visit(v):  # Tarjan's strongly connected components.
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in edges(v):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      group = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        group.append(w)
        if w == v:
          break
      if len(group) > 1:
        found.append(sorted(group))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return found


def _circle_text(graph: dict[str, Module], group: list[str]) -> str:
  """Every import between the modules of one circle, with its line."""
  members = set(group)
  lines = [f"{graph[a].where(b)} imports {b}" for a in group
           for b in sorted(graph[a].imports) if b in members
           and not a.startswith(b + ".")]
  return "\n    ".join(lines)


# --- The rules, on mpolicy itself ---------------------------------------------


@pytest.fixture(name="graph", scope="module")
def _graph():
  return import_graph(_SRC)


def test_the_walk_sees_every_module_and_its_imports(graph):
  assert {"interpreter", "registry", _PUBLIC} <= set(graph)
  assert "registry" in graph["interpreter"].imports
  # Subpackages are walked too: their modules are dotted names, and
  # importing one runs its package's __init__ first.
  assert {"training", "training.scaling", "training._trees"} <= set(graph)
  assert {"distributed", "training", "training._trees",
          "training.attribution"} <= set(graph["training.scaling"].imports)
  assert set(graph["haiku_bridge"].packages) >= {"haiku", "warnings"}
  assert graph["checkpoint.disk"].packages["orbax"] > 1  # A line number.
  # The lazy names of the public package are not imports.
  assert "haiku_bridge" not in graph[_PUBLIC].imports


def test_no_import_circles(graph):
  found = circles(graph)
  assert not found, "Import circles:\n" + "\n".join(
      f"  {', '.join(group)}:\n    {_circle_text(graph, group)}"
      for group in found)


def test_each_optional_package_is_imported_only_by_its_owners(graph):
  problems = []
  for package, owners in OWNERS.items():
    for module, chain in package_chains(graph, package, owners).items():
      problems.append(f"{module} needs {package}: {chain}")
  assert not problems, (
      "Only these modules may need each optional package, directly or "
      f"through their imports: {OWNERS}\n" + "\n".join(problems))
  # The owners do import them (the table names no stale module).
  importers = {package: {m for m, module in graph.items()
                         if package in module.packages}
               for package in OWNERS}
  assert importers["haiku"] == {"haiku_bridge"}
  assert importers["orbax"] == {"checkpoint.disk"}
  assert importers["flax"] == {"flax_bridge", "nnx_bridge"}
  assert importers["equinox"] == set()
  assert {"training.skipping", "training.train_step"} <= importers["optax"]
  assert "training.scaling" not in importers["optax"]


def test_the_public_package_needs_only_jax_and_numpy(graph):
  for package in OWNERS:
    chain = _chain(graph, _PUBLIC, lambda m: package in graph[m].packages)
    assert chain is None, (
        f"import mpolicy would import {package}: "
        + _describe(graph, chain, package))


def test_the_interpreter_never_reaches_the_wings(graph):
  core = [m for m in graph if _matches(m, INTERPRETER)]
  assert {"interpreter", "amp", "higher_order", "rules.matmul"} <= set(core)
  problems = []
  for start in sorted(core):
    chain = _chain(graph, start, lambda m: _matches(m, WINGS))
    if chain is not None:
      problems.append(f"{start} reaches {chain[-1]}: "
                      + _describe(graph, chain))
  assert not problems, (
      "The interpreter layer must not import the bridges, training, "
      "checkpoints or inspection:\n" + "\n".join(problems))


def test_only_the_flax_bridges_import_flax_and_nothing_imports_them(graph):
  importers = sorted(name for name, module in graph.items()
                     if set(module.imports) & {"flax_bridge", "nnx_bridge"})
  assert not importers, (
      f"{importers} import a Flax bridge, so mpolicy would need Flax; name "
      "it in its frameworks record instead.")


# --- The checker itself, on a small tree --------------------------------------


def _write(root: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
  for name, text in files.items():
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
  return root


def test_the_checker_follows_every_import_form_with_its_line(tmp_path):
  _write(tmp_path, {"__init__.py": (
      "import typing\n"
      "from mpolicy._src.clean import f\n"
      "from ._src.leaf import g\n"
      "if typing.TYPE_CHECKING:\n"
      "  from mpolicy._src.dotted import h\n")})
  src = _write(tmp_path / "_src", {
      "__init__.py": "",
      "top.py": "from mpolicy._src import middle as m\n",
      "middle.py": "def f():\n  import mpolicy._src.low.deep\n",
      "low/__init__.py": "",
      "low/deep.py": "from mpolicy._src.leaf import thing\n",
      "leaf.py": "import jax\n\ndef g():\n  from haiku import Module\n",
      "relative.py": "from . import leaf\n",
      "dotted.py": "import haiku.experimental\n",
      "clean.py": "import jax\nfrom mpolicy._src import other\n",
      "other.py": "'''import haiku  (a docstring, not an import)'''\n",
      "public.py": "def h():\n  import mpolicy\n",
  })
  graph = import_graph(src)
  assert set(graph["top"].imports) == {"middle"}
  assert graph["middle"].imports == {"low": 2, "low.deep": 2}
  assert set(graph["low.deep"].imports) == {"leaf"}
  assert graph["leaf"].packages == {"jax": 1, "haiku": 4}
  assert set(graph["mpolicy"].imports) == {"clean", "leaf"}  # Not dotted.
  assert set(graph["public"].imports) == {"mpolicy"}
  chains = package_chains(graph, "haiku", ())
  assert chains["top"] == (
      "mpolicy/_src/top.py:1 imports middle; "
      "mpolicy/_src/middle.py:2 imports low.deep; "
      "mpolicy/_src/low/deep.py:1 imports leaf; "
      "mpolicy/_src/leaf.py:4 imports haiku")
  assert chains["relative"].startswith("mpolicy/_src/relative.py:1 imports "
                                       "leaf;")
  assert chains["dotted"] == "mpolicy/_src/dotted.py:1 imports haiku"
  assert chains["public"].startswith(
      "mpolicy/_src/public.py:2 imports mpolicy; mpolicy/__init__.py:3 "
      "imports leaf;")
  assert "clean" not in chains and "other" not in chains
  # Allowing the importers themselves does not excuse their users.
  chains = package_chains(graph, "haiku", ("leaf", "dot*"))
  assert set(chains) == {"top", "middle", "low.deep", "relative", "public",
                         "mpolicy"}
  assert not circles(graph)


def test_the_checker_finds_a_circle_but_not_a_package_import(tmp_path):
  src = _write(tmp_path / "_src", {
      "__init__.py": "",
      "a.py": "from mpolicy._src import b\n",
      "b.py": "import jax\n\ndef f():\n  from mpolicy._src import a\n",
      "pkg/__init__.py": "from mpolicy._src.pkg import part\n",
      "pkg/part.py": "from mpolicy._src.pkg import base\n",
      "pkg/base.py": "",
  })
  graph = import_graph(src)
  assert circles(graph) == [["a", "b"]]
  assert _circle_text(graph, ["a", "b"]) == (
      "mpolicy/_src/a.py:1 imports b\n    mpolicy/_src/b.py:4 imports a")


# --- tests/rules mirrors mpolicy/_src/rules -----------------------------------

_TESTS = pathlib.Path(__file__).parent

# Test files still named for what they check rather than for their family,
# and the family each belongs to; families tested outside tests/rules.
_OLDER_NAMES = {
    "test_callbacks": "special",
    "test_grad_rules": "matmul",  # and conv: their transposes.
    "test_residuals": "half_storage",
    "test_fp8_sharding": "fp8_mesh",
    "test_rule_tables": "facts",
}
_TESTED_ELSEWHERE = {"conv": "tests/rules/test_grad_rules.py"}


def _family_of(test: str, families: set[str]) -> str | None:
  """The family ``test_<family>[_<aspect>]`` names (longest first)."""
  if test in _OLDER_NAMES:
    return _OLDER_NAMES[test]
  name = test[len("test_"):]
  for family in sorted(families, key=len, reverse=True):
    if name == family or name.startswith(family + "_"):
      return family
  return None


def test_each_rules_test_file_is_named_for_its_family_and_each_family_has_one():
  families = {p.stem for p in (_SRC / "rules").glob("*.py")} - {"__init__"}
  tests = {p.stem for p in (_TESTS / "rules").glob("test_*.py")}
  owner = {test: _family_of(test, families) for test in sorted(tests)}
  stray = sorted(t for t, f in owner.items() if f not in families)
  assert not stray, (
      f"tests/rules/{stray[0]}.py names no file of mpolicy/_src/rules: call "
      "it test_<family>.py or test_<family>_<aspect>.py after the family "
      f"it checks ({sorted(families)}).")
  untested = families - set(owner.values()) - set(_TESTED_ELSEWHERE)
  assert not untested, f"No tests/rules/test_<family>.py for {untested}."
  assert set(_OLDER_NAMES) <= tests  # The table names no stale file.


# --- One engine ---------------------------------------------------------------

# Modules that may loop over a jaxpr's equations and bind them, and why.
EVALUATORS = {
    "interpreter": "the interpreter: the one evaluator of jaxprs",
    # The gradient helpers' backward sums in reduce_dtype (`distributed.
    # summed_in`): a traced gradient run as JAX wrote it, but for the
    # narrower cross-device sums at its top level.
    "jax_compat.hijax": "eval_rebinding: a jaxpr run as written, some "
                        "equations rebound",
}


def _loops_over_equations(tree: ast.AST):
  """The ``for`` statements of ``tree`` over ``<something>.eqns`` (or an
  ``enumerate`` of it), each with whether its body binds a primitive (a
  call of something named ``bind``, ``bind_with`` or ``*.bind``)."""
  for node in ast.walk(tree):
    if isinstance(node, ast.For) and ".eqns" in ast.unparse(node.iter):
      binds = any(
          isinstance(n, ast.Call) and ast.unparse(n.func).split(".")[-1]
          in ("bind", "bind_with") for b in node.body for n in ast.walk(b))
      yield node.lineno, binds


def _equation_loops() -> dict[str, list[tuple[int, bool]]]:
  found = {}
  for path in sorted(_SRC.rglob("*.py")):
    loops = list(_loops_over_equations(ast.parse(path.read_text())))
    if loops:
      found[_module_name(path, _SRC)] = loops
  return found


def test_one_evaluator_binds_jaxpr_equations():
  """No module but the interpreter walks a jaxpr's equations binding them
  (the debugger replays programs through `interpreter.replay`, an op
  rule reusing JAX's own rule through `interpreter.replay_binding`;
  explain, the sites and fp8_stats watch the interpreter)."""
  loops = _equation_loops()
  binding = {m for m, found in loops.items() if any(b for _, b in found)}
  assert binding <= set(EVALUATORS), (
      "Only the interpreter evaluates jaxprs; these modules bind equations "
      f"in a loop of their own: {sorted(binding - set(EVALUATORS))}")
  # Every `for ... in ...eqns` loop is in a module allowed to have one.
  assert set(loops) <= set(EVALUATORS), sorted(set(loops) - set(EVALUATORS))
  assert "interpreter" in loops  # It finds them.


def test_the_check_finds_a_loop_that_binds(tmp_path):
  tree = ast.parse("def run(jaxpr, env):\n"
                   "  for eqn in jaxpr.eqns:\n"
                   "    env[eqn] = eqn.primitive.bind(*env[eqn])\n"
                   "  for n, e in enumerate(closed.jaxpr.eqns):\n"
                   "    print(e)\n")
  assert list(_loops_over_equations(tree)) == [(2, True), (4, False)]


def test_one_observer_seam(graph):
  """The interpreter and its rules tell observers through `observe` alone:
  explain, the debugger's sites and its checker are observers, not hooks
  of their own in the loop."""
  assert "recording" not in graph and "debugging.walk" not in graph
  for module in ("interpreter", "rules.dispatch"):
    assert "observe" in graph[module].imports, module
    assert not {"sites", "explain", "fp8_stats"} & set(
        graph[module].imports), module
  assert not any(m.startswith("debugging") for m in graph["interpreter"]
                 .imports)
  for observer in ("sites", "explain", "debugging.check"):
    assert "observe" in graph[observer].imports, observer
  # The debugger takes its higher-order rules from `higher_order`'s
  # table, through the interpreter's step rules.
  assert "higher_order" in graph["stepping"].imports
  assert "stepping" in graph["interpreter"].imports


def test_lower_modules_take_nothing_from_higher_ones(graph):
  """The debugger and the interpreter layer import no training helper
  (`path_str` lives in the low module `tree_paths`)."""
  for start in sorted(m for m in graph
                      if m.startswith("debugging") or _matches(m, INTERPRETER)):
    chain = _chain(graph, start, lambda m: m.startswith("training"))
    assert chain is None, f"{start} reaches training: {_describe(graph, chain)}"
  assert "tree_paths" in graph["debugging.program"].imports
  assert "tree_paths" in graph["training.attribution"].imports


def _class_names() -> dict[str, list[str]]:
  """Each public class name (no leading ``_``: a private helper class is
  its module's own) defined at any depth in mpolicy/, with its files."""
  found = collections.defaultdict(list)
  for path in sorted(_SRC.parent.rglob("*.py")):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
        found[node.name].append(path.relative_to(_SRC.parent.parent)
                                .as_posix())
  return found


def test_no_two_classes_share_a_name():
  """One name, one idea: a reader who meets `Decision` finds one class."""
  found = _class_names()
  shared = {name: files for name, files in found.items() if len(files) > 1}
  assert not shared, (
      f"Classes defined more than once (rename one of each): {shared}")
  assert found["Decision"] == ["mpolicy/_src/observe.py"]  # It sees them.


# The checkpoint layer keeps to what orbax lacks (agreement and timeouts
# across processes, per-leaf checksums, checks against the template, the
# `.mpolicy-old` recovery, removing what killed saves left); it may not grow
# past this many lines.
CHECKPOINT_LINES = 801


def test_the_checkpoint_layer_stays_small():
  files = sorted((_SRC / "checkpoint").glob("*.py"))
  lines = {p.name: len(p.read_text().splitlines()) for p in files}
  assert {"processes.py", "disk.py"} <= set(lines)  # It finds the layer.
  assert sum(lines.values()) <= CHECKPOINT_LINES, (
      f"The checkpoint layer has {sum(lines.values())} lines (at most "
      f"{CHECKPOINT_LINES}): {lines}. Let orbax do what it does.")
