"""The policy registry: keys, precedence, pushes, threads and errors."""

import sys
import threading

import haiku as hk
import jax
import jax.numpy as jnp
import pytest

import mpolicy
from mpolicy._src import class_lookup
from mpolicy._src import registry
from mpolicy._src import regions

FULL = mpolicy.get_policy("full")
HALF = mpolicy.get_policy("p=f32,c=bf16,o=f32")
F16 = mpolicy.get_policy("p=f32,c=f16,o=f32")


class MyLinear(hk.Linear):
  pass


class MyDeepLinear(MyLinear):
  pass


def region_for_module(name, cls, enclosing):
  return class_lookup.region_for_call(name, cls, enclosing, hk.Module)


def _policy(name, cls, enclosing=None):
  region = region_for_module(name, cls, enclosing)
  return None if region is None else region.policy


def test_set_and_get_by_class_and_pattern():
  mpolicy.set_policy(hk.BatchNorm, FULL)
  mpolicy.set_policy("encoder/~/attention", "p=f32,c=bf16,o=f32")
  assert mpolicy.policy_for(hk.BatchNorm) == FULL
  assert mpolicy.policy_for("encoder/~/attention") == HALF
  assert mpolicy.policy_for(hk.Linear) is None
  assert mpolicy.policy_for("encoder") is None


def test_spec_strings_and_jmp_policies_are_normalised():
  import jmp  # pylint: disable=g-import-not-at-top
  mpolicy.set_policy(hk.Linear, jmp.get_policy("p=f32,c=bf16,o=f32"))
  assert isinstance(mpolicy.policy_for(hk.Linear), mpolicy.Policy)
  assert mpolicy.policy_for(hk.Linear) == HALF
  mpolicy.set_policy("x", "half")
  assert isinstance(mpolicy.policy_for("x"), mpolicy.Policy)


def test_class_policy_covers_subclasses_via_mro():
  mpolicy.set_policy(hk.Linear, HALF)
  assert _policy("a", MyDeepLinear) == HALF
  mpolicy.set_policy(MyLinear, F16)
  assert _policy("a", MyDeepLinear) == F16  # nearest class wins
  assert _policy("a", hk.Linear) == HALF


def test_hk_module_is_only_the_default():
  mpolicy.set_policy(hk.Module, HALF)
  mpolicy.set_policy(hk.BatchNorm, FULL)
  assert _policy("bn", hk.BatchNorm) == FULL
  region = region_for_module("lin", hk.Linear, None)
  assert region.policy == HALF
  assert region.decided_by == "default hk.Module"


def test_pattern_on_own_name_beats_class():
  mpolicy.set_policy(hk.Linear, FULL)
  mpolicy.set_policy("encoder/~/linear", HALF)
  assert _policy("encoder/~/linear", hk.Linear) == HALF
  assert _policy("decoder/~/linear", hk.Linear) == FULL


def test_class_beats_enclosing_pattern():
  mpolicy.set_policy("encoder", HALF)
  mpolicy.set_policy(hk.BatchNorm, FULL)
  outer = region_for_module("encoder", hk.Module, None)
  assert outer.policy == HALF
  bn = region_for_module("encoder/~/batch_norm", hk.BatchNorm, outer)
  assert bn.policy == FULL
  assert not bn.inherited
  # The moving averages inside BatchNorm inherit full from it.
  ema = region_for_module("encoder/~/batch_norm/~/mean_ema",
                          hk.ExponentialMovingAverage, bn)
  assert ema.policy == FULL
  assert ema.inherited


def test_enclosing_beats_default():
  mpolicy.set_policy(hk.Module, FULL)
  outer = regions.Region(policy=HALF, decided_by="pattern 'enc'",
                         module_name="enc")
  inner = region_for_module("enc/~/linear", hk.Linear, outer)
  assert inner.policy == HALF
  assert inner.decided_by == "inherited from enc"


def test_nothing_governs_without_entries():
  assert region_for_module("lin", hk.Linear, None) is None


def test_longest_match_most_components_wins():
  mpolicy.set_policy("*", F16)
  mpolicy.set_policy("encoder/*", FULL)
  mpolicy.set_policy("encoder/~/mlp/*", HALF)
  assert _policy("encoder/~/mlp/~/linear_1", hk.Linear) == HALF
  assert _policy("encoder/~/attention", hk.Module) == FULL
  assert _policy("decoder", hk.Module) == F16


def test_fewer_wildcards_then_longer_pattern_win_ties():
  mpolicy.set_policy("enc*/~/lin*", F16)
  mpolicy.set_policy("encoder/~/lin*", HALF)
  assert _policy("encoder/~/linear", hk.Linear) == HALF
  mpolicy.clear_policies()
  mpolicy.set_policy("e*", F16)
  mpolicy.set_policy("en*", HALF)
  assert _policy("encoder", hk.Module) == HALF


def test_glob_wildcards():
  mpolicy.set_policy("*/attention", HALF)
  assert _policy("encoder/~/attention", hk.Module) == HALF
  assert _policy("attention", hk.Module) is None
  mpolicy.set_policy("layer_[0-2]", FULL)
  assert _policy("layer_1", hk.Module) == FULL
  assert _policy("layer_3", hk.Module) is None


def test_push_restores_previous_value_even_on_error():
  mpolicy.set_policy(hk.Linear, FULL)
  with pytest.raises(RuntimeError):
    with mpolicy.push_policy(hk.Linear, HALF):
      assert mpolicy.policy_for(hk.Linear) == HALF
      with mpolicy.push_policy(hk.Linear, F16):
        assert mpolicy.policy_for(hk.Linear) == F16
      assert mpolicy.policy_for(hk.Linear) == HALF
      raise RuntimeError("boom")
  assert mpolicy.policy_for(hk.Linear) == FULL


def test_push_of_unset_key_leaves_nothing_behind():
  with mpolicy.push_policy("enc", HALF):
    assert mpolicy.policy_for("enc") == HALF
  assert mpolicy.policy_for("enc") is None


def test_clear_policy_and_clear_policies():
  mpolicy.set_policy(hk.Linear, FULL)
  mpolicy.set_policy("enc", HALF)
  mpolicy.clear_policy(hk.Linear)
  assert mpolicy.policy_for(hk.Linear) is None
  assert mpolicy.policy_for("enc") == HALF
  mpolicy.clear_policy("not-there")  # No error.
  mpolicy.clear_policies()
  assert mpolicy.policy_for("enc") is None


def test_clear_inside_push_clears_for_this_thread():
  with mpolicy.push_policy(hk.Linear, HALF):
    mpolicy.clear_policy(hk.Linear)
    assert mpolicy.policy_for(hk.Linear) is None


@pytest.mark.parametrize("bad", [int, object, 3, None, jnp.float32, b"enc"])
def test_bad_keys_raise_type_error_and_register_nothing(bad):
  with pytest.raises(TypeError, match="Haiku module class.*name pattern"):
    mpolicy.set_policy(bad, HALF)
  assert registry.snapshot() == {}


def test_class_keys_are_checked_without_importing_haiku(monkeypatch):
  # As if Haiku had never been imported: no class can subclass its Module,
  # and checking a key must not import it.
  monkeypatch.delitem(sys.modules, "haiku")
  with pytest.raises(TypeError, match="Haiku module class.*name pattern"):
    mpolicy.set_policy(hk.Linear, HALF)
  assert "haiku" not in sys.modules
  mpolicy.set_policy("encoder", HALF)  # Patterns need no Haiku.
  assert registry.snapshot() == {"encoder": HALF}


@pytest.mark.parametrize("bad", ["", "   "])
def test_empty_pattern_raises_value_error(bad):
  with pytest.raises(ValueError, match="non-empty"):
    mpolicy.set_policy(bad, HALF)
  assert registry.snapshot() == {}


@pytest.mark.parametrize("pattern,intent", [
    ("encoder/", "use 'encoder' (children inherit its policy)"),
    ("/encoder", "use 'encoder'"),
    ("encoder//mlp", "use 'encoder/mlp'"),
    ("hk.Linear", "set_policy(hk.Linear, policy)"),
    ("nn.Dense", "set_policy(nn.Dense, policy)"),
    ("haiku.BatchNorm", "set_policy(haiku.BatchNorm, policy)"),
])
def test_a_pattern_that_can_never_match_names_itself_and_the_intent(
    pattern, intent):
  for register in (mpolicy.set_policy,
                   lambda k, p: mpolicy.push_policy(k, p).__enter__()):
    with pytest.raises(ValueError) as info:
      register(pattern, "p=f32,c=bf16,o=f32")
    assert repr(pattern) in str(info.value) and intent in str(info.value)
    assert "never match" in str(info.value)
  assert registry.snapshot() == {}


def test_patterns_used_across_the_docs_stay_valid():
  for pattern in ("encoder", "encoder/~/mlp/*", "*/attention", "layer_[0-2]",
                  "enc*/~/lin*", "*", "encoder/~/attention", "Dense_0",
                  "encoder/Dense_0", "block/attention"):
    mpolicy.set_policy(pattern, "full")
    assert mpolicy.policy_for(pattern) is not None
  mpolicy.clear_policies()


def test_bad_policies_raise_and_register_nothing():
  with pytest.raises(ValueError, match="p=f32"):
    mpolicy.set_policy(hk.Linear, "p=f32,c=bf17")
  with pytest.raises(TypeError):
    mpolicy.set_policy(hk.Linear, 42)
  with pytest.raises(TypeError, match="clear_policy"):
    mpolicy.set_policy(hk.Linear, None)
  with pytest.raises(ValueError):
    with mpolicy.push_policy(hk.Linear, "p=f16=f32"):
      pass
  assert registry.snapshot() == {}


def test_explain_policy_names_the_winning_entry():
  mpolicy.set_policy(hk.Module, HALF)
  mpolicy.set_policy(hk.BatchNorm, FULL)
  mpolicy.set_policy("enc/*", F16)
  e = mpolicy.explain_policy(hk.BatchNorm)
  assert e.policy == FULL and e.key is hk.BatchNorm and e.rule == 2
  assert "hk.BatchNorm" in str(e)
  e = mpolicy.explain_policy("enc/~/batch_norm", hk.BatchNorm)
  assert e.policy == F16 and e.rule == 1 and e.key == "enc/*"
  assert "also matched: hk.BatchNorm, hk.Module" in str(e)
  e = mpolicy.explain_policy(hk.Linear)
  assert e.rule == 4 and e.policy == HALF
  mpolicy.clear_policies()
  e = mpolicy.explain_policy("anything")
  assert e.policy is None and e.rule == 5 and "as written" in str(e)
  with pytest.raises(TypeError):
    mpolicy.explain_policy(3)


def test_region_for_scopes_matches_named_scope_paths():
  mpolicy.set_policy("encoder", HALF)
  mpolicy.set_policy("encoder/attention", FULL)
  assert registry.region_for_scopes(()) is None
  assert registry.region_for_scopes(("encoder",)).policy == HALF
  assert registry.region_for_scopes(("encoder", "mlp")).policy == HALF
  assert registry.region_for_scopes(("encoder", "attention")).policy == FULL
  assert registry.region_for_scopes(("decoder",)) is None


def test_region_for_scopes_markers_and_full_precision():
  mpolicy.set_policy("encoder", HALF)
  marked = regions.Region(policy=F16, decided_by="class hk.Linear")
  names = ("encoder", regions.marker_for(marked), "linear")
  assert registry.region_for_scopes(names).policy == F16
  fp = ("encoder", regions.marker_for(regions.FULL_PRECISION), "encoder")
  assert registry.region_for_scopes(fp).full_precision


def test_pushes_are_thread_local():
  """Eight threads, each tracing under its own push, see only their own."""
  policies = [mpolicy.get_policy(f"p=f32,c={c},o={o}")
              for c in ("bf16", "f16", "f32")
              for o in ("f32", "bf16", "f16")][:8]
  barrier = threading.Barrier(len(policies))
  seen = {}
  errors = []

  def run(i):
    try:
      with mpolicy.push_policy(hk.Linear, policies[i]):
        barrier.wait(timeout=30)  # Everyone has pushed before anyone reads.
        f = mpolicy.with_policies(lambda x: hk.Linear(2)(x))
        # Traced, not run: the dtypes are the trace's (no compiling).
        params = jax.eval_shape(hk.transform(f).init, jax.random.PRNGKey(i),
                                jnp.ones([1, 2]))
        seen[i] = (mpolicy.policy_for(hk.Linear),
                   jax.eval_shape(hk.transform(f).apply, params, None,
                                  jnp.ones([1, 2])).dtype)
        barrier.wait(timeout=30)
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)

  threads = [threading.Thread(target=run, args=(i,))
             for i in range(len(policies))]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert not errors, errors
  for i, policy in enumerate(policies):
    assert seen[i][0] == policy
    assert seen[i][1] == jnp.dtype(policy.output_dtype)
  assert mpolicy.policy_for(hk.Linear) is None


def test_pushes_leave_the_jit_cache_context_as_they_found_it():
  from mpolicy._src import registry as registry_lib  # pylint: disable=g-import-not-at-top
  state = registry_lib._PUSHED_STATE
  assert state.value == ()
  traces = []

  @jax.jit
  def f(x):
    traces.append(1)
    return x * 2

  f(1.)
  with mpolicy.push_policy("encoder", "p=f32,c=bf16,o=f32"):
    outer = state.value
    with mpolicy.push_policy("decoder", "full"):
      assert len(state.value) == 2
      f(1.)  # A new registry state: traced again.
    assert state.value == outer
  assert state.value == ()
  f(1.)  # Back to the first state: its cached trace is reused.
  assert len(traces) == 2
