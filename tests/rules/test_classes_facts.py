"""The facts `classes` registers beyond the classes: which primitives carry
scalar combiners, and which place, shard or key values (bound as is)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import mpolicy
from mpolicy._src import jax_compat
from mpolicy._src import sub_computations
from mpolicy._src.rules import facts

HALF = "p=f32,c=bf16,o=f32"
COMBINERS = ("scatter", "scatter-add", "scatter-sub", "scatter-mul",
             "scatter-min", "scatter-max", "reduce", "reduce_window",
             "select_and_scatter", "select_and_gather_add")
PLAIN = ("device_put", "sharding_constraint", "reshard", "pvary",
         "axis_index", "random_seed", "random_wrap", "random_unwrap")


def test_scatters_and_generic_reductions_combine_scalars():
  prims = jax_compat.primitives_named(COMBINERS)
  assert [p.name for p in prims] == list(COMBINERS)
  assert all(facts.of(p).combines_scalars for p in prims)
  assert facts.of(jax.lax.scatter_add_p).combines_scalars
  for p in (jax.lax.exp_p, jax.lax.reduce_sum_p, jax.lax.gather_p):
    assert facts.of(p).combines_scalars is False, p


def test_a_scalar_combiner_runs_as_a_first_order_primitive():
  assert sub_computations.handling(jax.lax.scatter_add_p) == "scalar combiner"
  assert sub_computations.handling(jax.lax.reduce_p) == "scalar combiner"
  fn = lambda x: x.at[jnp.array([0, 2])].add(x[:2] * 2)
  x = jnp.linspace(1, 2, 4)
  np.testing.assert_allclose(mpolicy.amp(fn, HALF)(x), fn(x))


def test_placement_sharding_and_prng_keys_bind_plainly():
  prims = jax_compat.primitives_named(PLAIN)
  assert [p.name for p in prims] == list(PLAIN)
  assert all(facts.of(p).binds_plainly for p in prims)
  for p in (jax.lax.exp_p, jax.lax.add_p, jax.lax.scatter_add_p):
    assert facts.of(p).binds_plainly is False, p
