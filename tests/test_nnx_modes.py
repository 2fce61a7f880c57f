"""`amp` over Flax NNX in tree mode (``nnx_graph_mode=False``) and with
hijax Variables (``flax_hijax_variable=True``)."""

import contextlib

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpolicy

nnx = pytest.importorskip("flax.nnx")

from _nnx_net import _x, Net, POLICY  # pylint: disable=g-bad-import-order


@contextlib.contextmanager
def _flag(name, value):
  old = getattr(flax.config, name)
  flax.config.update(name, value)
  try:
    yield
  finally:
    flax.config.update(name, old)


def _matmul_dtypes(fn, *args):
  """The dtype each matmul of the amp-ed ``fn`` runs in."""
  return [row.ran_in for row in mpolicy.explain(fn, *args).rows
          if row.primitive == "dot_general"]


# --- Tree mode ----------------------------------------------------------------


@pytest.mark.parametrize("jit", [False, True])
def test_tree_mode_updates_statistics_and_rngs_as_without_amp(jit):
  with _flag("nnx_graph_mode", False):
    model, ref = Net(nnx.Rngs(0)), Net(nnx.Rngs(0))
    f = mpolicy.amp(lambda m, x: m(x), POLICY)
    if jit:
      f = nnx.jit(f)
    y, ref_y = f(model, _x()), ref(_x())
  assert y.dtype == jnp.float32
  mean, ref_mean = model.norm.mean[...], ref.norm.mean[...]
  assert mean.dtype == jnp.float32 and float(jnp.abs(mean).max()) > 0.01
  np.testing.assert_allclose(mean, ref_mean, rtol=2e-2, atol=1e-3)
  np.testing.assert_allclose(y, ref_y, rtol=5e-2, atol=5e-2)
  assert int(model.drop.rngs.count[...]) == int(ref.drop.rngs.count[...]) == 1


def test_tree_mode_split_state_runs_its_matmul_in_the_compute_dtype():
  with _flag("nnx_graph_mode", False):
    graphdef, state = nnx.split(Net(nnx.Rngs(0)))

    def forward(state, x):
      model = nnx.merge(graphdef, state)
      return model(x, train=False)

    f = mpolicy.amp(forward, POLICY)
    dots = _matmul_dtypes(f, state, _x())
    y = jax.jit(f)(state, _x())
  assert dots == ["bfloat16"]
  assert y.dtype == jnp.float32


def test_tree_mode_grad_fails_as_it_does_without_amp():
  """Flax's tree-mode `nnx.grad` differentiates every leaf, the RNG count
  (uint32) too: plain and amp-ed alike raise JAX's TypeError."""
  with _flag("nnx_graph_mode", False):
    loss = lambda m, x: jnp.sum(m(x, train=False) ** 2)
    for fn in (loss, mpolicy.amp(loss, POLICY)):
      with pytest.raises(TypeError, match="uint32"):
        nnx.grad(fn)(Net(nnx.Rngs(0)), _x())


# --- Hijax Variables ----------------------------------------------------------


def test_hijax_variables_read_by_a_closed_over_module():
  with _flag("flax_hijax_variable", True):
    model = Net(nnx.Rngs(0))
    assert type(model.linear.kernel).__name__ == "HijaxVariable"
    f = mpolicy.amp(lambda x: model(x, train=False), POLICY)
    dots = _matmul_dtypes(f, _x())
    y, y_jit, ref = f(_x()), jax.jit(f)(_x()), model(_x(), train=False)
    grad = jax.grad(lambda x: jnp.sum(f(x)))(_x())
  assert dots == ["bfloat16"]
  assert y.dtype == y_jit.dtype == grad.dtype == jnp.float32
  np.testing.assert_allclose(y, ref, rtol=2e-2, atol=2e-2)
  np.testing.assert_array_equal(y, y_jit)
  assert np.any(y != ref)  # The matmul ran in bfloat16.
  assert np.all(np.isfinite(grad)) and np.any(grad != 0)


def test_hijax_variable_writes_fail_under_amp_as_under_nnx_jit():
  """Flax refuses to update a (non-ref) hijax Variable from inside a trace:
  BatchNorm's statistics under `amp`, as under `nnx.jit`."""
  with _flag("flax_hijax_variable", True):
    model = Net(nnx.Rngs(0))
    before = np.asarray(model.norm.mean[...])
    for fn in (nnx.jit(lambda m, x: m(x)),
               mpolicy.amp(lambda m, x: m(x), POLICY)):
      with pytest.raises((AttributeError, flax.errors.ImmutableVariableError)):
        fn(model, _x())
    np.testing.assert_array_equal(model.norm.mean[...], before)
