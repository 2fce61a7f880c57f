"""The NVFP4 recipe in the block matmul: stochastic rounding of gradients,
the 16x16 Hadamard rotation of the weight gradient, and their keys."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpolicy
from mpolicy._src.blocks import recipe
from mpolicy._src.rules import block_matmul
from mpolicy._src.rules import matmul
from mpolicy._src.training import train_step

F32 = jnp.float32
DN = (((1,), (0,)), ((), ()))
fq = mpolicy.fake_quantize


def _config(fmt, sr, hadamard):
  return block_matmul.BlockConfig(fmt, False, jnp.dtype(F32), jnp.dtype(F32),
                                  jnp.dtype(F32), sr=sr, hadamard=hadamard)


def _grads(a, b, g, key, config):
  _, vjp = jax.vjp(lambda a, b: block_matmul.blocked_mm(a, b, key, config),
                   a, b)
  return vjp(g)


def _tie_cotangent():
  # Each block of 32 along N: one 6 (the amax: scale 1 for e2m1) and 31
  # values 1.25, a tie that nearest-even rounds down to 1.
  g = np.full((2, 32), 1.25, np.float32)
  g[:, 0] = 6.0
  return jnp.asarray(g)


def test_nearest_rounding_of_the_gradient_is_exact_and_biased():
  a, b = jnp.ones((2, 4), F32), jnp.ones((4, 32), F32)
  da, _ = _grads(a, b, _tie_cotangent(), jax.random.PRNGKey(0),
                 _config("mxfp4", False, False))
  # 6 + 31 * 1 (the 1.25s rounded to 1), exactly.
  np.testing.assert_array_equal(da, np.full((2, 4), 37.0, np.float32))


def test_stochastic_rounding_is_unbiased_over_keys():
  a, b = jnp.ones((2, 4), F32), jnp.ones((4, 32), F32)
  config = _config("mxfp4", True, False)
  keys = jax.random.split(jax.random.PRNGKey(1), 2000)
  da = jax.vmap(lambda k: _grads(a, b, _tie_cotangent(), k, config)[0])(keys)
  exact = 6.0 + 31 * 1.25  # 44.75: the unrounded cotangent's product.
  assert abs(float(da.mean()) - exact) < 0.05, float(da.mean())
  # Each draw is on the grid (sums of 1s and 1.5s), not the mean itself.
  assert set(np.unique(np.asarray(da[:, 0, 0]) % 0.5)) == {0.0}
  assert float(da.std()) > 1.0


def test_a_fixed_key_is_deterministic_and_keys_differ():
  a = jax.random.normal(jax.random.PRNGKey(2), (16, 32))
  b = jax.random.normal(jax.random.PRNGKey(3), (32, 16))
  g = jax.random.normal(jax.random.PRNGKey(4), (16, 16))
  config = _config("nvfp4", True, True)
  one = _grads(a, b, g, jax.random.PRNGKey(7), config)
  again = _grads(a, b, g, jax.random.PRNGKey(7), config)
  other = _grads(a, b, g, jax.random.PRNGKey(8), config)
  for x, y, z in zip(one, again, other):
    np.testing.assert_array_equal(x, y)
    assert not np.array_equal(x, z)


def test_hadamard_rotates_the_weight_gradient_operands():
  a = jax.random.normal(jax.random.PRNGKey(5), (32, 32))
  a = a.at[3, :].multiply(40.0)  # An outlier row, as in activations.
  b = jax.random.normal(jax.random.PRNGKey(6), (32, 16))
  g = jax.random.normal(jax.random.PRNGKey(7), (32, 16))
  key = jax.random.PRNGKey(9)
  _, db = _grads(a, b, g, key, _config("nvfp4", False, True))
  _, db_plain = _grads(a, b, g, key, _config("nvfp4", False, False))
  rotate = jax.random.split(key, 3)[2]
  ra, rg = (recipe.hadamard_rotate(x, 0, rotate) for x in (a, g))
  expected = jnp.matmul(fq(ra, "nvfp4", 0).T, fq(rg, "nvfp4", 0),
                        precision="highest")
  # Equal up to the float32 accumulation order of the final product.
  close = lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-4)
  close(db, expected)
  plain = jnp.matmul(fq(a, "nvfp4", 0).T, fq(g, "nvfp4", 0),
                     precision="highest")
  close(db_plain, plain)
  assert float(jnp.max(jnp.abs(db - db_plain))) > 0.1
  exact = jnp.matmul(a.T, g, precision="highest")
  err = lambda x: float(jnp.linalg.norm(x - exact) / jnp.linalg.norm(exact))
  assert err(db) < 0.2, err(db)  # Within nvfp4's error of the true product.


def test_hadamard_pads_a_partial_run_and_keeps_the_product():
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 20, 3))
  y = jax.random.normal(jax.random.PRNGKey(1), (2, 20, 5))
  key = jax.random.PRNGKey(2)
  rx, ry = (recipe.hadamard_rotate(v, 1, key) for v in (x, y))
  assert rx.shape == (2, 32, 3)  # Padded to two runs of 16, kept.
  np.testing.assert_allclose(jnp.einsum("bmk,bmn->bkn", rx, ry),
                             jnp.einsum("bmk,bmn->bkn", x, y), atol=1e-4)
  assert not np.allclose(rx[:, :20], x)


def _grad_fn(rules):
  x = jax.random.normal(jax.random.PRNGKey(0), (16, 32))

  def loss(w1, w2, step):
    f = mpolicy.amp(lambda x, w1, w2: jnp.tanh(x @ w1) @ w2,
                    "p=f32,c=nvfp4,o=f32", rules=rules)
    return jnp.sum(f.at_step(step)(x, w1, w2).astype(F32) ** 2)
  w1 = jax.random.normal(jax.random.PRNGKey(1), (32, 32)) * 0.2
  w2 = jax.random.normal(jax.random.PRNGKey(2), (32, 16)) * 0.2
  grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
  return lambda step: grad(w1, w2, jnp.int32(step))


@pytest.mark.ci  # Five compilations of a two-layer grad (~10 s).
def test_rule_options_turn_each_default_off():
  rules = mpolicy.DEFAULT_RULES
  default = _grad_fn(rules)
  s3 = default(3)
  # The step count changes the keys; the same step gives the same grads.
  np.testing.assert_array_equal(s3[1], default(3)[1])
  assert not np.array_equal(s3[1], default(4)[1])
  for off in ({"stochastic_rounding": False}, {"hadamard": False},
              {"seed": 1}):
    changed = _grad_fn(rules.with_fp8(**off))(3)
    assert not np.array_equal(changed[1], s3[1]), off
  # Both off: the first layer's weight gradient (rotated and rounded
  # stochastically by default) no longer depends on the step.
  plain = _grad_fn(rules.with_fp8(stochastic_rounding=False, hadamard=False))
  np.testing.assert_array_equal(plain(3)[0], plain(4)[0])


def test_keys_fold_seed_place_and_step():
  np.testing.assert_array_equal(
      recipe.op_key(3, 1, 5),
      jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(3), 1), 5))
  assert not np.array_equal(recipe.op_key(0, 0), recipe.op_key(0, 1))


def test_explain_names_the_recipe_and_options_are_checked():
  x, w = jnp.ones((4, 32)), jnp.ones((32, 8))
  f = mpolicy.amp(lambda x, w: x @ w, "p=f32,c=nvfp4,o=bf16")
  (row,) = [r for r in mpolicy.explain(f, x, w).rows
            if r.primitive == "dot_general"]
  assert "stochastic rounding of gradients" in row.decided_by
  assert "16x16 Hadamard on the weight gradient" in row.decided_by
  rules = mpolicy.DEFAULT_RULES.with_fp8(stochastic_rounding=False,
                                         hadamard=False)
  g = mpolicy.amp(lambda x, w: x @ w, "p=f32,c=nvfp4,o=bf16", rules=rules)
  (row,) = [r for r in mpolicy.explain(g, x, w).rows
            if r.primitive == "dot_general"]
  assert "stochastic" not in row.decided_by and "Hadamard" not in row.decided_by
  with pytest.raises(ValueError, match="hadamard='yes'.*True or False"):
    mpolicy.DEFAULT_RULES.with_fp8(hadamard="yes")
  with pytest.raises(TypeError, match="unknown options \\['hadamrd'\\]"):
    mpolicy.DEFAULT_RULES.with_fp8(hadamrd=False)


def test_block_dot_general_without_a_key_uses_key_zero():
  x = jax.random.normal(jax.random.PRNGKey(0), (8, 32))
  w = jax.random.normal(jax.random.PRNGKey(1), (32, 16))
  f = lambda key: jax.grad(lambda w: jnp.sum(matmul.block_dot_general(
      x, w, DN, "nvfp4", out_dtype=F32, key=key)))(w)
  np.testing.assert_array_equal(f(None), f(jax.random.PRNGKey(0)))


def test_make_train_step_folds_the_optimizers_step_count_into_the_keys():
  # nvfp4's stochastic rounding and rotation draw from keys folded with the
  # step count (optax's Adam `count`): a step is reproducible, steps differ.
  x = jax.random.normal(jax.random.PRNGKey(0), (16, 32))
  w = {"w": jax.random.normal(jax.random.PRNGKey(1), (32, 16))}
  f = mpolicy.amp(lambda p, x: jnp.sum((x @ p["w"]) ** 2),
                  "p=f32,c=nvfp4,o=f32")
  opt = optax.adam(1e-2)
  step = jax.jit(mpolicy.make_train_step(f, opt))
  scale = mpolicy.NoOpLossScale()
  state = opt.init(w)
  at = lambda n: jax.tree.map(
      lambda v: jnp.asarray(n, v.dtype) if v.ndim == 0 else v, state)
  p0, p0_again, p1 = (step(w, at(n), scale, x).params["w"] for n in (0, 0, 1))
  np.testing.assert_array_equal(np.asarray(p0), np.asarray(p0_again))
  assert not np.array_equal(np.asarray(p0), np.asarray(p1))
  # The keys without a step count (no `count` in SGD's state) stay fixed.
  sgd = mpolicy.make_train_step(f, optax.sgd(1e-2))
  assert train_step.step_count(optax.sgd(1e-2).init(w)) is None
  a, b = (sgd(w, optax.sgd(1e-2).init(w), scale, x).params["w"]
          for _ in range(2))
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_places_count_across_sub_jaxprs():
  # Two matmuls in two checkpointed blocks are places 0 and 1, not both 0
  # (each sub-jaxpr is interpreted in its own environment): their
  # stochastic rounding draws differ, so the two weight gradients differ.
  x = jax.random.normal(jax.random.PRNGKey(0), (32, 32))
  w = jax.random.normal(jax.random.PRNGKey(1), (32, 32))
  rules = mpolicy.DEFAULT_RULES.with_fp8(min_size=0, hadamard=False)

  def f(w1, w2, x):
    h = jax.checkpoint(lambda w, x: x @ w)(w1, x)
    return jnp.sum(jax.checkpoint(lambda w, x: x @ w)(w2, x) * h)

  g1, g2 = jax.grad(mpolicy.amp(f, "p=f32,c=mxfp4,o=f32", rules=rules),
                    (0, 1))(w, w, x)
  assert not np.array_equal(np.asarray(g1), np.asarray(g2))


def test_one_unnamed_jit_called_at_two_places_draws_two_keys():
  # The interpretation of an unnamed sub-jaxpr is reused across call sites,
  # except one that drew keys by place: each site is its own place.
  x = jax.random.normal(jax.random.PRNGKey(0), (32, 32))
  w = jax.random.normal(jax.random.PRNGKey(1), (32, 32))
  rules = mpolicy.DEFAULT_RULES.with_fp8(min_size=0, hadamard=False)
  mm = jax.jit(lambda a, b: a @ b)

  def f(w1, w2, x):
    return jnp.sum(mm(x, w1) * mm(x, w2))

  g1, g2 = jax.grad(mpolicy.amp(f, "p=f32,c=nvfp4,o=f32", rules=rules),
                    (0, 1))(w, w, x)
  assert not np.array_equal(np.asarray(g1), np.asarray(g2))


def _scanned_layers(ws, x):
  def body(total, w):
    return total + jnp.sum(jnp.tanh(x @ w) ** 2), None

  return jax.lax.scan(body, jnp.float32(0), ws)[0]


def test_each_iteration_of_a_scanned_layer_draws_its_own_noise():
  # Two iterations of one scanned layer, with equal weights and inputs: the
  # stochastic rounding of their gradients differs (the iteration is folded
  # into the keys), and is the same from run to run.
  x = jax.random.normal(jax.random.PRNGKey(0), (32, 32))
  w = 0.2 * jax.random.normal(jax.random.PRNGKey(1), (32, 32))
  rules = mpolicy.DEFAULT_RULES.with_fp8(hadamard=False)
  grad = jax.jit(jax.grad(mpolicy.amp(_scanned_layers, "p=f32,c=nvfp4,o=f32",
                                      rules=rules)))
  g = np.asarray(grad(jnp.stack([w, w]), x))
  assert not np.array_equal(g[0], g[1])
  np.testing.assert_array_equal(g, np.asarray(grad(jnp.stack([w, w]), x)))


def test_each_microbatch_folds_its_index_into_the_keys(monkeypatch):
  # The microbatches run as one scan body: each block matmul's key folds
  # the microbatch's index (a traced int32), as a scanned layer's does.
  folded = []
  op_key = recipe.op_key

  def recording(seed, place, step=None, iterations=()):
    folded.append(tuple(str(jnp.asarray(i).dtype) for i in iterations))
    return op_key(seed, place, step, iterations)

  monkeypatch.setattr(recipe, "op_key", recording)
  x = jnp.ones((32, 32))
  w = {"w": jnp.ones((32, 16))}
  f = mpolicy.amp(lambda p, x: jnp.mean(jnp.tanh(x @ p["w"]) ** 2),
                  "p=f32,c=nvfp4,o=f32")
  opt = optax.sgd(1.0)
  jax.make_jaxpr(mpolicy.make_train_step(f, opt, microbatches=2))(
      w, opt.init(w), mpolicy.NoOpLossScale(), x)
  assert folded and set(folded) == {("int32",)}, folded


def test_the_step_reaches_the_rules_as_an_argument():
  # `f.at_step(step)` folds the step into the keys of f's block matmuls, a
  # sub-jaxpr's included; `make_train_step` calls the amp-ed loss at the
  # optimizer's count that way (here p - g: a schedule's count, scale -1).
  x = jax.random.normal(jax.random.PRNGKey(0), (16, 32))
  w = {"w": jax.random.normal(jax.random.PRNGKey(1), (32, 16))}
  f = mpolicy.amp(lambda p, x: jnp.sum(jax.checkpoint(
      lambda w, x: jnp.tanh(x @ w))(p["w"], x) ** 2), "p=f32,c=nvfp4,o=f32")
  grad = lambda fn: np.asarray(jax.jit(jax.grad(fn))(w, x)["w"])
  at5 = grad(f.at_step(5))
  np.testing.assert_array_equal(at5, jax.jit(lambda s: jax.grad(
      f.at_step(s))(w, x)["w"])(jnp.int32(5)))
  assert not np.array_equal(at5, grad(f.at_step(6)))
  assert not np.array_equal(at5, grad(f))
  opt = optax.chain(optax.scale_by_schedule(lambda count: 1.0),
                    optax.scale(-1.0))
  step = jax.jit(mpolicy.make_train_step(f, opt))
  state = jax.tree.map(lambda v: jnp.asarray(5, v.dtype), opt.init(w))
  new = step(w, state, mpolicy.NoOpLossScale(), x).params["w"]
  np.testing.assert_array_equal(np.asarray(new), np.asarray(w["w"]) - at5)


def test_a_loss_calling_an_amp_ed_model_gets_the_step_or_a_warning():
  # make_train_step gives a loss with a keyword-only `step` the optimizer's
  # count, to pass on as `model.at_step(step)`; a loss without one, whose
  # model draws random numbers, would repeat its draws: it warns.
  x = jax.random.normal(jax.random.PRNGKey(0), (16, 32))
  w = {"w": jax.random.normal(jax.random.PRNGKey(1), (32, 16))}
  model = mpolicy.amp(lambda p, x: jnp.tanh(x @ p["w"]), "p=f32,c=nvfp4,o=f32")
  at5 = np.asarray(jax.jit(jax.grad(
      lambda p: jnp.sum(model.at_step(5)(p, x) ** 2)))(w)["w"])
  opt = optax.chain(optax.scale_by_schedule(lambda count: 1.0),
                    optax.scale(-1.0))
  state = jax.tree.map(lambda v: jnp.asarray(5, v.dtype), opt.init(w))

  def stepped(p, x, *, step):
    return jnp.sum(model.at_step(step)(p, x) ** 2)

  with warnings.catch_warnings():
    warnings.simplefilter("error")
    new = jax.jit(mpolicy.make_train_step(stepped, opt))(
        w, state, mpolicy.NoOpLossScale(), x).params["w"]
  np.testing.assert_array_equal(np.asarray(new), np.asarray(w["w"]) - at5)

  unstepped = lambda p, x: jnp.sum(model(p, x) ** 2)
  with pytest.warns(UserWarning, match=r"keyword-only `step` parameter"):
    jax.jit(mpolicy.make_train_step(unstepped, opt))(
        w, state, mpolicy.NoOpLossScale(), x)
  # A model that draws nothing (mxfp8) needs no step: no warning.
  plain = mpolicy.amp(lambda p, x: jnp.tanh(x @ p["w"]), "p=f32,c=mxfp8,o=f32")
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    jax.jit(mpolicy.make_train_step(
        lambda p, x: jnp.sum(plain(p, x) ** 2), opt))(
            w, state, mpolicy.NoOpLossScale(), x)
