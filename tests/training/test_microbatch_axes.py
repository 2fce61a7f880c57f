"""Microbatches whose arguments do not line up are refused, naming them.

A batched keyword argument (keyword arguments are passed whole), or a
`batch_argnums` off by one, used to end in a shape error inside the user's
loss; an argument that is not the batch but has an axis was split with it.
The step now checks the leading axes when it is traced and names the
argument, and says what is split and what is passed whole.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpolicy

TX = optax.sgd(0.1)
PARAMS = {"w": jnp.full((3,), 0.5, jnp.float32)}
X = jnp.linspace(-1., 1., 24, dtype=jnp.float32).reshape(8, 3)
Y = jnp.linspace(0., 1., 8, dtype=jnp.float32)


def _run(loss_fn, *args, k=2, batch_argnums=None, **kwargs):
  step = mpolicy.make_train_step(loss_fn, TX, microbatches=k,
                                 batch_argnums=batch_argnums)
  return jax.jit(step)(PARAMS, TX.init(PARAMS), mpolicy.NoOpLossScale(),
                       *args, **kwargs)


def _loss(p, x, y):
  return jnp.mean((x @ p["w"] - y) ** 2)


def _reference():
  return _run(_loss, X, Y, k=1)


def test_a_batched_keyword_argument_is_named_and_said_to_be_passed_whole():
  loss = lambda p, x, *, y: _loss(p, x, y)
  with pytest.raises(ValueError) as e:
    _run(loss, X, y=Y)
  message = str(e.value)
  assert message.startswith("make_train_step: loss_fn failed on one "
                            "microbatch (TypeError: ")
  assert ("keyword argument 'y' (kwargs['y'], passed whole: keyword "
          "arguments are never split) has leading axis 8, the batch's"
          in message)
  assert "Pass a batched array positionally" in message


def test_batch_argnums_off_by_one_names_the_argument_left_whole():
  with pytest.raises(ValueError) as e:
    _run(_loss, X, Y, batch_argnums=(1,))
  assert ("args[0] (loss_fn's `x`) (not in batch_argnums) has leading axis "
          "8, the batch's" in str(e.value))


def test_batch_argnums_naming_an_argument_with_nothing_to_split():
  loss = lambda p, step, x, y: _loss(p, x, y) * step
  with pytest.raises(ValueError, match=re.escape(
      "make_train_step: batch_argnums=(0,) names args[0] (loss_fn's `step`) "
      "as batched, but it holds no array with an axis to split "
      "(float32[]). batch_argnums counts the data arguments after params")):
    _run(loss, jnp.float32(1), X, Y, batch_argnums=(0,))


def test_arrays_split_together_must_share_their_leading_axis():
  loss = lambda p, x, y, table: _loss(p, x, y) + jnp.sum(table) * 0
  with pytest.raises(ValueError) as e:
    _run(loss, X, Y, jnp.ones((4, 3)))
  message = str(e.value)
  assert message.startswith(
      "make_train_step: the batched arrays must share their leading axis "
      "(the batch, 8 here)")
  assert "args[2] (loss_fn's `table`): leading axis 4 (shape (4, 3))" in message
  assert "batch_argnums is None, so every array argument" in message


def test_an_off_by_one_that_splits_the_wrong_argument():
  loss = lambda p, table, x, y: _loss(p, x, y) + jnp.sum(table) * 0
  with pytest.raises(ValueError, match=re.escape(
      "args[0] (loss_fn's `table`): leading axis 4 (shape (4, 3)). "
      "batch_argnums=(0, 1) counts the data arguments after params (and "
      "model state), 0 for the first: is it off by one?")):
    _run(loss, jnp.ones((4, 3)), X, Y, batch_argnums=(0, 1))


def test_a_batch_passed_only_as_keywords_is_refused():
  loss = lambda p, *, x, y: _loss(p, x, y)
  with pytest.raises(ValueError, match=re.escape(
      "make_train_step: microbatches=2, but no array is split")) as e:
    _run(loss, x=X, y=Y)
  assert "keyword argument 'x'" in str(e.value)
  assert "float32[8, 3]" in str(e.value)


def test_whole_arrays_that_do_not_break_the_loss_are_accepted():
  """No false alarm: an array of the batch's size passed whole on purpose
  (a weight per feature, 8 of them), and a keyword argument of another
  size, give the same step as without microbatches."""
  loss = lambda p, x, y, per_row, *, bias: (
      _loss(p, x, y) + 0. * jnp.sum(per_row) + jnp.sum(bias * p["w"]))
  per_row, bias = jnp.arange(8.), jnp.full((3,), 0.25)
  reference = _run(loss, X, Y, per_row, bias=bias, k=1)
  out = _run(loss, X, Y, per_row, batch_argnums=(0, 1), bias=bias)
  np.testing.assert_allclose(np.asarray(out.params["w"]),
                             np.asarray(reference.params["w"]), rtol=1e-6)
  assert float(out.value) == pytest.approx(float(reference.value), rel=1e-6)


def test_a_loss_error_without_whole_arrays_of_the_batch_size_is_untouched():
  def loss(p, x, y):
    raise TypeError("my own bug")
  with pytest.raises(TypeError, match="^my own bug"):
    _run(loss, X, Y)


def test_the_right_call_matches_the_one_batch_step():
  out, reference = _run(_loss, X, Y, k=4), _reference()
  np.testing.assert_allclose(np.asarray(out.params["w"]),
                             np.asarray(reference.params["w"]), rtol=1e-6)
