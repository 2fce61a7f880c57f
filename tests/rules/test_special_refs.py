"""Mutable references are bound as they are: a function linearized once per
signature (`staged`) may not return one, so under `jax.grad` an `amp`-ed
function that makes a reference of a traced value still runs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpolicy
from mpolicy._src import jax_compat
from mpolicy._src.rules import facts

HALF = "p=f32,c=bf16,o=f32"
REFS = ("new_ref", "empty_ref", "get", "swap", "addupdate", "freeze")
X = jnp.linspace(0.0, 1.0, 4)


def _squares(x):
  r = jax.new_ref(x)  # A reference to a value being linearized.
  r[...] = r[...] * x
  return jnp.sum(r[...])


def test_making_and_touching_references_binds_plainly():
  prims = jax_compat.primitives_named(REFS)
  assert [p.name for p in prims] == list(REFS)
  assert all(facts.of(p).binds_plainly for p in prims)
  assert facts.of(jax_compat.ref_swap_p).binds_plainly


def test_a_reference_to_a_traced_value_under_grad(monkeypatch):
  want = jax.grad(_squares)(X)
  got = jax.grad(mpolicy.amp(_squares, HALF))(X)
  np.testing.assert_allclose(got, want, rtol=1e-2)
  # Bound through the linearization cache, the new reference would be
  # what the cached function returns: JAX refuses that.
  monkeypatch.setattr(facts, "_FACTS", facts._FACTS.copy())  # pylint: disable=protected-access
  facts.register("new_ref", binds_plainly=False)
  fresh = lambda x: _squares(x) + 0.0  # Not the function traced above.
  with pytest.raises(ValueError, match="mutable array"):
    jax.grad(mpolicy.amp(fresh, HALF))(X)
