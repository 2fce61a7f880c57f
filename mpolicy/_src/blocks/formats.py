"""The block-scaled formats by name: element grid, block size, scale kind.

Three formats: `mxfp8` and `mxfp4` (OCP Microscaling: blocks of 32, one
power-of-two E8M0 scale each, elements float8_e4m3fn or float4_e2m1fn) and
`nvfp4` (blocks of 16 float4_e2m1fn elements, a float8_e4m3fn scale per
block and a float32 scale per tensor).

A policy names a format by its name, in ``Policy.matmul_format``
(`c=mxfp8`); a `BlockFormat` is no dtype.

>>> fmt = get_format("nvfp4")
>>> fmt.block_size, fmt.max_elem, fmt.element_dtype.name
(16, 6.0, 'float4_e2m1fn')
>>> get_format("mxfp9")
Traceback (most recent call last):
...
ValueError: Unknown block format 'mxfp9': expected one of 'mxfp8', 'mxfp4', 'nvfp4'.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np


def element_dtype(name: str) -> np.dtype:
  """The numpy dtype ``jnp.<name>``, or an `ImportError` naming the fix.

  float4_e2m1fn came to JAX later than the float8 dtypes; a JAX without it
  cannot hold mxfp4 or nvfp4 elements.

  >>> element_dtype("float4_e2m1fn").itemsize
  1
  """
  dtype = getattr(jnp, name, None)
  if dtype is None:
    raise ImportError(
        f"this JAX has no jnp.{name}, which the block format's elements are "
        "stored in: upgrade jax and ml_dtypes (jax>=0.4.36), or use mxfp8, "
        "whose elements are float8_e4m3fn.")
  return np.dtype(dtype)


@dataclasses.dataclass(frozen=True)
class BlockFormat:
  """One block-scaled format.

  Attributes:
    name: 'mxfp8', 'mxfp4' or 'nvfp4'.
    element_name: the jnp name of the element dtype.
    block_size: consecutive values along the axis that share a scale.
    max_elem: the element grid's largest finite value (448 or 6).
    two_level: nvfp4's float8 block scales under a float32 tensor scale;
      False for MX's power-of-two (E8M0) scales.
  """
  name: str
  element_name: str
  block_size: int
  max_elem: float
  two_level: bool

  @property
  def element_dtype(self) -> np.dtype:
    return element_dtype(self.element_name)

  def __str__(self):
    return self.name


FORMATS: dict[str, BlockFormat] = {
    "mxfp8": BlockFormat("mxfp8", "float8_e4m3fn", 32, 448.0, False),
    "mxfp4": BlockFormat("mxfp4", "float4_e2m1fn", 32, 6.0, False),
    "nvfp4": BlockFormat("nvfp4", "float4_e2m1fn", 16, 6.0, True),
}
NAMES = tuple(FORMATS)

def get_format(fmt: Any) -> BlockFormat:
  """The `BlockFormat` named ``fmt`` (a name or a `BlockFormat`)."""
  if isinstance(fmt, BlockFormat):
    return fmt
  if isinstance(fmt, str) and fmt in FORMATS:
    return FORMATS[fmt]
  allowed = ", ".join(repr(n) for n in NAMES)
  raise ValueError(f"Unknown block format {fmt!r}: expected one of {allowed}.")
