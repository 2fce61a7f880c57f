"""A Flax NNX module passed to an `amp` function keeps what it writes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpolicy

nnx = pytest.importorskip("flax.nnx")

from _nnx_net import _x, Net, POLICY  # pylint: disable=g-bad-import-order


def _state(m):
  return (np.asarray(m.norm.mean[...]), np.asarray(m.norm.var[...]))


def test_batchnorm_statistics_are_updated_as_without_amp():
  model, ref = Net(nnx.Rngs(0)), Net(nnx.Rngs(0))
  f = mpolicy.amp(lambda m, x: m(x), POLICY)
  for _ in range(3):
    y = f(model, _x())
    ref(_x())
  assert y.dtype == jnp.float32
  (mean, var), (ref_mean, ref_var) = _state(model), _state(ref)
  assert mean.dtype == np.float32 and not np.all(mean == 0.)
  np.testing.assert_allclose(mean, ref_mean, rtol=2e-2, atol=1e-3)
  np.testing.assert_allclose(var, ref_var, rtol=2e-2, atol=1e-3)
  # Dropout's RNG counter advanced as in the plain calls.
  count = int(model.drop.rngs.count[...])
  assert count == int(ref.drop.rngs.count[...]) == 3


def test_state_comes_back_under_nnx_jit_and_as_a_keyword():
  model, ref = Net(nnx.Rngs(0)), Net(nnx.Rngs(0))
  f = mpolicy.amp(lambda x, *, m: m(x), POLICY)

  @nnx.jit
  def step(m, x):
    return f(x, m=m)

  step(model, _x())
  ref(_x())
  np.testing.assert_allclose(_state(model)[0], _state(ref)[0], rtol=2e-2,
                             atol=1e-3)


def test_evaluation_mode_leaves_the_statistics_alone():
  model = Net(nnx.Rngs(0))
  f = mpolicy.amp(lambda m, x: m(x, train=False), POLICY)
  before = _state(model)
  f(model, _x())
  for a, b in zip(before, _state(model)):
    np.testing.assert_array_equal(a, b)


def test_gradients_through_amp_with_a_module_argument():
  model = Net(nnx.Rngs(0))
  f = mpolicy.amp(lambda m, x: jnp.sum(m(x, train=False) ** 2), POLICY)
  grads = nnx.grad(f)(model, _x())
  kernel = grads["linear"]["kernel"][...]
  assert kernel.dtype == jnp.float32 and np.all(np.isfinite(kernel))
  assert np.any(kernel != 0)


def test_rngs_passed_beside_the_model_advance_as_without_amp():
  class Drop(nnx.Module):

    def __init__(self):
      self.drop = nnx.Dropout(0.5)

    def __call__(self, x, rngs):
      return self.drop(x, rngs=rngs)

  model, rngs, ref_rngs = Drop(), nnx.Rngs(dropout=1), nnx.Rngs(dropout=1)
  f = mpolicy.amp(lambda m, x, r: m(x, r), POLICY)
  x = jnp.ones((64,))
  masks = [np.asarray(f(model, x, rngs) == 0) for _ in range(2)]
  ref = [np.asarray(model(x, ref_rngs) == 0) for _ in range(2)]
  assert int(rngs.dropout.count[...]) == int(ref_rngs.dropout.count[...]) == 2
  np.testing.assert_array_equal(masks, ref)  # A new mask each call.
  assert (masks[0] != masks[1]).any()


def test_a_module_nested_in_a_container_argument_keeps_its_statistics():
  model, ref = Net(nnx.Rngs(0)), Net(nnx.Rngs(0))
  f = mpolicy.amp(lambda parts, x: parts["nets"][0](x), POLICY)
  f({"nets": (model,)}, _x())
  ref(_x())
  np.testing.assert_allclose(_state(model), _state(ref), rtol=2e-2, atol=1e-3)
  assert float(np.abs(_state(model)[0]).max()) > 0


def test_an_optimizer_argument_takes_its_step():
  optax = pytest.importorskip("optax")

  def step(model, opt, x):
    grads = nnx.grad(lambda m: (m(x) ** 2).mean())(model)
    opt.update(model, grads)

  results = []
  for wrap in (lambda f: f, lambda f: mpolicy.amp(f, POLICY)):
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(1e-1), wrt=nnx.Param)
    for _ in range(2):
      wrap(step)(model, opt, _x())
    results.append((int(opt.step[...]), np.asarray(model.kernel[...])))
  assert results[0][0] == results[1][0] == 2
  np.testing.assert_allclose(results[1][1], results[0][1], rtol=2e-2, atol=2e-3)


# --- nnx.jit's semantics: one graph over every NNX argument -----------------


class Counter(nnx.Variable):
  pass


class Block(nnx.Module):

  def __init__(self, rngs):
    self.calls = Counter(jnp.zeros((), jnp.int32))
    self.linear = nnx.Linear(3, 4, rngs=rngs)
    self.norm = nnx.BatchNorm(4, rngs=rngs)

  def __call__(self, x):
    self.calls[...] += 1
    return self.norm(self.linear(x))


class Model(nnx.Module):

  def __init__(self, rngs):
    self.block = Block(rngs)

  def __call__(self, x):
    return self.block(x)


def _through_both_ends(model, block, total, x):
  """Writes through a model and its own submodule, and a bare Variable."""
  y = model(x) + block(x)
  total[...] += y.sum()
  return y


def _run_both(wrap):
  model, total = Model(nnx.Rngs(0)), nnx.Variable(jnp.zeros(()))
  for _ in range(2):
    y = wrap(_through_both_ends)(model, model.block, total, _x())
  return model, total, y


def test_shared_variables_and_a_bare_variable_match_nnx_jit():
  ref_model, ref_total, ref_y = _run_both(nnx.jit)
  model, total, y = _run_both(lambda f: mpolicy.amp(f, "full"))
  # Two calls, each through the model and through its block: 4 writes.
  assert int(ref_model.block.calls[...]) == int(model.block.calls[...]) == 4
  assert float(total[...]) == float(ref_total[...]) != 0.
  np.testing.assert_array_equal(y, ref_y)
  got, want = nnx.state(model), nnx.state(ref_model)
  assert (jax.tree_util.tree_structure(got)
          == jax.tree_util.tree_structure(want))
  for a, b in zip(jax.tree_util.tree_leaves(got),
                  jax.tree_util.tree_leaves(want)):
    np.testing.assert_array_equal(a, b)


def test_shared_state_keeps_its_dtypes_under_a_half_policy():
  model, total, y = _run_both(lambda f: mpolicy.amp(f, POLICY))
  assert y.dtype == jnp.float32 and total[...].dtype == jnp.float32
  assert int(model.block.calls[...]) == 4
  assert model.block.calls[...].dtype == jnp.int32
  for leaf in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param,
                                                  nnx.BatchStat)):
    assert leaf.dtype == jnp.float32
  # The statistics moved (two calls of each end, averaged in float32).
  assert float(np.abs(model.block.norm.mean[...]).max()) > 0


def test_a_returned_argument_is_the_same_object_and_new_variables_stay():
  def grow(model):
    model.extra = nnx.BatchStat(jnp.full((2,), 3., jnp.bfloat16))
    return model

  for wrap in (nnx.jit, lambda f: mpolicy.amp(f, POLICY)):
    model = Model(nnx.Rngs(0))
    assert wrap(grow)(model) is model
    assert model.extra[...].dtype == jnp.bfloat16  # Not the output dtype.
    np.testing.assert_array_equal(model.extra[...], [3., 3.])


def test_split_state_is_data_inside_jax_grad():
  # The documented split/merge form: the state goes in and comes out as
  # values, also where a loss closes over it inside jax.grad.
  model = Net(nnx.Rngs(0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def forward(params, rest, x):
    m = nnx.merge(graphdef, params, rest)
    return m(x), nnx.state(m, nnx.BatchStat)

  f = mpolicy.amp(forward, POLICY)
  grads, stats = jax.jit(jax.grad(
      lambda p: (lambda y, s: (jnp.sum(y ** 2), s))(*f(p, rest, _x())),
      has_aux=True))(params)
  kernel = grads["linear"]["kernel"][...]
  assert kernel.dtype == jnp.float32 and np.any(kernel != 0)
  assert float(np.abs(stats["norm"]["mean"][...]).max()) > 0
  # The caller's state is left as it was: the new statistics are returned.
  assert float(np.abs(rest["norm"]["mean"][...]).max()) == 0
