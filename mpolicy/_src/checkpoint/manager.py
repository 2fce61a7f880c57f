"""The checkpoints of a training loop: one directory, the last few steps.
(orbax's `CheckpointManager` saves without mpolicy's checks and deletes old
steps in place, so a crash leaves a half-deleted step that it lists; this
one renames an old step to a hidden name first.)"""

import numbers
import os
import re
import shutil
from typing import Any, Optional

from mpolicy._src.checkpoint import disk
from mpolicy._src.checkpoint import processes
from mpolicy._src.checkpoint.save_restore import restore_checkpoint
from mpolicy._src.checkpoint.save_restore import save_checkpoint

_STEP = re.compile(r"step_(\d+)|\.step_(\d+)\.mpolicy-old")


def _whole(value: Any, least: int, what: str, more: str = "") -> int:
  """`value` as an int >= `least`, or an error naming `what`."""
  error = f"{what} must be a whole number >= {least}{more}; got {value!r}."
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise TypeError(error)
  if value < least:
    raise ValueError(error)
  return int(value)


class CheckpointManager:
  """Saves a training loop's state every few steps and keeps the last ones.

  `save(step, state)` writes `<directory>/step_<step>` with
  `save_checkpoint` and removes the oldest beyond `max_to_keep` (None: keep
  all); `restore(template)` loads the latest (or `step=`). With
  `jax.distributed`, every process makes the same calls.

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
      max_to_keep = _whole(max_to_keep, 1, "CheckpointManager: max_to_keep",
                           ", or None to keep every step")
    self.directory = disk.local_path(directory, "CheckpointManager")
    self.max_to_keep = max_to_keep

  def path(self, step: int) -> str:
    """The directory of `step`'s checkpoint."""
    step = _whole(step, 0, "CheckpointManager: step")
    return os.path.join(self.directory, f"step_{step}")

  def all_steps(self) -> list[int]:
    """The steps with a complete checkpoint, oldest first."""
    names = os.listdir(self.directory) if os.path.isdir(self.directory) else ()
    found = (_STEP.fullmatch(name) for name in names)
    return sorted({int(m.group(1) or m.group(2)) for m in found if m})

  def latest_step(self) -> Optional[int]:
    """The newest step with a checkpoint, or None."""
    return (self.all_steps() or [None])[-1]

  def save(self, step: int, tree: Any, *, overwrite: bool = False) -> None:
    """Saves `tree` as `step`'s checkpoint (see `save_checkpoint`; a step
    saved before needs `overwrite=True`); keeps the newest `max_to_keep`."""
    save_checkpoint(self.path(step), tree, overwrite=overwrite)
    group = processes.Processes("CheckpointManager.save")

    def prune():
      if group.primary and self.max_to_keep is not None:
        for old in self.all_steps()[:-self.max_to_keep]:
          for where in (self.path(old), disk.old_path(self.path(old))):
            if os.path.lexists(where):
              os.rename(where, os.path.join(
                  self.directory, f".{os.path.basename(where)}.deleting"))
        for name in os.listdir(self.directory):  # Also a crashed prune's.
          if name.endswith(".deleting"):
            shutil.rmtree(os.path.join(self.directory, name))
      return None, None

    group.step(prune)

  def restore(self, template: Any, step: Optional[int] = None) -> Any:
    """Loads `step`'s checkpoint (the latest by default) into `template`
    (see `restore_checkpoint`); `FileNotFoundError` if there is none."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(
          f"CheckpointManager.restore: no checkpoint in {self.directory} "
          "(nothing saved yet: start from a fresh state).")
    return restore_checkpoint(self.path(step), template)
