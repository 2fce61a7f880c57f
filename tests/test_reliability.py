"""Nothing silent: caches, threads, clears, reloads, bad outputs, float64."""

import importlib
import math
import sys
import threading
import warnings

import haiku as hk
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import pytest

import mpolicy
from mpolicy._src import haiku_bridge
from tests import _helpers

FULL = mpolicy.get_policy("full")
BF16 = mpolicy.get_policy("p=f32,c=bf16,o=f32")
F16 = mpolicy.get_policy("p=f32,c=f16,o=f32")

# 1 + 2**-9 + 2**-12: float32 keeps it, float16 rounds it to 1 + 2**-9,
# bfloat16 to 1. A matmul by one returns it in whatever dtype it ran in.
PROBE = 1 + 2**-9 + 2**-12
RAN_IN = {PROBE: "float32", 1 + 2**-9: "float16", 1.0: "bfloat16"}


def _blk_matmul(x, w):
  with jax.named_scope("blk"):
    return x @ w


def _ran_in(out) -> str:
  return RAN_IN[float(np.asarray(out, np.float32).reshape(-1)[0])]


def _probe_args():
  return jnp.full((1, 1), PROBE, jnp.float32), jnp.ones((1, 1), jnp.float32)


# --- 1. Static arguments that only compare equal -------------------------------


def test_int_then_float_static_argument_is_retraced():
  f = mpolicy.amp(lambda x, s: x * s)
  x = jnp.ones(3, jnp.int32)
  assert f(x, 2).dtype == jnp.int32
  assert f(x, 2.0).dtype == jnp.float32
  assert f(x, 2).dtype == jnp.int32


def test_true_is_not_one():
  h = mpolicy.amp(lambda x, s: x if isinstance(s, bool) else -x)
  x = jnp.ones(3, jnp.int32)
  assert h(x, 1).tolist() == [-1, -1, -1]
  assert h(x, True).tolist() == [1, 1, 1]
  assert h(x, 1).tolist() == [-1, -1, -1]


def test_negative_zero_and_nan_static_arguments():
  traces = []

  def fn(x, s):
    traces.append(s)
    return x / s if s == 0 else x * s

  g = mpolicy.amp(fn)
  x = jnp.ones(2)
  assert g(x, 0.0).tolist() == [math.inf, math.inf]
  assert g(x, -0.0).tolist() == [-math.inf, -math.inf]
  traces.clear()
  assert np.isnan(g(x, math.nan)).all()
  assert np.isnan(g(x, math.nan)).all()
  assert len(traces) == 1  # A NaN matches itself: compiled once.


def test_equal_static_arguments_of_one_type_share_a_compilation():
  traces = []

  def fn(x, s):
    traces.append(s)
    return x * len(s) if isinstance(s, str) else x * s

  g = mpolicy.amp(fn)
  x = jnp.ones(2)
  g(x, 3)
  g(x, 3)
  g(x, "a")
  g(x, "a")
  assert len(traces) == 2


def test_static_argument_types_inside_containers():
  f = mpolicy.amp(lambda x, d: x * d["s"])
  x = jnp.ones(3, jnp.int32)
  assert f(x, {"s": 2}).dtype == jnp.int32
  assert f(x, {"s": 2.0}).dtype == jnp.float32


# --- 2. The registry is part of the jit cache key ------------------------------


def test_jitted_amp_sees_set_policy_after_first_call():
  jg = jax.jit(mpolicy.amp(_blk_matmul))
  args = _probe_args()
  mpolicy.set_policy("blk", BF16)
  assert _ran_in(jg(*args)) == "bfloat16"
  mpolicy.set_policy("blk", F16)
  assert _ran_in(jg(*args)) == "float16"
  mpolicy.clear_policy("blk")
  assert _ran_in(jg(*args)) == "float32"
  with mpolicy.push_policy("blk", BF16):
    assert _ran_in(jg(*args)) == "bfloat16"
  assert _ran_in(jg(*args)) == "float32"


def test_eager_amp_sees_set_policy_after_first_call():
  g = mpolicy.amp(_blk_matmul)
  args = _probe_args()
  mpolicy.set_policy("blk", F16)
  assert _ran_in(g(*args)) == "float16"
  mpolicy.set_policy("blk", BF16)
  assert _ran_in(g(*args)) == "bfloat16"


def test_set_policy_while_another_thread_holds_a_push():
  jg = jax.jit(mpolicy.amp(_blk_matmul))
  args = _probe_args()
  pushed, changed, seen = threading.Event(), threading.Event(), []

  def worker():
    with mpolicy.push_policy("other", F16):  # A push of another key.
      seen.append(_ran_in(jg(*args)))
      pushed.set()
      changed.wait(60)
      seen.append(_ran_in(jg(*args)))

  mpolicy.set_policy("blk", BF16)
  t = threading.Thread(target=worker)
  t.start()
  pushed.wait(60)
  mpolicy.set_policy("blk", F16)
  changed.set()
  t.join(60)
  assert seen == ["bfloat16", "float16"]


def test_eight_threads_share_one_jitted_function():
  jg = jax.jit(mpolicy.amp(_blk_matmul))
  args = _probe_args()
  jg(*args)  # Compiled once with nothing pushed.
  wanted = ["bfloat16", "float16", "float32", None] * 2
  specs = {"bfloat16": BF16, "float16": F16, "float32": FULL}
  barrier = threading.Barrier(8)
  got = [[] for _ in wanted]
  errors = []

  def worker(i):
    try:
      with (mpolicy.push_policy("blk", specs[wanted[i]]) if wanted[i]
            else _no_push()):
        barrier.wait(120)
        for _ in range(5):
          got[i].append(_ran_in(jg(*args)))
          barrier.wait(120)  # Every thread calls between the others' calls.
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)
      barrier.abort()

  threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(300)
  assert not errors, errors
  for i, want in enumerate(wanted):
    assert got[i] == [want or "float32"] * 5, (i, got[i])


class _no_push:  # pylint: disable=invalid-name
  def __enter__(self):
    return self

  def __exit__(self, *exc):
    return False


def _mlp_forward(x):
  return hk.Linear(2)(x)


def test_transform_amp_apply_under_jit_sees_registry_changes():
  f = mpolicy.transform_amp(_mlp_forward)
  x = jnp.ones((1, 3))
  params = f.init(jax.random.PRNGKey(0), x)
  apply = jax.jit(f.apply)
  mpolicy.set_policy(hk.Module, "p=f32,c=bf16,o=bf16")
  assert apply(params, None, x).dtype == jnp.bfloat16
  mpolicy.set_policy(hk.Module, "p=f32,c=f16,o=f16")
  assert apply(params, None, x).dtype == jnp.float16
  with mpolicy.push_policy(hk.Linear, "full"):
    assert apply(params, None, x).dtype == jnp.float32
  mpolicy.clear_policies()
  assert apply(params, None, x).dtype == jnp.float32


def test_transform_amp_apply_under_jit_in_threads():
  f = mpolicy.transform_amp(_mlp_forward)
  x = jnp.ones((1, 3))
  params = f.init(jax.random.PRNGKey(0), x)
  apply = jax.jit(f.apply)
  specs = ["p=f32,c=bf16,o=bf16", "p=f32,c=f16,o=f16", "full", None] * 2
  want = [jnp.bfloat16, jnp.float16, jnp.float32, jnp.float32] * 2
  barrier = threading.Barrier(8)
  got = [None] * 8

  def worker(i):
    with (mpolicy.push_policy(hk.Module, specs[i]) if specs[i]
          else _no_push()):
      barrier.wait(120)
      got[i] = [apply(params, None, x).dtype for _ in range(3)]

  threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(300)
  assert got == [[np.dtype(w)] * 3 for w in want]


# --- 3. clear_policy inside push_policy ----------------------------------------


def test_clear_inside_push_leaves_nothing_behind():
  with mpolicy.push_policy(hk.Linear, BF16):
    mpolicy.clear_policy(hk.Linear)
    assert mpolicy.policy_for(hk.Linear) is None
  assert mpolicy.policy_for(hk.Linear) is None
  mpolicy.set_policy(hk.Linear, F16)
  assert mpolicy.policy_for(hk.Linear) == F16


def test_set_after_clear_inside_push_takes_effect_at_once():
  mpolicy.set_policy("blk", FULL)
  g = jax.jit(mpolicy.amp(_blk_matmul))
  args = _probe_args()
  with mpolicy.push_policy("blk", BF16):
    assert _ran_in(g(*args)) == "bfloat16"
    mpolicy.clear_policy("blk")
    assert mpolicy.policy_for("blk") is None
    assert _ran_in(g(*args)) == "float32"
    mpolicy.set_policy("blk", F16)
    assert mpolicy.policy_for("blk") == F16
    assert _ran_in(g(*args)) == "float16"
  assert mpolicy.policy_for("blk") == F16
  assert _ran_in(g(*args)) == "float16"


def test_haiku_sequence_clear_then_get_then_push():
  # Haiku's own tests in this order: a clear inside a push, then a set/get/
  # clear round trip, then a push that must restore the old policy.
  with mpolicy.push_policy(hk.Linear, "p=f16,c=f32,o=f16"):
    mpolicy.clear_policy(hk.Linear)
  assert mpolicy.policy_for(hk.Linear) is None
  policy = mpolicy.get_policy("p=f16,c=f32,o=f16")
  mpolicy.set_policy(hk.Linear, policy)
  assert mpolicy.policy_for(hk.Linear) == policy
  mpolicy.clear_policy(hk.Linear)
  assert mpolicy.policy_for(hk.Linear) is None
  old, new = mpolicy.get_policy("o=f16"), mpolicy.get_policy("o=f32")
  mpolicy.set_policy(hk.Linear, old)
  with mpolicy.push_policy(hk.Linear, new):
    assert mpolicy.policy_for(hk.Linear) == new
  assert mpolicy.policy_for(hk.Linear) == old


def test_nested_pushes_and_clear():
  with mpolicy.push_policy(hk.Linear, BF16):
    with mpolicy.push_policy(hk.Linear, F16):
      mpolicy.clear_policy(hk.Linear)  # Cancels both pushes.
      assert mpolicy.policy_for(hk.Linear) is None
      with mpolicy.push_policy(hk.Linear, FULL):  # A new push still works.
        assert mpolicy.policy_for(hk.Linear) == FULL
      assert mpolicy.policy_for(hk.Linear) is None
    assert mpolicy.policy_for(hk.Linear) is None
  assert mpolicy.policy_for(hk.Linear) is None


def test_clear_does_not_touch_other_threads_pushes():
  inside, cleared, seen = threading.Event(), threading.Event(), []

  def worker():
    with mpolicy.push_policy(hk.Linear, F16):
      inside.set()
      cleared.wait(60)
      seen.append(mpolicy.policy_for(hk.Linear))

  t = threading.Thread(target=worker)
  t.start()
  inside.wait(60)
  mpolicy.set_policy(hk.Linear, BF16)
  mpolicy.clear_policy(hk.Linear)
  cleared.set()
  t.join(60)
  assert seen == [F16]
  assert mpolicy.policy_for(hk.Linear) is None


def test_clear_policies_inside_push():
  with mpolicy.push_policy(hk.Linear, BF16):
    mpolicy.clear_policies()
    assert mpolicy.policy_for(hk.Linear) is None
    mpolicy.set_policy(hk.Linear, F16)
    assert mpolicy.policy_for(hk.Linear) == F16
  assert mpolicy.policy_for(hk.Linear) == F16


# --- 4. Reloaded classes ----------------------------------------------------------


def test_policy_for_reloaded_class(tmp_path, monkeypatch):
  (tmp_path / "mpolicy_reload_probe.py").write_text(
      "import haiku as hk\n\n\n"
      "class Dense(hk.Linear):\n"
      "  pass\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  try:
    mod = importlib.import_module("mpolicy_reload_probe")
    mpolicy.set_policy(mod.Dense, "p=bf16,c=bf16,o=bf16")
    old_cls = mod.Dense
    mod = importlib.reload(mod)
    assert mod.Dense is not old_cls
    assert str(mpolicy.policy_for(mod.Dense)) == "p=bf16,c=bf16,o=bf16"
    f = mpolicy.transform_amp(lambda x: mod.Dense(2)(x))
    x = jnp.ones((1, 3))
    params = f.init(jax.random.PRNGKey(0), x)
    assert params["dense"]["w"].dtype == jnp.bfloat16
    assert f.apply(params, None, x).dtype == jnp.bfloat16
    explanation = mpolicy.explain_policy(mod.Dense)
    assert explanation.rule == 2 and explanation.key is mod.Dense
    mpolicy.clear_policy(mod.Dense)
    assert mpolicy.policy_for(old_cls) is None
  finally:
    sys.modules.pop("mpolicy_reload_probe", None)


def test_classes_made_by_a_factory_do_not_share_a_policy():
  def make():
    class Made(hk.Linear):
      pass
    return Made

  a, b = make(), make()
  assert a.__qualname__ == b.__qualname__
  mpolicy.set_policy(a, BF16)
  assert mpolicy.policy_for(a) == BF16
  assert mpolicy.policy_for(b) is None


# --- 5. Outputs JAX cannot carry ----------------------------------------------


@pytest.mark.parametrize("fn, where, type_name", [
    (lambda a: (a * 2, "hello"), r"\[1\]", "builtins.str"),
    (lambda a: {"y": a, "meta": object()}, r"\['meta'\]", "builtins.object"),
    (lambda a: "hello", r"\(the whole output\)", "builtins.str"),
])
def test_bad_output_is_named(fn, where, type_name):
  f = mpolicy.amp(fn, "half")
  x = jnp.ones(2)
  with pytest.raises(TypeError, match=where + r".*" + type_name +
                     r".*not a valid JAX type"):
    f(x)
  with pytest.raises(TypeError, match=where):
    jax.jit(f)(x)


def test_scalar_and_none_outputs_are_fine():
  f = mpolicy.amp(lambda a: (a.sum(), 3, 2.5, True, None), "full")
  out = f(jnp.ones(2))
  assert [float(o) for o in out[:4]] == [2.0, 3.0, 2.5, 1.0]
  assert out[4] is None


# --- 6. Haiku's own registry ---------------------------------------------------


class _HaikuRegistered(hk.Linear):
  pass


def test_warns_once_when_haiku_registry_holds_a_policy():
  hk.mixed_precision.set_policy(_HaikuRegistered, jmp.get_policy("full"))
  try:
    f = mpolicy.transform_amp(lambda x: _HaikuRegistered(2)(x))
    x = jnp.ones((1, 3))
    with pytest.warns(haiku_bridge.HaikuPolicyWarning,
                      match=r"_HaikuRegistered.*clear_policy"):
      params = f.init(jax.random.PRNGKey(0), x)
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      f.init(jax.random.PRNGKey(1), x)
      f.apply(params, None, x)
      jax.jit(f.apply)(params, None, x)
    assert not [w for w in caught
                if issubclass(w.category, haiku_bridge.HaikuPolicyWarning)]
  finally:
    hk.mixed_precision.clear_policy(_HaikuRegistered)


def test_no_warning_without_haiku_policies():
  mpolicy.set_policy(hk.Module, BF16)
  f = mpolicy.transform_amp(lambda x: hk.nets.MLP([4, 2])(x))
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    params = f.init(jax.random.PRNGKey(0), jnp.ones((1, 3)))
    f.apply(params, None, jnp.ones((1, 3)))
  assert not [w for w in caught
              if issubclass(w.category, haiku_bridge.HaikuPolicyWarning)]


# --- 7. float64 is never narrowed ----------------------------------------------


def _f64_fn(x, w):
  return jnp.tanh(x @ w).sum(axis=0) + jnp.exp(x).mean()


def test_full_policy_under_x64_computes_exactly_f():
  with jax.enable_x64(True):
    x = jnp.asarray(np.random.RandomState(0).randn(4, 3), jnp.float64)
    w = jnp.asarray(np.random.RandomState(1).randn(3, 2), jnp.float64)
    out = mpolicy.amp(_f64_fn, "full")(x, w)
    assert out.dtype == jnp.float64
    assert _helpers.same_bits(out, _f64_fn(x, w))
    g = jax.grad(lambda x, w: mpolicy.amp(_f64_fn, "full")(x, w).sum())(x, w)
    assert g.dtype == jnp.float64
    assert _helpers.same_bits(g, jax.grad(lambda x, w: _f64_fn(x, w).sum())(
        x, w))


def test_half_policy_leaves_float64_matmuls_as_written():
  with jax.enable_x64(True):
    x = jnp.ones((2, 3), jnp.float64)
    w = jnp.ones((3, 4), jnp.float64)
    f = mpolicy.amp(lambda x, w: x @ w, "half")
    eqns = _helpers.all_eqns(f, x, w)
    dots = [e for e in eqns if "dot_general" in e.primitive.name]
    assert [e.primitive.name for e in dots] == ["dot_general"]
    assert [v.aval.dtype for v in dots[0].invars] == [np.float64] * 2
    assert f(x, w).dtype == jnp.float64


def test_full_policy_output_dtype_still_widens_half_outputs_under_x64():
  with jax.enable_x64(True):
    f = mpolicy.amp(lambda a, b: (a * 2, b * 2), "full")
    a, b = f(jnp.ones(2, jnp.bfloat16), jnp.ones(2, jnp.float64))
    assert a.dtype == jnp.float32
    assert b.dtype == jnp.float64


def test_float32_matmul_still_lowers_under_x64():
  with jax.enable_x64(True):
    f = mpolicy.amp(lambda x, w: x @ w, "p=f32,c=bf16,o=f32")
    eqns = _helpers.all_eqns(f, jnp.ones((2, 3), jnp.float32),
                             jnp.ones((3, 4), jnp.float32))
    assert any(e.primitive.name == "amp_dot_general" for e in eqns)


def test_explain_says_float64_matmul_is_not_eligible():
  with jax.enable_x64(True):
    f = mpolicy.amp(lambda x, w: x @ w, "half")
    report = mpolicy.explain(f, jnp.ones((2, 3), jnp.float64),
                             jnp.ones((3, 4), jnp.float64))
    dots = [r for r in report.rows if r.primitive == "dot_general"]
    assert [r.ran_in for r in dots] == ["float64"]
    assert "float64: not eligible" in dots[0].decided_by
