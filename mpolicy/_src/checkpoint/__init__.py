"""Checkpoints on orbax, with what orbax leaves out: agreement and timeouts
across processes, per-leaf checksums, and checks against a template."""

from mpolicy._src.checkpoint.save_restore import CheckpointManager
from mpolicy._src.checkpoint.save_restore import restore_checkpoint
from mpolicy._src.checkpoint.save_restore import save_checkpoint
