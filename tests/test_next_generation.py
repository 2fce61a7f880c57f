"""Specification: JAX's next-generation flags change nothing under amp.

``jax_scan3``, ``jax_remat3``, ``jax_custom_vjp3`` and ``jax_custom_jvp3``
(JAX 0.12; JAX 0.10.2 has the first three) make `lax.scan`,
`jax.checkpoint`, `jax.custom_vjp` and `jax.custom_jvp` stage new
primitives. With each flag on, alone and all together, `amp` and
`transform_amp` give the same per-op dtypes, values and gradients as with
the flags off, wherever plain JAX supports the combination. Where it does
not (JAX 0.12's scan3 has no gradient and no `vmap` yet), the amp-ed
function fails as plain JAX does; the same test compares gradients the day
JAX gains them.
"""

from __future__ import annotations

import collections
import contextlib
import inspect

import haiku as hk
import jax
from jax.sharding import PartitionSpec as P
import jax.numpy as jnp
import numpy as np
import pytest

import mpolicy
from mpolicy._src import jax_compat

from _helpers import checkpoints, jax_error, loop_carry_dtypes, multiplies_in
from _helpers import walk_eqns

HALF = "p=f32,c=bf16,o=f32"
BF16, F32 = np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
X = jnp.linspace(-1, 1, 12, dtype=F32).reshape(3, 4)
W = jnp.linspace(-0.5, 0.5, 16, dtype=F32).reshape(4, 4)

FLAGS = tuple(f for f in ("jax_scan3", "jax_remat3", "jax_custom_vjp3",
                          "jax_custom_jvp3") if f in jax.config.values)


@contextlib.contextmanager
def flags(names, on: bool):
  """The named flags on (or off), the others as they are; restored after."""
  before = {n: jax.config.values[n] for n in names}
  try:
    for n in names:
      jax.config.update(n, on)
    yield
  finally:
    for n, v in before.items():
      jax.config.update(n, v)


def flags_on(names):
  return flags(names, True)


def all_flags_off():
  return flags(FLAGS, False)


# --- The programs -------------------------------------------------------------


@jax.custom_jvp
def _sin_fake_jvp(x):
  return jnp.sin(x)


@_sin_fake_jvp.defjvp
def _sin_fake_jvp_rule(primals, tangents):
  (x,), (t,) = primals, tangents
  return _sin_fake_jvp(x), 3.0 * t * jnp.exp(x)  # Not cos(x): the rule's own.


@jax.custom_vjp
def _sin_fake_vjp(x):
  return jnp.sin(x)


_sin_fake_vjp.defvjp(lambda x: (jnp.sin(x), jnp.exp(x)),
                     lambda res, g: (5.0 * g * res,))


def _scan(x, w):
  def body(c, r):
    return jnp.tanh(c @ w) + r, jnp.exp(c).sum()
  c, ys = jax.lax.scan(body, x, jnp.ones((2, 3, 4)))
  return c.sum() + ys.sum()


def _fori(x, w):
  return jax.lax.fori_loop(0, 3, lambda i, c: jnp.tanh(c @ w), x).sum()


def _remat(x, w):
  pol = jax.checkpoint_policies.dots_saveable
  return jax.checkpoint(lambda a: jnp.exp(a @ w), policy=pol)(x).sum()


def _custom_jvp(x, w):
  return _sin_fake_jvp(x @ w).sum()


def _custom_vjp(x, w):
  return _sin_fake_vjp(x @ w).sum()


def _nested(x, w):
  def inner(a):
    return _scan(_sin_fake_jvp(a) @ w, w) + _sin_fake_vjp(a @ w).sum()
  return jax.checkpoint(inner)(x)


def _shard_map(x, w):
  mesh = jax.make_mesh((1,), ("d",))
  body = jax.shard_map(lambda a, b: _nested(a, b)[None], mesh=mesh,
                       in_specs=(P(), P()), out_specs=P())
  return jax.jit(body)(x, w).sum()


@jax.custom_jvp
def _tanh_layer(x, w):
  return jnp.tanh(x @ w)


@_tanh_layer.defjvp
def _tanh_layer_rule(primals, tangents):
  (x, w), (dx, dw) = primals, tangents
  y = jnp.tanh(x @ w)  # The rule computes its primal output itself.
  return y, (1 - y ** 2) * (dx @ w + x @ dw)


def _jvp_recomputes(x, w):
  return _tanh_layer(x, w).sum()


@jax.custom_jvp
def _jvp_of_vjp(x):
  return _sin_fake_vjp(x) * 2.0


@_jvp_of_vjp.defjvp
def _jvp_of_vjp_rule(primals, tangents):
  # JAX's JVP of the custom_vjp function stages its linear part: custom_lin,
  # or call_hi_primitive_linearized under jax_custom_vjp3.
  return jax.jvp(lambda a: _sin_fake_vjp(a) * 2.0, primals, tangents)


def _vjp_in_jvp_rule(x, w):
  return (_jvp_of_vjp(x @ w) @ w).sum()


PROGRAMS = {"scan": _scan, "fori_loop": _fori, "remat": _remat,
            "custom_jvp": _custom_jvp, "custom_vjp": _custom_vjp,
            "nested": _nested, "shard_map": _shard_map}
# Custom rules written for float32, checked by the tests that name them.
CUSTOM_RULE_PROGRAMS = {"jvp_recomputes": _jvp_recomputes,
                        "vjp_in_jvp_rule": _vjp_in_jvp_rule}

# Which flag each program's own construct turns into a new primitive.
OWN_FLAG = {"scan": "jax_scan3", "fori_loop": "jax_scan3",
            "remat": "jax_remat3", "custom_jvp": "jax_custom_jvp3",
            "custom_vjp": "jax_custom_vjp3",
            "jvp_recomputes": "jax_custom_jvp3"}


def _transforms(fn):
  """fn under each transformation, with its arguments."""
  grad = jax.grad(fn, argnums=(0, 1))
  return {
      "eager": (fn, (X, W)),
      "jit": (jax.jit(fn), (X, W)),
      "grad": (jax.jit(grad), (X, W)),
      "vmap": (jax.vmap(fn, in_axes=(0, None)), (jnp.stack([X, -X]), W)),
      "jvp": (lambda x, w: jax.jvp(lambda a: fn(a, w), (x,), (x,)), (X, W)),
  }


# The primitives whose operand dtypes the op rules decide.
_COMPUTE = frozenset({"dot_general", "amp_dot_general", "exp", "tanh", "sin",
                      "cos", "log", "reduce_sum", "mul"})


def op_dtypes(fn, *args) -> set:
  """Each compute primitive of ``fn``'s jaxpr with the dtypes its operands
  run in (a set: the number of equations differs between the classic and
  the next-generation constructs' derivatives)."""
  return {(e.primitive.name.replace("amp_", ""),
           tuple(d.name for d in multiplies_in(e)))
          for e in walk_eqns(jax.make_jaxpr(fn)(*args))
          if e.primitive.name in _COMPUTE}


def _leaves(tree):
  return [np.asarray(x, np.float32) for x in jax.tree_util.tree_leaves(tree)]


def check_same_as_flags_off(program: str, flags, transform: str):
  """amp-ed ``program`` under ``transform`` with ``flags`` on: what it gives
  with every flag off, or the error plain JAX raises with ``flags`` on."""
  fn = {**PROGRAMS, **CUSTOM_RULE_PROGRAMS}[program]
  with all_flags_off():
    plain, args = _transforms(fn)[transform]
    refused = jax_error(plain, *args)
    g, _ = _transforms(mpolicy.amp(fn, HALF))[transform]
    if refused is None:
      want, want_ops = g(*args), op_dtypes(g, *args)
  with flags_on(flags):
    plain, _ = _transforms(fn)[transform]
    refused = jax_error(plain, *args)
    g, _ = _transforms(mpolicy.amp(fn, HALF))[transform]
    if refused is not None:  # Plain JAX refuses: so does amp, alike.
      with pytest.raises(refused):
        jax.block_until_ready(g(*args))
      return
    got, got_ops = g(*args), op_dtypes(g, *args)
  assert got_ops == want_ops
  assert [x.dtype for x in jax.tree_util.tree_leaves(got)] == [
      x.dtype for x in jax.tree_util.tree_leaves(want)]
  for a, b in zip(_leaves(got), _leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


needs_flags = pytest.mark.skipif(
    not FLAGS, reason="this JAX has no next-generation flags")


@needs_flags
@pytest.mark.parametrize("program,transform", [
    ("nested", "jit"), ("nested", "grad"), ("nested", "vmap"),
    ("nested", "jvp"), ("shard_map", "grad")])
def test_all_flags_together(program, transform):
  check_same_as_flags_off(program, FLAGS, transform)


@needs_flags
@pytest.mark.parametrize("program", sorted(OWN_FLAG))
def test_each_flag_alone_on_its_construct(program):
  flag = OWN_FLAG[program]
  if flag not in FLAGS:
    pytest.skip(f"{flag} is not a flag of JAX {jax.__version__}")
  # jit for a loop: JAX 0.12 cannot differentiate scan3 (tested below).
  transform = "jit" if flag == "jax_scan3" else "grad"
  check_same_as_flags_off(program, (flag,), transform)


@pytest.mark.slow
@pytest.mark.parametrize("transform", ["eager", "jit", "grad", "vmap", "jvp"])
@pytest.mark.parametrize("program", sorted(PROGRAMS))
@pytest.mark.parametrize("flags", [(f,) for f in FLAGS] + [FLAGS])
def test_every_flag_setting_everywhere(flags, program, transform):
  check_same_as_flags_off(program, flags, transform)


@needs_flags
@pytest.mark.parametrize("program,transform", [
    ("jvp_recomputes", "jit"), ("jvp_recomputes", "grad"),
    ("jvp_recomputes", "jvp"), ("vjp_in_jvp_rule", "jit"),
    ("vjp_in_jvp_rule", "jvp")])
def test_custom_rules_written_for_float32_with_all_flags(program, transform):
  """A JVP rule that recomputes its primal output (at the dtypes it was
  written for) and a custom_vjp differentiated inside a JVP rule: as with
  the flags off."""
  check_same_as_flags_off(program, FLAGS, transform)


@needs_flags
@pytest.mark.parametrize("names", [("jax_custom_vjp3",), FLAGS])
def test_custom_vjp_in_a_jvp_rule_gradient_with_the_flags(names):
  """Its linear part (call_hi_primitive_linearized under jax_custom_vjp3)
  runs as traced: the gradient is the flags-off one, bit for bit (with
  jax_custom_jvp3 on too, the op dtypes differ in one `sin`, float32 there
  and bfloat16 with the flags off, which leaves the gradient's bits as
  they are)."""
  fn = lambda f: jax.jit(jax.grad(mpolicy.amp(f, HALF), argnums=(0, 1)))
  with all_flags_off():
    want = fn(_vjp_in_jvp_rule)(X, W)
  with flags_on(names):
    got = fn(_vjp_in_jvp_rule)(X, W)
  for a, b in zip(got, want):
    assert a.dtype == b.dtype == F32
    np.testing.assert_array_equal(a, b)


def test_a_recomputing_jvp_rule_keeps_its_derivative():
  with flags_on(FLAGS):
    f = mpolicy.amp(_jvp_recomputes, HALF)
    got = jax.jit(jax.grad(f, argnums=(0, 1)))(X, W)
    ops = op_dtypes(jax.grad(f), X, W)
  want = jax.grad(_jvp_recomputes, argnums=(0, 1))(X, W)
  assert ("dot_general", ("bfloat16", "bfloat16")) in ops
  for a, b in zip(got, want):
    assert a.dtype == F32
    np.testing.assert_allclose(a, b, rtol=3e-2, atol=3e-2)


@pytest.mark.skipif("jax_custom_jvp3" not in FLAGS,
                    reason="this JAX has no jax_custom_jvp3")
def test_a_jvp_rule_jax_makes_from_more_is_refused_by_name(monkeypatch):
  # JAX makes a custom_jvp's rule from what the rule closes over; one more
  # argument (as JAX 0.12.1 added the operands' tree) that mpolicy cannot
  # find is an error naming it, not the rule run at float32.
  hijax = jax_compat.hijax._hijax_module  # pylint: disable=protected-access
  make = hijax._custom_jvp_rule  # pylint: disable=protected-access
  signature = inspect.signature(make)
  def with_more(*args):
    return make(*args[:len(signature.parameters)])
  with_more.__signature__ = signature.replace(parameters=[
      *signature.parameters.values(),
      inspect.Parameter("layout_tree", inspect.Parameter.POSITIONAL_OR_KEYWORD)])
  with flags_on(("jax_custom_jvp3",)):
    monkeypatch.setattr(hijax, "_custom_jvp_rule", with_more)
    with pytest.raises(NotImplementedError,
                       match="'_sin_fake_jvp'.* from 'layout_tree'"):
      jax.grad(mpolicy.amp(_custom_jvp, HALF))(X, W)


# --- What each construct keeps --------------------------------------------------


def test_scan3_carry_keeps_the_dtype_it_enters_with():
  with flags_on([f for f in FLAGS if f == "jax_scan3"]):
    f = mpolicy.amp(_scan, HALF)
    assert loop_carry_dtypes(f, X, W) == [F32]
    ops = op_dtypes(f, X, W)
    assert ("dot_general", ("bfloat16", "bfloat16")) in ops
    assert ("exp", ("float32",)) in ops


def test_scan3_gradient_is_checked_once_jax_has_one():
  """JAX 0.12's scan3 has no reverse mode: amp's gradient fails alike. When
  JAX gains one, this compares it with the flags-off gradient."""
  if "jax_scan3" not in FLAGS:
    pytest.skip(f"jax_scan3 is not a flag of JAX {jax.__version__}")
  check_same_as_flags_off("scan", ("jax_scan3",), "grad")
  with flags_on(["jax_scan3"]):
    if jax_error(jax.grad(_scan), X, W) is None:
      return
    with pytest.raises(NotImplementedError, match="vjp_fwd"):
      jax.grad(mpolicy.amp(_scan, HALF))(X, W)


def test_fori_loop_under_scan3_updates_its_carry():
  """A loop whose results are only its carries (JAX 0.12's jit drops its
  own Scan3 there as dead code and returns the carry it started with)."""
  with flags_on([f for f in FLAGS if f == "jax_scan3"]):
    got = mpolicy.amp(_fori, HALF)(X, W)
  with all_flags_off():
    want = mpolicy.amp(_fori, HALF)(X, W)
  assert abs(float(_fori(X, W))) > 0.5  # The carry moved away from sum(X) = 0.
  np.testing.assert_allclose(got, want, rtol=1e-6)


def test_remat3_keeps_the_policy_of_plain_jax():
  with flags_on(FLAGS):
    ((policy, body),) = checkpoints(mpolicy.amp(_remat, HALF), X, W)
    ((plain, _),) = checkpoints(_remat, X, W)
  assert policy is plain is jax.checkpoint_policies.dots_saveable
  assert {np.dtype(v.aval.dtype) for e in body.jaxpr.eqns
          if e.primitive.name == "amp_dot_general" for v in e.invars} == {F32}


def test_custom_rules_keep_their_derivatives_under_the_flags():
  """The rules' own derivatives (3 exp(x) and 5 exp(x), not cos(x))."""
  with flags_on(FLAGS):
    for fn, k in ((_custom_jvp, 3.0), (_custom_vjp, 5.0)):
      gx = jax.grad(mpolicy.amp(fn, HALF))(X, W)
      want = jax.grad(lambda x: (k * jnp.exp(x @ W)).sum() * 0 + (
          k * jnp.exp(jax.lax.stop_gradient(x @ W)) * (x @ W)).sum())(X)
      np.testing.assert_allclose(gx, want, rtol=3e-2, atol=3e-2)


# --- transform_amp ---------------------------------------------------------------


class _Block(hk.Module):

  def __call__(self, x):
    h = hk.remat(lambda a: jax.nn.relu(hk.Linear(4)(a)))(x)
    return _sin_fake_vjp(hk.Linear(4)(h)) + _sin_fake_jvp(x)


def _haiku_forward(x):
  x = _Block()(x)
  return hk.scan(lambda c, _: (jnp.tanh(c), c.sum()), x, None, length=2)[0]


def test_transform_amp_same_with_the_flags():
  mpolicy.set_policy(hk.Module, HALF)
  model = mpolicy.transform_amp(_haiku_forward)
  params = model.init(jax.random.PRNGKey(0), X)
  loss = lambda p: model.apply(p, None, X).sum()

  def run(names):
    with flags_on(names):
      rows = collections.Counter(
          (r.primitive, r.ran_in) for r in mpolicy.explain(
              model.apply, params, None, X).rows
          if r.primitive not in ("new_ref", "get", "swap"))
      grads = (None if jax_error(jax.grad(hk.transform(_haiku_forward).apply),
                                 params, None, X)
               else jax.jit(jax.grad(loss))(params))
      return rows, jax.jit(model.apply)(params, None, X), grads

  with all_flags_off():
    rows, out, grads = run(())
  assert ("dot_general", "bfloat16") in rows
  for names in [FLAGS] if FLAGS else []:
    got_rows, got_out, got_grads = run(names)
    assert got_rows == rows, names
    np.testing.assert_allclose(got_out, out, rtol=1e-6)
    if got_grads is not None:
      for a, b in zip(_leaves(got_grads), _leaves(grads)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
