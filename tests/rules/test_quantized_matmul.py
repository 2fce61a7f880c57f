"""The one quantized matmul: one format value per format in one table, one
entry point and one custom_vjp for all of them, and a rule that asks the
value instead of branching on a format's name."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np

import mpolicy
from mpolicy._src import policy as policy_lib
from mpolicy._src.rules import conv
from mpolicy._src.rules import matmul
from mpolicy._src.rules import quantized_matmul as qm

DN = (((1,), (0,)), ((), ()))


def test_the_table_holds_one_value_per_format():
  assert set(qm.FORMATS) == {
      ("fp8", "per_row"), ("fp8", "per_tensor"), ("mxfp8", None),
      ("mxfp4", None), ("nvfp4", None), ("int8", None)}
  values = list(qm.FORMATS.values())
  assert len({id(v) for v in values}) == len(values)
  assert all(isinstance(v, qm.Format) for v in values)
  # Every Policy.matmul_format has its value; fp8's scaling picks one.
  assert {v.name for v in values} == set(policy_lib.MATMUL_FORMATS)
  assert qm.lookup("fp8", "per_tensor").per_tensor
  assert not qm.lookup("fp8", "per_row").per_tensor
  assert qm.lookup("nvfp4", "per_row") is qm.FORMATS[("nvfp4", None)]
  # What each value knows of itself.
  assert [qm.lookup(n).keyed for n in ("fp8", "mxfp8", "nvfp4", "int8")] == [
      False, True, True, False]
  assert qm.lookup("mxfp8").recipe_options == ()
  assert qm.lookup("nvfp4").recipe_options == (
      "stochastic_rounding", "hadamard", "weight_tiles", "seed")
  assert qm.lookup("int8").native is None
  assert qm.lookup("mxfp4").native is None
  assert "scaled_matmul" in qm.lookup("nvfp4").native


def test_an_unknown_format_is_refused_with_the_known_ones():
  try:
    qm.lookup("mxfp6")
  except ValueError as e:
    assert str(e) == (
        "Unknown quantized matmul format 'mxfp6': expected one of ['fp8', "
        "'int8', 'mxfp4', 'mxfp8', 'nvfp4'].")
  else:
    raise AssertionError("no error")


def test_the_rule_has_no_branch_per_format():
  names = [n for n, _ in qm.FORMATS] + ["per_row", "per_tensor"]
  for fn in (matmul._lower_dot_fp8, conv._lower_conv_fp8, qm.lower, qm._key,
             qm.quantized_dot_general, qm._forward, qm._backward):
    source = inspect.getsource(fn)
    assert not [n for n in names if repr(n) in source or f'"{n}"' in source], (
        fn.__name__)


class _Integers(qm.Format):
  """A test format: operands rounded to integers, exact float32 product;
  backward: the rounded operands' gradients."""
  name = ran_in = "integers"

  def reason(self, options):
    return "operands rounded to integers"

  def spec(self, a, b, lhs, rhs, dims, *, out_dtype, options, lhs_param,
           rhs_param, contraction_axes, label, backward):
    return qm.Spec(self, out_dtype, np.dtype(lhs.dtype), np.dtype(rhs.dtype),
                   bool(dims[1][0]))

  def forward(self, a, b, key, spec, given=None):
    out = qm._mm(jnp.round(a), jnp.round(b), spec.batched)
    return out.astype(spec.out_dtype), (a, b)

  def backward(self, spec, residuals, g):
    a, b = residuals
    g = g.astype(jnp.float32)
    return ((g @ jnp.round(b).T).astype(spec.lhs_dtype),
            (jnp.round(a).T @ g).astype(spec.rhs_dtype))


def test_a_format_value_put_in_the_table_runs_through_the_same_rule(
    monkeypatch):
  monkeypatch.setitem(qm.FORMATS, ("mxfp8", None), _Integers())
  x = jnp.asarray([[0.4, 1.6, -2.2, 3.0]], jnp.float32)
  w = jnp.asarray([[1.2], [0.7], [2.0], [-0.4]], jnp.float32)
  f = mpolicy.amp(lambda x, w: x @ w, "p=f32,c=mxfp8,o=f32")
  # round(x) = [0, 2, -2, 3], round(w) = [1, 1, 2, 0]: 0 + 2 - 4 + 0.
  np.testing.assert_array_equal(f(x, w), np.asarray([[-2.0]], np.float32))
  dx, dw = jax.grad(lambda x, w: jnp.sum(f(x, w)), (0, 1))(x, w)
  np.testing.assert_array_equal(dx, np.asarray([[1, 1, 2, 0]], np.float32))
  np.testing.assert_array_equal(dw, np.asarray([[0], [2], [-2], [3]],
                                               np.float32))
  row = [r for r in mpolicy.explain(f, x, w).rows
         if r.primitive == "dot_general"][0]
  assert row.ran_in == "integers" and "operands rounded to integers" in (
      row.decided_by)


def test_int8_backward_is_the_given_functions_gradient():
  r = np.random.default_rng(0)
  x = jnp.asarray(r.standard_normal((16, 96)), jnp.float32)
  w = jnp.asarray(r.standard_normal((96, 24)) * 0.1, jnp.float32)

  def bf16(a, b):
    return jax.lax.dot_general(
        a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), DN,
        preferred_element_type=jnp.float32).astype(jnp.bfloat16)

  g = jnp.asarray(r.standard_normal((16, 24)), jnp.bfloat16)
  _, vjp = jax.vjp(lambda a, b: qm.quantized_dot_general(
      a, b, DN, qm.lookup("int8"), backward=bf16), x, w)
  _, ref = jax.vjp(bf16, x, w)
  for got, want in zip(vjp(g), ref(g)):
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_every_format_goes_through_the_one_custom_vjp(monkeypatch):
  seen = []
  forward = qm._forward

  def recording(a, b, key, spec):
    seen.append(spec.fmt)
    return forward(a, b, key, spec)

  monkeypatch.setattr(qm, "_forward", recording)
  x = jnp.ones((8, 64), jnp.float32)
  w = jnp.ones((64, 16), jnp.float32)
  for (name, scaling), fmt in qm.FORMATS.items():
    rules = mpolicy.DEFAULT_RULES.with_fp8(scaling=scaling or "per_row")
    f = mpolicy.amp(lambda x, w: x @ w, f"p=f32,c={name},o=f32", rules=rules)
    f(x, w)
    assert seen[-1] is fmt, (name, scaling)
  assert len(seen) == len(qm.FORMATS)
