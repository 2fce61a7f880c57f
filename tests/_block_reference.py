"""An independent NumPy + ml_dtypes reading of the block formats' text.

Written from the definitions, not from mpolicy's code: blocks by plain
index arithmetic, scales by search over integers in float64 (where every
``max_elem * 2**e`` is exact), float32 arithmetic as float64 operations on
float32 values rounded once to float32 (exact for products of two float32
values; for a quotient float64's 53 bits make the double rounding
harmless). XLA's backends flush float32 subnormals to zero (inputs and
results); `f32` does the same, so both sides compute the same thing.
"""

import math

import ml_dtypes
import numpy as np

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E2M1 = np.dtype(ml_dtypes.float4_e2m1fn)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
F32_MAX = float(np.finfo(np.float32).max)
TINY = 2.0 ** -126

SPECS = {  # name: (element dtype, max element, block size, two-level)
    "mxfp8": (E4M3, 448.0, 32, False),
    "mxfp4": (E2M1, 6.0, 32, False),
    "nvfp4": (E2M1, 6.0, 16, True),
}


def f32(v):
  """float64 values rounded to float32, subnormals flushed (sign kept)."""
  v = np.asarray(v, np.float64).astype(np.float32)
  return np.where(np.abs(v) < TINY, np.copysign(np.float32(0), v), v)


def to_grid(y, dtype, top, u=None):
  """float64 ``y`` (finite) clamped to +-top, rounded to ``dtype``."""
  y = np.clip(np.asarray(y, np.float64), -top, top)
  if u is None:
    return y.astype(dtype)  # ml_dtypes: round to nearest, ties to even.
  values = np.arange(256, dtype=np.uint8).view(dtype).astype(np.float64)
  grid = np.unique(values[np.isfinite(values) & (values >= 0)])
  out = np.empty(y.shape)
  for idx, v in np.ndenumerate(y):
    a = abs(v)
    lo = grid[grid <= a].max()
    above = grid[grid > a]
    pick = lo
    if above.size and float(u[idx]) < (a - lo) / (above.min() - lo):
      pick = above.min()
    out[idx] = math.copysign(pick, v)
  return out.astype(dtype)


def mx_exponent(amax, top):
  """The smallest integer e with amax <= top * 2**e, clamped to [-127, 127]."""
  if amax == 0:
    return -127
  e = math.ceil(math.log2(amax / top))
  while amax > top * 2.0 ** e:
    e += 1
  while amax <= top * 2.0 ** (e - 1):
    e -= 1
  return min(max(e, -127), 127)


def blocks_of(shape, axis, size, two_d):
  """Index tuples of each block's members (in block order) and the scale
  index of each block."""
  ndim = len(shape)
  axis %= ndim
  out = []
  for lead in np.ndindex(*[n for i, n in enumerate(shape)
                           if i not in ((ndim - 2, ndim - 1) if two_d
                                        else (axis,))]):
    lead = list(lead)
    if two_d:
      m, n = shape[-2], shape[-1]
      for bi in range(math.ceil(m / size)):
        for bj in range(math.ceil(n / size)):
          members = [tuple(lead) + (i, j)
                     for i in range(bi * size, min(m, bi * size + size))
                     for j in range(bj * size, min(n, bj * size + size))]
          out.append((members, tuple(lead) + (bi, bj)))
    else:
      n = shape[axis]
      for b in range(math.ceil(n / size)):
        def at(k):
          return tuple(lead[:axis]) + (k,) + tuple(lead[axis:])
        out.append(([at(k) for k in range(b * size, min(n, b * size + size))],
                     at(b)))
  return out


def scale_shape(shape, axis, size, two_d):
  shape = list(shape)
  for a in ((-2, -1) if two_d else (axis,)):
    shape[a] = math.ceil(shape[a] / size)
  return tuple(shape)


def quantize(x, name, axis=-1, two_d=False, u=None):
  """(elements, scales, tensor scale or None, dequantized float32)."""
  dtype, top, size, two_level = SPECS[name]
  x = f32(np.asarray(x, np.float32))  # Subnormal inputs flushed.
  elements = np.zeros(x.shape, dtype)
  values = np.zeros(x.shape, np.float32)
  scales = np.zeros(scale_shape(x.shape, axis, size, two_d),
                    E4M3 if two_level else E8M0)
  g = None
  if two_level:
    finite = x[np.isfinite(x)].astype(np.float64)
    amax = np.abs(finite).max() if finite.size else 0.0
    g = f32(amax * float(np.float32(1 / 2688)))
    g = np.float32(1) if g == 0 else g
  for members, at in blocks_of(x.shape, axis, size, two_d):
    block = np.array([x[m] for m in members], np.float64)
    uu = None if u is None else np.array([u[m] for m in members])
    if not np.all(np.isfinite(block)):
      scales[at] = np.nan
      for m in members:
        values[m] = np.nan
      continue  # Elements stay +0.
    amax = np.abs(block).max()
    if two_level:
      t = f32(f32(amax * float(np.float32(1 / 6))) / float(g))
      s = np.float64(np.minimum(t, 448.0)).astype(E4M3)
      d = float(f32(float(s) * float(g)))
      scales[at] = s
      y = block * 0.0 if d == 0 else f32(block / d).astype(np.float64)
      q = to_grid(y, dtype, top, uu)
      v = f32(q.astype(np.float64) * d)
    else:
      e = mx_exponent(amax, top)
      scales[at] = np.float64(2.0 ** e).astype(E8M0) if e > -127 else (
          np.uint8(0).view(E8M0))
      q = to_grid(f32(block * 2.0 ** -e).astype(np.float64), dtype, top, uu)
      v = f32(np.clip(q.astype(np.float64) * 2.0 ** e, -F32_MAX, F32_MAX))
    for k, m in enumerate(members):
      elements[m] = q[k]
      values[m] = np.clip(v[k], -F32_MAX, F32_MAX)
  return elements, scales, g, values
