"""The checkpoints of a training loop: one directory, the last few steps.

Each step's checkpoint is `save_checkpoint`'s, in `<directory>/step_<n>`,
so it has the same guarantees (atomic, loss-scale settings, dtypes,
shardings, every process of a multi-process run taking part). After each
save the oldest checkpoints beyond `max_to_keep` are removed: each is
first renamed to a hidden name, so a listing never shows one half
deleted.
"""

from __future__ import annotations

import numbers
import os
import re
import shutil
from typing import Any, Optional

from mpolicy._src import checkpoint
from mpolicy._src import processes as processes_lib

_STEP = re.compile(r"step_(\d+)")


def _whole(value: Any, least: int, what: str) -> int:
  """`value` as an int >= `least`; `what` names it in the error."""
  error = (f"{what} must be a whole number >= {least}"
           + (", or None to keep every step" if "max_to_keep" in what
              else "") + f"; got {value!r}.")
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise TypeError(error)
  if value < least:
    raise ValueError(error)
  return int(value)


class CheckpointManager:
  """Saves a training loop's state every few steps and keeps the last ones.

  `save(step, state)` writes `<directory>/step_<step>` with
  `save_checkpoint` and then removes the oldest checkpoints beyond
  `max_to_keep`; `restore(template)` loads the latest (or `step=`) with
  `restore_checkpoint`. With `jax.distributed`, every process makes the
  same calls, as with `save_checkpoint` (process 0 removes old steps, and
  every process returns once they are gone).

  Args:
    directory: where the step directories go (created on the first save).
    max_to_keep: how many checkpoints to keep (the newest), or None for
      all of them.

  Raises:
    TypeError: `directory` is not a path, or `max_to_keep` is neither a
      whole number nor None.
    ValueError: `max_to_keep` is below 1.

  >>> import tempfile, jax.numpy as jnp, mpolicy
  >>> manager = mpolicy.CheckpointManager(tempfile.mkdtemp(), max_to_keep=2)
  >>> for step in (100, 200, 300):
  ...   manager.save(step, {"w": jnp.full(2, step, jnp.bfloat16)})
  >>> manager.all_steps()
  [200, 300]
  >>> manager.restore({"w": jnp.zeros(2, jnp.bfloat16)})["w"].tolist()
  [300.0, 300.0]

  See also: `save_checkpoint`, `restore_checkpoint`.
  """

  def __init__(self, directory: str | os.PathLike[str],
               max_to_keep: Optional[int] = 3):
    if not isinstance(directory, (str, os.PathLike)):
      raise TypeError("CheckpointManager: directory must be a path (a str or "
                      f"an os.PathLike), got {type(directory).__name__}.")
    if max_to_keep is not None:
      max_to_keep = _whole(max_to_keep, 1, "CheckpointManager: max_to_keep")
    self.directory = os.path.abspath(os.fspath(directory))
    self.max_to_keep = max_to_keep

  def path(self, step: int) -> str:
    """The directory of `step`'s checkpoint."""
    step = _whole(step, 0, "CheckpointManager: step")
    return os.path.join(self.directory, f"step_{step}")

  def all_steps(self) -> list[int]:
    """The steps with a complete checkpoint, oldest first."""
    if not os.path.isdir(self.directory):
      return []
    found = (_STEP.fullmatch(n) for n in os.listdir(self.directory))
    return sorted(int(m.group(1)) for m in found if m)

  def latest_step(self) -> Optional[int]:
    """The newest step with a checkpoint, or None."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  def save(self, step: int, tree: Any, *, overwrite: bool = False) -> None:
    """Saves `tree` as `step`'s checkpoint; keeps the newest `max_to_keep`.

    Raises what `save_checkpoint` raises (`FileExistsError` where `step`
    was saved before and `overwrite` is False), and a `TypeError` or
    `ValueError` where `step` is not a whole number >= 0.
    """
    checkpoint.save_checkpoint(self.path(step), tree, overwrite=overwrite)
    if self.max_to_keep is None:
      return
    group = processes_lib.Processes("CheckpointManager.save")

    def prune():
      if group.primary:
        for old in self.all_steps()[:-self.max_to_keep]:
          os.rename(self.path(old), os.path.join(self.directory,
                                                 f".step_{old}.deleting"))
        for name in os.listdir(self.directory):  # Also a crashed prune's.
          if name.endswith(".deleting"):
            shutil.rmtree(os.path.join(self.directory, name))
      return None, None

    group.step(prune)

  def restore(self, template: Any, step: Optional[int] = None) -> Any:
    """Loads `step`'s checkpoint (the latest by default) into `template`.

    Raises:
      FileNotFoundError: there is no checkpoint (of `step`).
      And what `restore_checkpoint` raises.
    """
    if step is None:
      step = self.latest_step()
      if step is None:
        raise FileNotFoundError(
            f"CheckpointManager.restore: no checkpoint in {self.directory} "
            "(nothing saved yet: start from a fresh state).")
    return checkpoint.restore_checkpoint(self.path(step), template)
