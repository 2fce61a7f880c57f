"""Checkpoints of training state on orbax: `save_checkpoint`,
`restore_checkpoint` and `CheckpointManager`, with the cross-process
agreement, per-leaf checksums and template checks that orbax leaves out."""

from mpolicy._src.checkpoint.manager import CheckpointManager
from mpolicy._src.checkpoint.restore import restore_checkpoint
from mpolicy._src.checkpoint.save import save_checkpoint

__all__ = ["CheckpointManager", "restore_checkpoint", "save_checkpoint"]
