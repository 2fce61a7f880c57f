"""Where a run's matmul FLOPs went: how many multiply in each dtype.

Counted as the interpreter replays the program (`check.Checker.flops`):
each matmul equation run adds its FLOPs (2 per multiply-add), so a loop
body counts once per iteration it ran, and each count knows the op of the
user's code it comes from (its `sites.Site`).

>>> import collections
>>> counts = collections.Counter({(0, "bfloat16"): 48, (1, "float32"): 16})
>>> by_dtype(counts)
{'bfloat16': 48, 'float32': 16}
>>> half_fraction(counts)
0.75
"""

from __future__ import annotations

import collections

from mpolicy._src import dtypes


def by_dtype(counts) -> dict[str, int]:
  """Matmul FLOPs by the dtype they multiply in (``counts``: a checker's
  `flops`)."""
  into: collections.Counter[str] = collections.Counter()
  for (_, dtype), n in counts.items():
    into[dtype] += n
  return dict(into)


def by_module(counts, found: list) -> dict[str, int]:
  """Matmul FLOPs by the module whose own op made them (forward and
  backward): ``found`` is the `sites.tagging` list the program was traced
  with; ``""``: outside any module."""
  into: collections.Counter[str] = collections.Counter()
  for (index, _), n in counts.items():
    into[found[index].path if index is not None else ""] += n
  return dict(into)


def half_fraction(counts) -> float:
  """The fraction of matmul FLOPs that multiply in a dtype narrower than
  float32 (NaN without matmuls)."""
  found = by_dtype(counts)
  total = sum(found.values())
  if not total:
    return float("nan")
  return sum(n for d, n in found.items() if dtypes.is_half(d)) / total
