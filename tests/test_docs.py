"""The documentation pages (docs/*.md) run as written, and their links hold.

Each page's ```python blocks run in order in one namespace, as a reader
would run them; a new page under docs/ is picked up without editing this
file. Relative links in README.md, the pages and the folders' READMEs
(benchmarks/README.md) must point at files that exist, and `#anchors` into
the repository's markdown at headings that exist.
"""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
MARKDOWN = [ROOT / "README.md"] + PAGES + sorted(ROOT.glob("*/README.md"))

README_MAX_LINES = 350
PAGE_MAX_LINES = 600


def _python_blocks(text: str) -> list:
  return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def _without_code(text: str) -> str:
  """The text with fenced blocks and inline code removed (links live outside)."""
  text = re.sub(r"^\s*```.*?^\s*```", "", text, flags=re.S | re.M)
  return re.sub(r"`[^`\n]*`", "", text)


def _slug(heading: str) -> str:
  """GitHub's anchor for a heading: lower case, punctuation dropped."""
  heading = re.sub(r"[^\w\- ]", "", heading.strip().lower())
  return heading.replace(" ", "-")


def _anchors(path: pathlib.Path) -> set:
  text = re.sub(r"^\s*```.*?^\s*```", "", path.read_text(), flags=re.S | re.M)
  return {_slug(h) for h in re.findall(r"^#+ (.*)$", text, flags=re.M)}


def _links(path: pathlib.Path) -> list:
  return re.findall(r"\]\(([^)\s]+)\)", _without_code(path.read_text()))


def test_there_are_docs_pages():
  assert len(PAGES) >= 8, [p.name for p in PAGES]


# Pages whose examples take 4-25 s each (debugging.md's tools run a program
# op by op): run once, in CI's newest job (.ci/run); the tests of their
# tools run on both JAX ends.
CI_PAGES = {"training.md", "op_rules.md", "fp8.md", "distributed.md",
            "debugging.md"}


@pytest.mark.parametrize("page", [
    pytest.param(p, marks=pytest.mark.ci) if p.name in CI_PAGES else p
    for p in PAGES], ids=lambda p: p.name)
def test_page_examples_run(page):
  namespace = {"__name__": f"docs_{page.stem}"}
  for block in _python_blocks(page.read_text()):
    exec(compile(block, str(page), "exec"), namespace)  # pylint: disable=exec-used


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_page_is_short_and_says_what_it_covers(page):
  lines = page.read_text().splitlines()
  assert len(lines) <= PAGE_MAX_LINES, (page.name, len(lines))
  assert lines[0].startswith("# "), page.name
  # The first paragraph after the title is prose, not a heading or a block.
  first = next(line for line in lines[1:] if line.strip())
  assert not first.startswith(("#", "```", "|", "-")), (page.name, first)


def test_readme_is_short_and_lists_every_page():
  text = (ROOT / "README.md").read_text()
  assert len(text.splitlines()) <= README_MAX_LINES
  linked = set(_links(ROOT / "README.md"))
  missing = [p.name for p in PAGES if f"docs/{p.name}" not in linked]
  assert not missing, f"README's Documentation list lacks {missing}"


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: p.name)
def test_relative_links_point_at_files_and_headings(path):
  broken = []
  for link in _links(path):
    if re.match(r"^[a-z]+:", link):  # http:, https:, mailto:
      continue
    target, _, anchor = link.partition("#")
    file = (path.parent / target).resolve() if target else path
    if not file.exists():
      broken.append(f"{link}: no file {file}")
    elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
      broken.append(f"{link}: no heading #{anchor} in {file.name}")
  assert not broken, f"{path.name}: " + "; ".join(broken)


def test_link_checker_catches_a_broken_file_and_anchor(tmp_path):
  page = tmp_path / "page.md"
  (tmp_path / "other.md").write_text("# Other\n\n## With `jmp` → mpolicy\n")
  page.write_text("[a](other.md#with-jmp--mpolicy) [b](missing.md) "
                  "[c](other.md#nowhere) `[d](inline.md)`\n")
  assert _links(page) == [
      "other.md#with-jmp--mpolicy", "missing.md", "other.md#nowhere"]
  assert _anchors(tmp_path / "other.md") == {"other", "with-jmp--mpolicy"}


# --- Printed tables against a run -------------------------------------------------


def _table_rows(page: str, first_header_cell: str) -> list[list[str]]:
  """The rows (cells stripped) of the markdown table on ``page`` whose
  header starts with ``first_header_cell``, header first."""
  lines = (DOCS / page).read_text().splitlines()
  start = next(i for i, l in enumerate(lines)
               if l.startswith(f"| {first_header_cell} |"))
  rows = []
  for line in lines[start:]:
    if not line.startswith("|"):
      break
    if not line.startswith("|---"):
      rows.append([c.strip() for c in line.strip().strip("|").split("|")])
  return rows


def _stablehlo_counts(fn, *args) -> tuple[int, int, int]:
  """(ops, reductions, float8 dots) of ``fn``'s StableHLO lowered for CUDA:
  every line that calls a ``stablehlo.`` op, the ``stablehlo.reduce`` ones,
  and the ``dot_general`` ones with float8 operands."""
  import jax  # pylint: disable=import-outside-toplevel
  text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  ops = [l for l in text.splitlines()
         if "stablehlo." in l and not l.startswith("module")]
  reductions = [l for l in ops if re.search(r"stablehlo\.reduce\(", l)]
  dots = [l for l in ops if "dot_general" in l and "xf8" in l.split("->")[0]]
  return len(ops), len(reductions), len(dots)


def test_fp8_lowering_table_counts_the_loss():
  """docs/fp8.md's op counts: the loss `sum(f(x, w) ** 2)`, forward and
  forward + backward, lowered for CUDA (no GPU needed)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import mpolicy  # pylint: disable=import-outside-toplevel
  rows = _table_rows("fp8.md", "scaling")
  assert rows[0] == ["scaling", "forward ops", "reductions", "fwd+bwd ops",
                     "reductions", "float8 dots"]
  x, w = jnp.ones((256, 512)), jnp.ones((512, 1024))
  new = tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 12)
  for row in rows[1:]:
    rules = mpolicy.DEFAULT_RULES.with_fp8(
        min_size=0, scaling=row[0].replace(" ", "_"))
    f = mpolicy.amp(lambda x, w: x @ w, "p=f32,c=f8,o=bf16", rules=rules)
    loss = lambda x, w: jnp.sum(f(x, w).astype(jnp.float32) ** 2)
    ops, reductions, _ = _stablehlo_counts(loss, x, w)
    both, both_reductions, dots = _stablehlo_counts(
        jax.grad(loss, argnums=(0, 1)), x, w)
    assert row[1:3] == [str(ops), str(reductions)], row
    documented = re.fullmatch(r"(\d+)(?: \((\d+) on 0\.12\))?", row[3])
    assert int(documented.group(2) if new and documented.group(2)
               else documented.group(1)) == both, row
    assert row[4:] == [str(both_reductions), str(dots)], row


def _lesson_header(script: str) -> list[str]:
  """The header of the table ``examples/<script>.py`` prints, from its
  `lesson_table` on one stand-in run."""
  import sys  # pylint: disable=import-outside-toplevel
  import types  # pylint: disable=import-outside-toplevel
  folder = str(ROOT / "examples")
  if folder not in sys.path:
    sys.path.insert(0, folder)
  module = __import__(script)
  log = types.SimpleNamespace(scale=[1.0], extra={}, skipped=0)
  metrics = {"final loss": 1.0, "test loss": 1.0, "test accuracy": 0.5,
             "never changed": 0.0, "unchanged by a step": 0.0}
  run = types.SimpleNamespace(name="master", scale_type="NoOp", log=log,
                              metrics=metrics)
  line = module.lesson_table([run]).splitlines()[0]
  return [c.strip() for c in line.strip().strip("|").split("|")]


@pytest.mark.parametrize("script, first_cells", [
    ("loss_scaling_lesson", ("run", "loss scale")),
    ("optimizer_lesson", ("run", "bytes/param"))])
def test_lesson_tables_have_the_columns_the_scripts_print(script, first_cells):
  page = (DOCS / "lessons.md").read_text()
  header = next(r for r in _table_rows_of(page)
                if tuple(r[:2]) == first_cells)
  assert header == _lesson_header(script)


def _table_rows_of(text: str) -> list[list[str]]:
  """The header row of every markdown table in ``text``."""
  lines = text.splitlines()
  return [[c.strip() for c in l.strip().strip("|").split("|")]
          for l, nxt in zip(lines, lines[1:] + [""])
          if l.startswith("| ") and nxt.startswith("|---")]


def test_compare_to_float32_table_has_the_printed_columns():
  """docs/debugging.md's printed `compare_to_float32` table: the header
  (and its rule) a report prints today, on a small model."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import mpolicy  # pylint: disable=import-outside-toplevel
  text = (DOCS / "debugging.md").read_text()
  (printed,) = [b for b in re.findall(r"^```\n(.*?)^```$", text,
                                      flags=re.S | re.M)
                if b.startswith("module (or op)")]
  f = mpolicy.amp(lambda w, x: jnp.mean(jnp.tanh(x @ w) ** 2),
                  "p=f32,c=bf16,o=f32")
  real = str(mpolicy.compare_to_float32(f, jnp.ones((3, 2)), jnp.ones((4, 3))))
  columns = lambda table: re.split(r"\s{2,}", table.splitlines()[0].strip())
  assert columns(printed) == columns(real)
  assert "backward" in columns(printed)
  # Every row has a cell per column (paths and numbers have no spaces
  # but "(code outside amp)" and "max at ?": joined first).
  for line in printed.splitlines()[2:-1]:
    line = line.replace("(code outside amp)", "outside").replace(
        "max at ?", "max")
    assert len(line.split()) == len(columns(printed)), line
