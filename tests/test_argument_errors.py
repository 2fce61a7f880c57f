"""A bad argument is refused at the call that got it, in words.

Each error is raised by the call that was given the bad value (as
`jax.jit(3)` does), names the function and the argument, and says what is
accepted, instead of an AttributeError from deep inside a later call.
"""

import re
import warnings

import haiku as hk
import jax
import jax.numpy as jnp
import optax
import pytest

import mpolicy

SCALE_CLASSES = ("NoOpLossScale()", "StaticLossScale(value)",
                 "DynamicLossScale(value)")


# --- Functions and transformations --------------------------------------------


def test_amp_of_a_non_callable_fails_when_wrapped():
  with pytest.raises(TypeError, match=re.escape(
      "amp: fn must be a callable (the function to run under the op rules")
                     ) as e:
    mpolicy.amp(3)
  assert "got 3 (int)" in str(e.value)


def test_amp_with_the_policy_first_says_the_function_comes_first():
  with pytest.raises(TypeError, match=re.escape(
      "got 'full' (str). A string comes after the function: amp(fn, 'full')")):
    mpolicy.amp("full", jnp.sin)


@pytest.mark.parametrize("wrap, name, arg", [
    (lambda tx: mpolicy.with_state_dtypes(tx, jnp.bfloat16),
     "with_state_dtypes", "transform"),
    (mpolicy.skip_nonfinite, "skip_nonfinite", "inner"),
    (mpolicy.master_weights, "master_weights", "inner"),
    (mpolicy.stochastic_params, "stochastic_params", "inner"),
    (mpolicy.keep_dtypes, "keep_dtypes", "inner"),
    (lambda tx: mpolicy.make_train_step(jnp.sum, tx), "make_train_step",
     "optimizer"),
])
def test_optax_wrappers_refuse_what_is_not_a_transformation(wrap, name, arg):
  with pytest.raises(TypeError, match=re.escape(
      f"{name}: {arg} must be an optax GradientTransformation (an object with "
      "init and update methods, e.g. optax.adam(1e-3)), got None (NoneType).")):
    wrap(None)
  # The optimizer's maker, not yet called: the message says to call it.
  with pytest.raises(TypeError, match=r"got <function adam .*call it, e\.g\."):
    wrap(optax.adam)


def test_with_state_dtypes_refuses_none_as_dtypes():
  # np.dtype(None) is float64: None must not silently mean that.
  with pytest.raises(TypeError, match="dtypes must be a dtype .* got None"):
    mpolicy.with_state_dtypes(optax.adam(1e-3), None)


def test_loss_functions_must_be_callable():
  with pytest.raises(TypeError, match=re.escape(
      "scaled_value_and_grad: fun must be a callable (the loss function), "
      "got 3 (int).")):
    mpolicy.scaled_value_and_grad(3)
  with pytest.raises(TypeError, match=re.escape(
      "make_train_step: loss_fn must be a callable")):
    mpolicy.make_train_step(3, optax.sgd(0.1))


# --- The loss scale -----------------------------------------------------------


def _loss(w, x):
  return jnp.sum(w * x)


def _assert_names_loss_scale(message, who, call):
  assert message.startswith(f"{who}: loss_scale must be a loss scale")
  assert all(c in message for c in SCALE_CLASSES), message
  assert f"call it as {call}." in message


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("scale, hint", [
    (2. ** 15, "pass StaticLossScale(32768.0), or DynamicLossScale(32768.0)"),
    (jnp.float32(2. ** 15), "wrap it: StaticLossScale(x)"),
])
def test_a_number_as_the_loss_scale_names_the_class_that_holds_it(scale, hint,
                                                                  jit):
  grad_fn = mpolicy.scaled_value_and_grad(_loss)
  grad_fn = jax.jit(grad_fn) if jit else grad_fn
  with pytest.raises(TypeError) as e:
    grad_fn(scale, jnp.ones(2), jnp.ones(2))
  _assert_names_loss_scale(str(e.value), "scaled_value_and_grad",
                           "scaled_value_and_grad(fun)(loss_scale, *args)")
  # Under jit a Python number arrives traced: its value is not known.
  assert (("wrap it: StaticLossScale(x)" if jit else hint) in str(e.value))


def test_a_forgotten_loss_scale_is_named_not_blamed_on_the_loss():
  grad_fn = mpolicy.scaled_value_and_grad(_loss)
  with pytest.raises(TypeError) as e:
    grad_fn(jnp.ones(2), jnp.ones(2))  # _loss would get one argument.
  _assert_names_loss_scale(str(e.value), "scaled_value_and_grad",
                           "scaled_value_and_grad(fun)(loss_scale, *args)")
  assert "got a float32[2] array" in str(e.value)
  assert "Was the loss scale left out?" in str(e.value)


def test_train_steps_name_the_loss_scale_in_their_own_signature():
  tx = optax.sgd(0.1)
  w = jnp.ones(2)
  step = jax.jit(mpolicy.make_train_step(_loss, tx))
  with pytest.raises(TypeError) as e:
    step(w, tx.init(w), jnp.ones(2))  # Forgotten.
  _assert_names_loss_scale(str(e.value), "make_train_step",
                           "step(params, opt_state, loss_scale, *args)")
  with pytest.raises(TypeError, match=r"wrap it: StaticLossScale\(x\)"):
    step(w, tx.init(w), 128., jnp.ones(2))
  step = mpolicy.make_train_step(lambda p, s, x: (_loss(p, x), s), tx,
                                 has_state=True)
  with pytest.raises(TypeError) as e:
    step(w, {}, tx.init(w), jnp.ones(2))
  _assert_names_loss_scale(
      str(e.value), "make_train_step(has_state=True)",
      "step(params, model_state, opt_state, loss_scale, *args)")


def test_loss_scales_of_other_libraries_are_still_accepted():
  jmp = pytest.importorskip("jmp")
  grad_fn = mpolicy.scaled_value_and_grad(_loss)
  _, finite, loss, grads = grad_fn(jmp.StaticLossScale(jnp.float32(4.)),
                                   jnp.ones(2), jnp.full(2, 3.))
  assert bool(finite) and float(loss) == 6. and grads.tolist() == [3., 3.]


# --- with_state_dtypes: a seed that nearest rounding ignores ------------------


def test_seed_with_nearest_rounding_warns_naming_both():
  with pytest.warns(UserWarning, match=re.escape(
      'with_state_dtypes: seed=3 has no effect with rounding="nearest"')
                    ) as record:
    mpolicy.with_state_dtypes(optax.adam(1e-3), jnp.bfloat16, seed=3)
  assert 'rounding="stochastic"' in str(record[0].message)
  assert record[0].filename == __file__  # Points at the call.


def test_seed_is_quiet_where_it_is_used_or_left_out():
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    mpolicy.with_state_dtypes(optax.adam(1e-3), jnp.bfloat16, seed=3,
                              rounding="stochastic")
    mpolicy.with_state_dtypes(optax.adam(1e-3), jnp.bfloat16)
  with pytest.raises(TypeError, match="seed must be an int"):
    mpolicy.with_state_dtypes(optax.adam(1e-3), jnp.bfloat16, seed="0",
                              rounding="stochastic")


# --- A float64 policy while x64 is off ------------------------------------------

X64_FIX = 'jax.config.update("jax_enable_x64", True)'


def test_float64_policy_without_x64_fails_at_trace_naming_policy_and_fix():
  f = mpolicy.amp(lambda x, w: x @ w, "p=f64,c=f64,o=f64")  # Wrapping is fine.
  x = jnp.ones((2, 3))
  with jax.enable_x64(False), pytest.raises(ValueError) as e:
    f(x, x.T)
  msg = str(e.value)
  assert msg.startswith("amp(policy=p=f64,c=f64,o=f64): the policy "
                        "p=f64,c=f64,o=f64 asks for float64")
  assert "would compute and return float32" in msg and X64_FIX in msg
  with jax.enable_x64(True):  # The same function, with x64 on: float64.
    assert f(x, x.T).dtype == jnp.float64
  assert str(mpolicy.get_policy("c=f64")) == "p=f32,c=f64,o=f64"  # Parses.


def test_float64_module_policy_without_x64_names_the_module_and_entry():
  model = mpolicy.transform_amp(lambda x: hk.Linear(2)(x))
  with mpolicy.push_policy(hk.Linear, "p=f32,c=f64,o=f32"):
    with jax.enable_x64(False), pytest.raises(ValueError, match=re.escape(
        "module 'linear' (class hk.Linear): the policy p=f32,c=f64,o=f32 "
        "asks for float64")):
      model.init(jax.random.PRNGKey(0), jnp.ones((1, 3)))


def test_float64_scope_pattern_without_x64_names_the_scope():
  def f(x):
    with jax.named_scope("head"):
      return x @ x

  with mpolicy.push_policy("head", "p=f32,c=f64,o=f32"):
    with jax.enable_x64(False), pytest.raises(ValueError, match=re.escape(
        "named scope 'head' (pattern 'head'): the policy")) as e:
      mpolicy.amp(f)(jnp.ones((2, 2)))
  assert X64_FIX in str(e.value)
