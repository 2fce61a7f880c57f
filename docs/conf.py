"""Sphinx configuration: the API reference (docs/api/, from the docstrings)
beside the task pages (docs/*.md, through myst-parser).

Built by ``bash .ci/run docs`` (with warnings as errors) into
docs/_build/html; its last step checks that every public name has an entry.
"""

import os
import sys

sys.path.insert(0, os.path.abspath(".."))  # This checkout's mpolicy.

import mpolicy  # pylint: disable=wrong-import-position

project = "mpolicy"
release = version = mpolicy.__version__
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "myst_parser"]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

# Google-style docstrings; `name` in a docstring links to its entry.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # Attributes: as fields, not second entries.
default_role = "py:obj"
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_typehints_format = "short"
autodoc_default_options = {"members": True}

# The task pages: GitHub's heading anchors, so their links hold here too.
myst_heading_anchors = 3
# Links out of docs/ (examples/, benchmarks/README.md) name repository files,
# not pages; tests/test_docs.py checks that every relative link and anchor
# of the pages holds.
suppress_warnings = ["myst.xref_missing"]

html_theme = "alabaster"
html_title = f"mpolicy {release}"

DOORS = ("training", "debug", "checkpoint")


def missing_entries(documented: set) -> list:
  """The public names without an entry among ``documented`` (full names):
  ``mpolicy.X`` for each X of `mpolicy.__all__` and the doors' ``__all__``
  (a door's name is the same object as the top-level one, so its entry
  serves both), and each door module itself."""
  import importlib  # pylint: disable=import-outside-toplevel
  wanted = {f"mpolicy.{n}" for n in mpolicy.__all__}
  for door in DOORS:
    module = importlib.import_module(f"mpolicy.{door}")
    wanted.add(module.__name__)
    for n in module.__all__:
      if getattr(module, n) is not getattr(mpolicy, n, None):
        wanted.add(f"{module.__name__}.{n}")  # Not the top-level object.
      else:
        wanted.add(f"mpolicy.{n}")
  return sorted(wanted - documented)


def _check_entries(app, env) -> None:
  from sphinx.util import logging  # pylint: disable=import-outside-toplevel
  for name in missing_entries(set(env.get_domain("py").objects)):
    logging.getLogger(__name__).warning(
        "%s is public but has no entry in the API reference (docs/api/)",
        name)


def setup(app):
  app.connect("env-check-consistency", _check_entries)
