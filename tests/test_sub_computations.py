"""Specification: no sub-computation passes through the interpreter unseen.

Every primitive whose params may carry a sub-computation (a jaxpr, a
traced function, a thunk that traces one) is interpreted, run as a kernel
with its traced dtypes, a scalar combiner, or refused with an error that
names it and the ways out (`full_precision()`, `OpRules.with_rule`). The
survey walks the primitives of JAX's control-flow, checkpoint, custom
derivative, callback, sharding, state, hijax and Pallas modules; a
primitive a newer JAX adds fails it until it is given an entry.
"""

from __future__ import annotations

import jax
import jax.custom_batching
from jax.extend import core as jex_core
import jax.numpy as jnp
import numpy as np
import pytest

import mpolicy
from mpolicy._src import jax_compat
from mpolicy._src import sub_computations

import _survey

HALF = "p=f32,c=bf16,o=f32"
X = jnp.linspace(-1, 1, 12, dtype=jnp.float32).reshape(3, 4)
W = jnp.linspace(-0.5, 0.5, 16, dtype=jnp.float32).reshape(4, 4)

# Refused names this JAX does not define (each is defined by the other end
# of the supported range, so no entry is dead).
_ABSENT = {"0.10": {"program_order", "xla_metadata_call"},
           "0.12": {"core_map", "fusible", "jaxpr_call"}}


def _surveyed():
  return [p for p in _survey.primitives_in()
          if _survey.may_carry_sub_computations(p)]


def test_every_surveyed_primitive_is_handled():
  unhandled = [p.name for p in _surveyed()
               if sub_computations.handling(p) is None]
  assert not unhandled, (
      "primitives that may carry a sub-computation and have no entry "
      "(interpret, kernel, combiner or refuse them, with a reason): "
      f"{unhandled}")


def test_the_survey_sees_the_higher_order_primitives():
  names = {p.name for p in _surveyed()}
  expected = {"scan", "while", "cond", "jit", "remat2", "custom_jvp_call",
              "custom_vjp_call", "custom_linear_solve", "shard_map",
              "call_hi_primitive", "pallas_call", "io_callback",
              "custom_vmap_call", "reduce", "scatter-add"}
  assert expected <= names, expected - names
  assert not names & {"exp", "add", "dot_general", "convert_element_type",
                      "random_wrap", "get", "swap"}


def test_each_kind_of_handling_is_in_use():
  by_kind = {}
  for p in _surveyed():
    by_kind.setdefault(sub_computations.handling(p), set()).add(p.name)
  assert {"scan", "call_hi_primitive"} <= by_kind["interpreted"]
  assert {"pallas_call", "io_callback"} <= by_kind["kernel"]
  assert "scatter-add" in by_kind["scalar combiner"]
  assert "custom_vmap_call" in by_kind["refused"]


def test_refused_names_are_primitives_of_the_supported_jax():
  version = ".".join(jax.__version__.split(".")[:2])
  names = ({p.name for p in _survey.primitives_in()}
           | jax_compat.primitive_names())
  missing = set(sub_computations.REFUSED_PRIMITIVES) - names
  assert missing == _ABSENT.get(version, missing), missing


# --- The runtime guard --------------------------------------------------------


@jax.custom_batching.custom_vmap
def _sin(x):
  return jnp.sin(x)


@_sin.def_vmap
def _sin_vmap(axis_size, in_batched, x):
  del axis_size
  return jnp.sin(x), in_batched[0]


def _with_custom_vmap(x, w):
  return _sin(x @ w).sum()


def test_a_refused_primitive_names_itself_and_the_ways_out():
  with pytest.raises(mpolicy.UnsupportedPrimitiveError) as info:
    mpolicy.amp(_with_custom_vmap, HALF)(X, W)
  message = str(info.value)
  assert "'custom_vmap_call'" in message
  assert "custom_vmap" in message and "batching rule" in message
  assert "full_precision()" in message
  assert "with_rule('custom_vmap_call'" in message


def test_full_precision_runs_it_as_written():
  fn = lambda x, w: mpolicy.full_precision()(_with_custom_vmap)(x, w)
  np.testing.assert_allclose(mpolicy.amp(fn, HALF)(X, W),
                             _with_custom_vmap(X, W), rtol=1e-6)


def test_a_rule_of_the_users_runs_it():
  seen = []

  def rule(policy, *args, call, **params):
    del params
    seen.append((str(policy), [a.dtype for a in args]))
    closed = jex_core.ClosedJaxpr(call, ())
    return jex_core.jaxpr_as_fun(closed)(*[a.astype(jnp.float32)
                                           for a in args])

  rules = mpolicy.DEFAULT_RULES.with_rule("custom_vmap_call", rule)
  out = mpolicy.amp(_with_custom_vmap, HALF, rules=rules)(X, W)
  assert seen and seen[0][1] == [jnp.bfloat16]  # The matmul ran in bf16.
  np.testing.assert_allclose(out, _with_custom_vmap(X, W), rtol=2e-2,
                             atol=2e-2)


def _toy(param_name, value):
  prim = jax_compat.new_primitive(f"toy_{param_name}")
  prim.def_impl(lambda x, **_: x)
  prim.def_abstract_eval(lambda x, **_: x)
  jax_compat.define_lowering(prim, lambda x, **_: x)
  return lambda x: prim.bind(x, **{param_name: value})


def test_a_thunk_in_the_params_is_a_sub_computation():
  # Custom derivatives hold their rules as thunks that trace a jaxpr.
  thunk = jax_compat.wrap_thunk(lambda *a: a, jax.make_jaxpr(jnp.sin)(
      1.0).jaxpr)
  with pytest.raises(mpolicy.UnsupportedPrimitiveError, match="toy_rule"):
    mpolicy.amp(_toy("rule", thunk), HALF)(X)


def test_a_plain_function_in_the_params_is_not():
  # (random_wrap holds its PRNG implementation so; a callback's Python
  # code is a kernel's.)
  out = mpolicy.amp(_toy("impl", jnp.sin), HALF)(X)
  np.testing.assert_array_equal(out, X)


# --- Constructs of the user's (jax.experimental.hijax) ---------------------------


def _construct_class():
  from jax.experimental import hijax  # pylint: disable=g-import-not-at-top
  base = getattr(hijax, "HiPrim", None) or getattr(hijax, "VJPHiPrimitive")

  class Cube(base):
    """x ** 3 for an aval; ``body``, if given, is carried (not run)."""

    def __init__(self, aval, body=None):
      self.in_avals = (aval,)
      self.out_aval = aval
      self.params = {} if body is None else {"body": body}
      super().__init__()

    def expand(self, x):
      return x * x * x

  return Cube


def test_a_users_construct_without_sub_computation_runs_as_traced():
  cube = _construct_class()
  fn = lambda x, w: cube(jax.typeof(x @ w))(x @ w).sum()
  f = mpolicy.amp(fn, HALF)
  (eqn,) = [e for e in jax.make_jaxpr(f)(X, W).eqns
            if jax_compat.hijax.hi_object(e) is not None]
  assert eqn.invars[0].aval.dtype == jnp.float32  # Its traced dtype.
  np.testing.assert_allclose(f(X, W), fn(X, W), rtol=3e-2)


def test_a_users_construct_with_a_sub_computation_is_refused():
  cube = _construct_class()
  body = jax.make_jaxpr(jnp.sin)(X)
  fn = lambda x, w: cube(jax.typeof(x @ w), body)(x @ w).sum()
  with pytest.raises(mpolicy.UnsupportedPrimitiveError,
                     match="Cube.*full_precision"):
    mpolicy.amp(fn, HALF)(X, W)
  np.testing.assert_allclose(
      mpolicy.amp(mpolicy.full_precision()(fn), HALF)(X, W), fn(X, W),
      rtol=1e-6)
