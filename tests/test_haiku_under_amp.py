"""`amp` over a plain `hk.transform` honours the registry as `transform_amp`.

`amp(hk.transform(f).apply)` (a script that kept `hk.transform`) gets the
same module policies (class and name-pattern entries), the same casts and
the same op rules as `transform_amp(f).apply`; only ``init`` is beyond its
reach.
"""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpolicy
from _helpers import same_bits

HALF = "p=f32,c=bf16,o=f32"


def _forward(x, is_training):
  x = hk.nets.MLP([8, 8], activate_final=True)(x)
  x = hk.BatchNorm(True, True, 0.9)(x, is_training)
  return hk.Linear(2)(x)


def _setup():
  x = jax.random.normal(jax.random.PRNGKey(0), (4, 3))
  plain = hk.transform_with_state(_forward)
  params, state = plain.init(jax.random.PRNGKey(1), x, True)
  return plain, params, state, x


def _rows(report):
  return [(r.scope, r.module_class, r.primitive, r.in_dtypes, r.ran_in,
           r.rule, r.decided_by) for r in report.rows]


def test_class_entries_give_transform_amps_rows_values_and_gradients():
  mpolicy.set_policy(hk.Module, HALF)
  mpolicy.set_policy(hk.BatchNorm, "full")
  plain, params, state, x = _setup()
  ours = mpolicy.amp(plain.apply)
  theirs = mpolicy.transform_amp_with_state(_forward).apply
  report = mpolicy.explain(ours, params, state, None, x, True)
  assert _rows(report) == _rows(
      mpolicy.explain(theirs, params, state, None, x, True))
  dots = [r for r in report.rows if r.primitive == "dot_general"]
  assert len(dots) == 3 and all(r.ran_in == "bfloat16" for r in dots)
  assert report.casts_by_policies > 0
  norm = [r for r in report.rows if r.module_class == "hk.BatchNorm"]
  assert norm and all(r.ran_in == "float32" for r in norm
                      if r.primitive != "convert_element_type")

  @jax.jit
  def run(params):  # Outputs, new state and gradients, bit for bit.
    return ({"ours": ours(params, state, None, x, True),
             "theirs": theirs(params, state, None, x, True)},
            {who: jax.grad(lambda p, f=f: f(p, state, None, x, True)[0].sum())(
                params) for who, f in (("ours", ours), ("theirs", theirs))})

  results, grads = run(params)
  assert same_bits(results["ours"], results["theirs"])
  assert same_bits(grads["ours"], grads["theirs"])
  out, new_state = results["ours"]
  assert out.dtype == jnp.float32
  assert {s.dtype for s in jax.tree_util.tree_leaves(new_state)} == {
      jnp.dtype(jnp.float32), jnp.dtype(jnp.int32)}  # Averages, counters.


def test_name_patterns_govern_a_plain_transform_under_amp():
  mpolicy.set_policy("mlp/~/linear_1", HALF)
  plain, params, state, x = _setup()
  report = mpolicy.explain(mpolicy.amp(plain.apply), params, state, None, x,
                           True)
  ran = {r.scope: r.ran_in for r in report.rows
         if r.primitive == "dot_general"}
  assert ran == {"mlp/linear_0": "float32", "mlp/linear_1": "bfloat16",
                 "linear": "float32"}


def test_params_are_as_init_made_them_and_amp_only_casts_their_use():
  mpolicy.set_policy(hk.Module, "p=bf16,c=bf16,o=f32")
  plain, params, state, x = _setup()
  # A plain init is beyond amp's reach: its params stay float32;
  # transform_amp's init stores them in the param dtype.
  assert all(p.dtype == jnp.float32
             for p in jax.tree_util.tree_leaves(params))
  init = mpolicy.transform_amp_with_state(_forward).init
  ta_params, _ = jax.eval_shape(lambda k, x: init(k, x, True),
                                jax.random.PRNGKey(1), x)
  assert all(p.dtype == jnp.bfloat16
             for p in jax.tree_util.tree_leaves(ta_params))
  apply = mpolicy.amp(plain.apply)
  out, new_state = jax.eval_shape(
      lambda p, s, x: apply(p, s, None, x, True), params, state, x)
  assert out.dtype == jnp.float32
  # State is written in the param dtype, as transform_amp stores it.
  assert all(s.dtype == jnp.bfloat16 for s in jax.tree_util.tree_leaves(
      new_state) if jnp.issubdtype(s.dtype, jnp.floating))


@pytest.mark.parametrize("transform", [mpolicy.transform_amp,
                                       mpolicy.transform_amp_with_state])
@pytest.mark.parametrize("wrap", [hk.transform, hk.transform_with_state])
def test_a_transformed_function_is_refused_with_the_fix(transform, wrap):
  name = transform.__name__
  with pytest.raises(TypeError, match=(
      rf"{name} takes the forward function itself.*call {name}\(f\), not "
      rf"{name}\(hk.transform\(f\)\)")):
    transform(wrap(lambda x: hk.Linear(2)(x)))
