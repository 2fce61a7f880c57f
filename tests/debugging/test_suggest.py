"""suggest_policy: the few modules to run wider, measured against float32."""

from __future__ import annotations

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpolicy

from _helpers import overflowing_flax_net

HALF16 = "p=f32,c=f16,o=f32"


class Attention(hk.Module):
  """Single-head attention; its logits overflow float16 with big weights."""

  def __call__(self, x):
    q = hk.Linear(8, name="query")(x)
    k = hk.Linear(8, name="key")(x)
    logits = jnp.einsum("btd,bsd->bts", q, k)
    return jnp.einsum("bts,bsd->btd", jax.nn.softmax(logits), x)


def _overflowing():
  model = mpolicy.transform_amp(
      lambda x: hk.Linear(1, name="head")(Attention(name="attention")(x)))
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 4, 8))
  params = jax.jit(model.init)(jax.random.PRNGKey(0), x)  # Not op by op.
  for name in ("attention/query", "attention/key"):
    params[name] = dict(params[name], w=params[name]["w"] * 300.0)
  calls = []

  def loss(p, x):
    calls.append(1)
    return jnp.mean(model.apply(p, None, x) ** 2)

  return loss, params, x, calls


@pytest.fixture(scope="module")
def overflow():
  """One search over the overflowing attention, with a LayerNorm entry in
  the registry (overridden while it searches)."""
  loss, params, x, calls = _overflowing()
  mpolicy.set_policy(hk.LayerNorm, "full")
  try:
    s = mpolicy.suggest_policy(loss, params, x, policy=HALF16,
                               tolerance=0.05, max_evals=6)
  finally:
    mpolicy.clear_policies()
  return s, loss, params, x, calls


def test_the_module_of_a_float16_overflow_becomes_an_island(overflow):
  s, loss, params, x, calls = overflow
  mpolicy.set_policy(hk.LayerNorm, "full")
  assert s.float32_paths == ("attention",)
  assert not s.before.finite and s.before.first_nonfinite.path == "attention"
  assert s.ok and s.after.finite and s.after.grad_error < 0.05
  assert len(calls) == s.evals <= 6
  # The island is the attention's own ops: its projections stay float16.
  assert s.kept == ("attention/key", "attention/query")
  assert 0.5 < s.after.half_flops < 1.0 == s.before.half_flops
  text = str(s)
  assert "before: not finite" in text and "after (1 island)" in text
  assert "attention  its dot_general made the first non-finite value" in text
  # apply(): the policy everywhere, the island, then the registry as it was.
  with s.apply():
    assert str(mpolicy.policy_for(hk.Module)) == HALF16
    assert str(mpolicy.policy_for(hk.LayerNorm)) == HALF16
    assert str(mpolicy.policy_for("attention")) == "p=f32,c=f32,o=f32"
    assert str(mpolicy.policy_for("attention/query")) == HALF16
    assert jnp.isfinite(jax.grad(loss)(params, x)["attention/key"]["w"]).all()
  assert mpolicy.policy_for(hk.Module) is None
  assert str(mpolicy.policy_for(hk.LayerNorm)) == "p=f32,c=f32,o=f32"


def test_the_set_policy_lines_reproduce_the_suggestion(overflow):
  s, loss, params, x, _ = overflow
  lines = s.set_policy_lines()
  assert lines.splitlines()[0] == "mpolicy.clear_policies()"
  assert 'mpolicy.set_policy(hk.Module, "p=f32,c=f16,o=f32")' in lines
  assert "mpolicy.set_policy('attention', \"p=f32,c=f32,o=f32\")  # its" in lines
  exec(lines, {"mpolicy": mpolicy, "hk": hk})  # pylint: disable=exec-used
  grads = jax.grad(loss)(params, x)
  assert all(jnp.isfinite(g).all() for g in jax.tree_util.tree_leaves(grads))


# Slow: 6 s of eager bfloat16 ops; the default run's
# test_a_float16_model_is_judged_on_its_loss_scaled_gradients checks the
# same no-island outcome (two evaluations, "No island needed").
@pytest.mark.slow
def test_where_half_is_fine_it_suggests_nothing():
  loss, params, x, calls = _overflowing()
  params = jax.tree_util.tree_map(lambda w: w / 300.0, params)
  s = mpolicy.suggest_policy(loss, params, x, policy="p=f32,c=bf16,o=f32")
  assert (s.float32_paths, s.evals, len(calls)) == ((), 2, 2)
  assert s.ok and s.before == s.after and s.before.within(0.05)
  assert "No island needed" in str(s)


class Cancel(hk.Module):
  """Two close products subtracted: float8's rounding swamps the rest."""

  def __call__(self, x):
    w = hk.get_parameter("w", [16, 16], init=hk.initializers.RandomNormal())
    return x @ w - x @ (0.9 * w)


@pytest.mark.slow  # A float8 search: seconds of eager dispatch.
def test_under_float8_a_bfloat16_island_may_be_enough():
  rules = mpolicy.DEFAULT_RULES.with_fp8(matmuls="all", min_size=0)
  model = mpolicy.transform_amp(
      lambda x: hk.Linear(1, name="head")(Cancel(name="cancel")(
          hk.Linear(16, name="embed")(x))), rules=rules)
  x = jax.random.normal(jax.random.PRNGKey(1), (32, 16))
  params = model.init(jax.random.PRNGKey(0), x)
  loss = lambda p, x: jnp.mean(model.apply(p, None, x) ** 2)
  s = mpolicy.suggest_policy(loss, params, x, policy="p=f32,c=f8,o=f32",
                             tolerance=0.2, max_evals=8,
                             island_dtype=jnp.bfloat16)
  assert s.float32_paths == ("cancel",), str(s)
  assert str(s.island_policy) == "p=f32,c=bf16,o=f32"
  assert not s.before.within(0.2) and s.ok
  assert "adds" in s.reasons[0]


@pytest.mark.slow  # Flax's import and first trace: seconds.
def test_a_flax_linen_module_becomes_an_island():
  nn = pytest.importorskip("flax.linen")
  model, variables, x = overflowing_flax_net()
  apply = mpolicy.amp(model.apply)
  s = mpolicy.suggest_policy(lambda v, x: jnp.mean(apply(v, x)) * 1e-3,
                             variables, x, policy=HALF16, max_evals=4)
  assert s.float32_paths == ("out",) and s.ok
  assert 'mpolicy.set_policy(nn.Module, "p=f32,c=f16,o=f32")' in (
      s.set_policy_lines())


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(), TypeError, "pass the policy"),
    (dict(policy=HALF16, tolerance=0), ValueError, "tolerance must be"),
    (dict(policy=HALF16, max_evals=1), ValueError, "max_evals must be"),
    (dict(policy=HALF16, island_dtype=jnp.int32), TypeError,
     "island_dtype must be a floating dtype"),
])
def test_bad_arguments_say_what_is_wrong(kwargs, error, message):
  with pytest.raises(error, match=message):
    mpolicy.suggest_policy(lambda x: jnp.sum(x), jnp.ones(2), **kwargs)


def test_matmul_flops_are_counted_by_the_module_path_that_ran_them():
  # The ranking's cost: each module's own matmuls, forward and backward
  # (a named scope is a path too, as for NNX and Equinox).
  from mpolicy._src.debugging import flops  # pylint: disable=g-import-not-at-top
  from mpolicy._src.debugging import program  # pylint: disable=g-import-not-at-top

  def loss(w, x):
    with jax.named_scope("big"):
      h = x @ w  # 3x4 @ 4x4: 96 FLOPs, and 96 for its weight's gradient.
    with jax.named_scope("small"):
      return jnp.sum(h @ w[:, :2])  # 48, 48 for h's cotangent, 48 for w's.

  f = mpolicy.amp(loss, "p=f32,c=bf16,o=f32")
  call = program.Call(f, (jnp.ones((4, 4)), jnp.ones((3, 4))), "test")
  run = program.run(call, call.program(True))
  assert flops.by_module(run.checker.flops, run.sites) == {"big": 192,
                                                         "small": 144}
  assert flops.by_dtype(run.checker.flops) == {"bfloat16": 336}


def test_a_loop_body_counts_its_matmul_flops_once_per_iteration_it_ran():
  from mpolicy._src.debugging import flops  # pylint: disable=g-import-not-at-top
  from mpolicy._src.debugging import program  # pylint: disable=g-import-not-at-top

  def loss(w, x):
    def body(i, c):
      with jax.named_scope("layer"):
        return c @ w  # 3x4 @ 4x4: 96 FLOPs an iteration.
    return jnp.sum(jax.lax.fori_loop(0, x.shape[0] + 2, body, x))

  f = mpolicy.amp(loss, "p=f32,c=bf16,o=f32")
  call = program.Call(f, (jnp.ones((4, 4)), jnp.ones((3, 4))), "test")
  run = program.run(call, call.program(False))
  assert flops.by_module(run.checker.flops, run.sites) == {"layer": 5 * 96}


def test_a_float16_model_is_judged_on_its_loss_scaled_gradients():
  """Unscaled, the gradients underflow float16 and an island is proposed;
  with the training step's loss scale none is needed."""
  from test_shadow import _underflowing  # pylint: disable=g-import-not-at-top
  f, w, x = _underflowing()
  plain = mpolicy.suggest_policy(f, w, x, policy=HALF16)
  scaled = mpolicy.suggest_policy(f, w, x, policy=HALF16,
                                  loss_scale=2.0 ** 15)
  assert plain.before.grad_error > 0.2 and plain.float32_paths
  assert scaled.before.grad_error < 0.005
  assert scaled.float32_paths == () and scaled.ok
  # Nothing to search: the float32 run and the policy's, then no island.
  assert scaled.evals == 2 and scaled.before == scaled.after
  assert "No island needed" in str(scaled)


@pytest.mark.ci  # 5 s: once, in CI's newest job; the Haiku island tests here run on both ends.
def test_a_flax_root_island_keeps_its_children_in_the_policy():
  """A Flax root module is named by its class ("Model") while its
  children keep Flax's names ("Dense_0"): as an island, its own ops run
  in float32 and its children keep the policy, so the matmul FLOPs in
  half and the share the suggestion states agree with what ran."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  from mpolicy._src import registry  # pylint: disable=g-import-not-at-top
  from mpolicy._src.debugging import program as program_lib  # pylint: disable=g-import-not-at-top
  from mpolicy._src.debugging import suggest as suggest_lib  # pylint: disable=g-import-not-at-top

  class Model(nn.Module):

    @nn.compact
    def __call__(self, x):
      return jnp.mean(nn.Dense(8)(nn.Dense(8)(x)))

  model, x = Model(), jnp.ones((2, 4))
  params = model.init(jax.random.PRNGKey(0), x)
  f = mpolicy.amp(model.apply)
  half = mpolicy.get_policy(HALF16)
  with registry.push_policy(nn.Module, HALF16):
    search = suggest_lib._Search(  # pylint: disable=protected-access
        program_lib.Call(f, (params, x), "test"), half,
        mpolicy.get_policy("full"), suggest_lib._roots(), 8)  # pylint: disable=protected-access
    search.float32()
    before, _ = search.measure(())
    assert search.kept(("Model",)) == ("Dense_0", "Dense_1")
    island, run = search.measure(("Model",))
  assert before.half_flops == 1.0
  assert island.half_flops == 1.0  # The children still multiply in half.
  from mpolicy._src.debugging import flops  # pylint: disable=g-import-not-at-top
  own = flops.by_module(run.checker.flops, run.sites)
  assert own.get("Model", 0) == 0 and own["Dense_0"] and own["Dense_1"]


def _overflows_at_scale():
  """A float16 model whose scaled gradients overflow at 2**15 and not
  below 2**13: the cotangent reaching the layer is ten times the scale
  (327680 at 2**15, 81920 at 2**13, 40960 at 2**12)."""

  def loss(w, x):
    with jax.named_scope("layer"):
      h = x @ w
    with jax.named_scope("head"):
      return jnp.sum(h) * 10.0

  w = jnp.asarray(np.random.RandomState(0).normal(size=(16, 16)) * 0.3,
                  jnp.float32)
  x = jnp.asarray(np.random.RandomState(1).normal(size=(64, 16)),
                  jnp.float32)
  return mpolicy.amp(loss, HALF16), w, x


def test_a_dynamic_loss_scale_that_alone_overflows_is_backed_off():
  f, w, x = _overflows_at_scale()
  s = mpolicy.suggest_policy(f, w, x, policy=HALF16,
                             loss_scale=mpolicy.DynamicLossScale(2.0 ** 15))
  assert not s.before.finite
  assert s.float32_paths == () and s.ok and s.after.finite
  assert s.backed_off == (2.0 ** 15, 2.0 ** 12)
  assert ("The loss scale 2**15 alone overflows: at 2**12, which the dynamic "
          "loss scale backs off to by itself, no module needs float32."
          ) in str(s).splitlines()
  # The float32 shadow, the scale as given, the floor (2**0), then halving
  # the range of the 15 scales below 2**15: 2**7, 2**11, 2**13, 2**12.
  assert s.evals == 7


def test_a_loss_scale_that_cannot_back_off_far_enough_gets_islands():
  f, w, x = _overflows_at_scale()
  for scale in (mpolicy.StaticLossScale(2.0 ** 15),
                mpolicy.DynamicLossScale(2.0 ** 15, min_loss_scale=2.0 ** 14)):
    s = mpolicy.suggest_policy(f, w, x, policy=HALF16, loss_scale=scale,
                               max_evals=4)
    assert s.backed_off is None and s.float32_paths
    assert "alone overflows" not in str(s)
