"""Pallas kernels are code as written: they run with their traced dtypes.

A `pallas_call` inside `amp` or `transform_amp` runs as an opaque kernel
(interpret mode on CPU): its operands are cast back to the dtypes it was
traced with, and `explain` lists it. A kernel gets a dtype rule of the
user's by name, ``OpRules.with_rule("pallas_call:<kernel>", fn)``.
"""

from __future__ import annotations

import haiku as hk
import jax
from jax.experimental import pallas as pl
import jax.numpy as jnp
import numpy as np
import pytest

import mpolicy
from mpolicy._src import jax_compat
from mpolicy._src import sub_computations
from mpolicy._src.rules import facts

from _helpers import jax_error, walk_eqns

HALF = "p=f32,c=bf16,o=f32"
BF16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
X = jnp.linspace(-1, 1, 8 * 128, dtype=F32).reshape(8, 128)
W = jnp.eye(128, dtype=F32) * 0.5 + 0.01


def _twice_plus(x_ref, y_ref, o_ref):
  o_ref[...] = x_ref[...] * 2.0 + y_ref[...]


def twice_plus(x, y, name=None, dtype=None):
  dtype = x.dtype if dtype is None else dtype
  return pl.pallas_call(_twice_plus, out_shape=jax.ShapeDtypeStruct(
      x.shape, dtype), interpret=True, name=name)(x, y)


def fn(x, w):
  return twice_plus(x @ w, x)


def _kernel_eqns(f, *args):
  return [e for e in walk_eqns(jax.make_jaxpr(f)(*args))
          if e.primitive.name == "pallas_call"]


def _bf16_product(x, w):
  return (x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)).astype(F32)


def test_runs_with_its_traced_dtypes_eager_and_under_jit():
  f = mpolicy.amp(fn, HALF)
  want = 2.0 * _bf16_product(X, W) + X  # The matmul still ran in bf16.
  for g in (f, jax.jit(f)):
    np.testing.assert_allclose(g(X, W), want, rtol=1e-6)
  (eqn,) = _kernel_eqns(f, X, W)
  assert [v.aval.dtype for v in eqn.invars] == [F32, F32]


def test_explain_has_a_row_for_it():
  report = mpolicy.explain(mpolicy.amp(fn, HALF), X, W)
  (row,) = [r for r in report.rows if r.primitive == "pallas_call"]
  assert row.in_dtypes == ("bfloat16", "float32")
  assert row.ran_in == "float32" and row.rule == "as written"
  assert "'_twice_plus'" in row.decided_by
  assert "with_rule('pallas_call:_twice_plus'" in row.decided_by


def test_forward_mode():
  f = mpolicy.amp(fn, HALF)
  _, tangent = jax.jvp(lambda x: f(x, W), (X,), (X,))
  _, want = jax.jvp(lambda x: fn(x, W), (X,), (X,))
  np.testing.assert_allclose(tangent, want, rtol=2e-2, atol=2e-2)


def test_reverse_mode_fails_as_jax_does_without_a_vjp():
  error = jax_error(jax.grad(lambda x: fn(x, W).sum()), X)
  assert error is not None  # pallas_call has no transpose rule.
  with pytest.raises(error):
    jax.grad(lambda x: mpolicy.amp(fn, HALF)(x, W).sum())(X)


@jax.custom_vjp
def scaled(x, y):
  return twice_plus(x, y)


def _scaled_fwd(x, y):
  return twice_plus(x, y), None


def _scaled_bwd(_, g):
  return twice_plus(g, jnp.zeros_like(g)), g


scaled.defvjp(_scaled_fwd, _scaled_bwd)


def test_reverse_mode_through_a_custom_vjp_of_kernels():
  loss = lambda x, w: (scaled(x @ w, x) ** 2).sum()
  f = mpolicy.amp(loss, HALF)
  got = jax.grad(f, argnums=(0, 1))(X, W)
  want = jax.grad(loss, argnums=(0, 1))(X, W)
  for a, b in zip(got, want):
    assert a.dtype == F32
    np.testing.assert_allclose(a, b, rtol=3e-2, atol=0.5)
  eqns = _kernel_eqns(jax.grad(f, argnums=(0, 1)), X, W)
  assert len(eqns) == 2  # Forward and backward kernels, both in float32.
  assert {v.aval.dtype for e in eqns for v in e.invars} == {F32}


def test_inside_full_precision_it_runs_as_written():
  f = mpolicy.amp(mpolicy.full_precision()(fn), HALF)
  np.testing.assert_allclose(f(X, W), fn(X, W), rtol=1e-6)


def test_transform_amp():
  def forward(x):
    return twice_plus(hk.Linear(128)(x), x)

  mpolicy.set_policy(hk.Module, HALF)
  model = mpolicy.transform_amp(forward)
  params = model.init(jax.random.PRNGKey(0), X)
  out = jax.jit(model.apply)(params, None, X)
  want = hk.transform(forward).apply(params, None, X)
  assert out.dtype == F32
  np.testing.assert_allclose(out, want, rtol=3e-2, atol=3e-2)
  (eqn,) = _kernel_eqns(lambda p: model.apply(p, None, X), params)
  assert [v.aval.dtype for v in eqn.invars] == [F32, F32]


# --- A dtype rule by the kernel's name ------------------------------------------


def _in_bf16(policy, x, y, **params):
  """Runs the kernel on bfloat16 operands, as its author allows."""
  del policy, params
  return twice_plus(x.astype(jnp.bfloat16), y.astype(jnp.bfloat16))


def test_a_rule_by_kernel_name():
  rules = mpolicy.DEFAULT_RULES.with_rule("pallas_call:_twice_plus", _in_bf16)
  f = mpolicy.amp(lambda x, w: twice_plus(fn(x, w), x, name="other"), HALF,
                  rules=rules)
  first, other = _kernel_eqns(f, X, W)
  assert [v.aval.dtype for v in first.invars] == [BF16, BF16]
  assert [v.aval.dtype for v in other.invars] == [F32, F32]  # No rule.
  rows = [r for r in mpolicy.explain(f, X, W).rows
          if r.primitive == "pallas_call"]
  assert rows[0].rule == "custom" and "'pallas_call:_twice_plus'" in (
      rows[0].decided_by)
  assert rows[1].rule == "as written" and "'other'" in rows[1].decided_by
  want = 2.0 * (2.0 * _bf16_product(X, W) + X) + X
  np.testing.assert_allclose(f(X, W), want, rtol=2e-2, atol=2e-2)


def test_a_rule_for_every_kernel_and_a_name_that_wins():
  rules = (mpolicy.DEFAULT_RULES.with_rule("pallas_call", _in_bf16)
           .with_rule("pallas_call:other", lambda p, x, y, **k: twice_plus(
               x.astype(F32), y.astype(F32), name="other")))
  f = mpolicy.amp(lambda x, w: twice_plus(fn(x, w), x, name="other"), HALF,
                  rules=rules)
  first, other = _kernel_eqns(f, X, W)
  assert [v.aval.dtype for v in first.invars] == [BF16, BF16]
  # Its own rule (float32), not the general one (bfloat16).
  assert [v.aval.dtype for v in other.invars] == [F32, F32]


@pytest.mark.parametrize("name,error", [
    ("exp:fast", "'exp' takes no kernel name"),
    ("pallas_call:", "names no kernel"),
])
def test_kernel_names_are_checked(name, error):
  with pytest.raises(ValueError, match=error):
    mpolicy.DEFAULT_RULES.with_rule(name, _in_bf16)


def test_kernels_and_host_callbacks_are_facts():
  assert facts.names_with("kernel") == [
      "debug_callback", "inspect_sharding", "io_callback", "pallas_call",
      "pure_callback"]
  assert sub_computations.handling(jax_compat.pallas_call_p) == "kernel"
  # A host callback is bound as is (Python code, with effects for some); a
  # Pallas kernel may be linearized once per signature like any primitive.
  callbacks = {p.name for p in jax_compat.CALLBACK_PRIMITIVES}
  assert callbacks == {"pure_callback", "io_callback", "debug_callback"}
  assert callbacks <= set(facts.names_with("binds_plainly"))
  assert not facts.of(jax_compat.pallas_call_p).binds_plainly
  assert not facts.of(jax.lax.exp_p).kernel
