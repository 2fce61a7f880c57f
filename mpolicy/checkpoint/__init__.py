"""Checkpoints of training state through orbax: `save_checkpoint`,
`restore_checkpoint` and `CheckpointManager` (also in `mpolicy` itself).

>>> import os, tempfile, jax.numpy as jnp
>>> from mpolicy import checkpoint
>>> path = os.path.join(tempfile.mkdtemp(), "step_1")
>>> checkpoint.save_checkpoint(path, {"w": jnp.ones(2, jnp.bfloat16)})
>>> checkpoint.restore_checkpoint(path, {"w": jnp.zeros(2, jnp.bfloat16)})
{'w': Array([1, 1], dtype=bfloat16)}
"""

from mpolicy._src.checkpoint import CheckpointManager
from mpolicy._src.checkpoint import restore_checkpoint
from mpolicy._src.checkpoint import save_checkpoint

__all__ = ("CheckpointManager", "restore_checkpoint", "save_checkpoint")
