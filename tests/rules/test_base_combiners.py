"""Primitives that carry a combiner traced for their operands' dtypes.

A scatter's update function, a generic `lax.reduce` and a generic
`lax.reduce_window` hold a small jaxpr typed for the dtypes they were traced
in. Re-bound on half operands, JAX accepts them and XLA rejects the program
when it is lowered; under `amp` they run at their traced dtypes instead.
"""

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import pytest

import mpolicy
from _helpers import all_eqns

BF16 = "p=f32,c=bf16,o=f32"
IDX = jnp.array([0, 1, 1, 3, 2, 2, 5, 7])

CASES = {
    "scatter_add": lambda h, w: (h @ w).at[IDX].add(h @ w),
    "scatter_mul": lambda h, w: (h @ w).at[IDX].multiply(h @ w),
    "scatter_min": lambda h, w: (h @ w).at[IDX].min(h @ w),
    "scatter_max": lambda h, w: (h @ w).at[IDX].max(h @ w),
    "scatter_set": lambda h, w: (h @ w).at[IDX].set(2 * (h @ w)),
    "segment_sum": lambda h, w: jax.ops.segment_sum(h @ w, IDX, 8),
    "reduce_variadic": lambda h, w: lax.reduce(
        (h @ w, h @ w), (0., -jnp.inf),
        lambda a, b: (a[0] + b[0], jnp.maximum(a[1], b[1])), (0,)),
    "reduce_non_monoid": lambda h, w: lax.reduce(
        h @ w, 0., lambda a, b: a + 2 * b, (1,)),
    "reduce_window": lambda h, w: lax.reduce_window(
        h @ w, 0., lambda a, b: a + 2 * b, (2, 2), (1, 1), "VALID"),
}

# Plain JAX has no reverse mode for these either.
NO_REVERSE_MODE = {"scatter_mul", "reduce_window"}


def _inputs():
  kh, kw = jax.random.split(jax.random.PRNGKey(0))
  return (jax.random.normal(kh, (8, 16)),
          jax.random.normal(kw, (16, 16)) / 4)


def _loss(fn):
  return lambda h, w: sum(jnp.sum(o ** 2) for o in jax.tree.leaves(fn(h, w)))


def _close(a, b, rtol):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    scale = np.max(np.abs(y)) + 1e-6
    np.testing.assert_array_less(np.max(np.abs(x - y)) / scale, rtol)


@pytest.mark.parametrize("name", sorted(CASES))
def test_runs_under_amp_jit_and_grad_close_to_float32(name):
  fn = CASES[name]
  h, w = _inputs()
  amp_fn = mpolicy.amp(fn, BF16)
  out = jax.jit(amp_fn)(h, w)
  for o in jax.tree.leaves(out):
    assert o.dtype == jnp.float32
  _close(out, fn(h, w), 0.03)
  if name in NO_REVERSE_MODE:
    return
  grads = jax.jit(jax.grad(_loss(amp_fn), argnums=(0, 1)))(h, w)
  _close(grads, jax.grad(_loss(fn), argnums=(0, 1))(h, w), 0.05)


def test_combiner_runs_at_its_traced_dtype():
  h, w = _inputs()
  eqns = all_eqns(mpolicy.amp(CASES["scatter_add"], BF16), h, w)
  scatters = [e for e in eqns if e.primitive.name == "scatter-add"]
  assert scatters
  for e in scatters:
    assert [np.dtype(v.aval.dtype) for v in e.invars[::2]] == [
        np.dtype(jnp.float32)] * 2
  # The matmuls feeding it still run in bfloat16.
  assert any(e.params.get("compute_dtype") == jnp.bfloat16 for e in eqns)


def test_explain_says_why_the_combiner_ran_as_traced():
  h, w = _inputs()
  report = mpolicy.explain(mpolicy.amp(CASES["reduce_window"], BF16), h, w)
  rows = [r for r in report.rows if r.primitive == "reduce_window"]
  assert rows and "combiner was traced for float32" in rows[0].decided_by
  assert rows[0].ran_in == "float32"


def test_half_combiner_written_in_half_is_kept():
  # A combiner the code traced in bfloat16 runs in bfloat16, also where a
  # rule would have widened its operands.
  h, w = _inputs()
  fn = lambda h, w: lax.reduce_window(
      jnp.exp((h @ w).astype(jnp.bfloat16)), jnp.bfloat16(0),
      lambda a, b: a + 2 * b, (2, 2), (1, 1), "VALID")
  out = jax.jit(mpolicy.amp(fn, BF16))(h, w)
  assert out.dtype == jnp.float32  # the policy's output dtype
  eqns = all_eqns(mpolicy.amp(fn, BF16), h, w)
  windows = [e for e in eqns if e.primitive.name == "reduce_window"]
  assert windows and windows[0].invars[0].aval.dtype == jnp.bfloat16
