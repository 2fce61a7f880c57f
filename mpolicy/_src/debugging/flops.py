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


def by_dtype(jaxpr, times: int = 1, into=None) -> dict[str, int]:
  """Matmul FLOPs (2 per multiply-add) by the dtype they multiply in; a
  `scan` body counts once per iteration, other bodies once."""
  into = collections.Counter() if into is None else into
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  for eqn in jaxpr.eqns:
    found = jax_compat.matmul_flops(eqn)
    if found is not None:
      into[np.dtype(found[1]).name] += found[0] * times
    repeat = (jax_compat.scan_layout(eqn.params)[2]
              if eqn.primitive is jax_compat.scan_p else 1)
    for sub in jax_compat.jaxprs_in_params(eqn.params):
      by_dtype(sub, times * repeat, into)
  return dict(into)


def half_fraction(jaxpr) -> float:
  """The fraction of matmul FLOPs that multiply in a dtype narrower than
  float32 (NaN without matmuls)."""
  counts = by_dtype(jaxpr)
  total = sum(counts.values())
  if not total:
    return float("nan")
  return sum(n for d, n in counts.items() if dtypes.is_half(d)) / total
