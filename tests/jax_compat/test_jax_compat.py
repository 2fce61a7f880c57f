"""The JAX version shim: param readers, and loops run under the rules.

JAX 0.10 records a scan's operand counts as ``num_consts``/``num_carry``;
0.11 and 0.12 record flat trees ``ft_in``/``ft_out`` instead. The readers
are tested on both shapes (the newer one built by hand, so these tests run
on every supported JAX), then every way of writing a loop is run through
`amp` and `transform_amp`, forward and under `jax.grad`, on the JAX
installed.
"""

from __future__ import annotations

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpolicy
from _helpers import multiplies_in, walk_eqns
from mpolicy._src import jax_compat

HALF = "p=f32,c=bf16,o=f32"
BF16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
KEY = jax.random.PRNGKey(0)
X = jnp.linspace(-1, 1, 12, dtype=F32).reshape(3, 4)
W = jnp.linspace(-0.5, 0.5, 16, dtype=F32).reshape(4, 4)
XS = jnp.linspace(-1, 1, 24, dtype=F32).reshape(2, 3, 4)


class _FlatTreeLike:
  """Stands in for JAX 0.11's FlatTree: groups of leaves, via `unpack`."""

  def __init__(self, *groups):
    self._groups = groups

  def unpack(self):
    return self._groups


# --- Param readers, both shapes ------------------------------------------------


def test_scan_counts_reads_the_010_params():
  params = dict(reverse=False, length=3, jaxpr=None, num_consts=2,
                num_carry=3, unroll=1)
  assert jax_compat.scan_counts(params) == (2, 3)


def test_scan_counts_reads_the_011_params():
  params = dict(
      reverse=False, length=3, jaxpr=None, unroll=1,
      ft_in=_FlatTreeLike((None, None), (None, None, None), (None,)),
      ft_out=_FlatTreeLike((None, None, None), (None,)))
  assert jax_compat.scan_counts(params) == (2, 3)
  # No consts, one carry, nothing scanned over (a fori_loop's scan).
  params["ft_in"] = _FlatTreeLike((), (None,), ())
  assert jax_compat.scan_counts(params) == (0, 1)


def test_scan_counts_prefers_neither_shape_silently():
  with pytest.raises(KeyError, match="num_consts/num_carry nor ft_in"):
    jax_compat.scan_counts(dict(length=3, jaxpr=None))
  with pytest.raises(TypeError, match="ft_in to split into 3 groups"):
    jax_compat.scan_counts(dict(ft_in=_FlatTreeLike((None,), (None,))))


def test_while_and_custom_jvp_readers():
  assert jax_compat.while_counts(
      dict(cond_nconsts=1, body_nconsts=2, cond_jaxpr=None,
           body_jaxpr=None)) == (1, 2)
  with pytest.raises(KeyError, match="cond_nconsts/body_nconsts"):
    jax_compat.while_counts(dict(cond_jaxpr=None, body_jaxpr=None))
  assert jax_compat.custom_jvp_num_consts(dict(num_consts=3)) == 3


def _eqns_named(closed, name):
  return [e for e in walk_eqns(closed) if e.primitive.name == name]


def test_scan_counts_reads_this_jax_s_own_params():
  # Two carries (neither forwarded unchanged), one closed-over constant.
  w = W + 1.0

  def fn(x, y, xs):
    def body(carry, xi):
      a, b = carry
      return (jnp.tanh(a @ w) + xi, b * 2.0), a.sum()
    return jax.lax.scan(body, (x, y), xs)

  closed = jax.make_jaxpr(fn)(X, X, XS)
  (scan,) = _eqns_named(closed, "scan")
  n_consts, n_carry = jax_compat.scan_counts(scan.params)
  assert n_carry == 2
  assert n_consts == len(scan.invars) - 2 - 1  # Less the carries and xs.
  assert n_consts >= 1  # `w`.


def test_while_counts_reads_this_jax_s_own_params():
  bound = jnp.float32(3.0)
  fn = lambda x: jax.lax.while_loop(lambda c: c.sum() < bound,
                                    lambda c: c + W[0], x)
  (loop,) = _eqns_named(jax.make_jaxpr(fn)(X[0]), "while")
  n_cond, n_body = jax_compat.while_counts(loop.params)
  assert n_cond + n_body + 1 == len(loop.invars)
  assert n_cond >= 1 and n_body >= 1


# --- Loops under amp -----------------------------------------------------------


def _dots_inside(closed, loop_name):
  """Operand dtypes of the matmuls inside every ``loop_name`` equation."""
  loops = _eqns_named(closed, loop_name)
  assert loops, f"expected a {loop_name} in the jaxpr"
  out = []
  for loop in loops:
    for sub in jax_compat.jaxprs_in_params(loop.params):
      out += [multiplies_in(e) for e in walk_eqns(sub)
              if "dot_general" in e.primitive.name]
  return out


def _check_amp(fn, loop_name, args, argnums=(0, 1)):
  """Half x half matmuls inside the loop, forward and under grad; values."""
  f = mpolicy.amp(fn, HALF)
  loss = lambda *a: jnp.sum(f(*a) ** 2)
  for g in (f, jax.grad(loss, argnums=argnums)):
    dots = _dots_inside(jax.make_jaxpr(g)(*args), loop_name)
    assert dots and all(d == (BF16, BF16) for d in dots), dots
  out = f(*args)
  assert out.dtype == F32
  np.testing.assert_allclose(out, fn(*args), rtol=3e-2, atol=3e-2)
  want = jax.grad(lambda *a: jnp.sum(fn(*a) ** 2), argnums=argnums)(*args)
  for a, b in zip(jax.grad(loss, argnums=argnums)(*args), want):
    assert a.dtype == F32
    np.testing.assert_allclose(a, b, rtol=5e-2,
                               atol=5e-2 * float(jnp.abs(b).max()))


def test_lax_scan_under_amp_and_grad():
  def fn(x, w):
    def body(c, xi):
      c = jnp.tanh(c @ w + xi)
      return c, c.sum()
    c, ys = jax.lax.scan(body, x, XS)
    return c + ys.sum()
  _check_amp(fn, "scan", (X, W))
  # The carry leaves the loop in the dtype it entered with.
  (scan,) = _eqns_named(jax.make_jaxpr(mpolicy.amp(fn, HALF))(X, W), "scan")
  assert np.dtype(scan.outvars[0].aval.dtype) == F32


def test_reverse_scan_with_unroll_under_amp():
  def fn(x, w):
    c, _ = jax.lax.scan(lambda c, xi: (jnp.tanh(c @ w) * xi, None), x, XS,
                        reverse=True, unroll=2)
    return c
  _check_amp(fn, "scan", (X, W))


def test_fori_loop_with_static_bounds_is_a_scan_under_amp():
  fn = lambda x, w: jax.lax.fori_loop(0, 3, lambda i, c: jnp.tanh(c @ w), x)
  _check_amp(fn, "scan", (X, W))


def test_fori_loop_with_traced_bounds_is_a_while_under_amp():
  def fn(x, w, n):
    return jax.lax.fori_loop(0, n, lambda i, c: jnp.tanh(c @ w), x)
  f = mpolicy.amp(fn, HALF)
  n = jnp.int32(3)
  dots = _dots_inside(jax.make_jaxpr(f)(X, W, n), "while")
  assert dots and all(d == (BF16, BF16) for d in dots), dots
  (loop,) = _eqns_named(jax.make_jaxpr(f)(X, W, n), "while")
  assert np.dtype(loop.outvars[-1].aval.dtype) == F32
  np.testing.assert_allclose(f(X, W, n), fn(X, W, n), rtol=3e-2, atol=3e-2)


# --- Loops under transform_amp --------------------------------------------------


def _check_haiku(forward, loop_name):
  """Params f32; matmuls inside the loop half x half, also in the grad."""
  mpolicy.set_policy(hk.Module, HALF)
  f = mpolicy.transform_amp(forward)
  x = jnp.ones([2, 4], F32)
  params = f.init(KEY, x)
  assert {np.dtype(p.dtype) for p in jax.tree_util.tree_leaves(params)} == {F32}
  loss = lambda p: jnp.sum(f.apply(p, None, x) ** 2)
  for g, args in ((f.apply, (params, None, x)), (jax.grad(loss), (params,))):
    dots = _dots_inside(jax.make_jaxpr(g)(*args), loop_name)
    assert dots and all(d == (BF16, BF16) for d in dots), dots
  out = f.apply(params, None, x)
  assert out.dtype == F32
  plain = hk.transform(forward)
  np.testing.assert_allclose(out, plain.apply(params, None, x), rtol=3e-2,
                             atol=3e-2)
  grads = jax.grad(loss)(params)
  want = jax.grad(lambda p: jnp.sum(plain.apply(p, None, x) ** 2))(params)
  for a, b in zip(jax.tree_util.tree_leaves(grads),
                  jax.tree_util.tree_leaves(want)):
    assert a.dtype == F32
    np.testing.assert_allclose(a, b, rtol=5e-2,
                               atol=5e-2 * float(jnp.abs(b).max()))


def test_hk_scan_under_transform_amp_and_grad():
  def forward(x):
    linear = hk.Linear(4, name="cell")

    def body(carry, _):
      return jnp.tanh(linear(carry)), None

    y, _ = hk.scan(body, x, None, length=3)
    return y

  _check_haiku(forward, "scan")


def test_hk_layer_stack_under_transform_amp_and_grad():
  def forward(x):
    return hk.experimental.layer_stack(3, name="layers")(
        lambda x: jnp.tanh(hk.Linear(4, name="block")(x)))(x)

  _check_haiku(forward, "scan")


def test_scans_made_by_autodiff_inside_amp():
  # JAX's own AD writes scans with nested operand groups (primal and tangent
  # pairs, transposed carries); amp entered after AD must read those too.
  def fn(x, w):
    def body(c, xi):
      c = jnp.tanh(c @ w + xi)
      return c, c.sum()
    c, ys = jax.lax.scan(body, x, XS)
    return c.sum() + ys.sum()

  inner = {
      "grad": jax.grad(fn, argnums=(0, 1)),
      "jvp": lambda x, w: jax.jvp(fn, (x, w), (x, w)),
      "grad_of_jvp": jax.grad(
          lambda x, w: jax.jvp(fn, (x, w), (x, w))[1], argnums=1),
  }
  for name, g in inner.items():
    f = mpolicy.amp(g, HALF)
    dots = _dots_inside(jax.make_jaxpr(f)(X, W), "scan")
    assert dots and all(d == (BF16, BF16) for d in dots), (name, dots)
    for a, b in zip(jax.tree_util.tree_leaves(f(X, W)),
                    jax.tree_util.tree_leaves(g(X, W))):
      assert a.dtype == F32, name
      np.testing.assert_allclose(a, b, rtol=5e-2,
                                 atol=5e-2 * float(jnp.abs(b).max()) + 1e-3)
