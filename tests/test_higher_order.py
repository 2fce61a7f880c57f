"""Specification: the op rules reach inside higher-order primitives."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _helpers import all_eqns, checkpoints, jax_error, loop_carry_dtypes
from _helpers import multiplies_in
from jax.sharding import PartitionSpec as P

from mpolicy._src import higher_order
from mpolicy._src import jax_compat
from mpolicy._src.jax_compat import internals as jax_internals
from mpolicy._src.higher_order import UnsupportedPrimitiveError
from mpolicy._src.amp import amp
from mpolicy._src.amp import full_precision

HALF = "p=f32,c=bf16,o=f32"
BF16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
X = jnp.linspace(-1, 1, 12, dtype=F32).reshape(3, 4)
W = jnp.linspace(-0.5, 0.5, 16, dtype=F32).reshape(4, 4)


def dot_dtypes(fn, *args):
  """Operand dtypes of every matmul, forward and backward."""
  return [multiplies_in(e)
          for e in all_eqns(fn, *args) if "dot_general" in e.primitive.name]


def exp_dtypes(fn, *args):
  return [np.dtype(e.invars[0].aval.dtype)
          for e in all_eqns(fn, *args) if e.primitive.name == "exp"]


def check(fn, *, exp=False):
  """Matmuls in half, exp in f32, forward and under grad; values close.

  Where JAX cannot differentiate ``fn`` (a scan under ``jax_scan3`` in JAX
  0.12), the amp-ed function's gradient fails as JAX's does."""
  f = amp(fn, HALF)
  grad = jax.grad(f, argnums=(0, 1))
  refused = jax_error(jax.grad(fn, argnums=(0, 1)), X, W)
  if refused is not None:
    with pytest.raises(refused):
      grad(X, W)
  for g in (f,) if refused else (f, grad):
    dots = dot_dtypes(g, X, W)
    assert dots and all(d == (BF16, BF16) for d in dots), dots
    if exp:
      assert exp_dtypes(g, X, W) and set(exp_dtypes(g, X, W)) == {F32}
  np.testing.assert_allclose(f(X, W), fn(X, W), rtol=3e-2, atol=3e-2)
  if refused:
    return
  for a, b in zip(grad(X, W), jax.grad(fn, argnums=(0, 1))(X, W)):
    assert a.dtype == F32
    np.testing.assert_allclose(a, b, rtol=5e-2, atol=5e-2)


def test_jit():
  check(lambda x, w: jax.jit(lambda a, b: jnp.exp(a @ b))(x, w).sum(), exp=True)


def test_nested_jit():
  inner = jax.jit(lambda a, b: jnp.exp(a @ b))
  check(lambda x, w: jax.jit(lambda a, b: inner(a, b) * 2)(x, w).sum(), exp=True)


def test_scan_carry_keeps_dtype():
  def fn(x, w):
    def body(c, r):
      return jnp.tanh(c @ w) + r, jnp.exp(c).sum()
    c, ys = jax.lax.scan(body, x, jnp.ones((2, 3, 4)))
    return c.sum() + ys.sum()
  check(fn, exp=True)
  assert loop_carry_dtypes(amp(fn, HALF), X, W) == [F32]


def test_fori_loop():
  check(lambda x, w: jax.lax.fori_loop(0, 3, lambda i, c: jnp.tanh(c @ w), x).sum())


def test_while_loop_forward():
  def fn(x, w):
    return jax.lax.while_loop(lambda s: s[0] < 3,
                              lambda s: (s[0] + 1, jnp.tanh(s[1] @ w)), (0, x))[1]
  f = amp(fn, HALF)
  assert dot_dtypes(f, X, W) == [(BF16, BF16)]
  (loop,) = [e for e in all_eqns(f, X, W) if e.primitive.name == "while"]
  assert loop.params["body_jaxpr"].out_avals[1].dtype == F32
  np.testing.assert_allclose(f(X, W), fn(X, W), atol=3e-2)


def test_cond_branches_agree_on_widest_dtype():
  def fn(x, w):
    return jax.lax.cond(x.sum() > 0, lambda a: a @ w, lambda a: jnp.exp(a), x).sum()
  check(fn, exp=True)
  (cond,) = [e for e in all_eqns(amp(fn, HALF), X, W) if e.primitive.name == "cond"]
  assert {b.out_avals[0].dtype for b in cond.params["branches"]} == {F32}


def test_switch():
  branches = [lambda a, w: a @ w, lambda a, w: jnp.exp(a), lambda a, w: a]
  check(lambda x, w: jax.lax.switch(0, branches, x, w).sum(), exp=True)


def test_remat_keeps_its_policy():
  pol = jax.checkpoint_policies.nothing_saveable
  fn = lambda x, w: jax.checkpoint(lambda a: jnp.exp(a @ w), policy=pol)(x).sum()
  check(fn, exp=True)
  ((policy, _),) = checkpoints(amp(fn, HALF), X, W)
  ((plain_policy, _),) = checkpoints(fn, X, W)  # remat3 takes this as None.
  assert policy is plain_policy and plain_policy in (pol, None)


@jax.custom_jvp
def _sin_with_fake_jvp(x):
  return jnp.sin(x)


@_sin_with_fake_jvp.defjvp
def _fake_jvp(primals, tangents):
  (x,), (t,) = primals, tangents
  return _sin_with_fake_jvp(x), 3.0 * t  # Not cos(x): the custom rule.


def test_custom_jvp_keeps_custom_derivative():
  fn = lambda x, w: _sin_with_fake_jvp(x @ w).sum()
  f = amp(fn, HALF)
  gx = jax.grad(f)(X, W)
  expected = jax.grad(lambda x: (3.0 * (x @ W)).sum())(X)
  np.testing.assert_allclose(gx, expected, rtol=2e-2)
  assert all(d == (BF16, BF16) for d in dot_dtypes(jax.grad(f), X, W))


def test_custom_jvp_forward_mode():
  f = amp(lambda x, w: _sin_with_fake_jvp(x @ w).sum(), HALF)
  w = W + 1.0
  _, tangent = jax.jvp(lambda x: f(x, w), (X,), (jnp.ones_like(X),))
  np.testing.assert_allclose(tangent, (3.0 * (jnp.ones_like(X) @ w)).sum(),
                             rtol=3e-2)
  jac = jax.jacfwd(lambda x: f(x, w))(X)
  np.testing.assert_allclose(jac, jax.grad(lambda x: f(x, w))(X), rtol=1e-2)


@jax.custom_vjp
def _sin_with_fake_vjp(x):
  return jnp.sin(x)


def _fwd(x):
  return jnp.sin(x), jnp.exp(x)


def _bwd(res, g):
  return (g * 0.0 + 5.0,)  # Not cos(x): the custom rule.


_sin_with_fake_vjp.defvjp(_fwd, _bwd)


def test_custom_vjp_keeps_custom_bwd_and_interprets_fwd():
  fn = lambda x, w: _sin_with_fake_vjp(x @ w).sum()
  f = amp(fn, HALF)
  gw = jax.grad(f, argnums=1)(X, W)
  expected = jax.grad(lambda w: (5.0 * (X @ w)).sum())(W)
  np.testing.assert_allclose(gw, expected, rtol=2e-2)
  assert F32 in exp_dtypes(jax.grad(f, argnums=1), X, W)  # fwd ran the rules.


def test_shard_map_one_device_mesh():
  mesh = jax.make_mesh((1,), ("d",))
  def fn(x, w):
    g = jax.shard_map(lambda a, b: jnp.exp(a @ b), mesh=mesh,
                      in_specs=(P(), P()), out_specs=P())
    return g(x, w).sum()
  check(fn, exp=True)


def test_pmap_one_device():
  f = amp(lambda x, w: jnp.exp(x @ w), HALF)
  g = jax.pmap(lambda x: f(x, W))
  assert dot_dtypes(g, X[None]) == [(BF16, BF16)]
  np.testing.assert_allclose(g(X[None])[0], jnp.exp(X @ W), rtol=3e-2)


def test_vmap_inside():
  fn = lambda x, w: jax.vmap(lambda r: jnp.exp(r @ w))(x).sum()
  check(fn, exp=True)


def _toy_hop():
  prim = jax_compat.new_primitive("toy_hop")
  prim.def_impl(lambda x, *, jaxpr: x)
  prim.def_abstract_eval(lambda x, *, jaxpr: x)
  jax_compat.define_lowering(prim, lambda x, *, jaxpr: x)
  return prim


def test_unknown_higher_order_primitive_raises_clearly():
  prim = _toy_hop()
  inner = jax.make_jaxpr(jnp.sin)(1.0)
  fn = lambda x: prim.bind(x, jaxpr=inner)
  with pytest.raises(UnsupportedPrimitiveError, match="toy_hop"):
    amp(fn, HALF)(X)
  # Inside full_precision() it runs as written.
  np.testing.assert_array_equal(amp(full_precision()(fn), HALF)(X), X)


def test_amp_inside_shard_map():
  mesh = jax.make_mesh((1,), ("d",))
  f = amp(lambda a, b: jnp.exp(a @ b), HALF)
  g = jax.shard_map(f, mesh=mesh, in_specs=(P(), P()), out_specs=P())
  assert dot_dtypes(g, X, W) == [(BF16, BF16)]
  assert exp_dtypes(g, X, W) == [F32]
  np.testing.assert_allclose(g(X, W), jnp.exp(X @ W), rtol=3e-2)
  grads = jax.grad(lambda x, w: g(x, w).sum(), argnums=(0, 1))(X, W)
  assert [gr.dtype for gr in grads] == [F32, F32]


def test_pmap_inside_amp():
  f = amp(jax.pmap(lambda x: jnp.exp(x @ W)), HALF)
  assert dot_dtypes(f, X[None]) == [(BF16, BF16)]
  np.testing.assert_allclose(f(X[None])[0], jnp.exp(X @ W), rtol=3e-2)


SPD = jnp.eye(4) * 4.0 + W @ W.T


def test_custom_linear_solve_runs_as_traced_under_grad():
  # jnp.linalg.solve is a custom_linear_solve: its solver jaxprs are written
  # for the operands' dtypes, and LAPACK has no half kernels.
  fn = lambda a, b: jnp.linalg.solve(a @ jnp.eye(4), b).sum()
  f = amp(fn, HALF)
  np.testing.assert_allclose(f(SPD, X[0]), fn(SPD, X[0]), rtol=2e-2)
  (solve,) = [e for e in all_eqns(f, SPD, X[0])
              if e.primitive.name == "custom_linear_solve"]
  assert {v.aval.dtype for v in solve.invars
          if jnp.issubdtype(v.aval.dtype, jnp.floating)} == {F32}
  ga = jax.grad(f)(SPD, X[0])
  np.testing.assert_allclose(ga, jax.grad(fn)(SPD, X[0]), rtol=5e-2, atol=1e-2)


def test_decompositions_run_in_float32_on_half_inputs():
  # The matmul runs in bf16; cholesky and eigh (full rule) upcast its result.
  fn = lambda a: jnp.linalg.cholesky(a @ a.T + 4 * jnp.eye(4)).sum() + (
      jnp.linalg.eigh(a @ a.T)[0].sum())
  f = amp(fn, HALF)
  prims = {e.primitive.name: e for e in all_eqns(f, W)}
  assert prims["cholesky"].invars[0].aval.dtype == F32
  assert prims["eigh"].invars[0].aval.dtype == F32
  np.testing.assert_allclose(f(W), fn(W), rtol=3e-2)


# --- Call primitives, found by name ---------------------------------------------

_BIAS = jnp.arange(4.0, dtype=F32)


def _calls_traced(x, w):
  """A closed call (JAX 0.12's `eval_jaxpr`, 0.10.2's `closed_call`) whose
  body closes over a constant."""
  closed = jax.make_jaxpr(lambda a, b: jnp.tanh(a @ b + _BIAS))(x, w)
  (out,) = jax_compat.bind(jax_compat.closed_call_p, [x, w],
                           {"call_jaxpr": closed})
  return out.sum()


def _call_primitive_names(fn, *args):
  calls = {p.name for p in sum(jax_compat.call_primitives(), ())}
  return {e.primitive.name for e in all_eqns(fn, *args)} & calls


def test_each_call_primitive_has_one_rule_of_its_kind():
  """JAX 0.12 keeps `closed_call_p` and `call_p` as aliases of one
  primitive, `eval_jaxpr` (a closed call): it gets the closed call's rule,
  once, not the open call's."""
  closed, opened = jax_compat.call_primitives()
  assert closed, "no call primitive found by name"
  assert len({id(p) for p in closed + opened}) == len(closed + opened)
  for p in closed:
    assert higher_order.rule_for(p) is higher_order._call, p.name  # pylint: disable=protected-access
  for p in opened:
    assert higher_order.rule_for(p) is higher_order._open_call, p.name  # pylint: disable=protected-access
  names = higher_order.supported()
  assert len(names) == len(set(names)), names
  assert _call_primitive_names(_calls_traced, X, W)  # The program holds one.
  check(_calls_traced)


def test_call_rules_survive_the_aliases_going(monkeypatch):
  """The day JAX deletes `closed_call_p` and `call_p` (aliases of
  `eval_jaxpr_p` in 0.12), the call rules are registered all the same."""
  from jax._src import core as jax_core  # pylint: disable=g-import-not-at-top
  want = jax.jit(amp(_calls_traced, HALF))(X, W)
  want_grad = jax.jit(jax.grad(amp(_calls_traced, HALF)))(X, W)
  before = {p.name for p in jax_compat.call_primitives()[0]}
  for alias in ("closed_call_p", "call_p"):
    if getattr(jax_core, alias, None) is getattr(jax_core, "eval_jaxpr_p",
                                                 object()):
      monkeypatch.delattr(jax_core, alias)
  monkeypatch.setattr(jax_internals, "_primitives_cache", {})
  monkeypatch.setattr(higher_order, "_RULES", {
      p: r for p, r in higher_order._RULES.items()  # pylint: disable=protected-access
      if r not in (higher_order._call, higher_order._open_call)})  # pylint: disable=protected-access
  higher_order._register_calls()  # pylint: disable=protected-access
  assert {p.name for p in jax_compat.call_primitives()[0]} == before
  assert "eval_jaxpr" in before or "closed_call" in before
  for p in jax_compat.call_primitives()[0]:
    assert higher_order.rule_for(p) is higher_order._call  # pylint: disable=protected-access
  got = jax.jit(amp(_calls_traced, HALF))(X, W)
  assert multiplies_in(next(e for e in all_eqns(
      amp(_calls_traced, HALF), X, W) if "dot_general" in e.primitive.name)) \
      == (BF16, BF16)
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(
      jax.jit(jax.grad(amp(_calls_traced, HALF)))(X, W), want_grad)


def test_a_rule_given_twice_to_one_primitive_is_refused(monkeypatch):
  monkeypatch.setattr(higher_order, "_RULES", dict(higher_order._RULES))  # pylint: disable=protected-access
  with pytest.raises(ValueError, match="'scan' would get two"):
    higher_order._rule_for(jax.lax.scan_p)(higher_order._call)  # pylint: disable=protected-access
  higher_order._rule_for(jax.lax.scan_p, jax.lax.scan_p)(higher_order._scan)  # pylint: disable=protected-access


# --- A custom_vjp differentiated inside a custom_jvp rule ----------------------


@jax.custom_vjp
def _vjp_inner(x, w):
  return jnp.tanh(x @ w)


def _vjp_inner_fwd(x, w):
  return _vjp_inner(x, w), (x, w)


_BWD_SAW: list = []  # The dtypes each call of the backward rule received.


def _vjp_inner_bwd(res, g):
  _BWD_SAW.append({np.dtype(v.dtype) for v in (*res, g)})
  return jax.vjp(lambda a, b: jnp.tanh(a @ b), *res)[1](g)


_vjp_inner.defvjp(_vjp_inner_fwd, _vjp_inner_bwd)


@jax.custom_jvp
def _jvp_outer(x, w):
  return _vjp_inner(x, w) * 2.0


@_jvp_outer.defjvp
def _jvp_outer_rule(primals, tangents):
  return jax.jvp(lambda a, b: _vjp_inner(a, b) * 2.0, primals, tangents)


def _custom_lin_program(x, w):
  return (_jvp_outer(x, w) @ w).sum()


def test_custom_vjp_inside_a_jvp_rule_under_grad():
  """JAX's JVP of the custom_vjp function inside the rule stages its
  linear part (`custom_lin`): it runs as traced, its backward rule gets the
  dtypes it was written for, and the gradient is the float32 one."""
  _BWD_SAW.clear()
  jax.grad(amp(_custom_lin_program, HALF))(X, W)
  assert _BWD_SAW and all(saw == {F32} for saw in _BWD_SAW), _BWD_SAW
  want = jax.grad(_custom_lin_program, argnums=(0, 1))(X, W)
  full = jax.grad(amp(_custom_lin_program, "full"), argnums=(0, 1))(X, W)
  for a, b in zip(full, want):
    np.testing.assert_array_equal(a, b)
  f = amp(_custom_lin_program, HALF)
  dots = dot_dtypes(f, X, W)
  assert dots and all(d == (BF16, BF16) for d in dots), dots
  got = jax.jit(jax.grad(f, argnums=(0, 1)))(X, W)
  for a, b in zip(got, want):
    assert a.dtype == F32
    np.testing.assert_allclose(a, b, rtol=5e-2, atol=5e-2)
    assert not np.array_equal(a, b)  # Its forward ran in bfloat16.
