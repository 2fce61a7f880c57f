"""The float8 probe: what quantizing loses, counted while `fp8_stats` runs.

While a probe is open, each float8 matmul and convolution is traced with a
label, and every quantization it makes (its two operands forward, its
cotangent backward) hands its counts to the host through
`jax.debug.callback`: how many nonzero values rounded to zero (underflow),
how many were clamped to the float8 range (saturation), and the range of
the scales. Outside a probe nothing is added to the program.

The probe is a JAX user context, so a function compiled without it is not
reused with it (JAX traces again).
"""

from __future__ import annotations

from collections.abc import Iterator
import contextlib
import dataclasses
import functools
import threading
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

# Part of JAX's jit cache key: a probe run never reuses a compiled program
# traced without one (it would have no callbacks).
_OPEN = jax.make_user_context(default_value=False)


@dataclasses.dataclass
class Counts:
  """What one operand's quantizations lost, summed over the calls seen.

  Attributes:
    values: how many values were quantized.
    nonzero: how many of them were nonzero.
    underflow: nonzero values that became zero in float8.
    saturated: values beyond the float8 range (clamped), non-finite ones
      included.
    scale_min, scale_max: the smallest and largest scale used.
    calls: how many quantizations were counted.
  """
  values: int = 0
  nonzero: int = 0
  underflow: int = 0
  saturated: int = 0
  scale_min: float = float("inf")
  scale_max: float = float("-inf")
  calls: int = 0

  def add(self, values, nonzero, underflow, saturated, smin, smax) -> None:
    self.values += int(values)
    self.nonzero += int(nonzero)
    self.underflow += int(underflow)
    self.saturated += int(saturated)
    self.scale_min = min(self.scale_min, float(smin))
    self.scale_max = max(self.scale_max, float(smax))
    self.calls += 1

  @property
  def underflow_fraction(self) -> float:
    """Nonzero values that became zero, as a fraction of the nonzero ones."""
    return self.underflow / self.nonzero if self.nonzero else 0.0

  @property
  def saturated_fraction(self) -> float:
    """Values clamped to the float8 range, as a fraction of all values."""
    return self.saturated / self.values if self.values else 0.0


@dataclasses.dataclass
class ProbeSite:
  """One float8 op seen by the probe: where, what shape, its counts by role
  (``"lhs"``, ``"rhs"``, ``"cotangent"``)."""
  label: str
  scope: str
  primitive: str
  shape: str
  counts: dict[str, Counts] = dataclasses.field(default_factory=dict)


class _State(threading.local):
  sites: Optional[dict[str, ProbeSite]] = None


_state = _State()
_lock = threading.Lock()


@contextlib.contextmanager
def probe() -> Iterator[dict[str, ProbeSite]]:
  """Opens a probe on this thread; yields the sites it collects."""
  prev = _state.sites
  sites: dict[str, ProbeSite] = {}
  _state.sites = sites
  try:
    with _OPEN(True):
      yield sites
  finally:
    _state.sites = prev


def active() -> bool:
  """Whether a probe is open (on this thread, where the op is traced)."""
  return _state.sites is not None and bool(_OPEN.value)


def new_site(scope: str, primitive: str, shape: str) -> Optional[str]:
  """Registers a float8 op about to be traced; returns its label, or
  ``None`` when no probe is open."""
  if not active():
    return None
  sites = _state.sites
  label = f"{len(sites)}:{scope or '-'}/{primitive}"
  sites[label] = ProbeSite(label, scope, primitive, shape)
  return label


def _collect(sites, label, role, values, nonzero, underflow, saturated, smin,
             smax) -> None:
  with _lock:
    site = sites.get(label)
    if site is not None:
      site.counts.setdefault(role, Counts()).add(
          values, nonzero, underflow, saturated, smin, smax)


def observe(label: Optional[str], role: str, x, q, scale, fmax: float) -> None:
  """Counts what quantizing ``x`` to ``q`` (with ``scale``) lost, for the
  op ``label`` (no-op when ``label`` is ``None``)."""
  if label is None or _state.sites is None:
    return
  x = x.astype(jnp.float32)
  nonzero = x != 0
  stats = (jnp.asarray(x.size, jnp.int32),
           jnp.sum(nonzero, dtype=jnp.int32),
           jnp.sum(nonzero & (q.astype(jnp.float32) == 0), dtype=jnp.int32),
           jnp.sum(~(jnp.abs(x / scale) <= fmax), dtype=jnp.int32),
           jnp.min(scale), jnp.max(scale))
  jax.debug.callback(functools.partial(_collect, _state.sites, label, role),
                     *stats)


def shape_of(*operands: Any) -> str:
  """``"AxB, CxD"``: the operands' shapes, for a report."""
  return ", ".join("x".join(map(str, np.shape(o))) or "scalar"
                   for o in operands)
