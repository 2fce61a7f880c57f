"""The private JAX names mpolicy uses: each exists in the installed JAX,
each is listed (with its use and awaited public replacement), and there are
at most 20 of them."""

import ast
import pathlib

import jax

from mpolicy._src.jax_compat import private

import _private_names

_DOOR = pathlib.Path(private.__file__).parent
_DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "compatibility.md"
_LIMIT = 20


def test_every_private_name_mpolicy_uses_exists_in_the_installed_jax():
  report = private.private_name_report()
  print(f"\nJAX {jax.__version__}: private names mpolicy uses")
  for name, expected, present in report:
    state = "present" if present else "absent"
    print(f"  {name}: {state}{'' if expected else ' (optional here)'}")
  missing = private.missing_private_names()
  assert not missing, (f"JAX {jax.__version__} lacks private names mpolicy "
                       f"uses (update mpolicy/_src/jax_compat): {missing}")
  assert len(report) > 30


def test_a_missing_private_name_is_named(monkeypatch):
  names = dict(private.PRIVATE_NAMES)
  names["jax._src.core"] = {"no_such_name": (None, None)}
  names["jax._src.no_such_module"] = {"x": (None, (0, 1, 0))}
  monkeypatch.setattr(private, "PRIVATE_NAMES", names)
  assert private.missing_private_names() == ["jax._src.core.no_such_name"]


def test_mpolicy_names_at_most_twenty_private_jax_names():
  names = _private_names.private_names()
  listing = "\n".join(f"  {n}: {', '.join(f)}" for n, f in names.items())
  print(f"\n{len(names)} private JAX names:\n{listing}")
  assert len(names) <= _LIMIT, (
      f"mpolicy/ names {len(names)} private JAX names (at most {_LIMIT}):\n"
      + listing)
  assert all(f.startswith("mpolicy/_src/jax_compat/")
             for files in names.values() for f in files)


def test_each_counted_name_is_listed_and_each_listed_module_used():
  counted = set(_private_names.private_names())
  listed = set(private.PRIVATE_NAMES)
  unlisted = {n for n in counted if n not in listed
              and n.rpartition(".")[0] not in listed}
  assert not unlisted, f"private names missing from PRIVATE_NAMES: {unlisted}"
  assert listed <= counted, f"listed but unused: {listed - counted}"


def _private_reads(path: pathlib.Path) -> set[str]:
  """``module.name`` for each name read off an imported private module
  (``alias.name``, ``getattr(alias, "name")``, ``hasattr(alias, "name")``)."""
  tree = ast.parse(path.read_text())
  aliases = {}
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
        "jax._src"):
      for a in node.names:
        aliases[a.asname or a.name] = f"{node.module}.{a.name}"
  reads = set()
  for node in ast.walk(tree):
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
        and node.value.id in aliases):
      reads.add(f"{aliases[node.value.id]}.{node.attr}")
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
          and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
          and isinstance(node.args[0], ast.Name)
          and node.args[0].id in aliases
          and isinstance(node.args[1], ast.Constant)):
      reads.add(f"{aliases[node.args[0].id]}.{node.args[1].value}")
  return reads


def test_every_name_read_off_a_private_module_is_listed():
  reads = set().union(*(_private_reads(p) for p in _DOOR.glob("*.py")))
  listed = {f"{m}.{n}" for m, names in private.PRIVATE_NAMES.items()
            for n in names}
  assert reads, "the reader found no private reads"
  assert reads <= listed, f"unlisted private reads: {sorted(reads - listed)}"
  assert listed <= reads, f"listed but never read: {sorted(listed - reads)}"


def test_the_docs_table_lists_each_private_module():
  rows = [line for line in _DOCS.read_text().splitlines()
          if line.startswith("| `jax._src.")]
  documented = {row.split("`")[1] for row in rows}
  assert documented == set(private.PRIVATE_NAMES)


def test_the_counter_sees_each_form():
  source = ("import jax._src.a\nfrom jax._src.b import c\n"
            "from jax._src import d as _d\n"
            "x = 'see jax._src.e.f here'\n"
            "y = _attr('jax._src.g', 'H')\n"
            "# jax._src.i.j in a comment\n"
            "from jax.extend import core\n")
  assert _private_names.names_in_source(source) == {
      "jax._src.a", "jax._src.b.c", "jax._src.d", "jax._src.e.f",
      "jax._src.g.H", "jax._src.i.j"}
