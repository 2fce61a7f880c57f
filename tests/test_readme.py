"""The README's Python examples run as written."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def _python_blocks():
  text = README.read_text()
  return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_readme_has_examples():
  assert len(_python_blocks()) >= 3


def test_readme_examples_run(capsys):
  # The blocks build on each other, as a reader would run them.
  namespace = {}
  for block in _python_blocks():
    exec(compile(block, str(README), "exec"), namespace)  # pylint: disable=exec-used
  out = capsys.readouterr().out
  assert "amp_dot_general" in out or "dot_general" in out  # explain's table
