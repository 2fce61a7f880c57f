"""Where float8 runs under ``c=f8``: weight matmuls above a size threshold.

A matmul or convolution under a float8 policy runs in float8 only where

1. at least one operand is a parameter or an input of the call (a weight
   matmul; ``matmuls="all"`` lifts this), and
2. its size ``M*K*N`` (batch included; for a convolution, output elements
   times multiply-adds per output element) is at least the threshold
   ``min_size``: by default the device kind's entry in `THRESHOLDS`.

Everywhere else it runs in bfloat16, and `explain` says why. The options
live on the `OpRules` table (`OpRules.with_fp8`) as one `Fp8Options`.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, Optional

import jax
import numpy as np

from mpolicy._src import jax_compat
from mpolicy._src import observe
from mpolicy._src import policy as policy_lib
from mpolicy._src.rules import base
from mpolicy._src.rules import facts

MATMULS = ("weights", "all")
SCALINGS = ("per_row", "per_tensor")
RECIPE_OPTIONS = ("stochastic_rounding", "hadamard", "weight_tiles", "seed")
USED_BY = {"stochastic_rounding": ("mxfp4", "nvfp4"),
           "hadamard": ("mxfp4", "nvfp4"),
           "weight_tiles": ("nvfp4",),
           "seed": ("mxfp4", "nvfp4")}
"""The formats that use each recipe option; under any other (mxfp8, or
``c=f8``'s float8) one that `OpRules.with_fp8` sets is warned about."""
UNSET = object()
"""`OpRules.with_fp8`'s default for ``min_size`` (``None`` means auto)."""

H100_MIN_SIZE = 8192 ** 3
"""The smallest n*n*n matmul measured faster in float8 than in bfloat16 on
an H100 with per-tensor scaling (jax 0.11.2: 8192 gained 1.30x, 4096 lost
0.85x)."""

H200_PER_ROW_MIN_SIZE = 8192 ** 3
"""The smallest n*n*n matmul measured faster in float8 than in bfloat16 on
an H200 with per-row scaling (jax 0.11.2, forward, median of 15: 8192 ran
1.41x bfloat16's speed, 4096 0.94x)."""

THRESHOLDS: tuple[tuple[str, str, int, str], ...] = (
    ("H200", "per_row", H200_PER_ROW_MIN_SIZE, "measured"),
    ("H100", "per_row", H200_PER_ROW_MIN_SIZE,
     "per-row unmeasured: the H200's"),
    ("H100", "per_tensor", H100_MIN_SIZE, "measured"),
    ("H200", "per_tensor", H100_MIN_SIZE, "per-tensor unmeasured: the H100's"),
)
"""``(device kind substring, scaling, min M*K*N, source)``, first match of
kind and scaling wins."""

CPU_MIN_SIZE = 0
"""CPU emulates float8 (for checking numerics): every size runs in it."""

OTHER_MIN_SIZE = (H100_MIN_SIZE, "unmeasured: the H100's")
"""Any other accelerator: the H100's threshold."""


@dataclasses.dataclass(frozen=True)
class Fp8Options:
  """Where and how float8 runs under a ``c=f8`` policy.

  >>> Fp8Options()
  Fp8Options(matmuls='weights', min_size=None, scaling='per_row', stochastic_rounding=True, hadamard=True, weight_tiles=True, seed=0)
  >>> Fp8Options(matmuls="every")
  Traceback (most recent call last):
  ...
  ValueError: OpRules.with_fp8(matmuls='every'): must be one of 'weights' (at least one operand a parameter or input) or 'all' (every matmul and convolution)

  Attributes:
    matmuls: ``"weights"``: only matmuls and convolutions with a parameter
      or input among their operands run in float8 (attention's ``QK^T`` and
      ``PV`` multiply two activations and run in bfloat16); ``"all"``:
      every one.
    min_size: the smallest ``M*K*N`` (batch included) run in float8;
      ``None``: the threshold of the default backend's device kind
      (`THRESHOLDS`; 0 on CPU).
    scaling: ``"per_row"``: one scale per row of the left operand (per
      token), one per batch element of the right; ``"per_tensor"``: one
      scale per operand and per cotangent (the form cuBLASLt takes).
    stochastic_rounding: under ``c=mxfp4``/``c=nvfp4``, the backward
      matmuls round the cotangent stochastically (the NVFP4 recipe).
    hadamard: under ``c=mxfp4``/``c=nvfp4``, the weight-gradient matmul's
      operands are rotated by a random 16 x 16 Hadamard transform.
    weight_tiles: under ``c=nvfp4``, weights are quantized in 16 x 16 tiles.
    seed: the recipe's randomness: each block matmul's key is this seed
      folded with its place in the program and the step count.
    given: the recipe options `OpRules.with_fp8` set (a boolean to
      ``True``, or the seed): a float8 or block matmul in a format that
      does not use one of them warns (`USED_BY`). Not compared: it
      changes no number.
  """
  matmuls: str = "weights"
  min_size: Optional[int] = None
  scaling: str = "per_row"
  stochastic_rounding: bool = True
  hadamard: bool = True
  weight_tiles: bool = True
  seed: int = 0
  given: frozenset = dataclasses.field(default=frozenset(), repr=False,
                                       compare=False)

  def __post_init__(self):
    if self.matmuls not in MATMULS:
      raise ValueError(
          f"OpRules.with_fp8(matmuls={self.matmuls!r}): must be one of "
          "'weights' (at least one operand a parameter or input) or 'all' "
          "(every matmul and convolution)")
    if self.scaling not in SCALINGS:
      raise ValueError(
          f"OpRules.with_fp8(scaling={self.scaling!r}): must be 'per_row' "
          "(one scale per row of the left operand) or 'per_tensor' (one "
          "scale per operand)")
    for name in ("stochastic_rounding", "hadamard", "weight_tiles"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"OpRules.with_fp8({name}={getattr(self, name)!r}): "
                         "must be True or False")
    if isinstance(self.seed, bool) or not isinstance(self.seed, int):
      raise ValueError(f"OpRules.with_fp8(seed={self.seed!r}): must be an "
                       "int (the recipe's PRNG seed)")
    size = self.min_size
    if size is not None and (isinstance(size, bool)
                             or not isinstance(size, int) or size < 0):
      raise ValueError(
          f"OpRules.with_fp8(min_size={size!r}): must be None (the device "
          "kind's threshold) or an int >= 0, the smallest M*K*N run in "
          "float8 (e.g. 8192**3)")


def default_device():
  """The first device of the default backend, where the code will run."""
  return jax.devices()[0]


def device_threshold(scaling: str = "per_row") -> tuple[int, str]:
  """The default backend's threshold for ``scaling`` and a description of it.

  >>> size, device = device_threshold()
  >>> size == 0 if device == "cpu" else size > 0
  True

  Returns:
    ``(min_size, device)``: the threshold from `THRESHOLDS` for the device
    kind of ``jax.devices()[0]`` (0 on CPU), and its device kind, with the
    entry's source where it was not measured there.
  """
  device = default_device()
  kind = str(getattr(device, "device_kind", device.platform))
  if device.platform == "cpu":
    return CPU_MIN_SIZE, "cpu"
  for part, scaled, size, source in THRESHOLDS:
    if part.lower() in kind.lower() and scaled == scaling:
      return size, kind if source == "measured" else f"{kind} ({source})"
  size, source = OTHER_MIN_SIZE
  return size, f"{kind} ({source})"


def _size_text(size: int) -> str:
  root = round(size ** (1 / 3)) if size > 0 else 0
  return f"{root}^3" if root > 1 and root ** 3 == size else f"{size:,}"


def low_precision_name(op) -> str:
  """What the op's low precision is called in `explain`: its matmul format
  (``mxfp8``, ...), ``float8_e4m3fn`` for ``fp8``."""
  return (policy_lib.FP8_COMPUTE.name if op.matmul_format == "fp8"
          else op.matmul_format)


def declines(op, options: Fp8Options, dims: tuple[int, ...],
             operands) -> bool:
  """Whether ``op`` stays out of float8; if so, says why in ``op.note``.

  Args:
    op: the `base.Op` (its ``env`` knows parameters and inputs).
    options: the table's `Fp8Options`.
    dims: the product's sizes, e.g. ``(M, K, N)`` or ``(B, M, K, N)``.
    operands: the op's operands as the rule received them.
  """
  dtype = low_precision_name(op)
  env = op.env
  if options.matmuls == "weights" and not any(
      env.is_param(a) or env.is_param(env.wider_source(a)) for a in operands):
    op.note = (f", not {dtype}: both operands are activations (fp8 covers "
               "weight matmuls; OpRules.with_fp8(matmuls='all') for all)")
    return True
  size = math.prod(dims)
  if options.min_size is None:
    threshold, device = device_threshold(options.scaling)
    where = f"for {device}"
  else:
    threshold, where = options.min_size, "set by OpRules.with_fp8(min_size=)"
  if size < threshold:
    shape = "x".join(str(d) for d in dims)
    letters = "BxMxKxN" if len(dims) == 4 else "MxKxN"
    op.note = (f", not {dtype}: fp8 skipped: {letters} = {shape} = {size:,} "
               f"below the fp8 threshold {_size_text(threshold)} {where}")
    return True
  return False


def admit(op, what: str, dims: tuple[int, ...], reason: str):
  """The float8 rule's common part: whether ``op`` runs in float8 and, if
  so, its operands, result dtype and probe label.

  Declines (returns ``None``, saying why in ``op.note``) a ``what`` (``"dot"``,
  ``"convolution"``) that names an output sharding, which the float8 ops do
  not carry, and one `declines` keeps out. Otherwise it records the rule
  and ``reason`` on ``op`` and returns ``(lhs, rhs, out_dtype, label)``:
  the operands quantized from the widest value at hand (a float32
  parameter's gradient then comes back in float32; only float8 copies are
  saved), the result dtype, and the label its quantizations tell the
  observers by (`observe.quantization_site`; ``None``
  outside a probe).
  """
  dtype = low_precision_name(op)
  if jax_compat.out_sharding(op.eqn) is not None:
    op.note = (f", not {dtype}: the {what} names an out_sharding, which the "
               f"float8 {what} does not carry")
    return None
  if declines(op, op.rules.fp8, dims, op.args):
    return None
  warn_unused(op.rules.fp8, dtype)
  op.rule, op.ran_in = facts.LOWER, dtype
  op.why = f"lower in {dtype} ({reason}); policy from {op.decided_by}"
  lhs, rhs = (op.env.wider_source(a) for a in op.args)
  out_dtype = base.result_dtype(op.eqn, op.policy.compute_dtype)
  label = observe.quantization_site(op.scope, op.prim.name,
                                   shape_of(lhs, rhs))
  return lhs, rhs, out_dtype, label


def warn_unused(options: Fp8Options, dtype: str) -> None:
  """Warns if ``options`` set recipe options that ``dtype`` (a block
  format's name or a float8 dtype's) does not use: never in silence."""
  unused = [o for o in sorted(options.given) if dtype not in USED_BY[o]]
  if not unused:
    return
  called = ", ".join(f"{o}={getattr(options, o)!r}" for o in unused)
  names = " or ".join(f"{o} (used by {' and '.join(USED_BY[o])})"
                      for o in unused)
  them = "it" if len(unused) == 1 else "them"
  warnings.warn(
      f"OpRules.with_fp8({called}): {dtype} does not use {names}; its "
      f"matmuls run without {them}. Drop {them} from with_fp8, or compute "
      f"in a format that uses {them}.", UserWarning, stacklevel=2)


def shape_of(*operands: Any) -> str:
  """``"AxB, CxD"``: the operands' shapes, for a report."""
  return ", ".join("x".join(map(str, np.shape(o))) or "scalar"
                   for o in operands)
