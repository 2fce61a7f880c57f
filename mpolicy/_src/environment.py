"""The environment of one interpreted jaxpr: its values, and what is known
of them.

`Env` holds the values of a jaxpr's variables while the interpreter runs
it, caches the casts made of them per (value, dtype), so a parameter used
three times is cast once and an up-cast remembers its half source (casting
back is free), and keeps the marks the op rules read: which values are
parameters or inputs, scalar constants, broadcasts, and the wider value a
half one was cast down from.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import numpy as np

from mpolicy._src import constants
from mpolicy._src import dtypes
from mpolicy._src import jax_compat
from mpolicy._src import staged
from mpolicy._src import widen


class Env:
  """Values of one jaxpr's variables, and the casts made of them.

  It knows which values are parameters or inputs (arrays that entered the
  `amp` call, and reshapes, broadcasts, transposes, slices of them): one
  wider than the compute dtype meeting half values in an op without a rule
  is used in the compute dtype (as Haiku casts parameters), so
  ``x @ w + b`` adds the bias in half.
  """

  def __init__(self):
    self.values: dict[Any, Any] = {}
    self._casts: dict[tuple[int, np.dtype], Any] = {}
    self._wider: dict[int, Any] = {}  # Down-cast value -> its source.
    self._keep: list[Any] = []  # Keeps ids in `_casts` alive.
    self._params: set[int] = set()  # Ids of parameters and inputs.
    self._param_made: set[int] = set()  # Ids whose wider source is one.
    # Which of the jaxpr's invars are parameters or inputs (``None``: all,
    # as at the top of an `amp` call).
    self.arg_params: Optional[Sequence[bool]] = None
    # Traced values known to hold one scalar constant everywhere (a
    # broadcast literal), by id; and the constants among the invars.
    self._consts: dict[int, np.ndarray] = {}
    self.arg_consts: Optional[Sequence[Any]] = None
    # Ids of broadcasts of smaller arrays (a statistic spread along a row).
    self._spread: set[int] = set()
    # Variables read only by `full` ops (they keep float32 results).
    self.full_only: set[Any] = set()
    self.places = [0]  # Next block matmul's place; shared with sub-jaxprs.
    self.step = None  # The training step, folded into block matmuls' keys.
    # What an export tells the int8 matmuls and learns from them (an
    # `int8_matmul.Weights`; this jaxpr's only, not its sub-jaxprs').
    self.int8: Any = None
    self.inserted = 0

  def keys_from(self, outer: "Env") -> None:
    """Shares ``outer``'s block matmul places and step (a sub-jaxpr's)."""
    self.places, self.step = outer.places, outer.step

  def mark_param(self, x) -> None:
    """Records ``x`` as a parameter or input."""
    if dtypes.is_traced(x) and dtypes.float_value((x)):
      self._params.add(id(x))
      self._keep.append(x)

  def is_param(self, x) -> bool:
    return dtypes.is_traced(x) and id(x) in self._params

  def mark_const(self, x, value) -> None:
    """Records that ``x`` holds the scalar ``value`` everywhere."""
    if dtypes.is_traced(x) and dtypes.float_value(x):
      self._consts[id(x)] = np.asarray(value)
      self._keep.append(x)

  def const_of(self, x) -> Optional[np.ndarray]:
    """The scalar constant ``x`` holds everywhere, if known: a literal, or
    a broadcast of one (see `constants`); else ``None``."""
    if not dtypes.is_traced(x):
      return np.asarray(x) if np.ndim(x) == 0 else None
    return self._consts.get(id(x))

  def mark_spread(self, x) -> None:
    """Records that ``x`` repeats a smaller array (a broadcast)."""
    if dtypes.is_traced(x):
      self._spread.add(id(x))
      self._keep.append(x)

  def is_spread(self, x) -> bool:
    return dtypes.is_traced(x) and id(x) in self._spread

  def has_wider(self, x) -> bool:
    return dtypes.is_traced(x) and id(x) in self._wider

  def read(self, var):
    if isinstance(var, jax_compat.Literal):
      return var.val
    value = self.values[var]
    if self.int8 is not None:
      self.int8.read(value)
    return value

  def cast(self, x, dtype):
    """``x`` as ``dtype``, made at most once per (value, dtype)."""
    dtype = np.dtype(dtype)
    src = dtypes.dtype_of(x)
    if src == dtype:
      return x
    narrows = (dtypes.is_float(src) and dtypes.is_float(dtype)
               and dtype.itemsize < src.itemsize)
    if not dtypes.is_traced(x):  # Literals and numpy consts: fold now.
      if narrows and np.ndim(x) == 0:
        return constants.saturate(x, dtype)
      return np.asarray(x).astype(dtype)
    key = (id(x), dtype)
    hit = self._casts.get(key)
    if callable(hit):  # A cheaper way to the same values (`precast`).
      hit = self._casts[key] = hit()
      self._keep.append(hit)
      self._wider[id(hit)] = x
      self.inserted += 1
    if hit is not None:
      return hit
    value = self._consts.get(id(x)) if narrows else None
    if value is not None:  # A broadcast constant: a constant again.
      y = constants.filled(np.shape(x), value, dtype)
      self._casts[key] = y
      self._keep += [x, y]
      self.inserted += 1
      self.mark_const(y, constants.saturate(value, dtype))
      return y
    y = staged.call(widen.widener(dtype), x)
    self._casts[key] = y
    self._keep += [x, y]
    self.inserted += 1
    if dtypes.is_float(src) and dtypes.is_float(dtype):
      if dtype.itemsize > src.itemsize:
        self._casts[(id(y), src)] = x  # Exact up-cast: casting back is free.
      else:
        self._wider[id(y)] = x
    return y

  def precast(self, x, dtype, make) -> None:
    """Records that ``make()`` gives ``x`` as ``dtype`` (with the values of
    a cast); `cast` calls it if ``x`` is ever cast to ``dtype``."""
    if dtypes.is_traced(x):
      self._casts[(id(x), np.dtype(dtype))] = make
      self._keep.append(x)

  def wider_source(self, x):
    """The wider float value ``x`` was cast down from here, else ``x``."""
    wide = self._wider.get(id(x), x)
    if callable(wide):  # Made when first asked for (see `mark_wider`).
      wide = self._wider[id(x)] = wide()
      self._keep.append(wide)
    return wide

  def from_param(self, x) -> bool:
    """Whether ``x`` was cast down from a parameter or input here (its
    wider source is one, or will be once made)."""
    if not dtypes.is_traced(x) or id(x) not in self._wider:
      return False
    return id(x) in self._param_made or self.is_param(self._wider[id(x)])

  def mark_wider(self, x, make_source, param: bool = False) -> None:
    """Records that ``x`` is ``make_source()`` cast down; the source is
    made only if `wider_source` asks for it (``param``: it is a
    parameter or input)."""
    if dtypes.is_traced(x):
      self._wider[id(x)] = make_source
      self._keep.append(x)
      if param:
        self._param_made.add(id(x))
