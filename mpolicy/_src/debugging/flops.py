"""Where a program's matmul FLOPs run: how many multiply in each dtype.

>>> import jax, jax.numpy as jnp
>>> closed = jax.make_jaxpr(lambda a, b: a @ b.astype(jnp.bfloat16))(
...     jnp.ones((2, 3), jnp.bfloat16), jnp.ones((3, 4)))
>>> by_dtype(closed.jaxpr)
{'bfloat16': 48}
>>> half_fraction(closed.jaxpr)
1.0
"""

from __future__ import annotations

import collections

import numpy as np

from mpolicy._src import dtypes
from mpolicy._src import jax_compat
from mpolicy._src import sites as sites_lib


def _matmuls(jaxpr, times: int = 1, names: tuple[str, ...] = ()):
  """``(flops, dtype, scope names)`` of every matmul; a `scan` body counts
  once per iteration, other bodies once."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  for eqn in jaxpr.eqns:
    inside = names + jax_compat.eqn_scope_names(eqn)
    found = jax_compat.matmul_flops(eqn)
    if found is not None:
      yield found[0] * times, np.dtype(found[1]).name, inside
    repeat = (jax_compat.scan_layout(eqn.params)[2]
              if eqn.primitive is jax_compat.scan_p else 1)
    for sub in jax_compat.jaxprs_in_params(eqn.params):
      yield from _matmuls(sub, times * repeat, inside)


def by_dtype(jaxpr) -> dict[str, int]:
  """Matmul FLOPs (2 per multiply-add) by the dtype they multiply in; a
  `scan` body counts once per iteration, other bodies once."""
  into = collections.Counter()
  for n, dtype, _ in _matmuls(jaxpr):
    into[dtype] += n
  return dict(into)


def by_module(jaxpr, found: list) -> dict[str, int]:
  """Matmul FLOPs by the module whose own op made them (forward and
  backward), for a program traced with every op named (``found``: the
  `sites.tagging` list); ``""``: outside any module."""
  into = collections.Counter()
  for n, _, names in _matmuls(jaxpr):
    index = sites_lib.site_of(names)
    into[found[index].path if index is not None else ""] += n
  return dict(into)


def half_fraction(jaxpr) -> float:
  """The fraction of matmul FLOPs that multiply in a dtype narrower than
  float32 (NaN without matmuls)."""
  counts = by_dtype(jaxpr)
  total = sum(counts.values())
  if not total:
    return float("nan")
  return sum(n for d, n in counts.items() if dtypes.is_half(d)) / total
