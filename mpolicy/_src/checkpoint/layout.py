"""Where a checkpoint lives: a local directory, put in place in one step.

orbax commits each save into a fresh directory beside the path (`scratch`)
and `place` renames it to the path. Replacing a checkpoint takes two
renames: the old one goes to `old_path` first, where `locate` (and so a
restore) still finds it if the process dies before the new one is in.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from typing import Any, Optional

_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]+):/")


def local_path(path: Any, what: str) -> str:
  """`path` made absolute; a clear error for what is not a local path."""
  if not isinstance(path, (str, os.PathLike)):
    raise TypeError(f"{what}: path must be a directory path (a str or an "
                    f"os.PathLike), got {type(path).__name__} {path!r:.80}.")
  text = os.fspath(path)
  url = _URL.match(str(text))
  if url:
    raise ValueError(
        f"{what}: {text} is a {url.group(1)}:// URL; mpolicy checkpoints go "
        "to a directory on a file system (shared by every process). Mount "
        "the bucket (e.g. with gcsfuse) and pass the mounted path, or save "
        "with orbax directly.")
  return os.path.abspath(text)


def old_path(path: str) -> str:
  """Where a checkpoint being replaced waits for its successor."""
  parent, name = os.path.split(path)
  return os.path.join(parent, f".{name}.mpolicy-old")


def locate(path: str) -> Optional[str]:
  """The checkpoint at `path`, or the one a replacing save left aside."""
  for where in (path, old_path(path)):
    if os.path.lexists(where):
      return where
  return None


def scratch(path: str, overwrite: bool, what: str) -> str:
  """A new directory beside `path` (which must be free unless
  `overwrite`), for orbax to commit into."""
  if locate(path) and not overwrite:
    raise FileExistsError(f"{what}: {path} already exists; pass "
                          "overwrite=True to replace it, or choose a new path.")
  parent, name = os.path.split(path)
  os.makedirs(parent, exist_ok=True)
  return tempfile.mkdtemp(prefix=f".{name}.", suffix=".mpolicy-tmp",
                          dir=parent)


def place(staged: str, path: str, overwrite: bool, what: str) -> None:
  """Renames the complete checkpoint `staged` to `path`, replacing what is
  there if `overwrite`."""
  old = old_path(path)
  if overwrite and os.path.lexists(path):
    if os.path.lexists(old):
      shutil.rmtree(old)  # Left by an earlier save; `path` is newer.
    os.rename(path, old)
  try:
    os.rename(staged, path)  # Atomic; refuses a non-empty directory.
  except OSError as e:
    if not os.path.lexists(path):
      raise
    raise FileExistsError(
        f"{what}: {path} was created by another save while this one ran; "
        "it is left as that save wrote it.") from e
  shutil.rmtree(old, ignore_errors=True)
