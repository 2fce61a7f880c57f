"""check_accumulation and its measure, ulp_distance."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpolicy
from mpolicy._src.training.accumulation_check import ulp_distance


def test_ulp_distance_counts_steps_of_the_dtype_at_the_largest_element():
  one = np.float32(1.)
  assert ulp_distance(one, np.nextafter(one, np.float32(2.))) == 1
  # Next to elements of 1, a difference of 2 ** -30 is a small part of an
  # ulp, though 0 and 2 ** -30 are a billion ulps apart one by one.
  assert ulp_distance(np.array([1., 0.], np.float32),
                      np.array([1., 2. ** -30], np.float32)) == 2. ** -7
  bf16 = jnp.asarray([1., 2.], jnp.bfloat16)
  assert ulp_distance(bf16, bf16.at[1].set(2.015625)) == 1  # bf16: 2 ** -6.
  assert ulp_distance(np.float32(-0.), np.float32(0.)) == 0
  assert ulp_distance(np.float32(np.nan), np.float32(np.nan)) == 0
  assert ulp_distance(np.float32(np.nan), np.float32(1.)) == float("inf")
  assert ulp_distance(np.int32(3), np.int32(5)) == 2
  assert ulp_distance(np.ones(2, np.float32), np.ones(2, np.float16)) == float(
      "inf")


def _loss(p, x, y):
  return jnp.mean((x @ p["w"] - y) ** 2)


def _setup():
  tx = optax.sgd(0.1)
  params = {"w": jnp.zeros((3, 1))}
  x = jnp.linspace(0.1, 1., 24).reshape(8, 3)
  return tx, params, (params, tx.init(params), mpolicy.NoOpLossScale(), x,
                      jnp.ones((8, 1)))


def test_check_accumulation_reports_each_leaf_in_a_table():
  tx, _, args = _setup()
  check = mpolicy.check_accumulation(
      lambda k: mpolicy.make_train_step(_loss, tx, microbatches=k), *args,
      microbatches=(2,))
  assert check.runs == ("k=2",) and check.max_ulps() <= 4
  assert [path for path, _ in check.leaves] == ["params/w", "value"]
  assert check.finite == {"reference": True, "k=2": True}
  lines = str(check).splitlines()
  assert lines[1] == "| leaf | dtype | k=2 |"
  assert lines[3].startswith("| params/w | float32 | ")


def test_check_accumulation_finds_a_step_that_accumulates_wrong():
  tx, _, args = _setup()

  def summing_step(k):  # Sums the microbatches' losses: k times too large.
    return mpolicy.make_train_step(lambda p, x, y: _loss(p, x, y) * k, tx,
                                   microbatches=k)

  check = mpolicy.check_accumulation(summing_step, *args, microbatches=(2,))
  assert check.max_ulps("k=2", "params") > 1e5
  assert check.max_ulps("k=2", "value") > 1e5


def test_check_accumulation_needs_a_loss_scale_among_the_arguments():
  tx, params, _ = _setup()
  with pytest.raises(ValueError, match="found no loss scale"):
    mpolicy.check_accumulation(
        lambda k: mpolicy.make_train_step(_loss, tx, microbatches=k),
        params, tx.init(params), jnp.ones((8, 3)), jnp.ones((8, 1)))
