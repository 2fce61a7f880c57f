"""Helpers shared by the tests: walking jaxprs and comparing bits."""

import jax
import numpy as np

from mpolicy._src import jax_compat


def walk_eqns(jaxpr):
  """Every equation of a (closed or open) jaxpr, sub-jaxprs included."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in jax_compat.jaxprs_in_params(eqn.params):
      yield from walk_eqns(sub)


def all_eqns(fn, *args):
  """Every equation of ``fn``'s jaxpr at ``args``, sub-jaxprs included."""
  return list(walk_eqns(jax.make_jaxpr(fn)(*args)))


def bits(tree):
  """Each leaf's dtype and raw bytes."""
  return [(np.asarray(x).dtype, np.asarray(x).tobytes())
          for x in jax.tree_util.tree_leaves(tree)]


def same_bits(a, b) -> bool:
  """Whether two pytrees have the same structure and bit-identical leaves."""
  return (jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
          and bits(a) == bits(b))
