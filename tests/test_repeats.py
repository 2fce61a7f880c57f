"""Identical module calls are interpreted once and bound as one shared body.

The model: three identical residual blocks (layer norm, two linears, gelu)
and a head, under `transform_amp` with a bf16 policy. Sharing is checked
by the program (one body object for the three calls) and by the values (bit
for bit against the same program with sharing off, each evaluated one
primitive at a time so that no XLA fusion keeps excess precision).
"""

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpolicy
from mpolicy._src import jax_compat
from mpolicy._src import repeats

HALF = "p=f32,c=bf16,o=f32"


class Block(hk.Module):

  def __call__(self, x):
    h = hk.LayerNorm(-1, True, True)(x)
    h = jax.nn.gelu(hk.Linear(16)(h))
    return x + hk.Linear(8)(h)


def _forward(x, layers=3):
  for _ in range(layers):
    x = Block()(x)
  return jnp.sum(jax.nn.log_softmax(hk.Linear(4)(x)))


X = jnp.linspace(-2, 2, 32, dtype=jnp.float32).reshape(4, 8)


@pytest.fixture(name="model")
def _model():
  f = mpolicy.transform_amp(_forward)
  params = jax.jit(f.init)(jax.random.PRNGKey(0), X)
  with mpolicy.push_policy(hk.Module, HALF):
    yield f, params


@pytest.fixture(name="unshared")
def _unshared(monkeypatch):
  """Sharing off (JAX's trace caches cleared on both sides)."""
  jax.clear_caches()
  monkeypatch.setattr(repeats, "MIN_EQNS", 10**9)
  yield
  jax.clear_caches()


def _calls(jaxpr, name="block"):
  return [e for e in jaxpr.eqns if e.primitive is jax_compat.jit_p
          and e.params.get("name") == name]


def _program(f, params):
  return jax.make_jaxpr(lambda p, x: f.apply(p, None, x))(params, X)


def test_identical_blocks_share_one_body(model):
  f, params = model
  calls = _calls(_program(f, params).jaxpr)
  assert len(calls) == 3
  # The first block reads the call's input (the rules may treat it as they
  # treat a parameter): its own body. The others meet one body, so JAX's
  # caches (JVP, transpose, lowering) hit.
  assert calls[0].params["jaxpr"] is not calls[1].params["jaxpr"]
  assert calls[1].params["jaxpr"] is calls[2].params["jaxpr"]
  body = calls[0].params["jaxpr"].jaxpr
  dots = [e for e in body.eqns if "dot_general" in e.primitive.name]
  assert len(dots) == 2
  assert all(str(e.invars[0].aval.dtype) == "bfloat16" for e in dots)


def test_without_sharing_the_blocks_are_inline(model, unshared):
  del unshared
  f, params = model
  jaxpr = _program(f, params).jaxpr
  assert not _calls(jaxpr)
  assert sum("dot_general" in e.primitive.name for e in jaxpr.eqns) == 7


def _values_and_grads(f, params):
  closed = jax.make_jaxpr(jax.value_and_grad(
      lambda p, x: f.apply(p, None, x)))(params, X)
  with jax.disable_jit():  # Primitive by primitive: no fusion rounds.
    return [np.asarray(v) for v in jax_compat.eval_eagerly(
        closed, *jax.tree_util.tree_leaves(params), X)]


@pytest.mark.ci  # Every primitive dispatched on its own: 8 s on 2 cores.
def test_shared_blocks_compute_bit_for_bit_as_inline(model, monkeypatch):
  f, params = model
  # Blocks output bf16: the next block's layer norm reads the float32 value
  # they were cast down from (a mark that crosses the call).
  with mpolicy.push_policy(Block, "p=f32,c=bf16,o=bf16"):
    shared = _values_and_grads(f, params)
    assert len(_calls(_program(f, params).jaxpr)) == 3
    jax.clear_caches()
    monkeypatch.setattr(repeats, "MIN_EQNS", 10**9)
    inline = _values_and_grads(f, params)
  jax.clear_caches()
  assert len(shared) == len(inline) == 1 + len(jax.tree_util.tree_leaves(
      params))
  for a, b in zip(shared, inline):
    assert a.dtype == b.dtype and np.array_equal(a, b)


def test_a_block_with_its_own_policy_runs_inline(model):
  f, params = model
  with mpolicy.push_policy("block_1", "p=f32,c=f32,o=f32"):
    jaxpr = _program(f, params).jaxpr
  calls = _calls(jaxpr)
  assert len(calls) == 2  # block and block_2 are still calls.
  inline_dots = [e for e in jaxpr.eqns if "dot_general" in e.primitive.name]
  assert len(inline_dots) == 3  # block_1's two and the head's.
  f32 = [e for e in inline_dots if str(e.invars[0].aval.dtype) == "float32"]
  assert len(f32) == 2


def test_explain_reports_every_block(model):
  f, params = model
  report = mpolicy.explain(f.apply, params, None, X)
  dots = [r.scope for r in report.rows if r.primitive == "dot_general"]
  assert sorted(dots) == sorted(
      f"{b}/{l}" for b in ("block", "block_1", "block_2")
      for l in ("linear", "linear_1")) + ["linear"], dots


@pytest.mark.parametrize("fmt", ["mxfp8", "int8"])
def test_quantized_formats_are_not_shared(model, fmt):
  """Block-format recipes draw random keys by a matmul's place, and an
  int8 export stores each weight where its matmul reads it: each layer
  must be interpreted on its own."""
  f, params = model
  with mpolicy.push_policy(hk.Module, f"p=f32,c={fmt},o=f32"):
    jaxpr = _program(f, params).jaxpr
  assert not _calls(jaxpr)


def test_short_runs_stay_inline():
  def two_linears(x):
    return hk.Linear(8, name="a")(hk.Linear(8, name="b")(x))

  f = mpolicy.transform_amp(two_linears)
  params = jax.jit(f.init)(jax.random.PRNGKey(0), X)
  with mpolicy.push_policy(hk.Module, HALF):
    jaxpr = jax.make_jaxpr(lambda p: f.apply(p, None, X))(params).jaxpr
  assert not _calls(jaxpr, "a") and not _calls(jaxpr, "b")
  assert sum("dot_general" in e.primitive.name for e in jaxpr.eqns) == 2


# --- Keys ---------------------------------------------------------------------


def _key(fn, *args):
  jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
  return jax_compat.run_key(jaxpr.eqns, jaxpr.invars, jaxpr.outvars)


def test_keys_tell_custom_jvp_rules_apart():
  def make(scale):
    @jax.custom_jvp
    def f(x):
      return jnp.sin(x)
    f.defjvp(lambda p, t: (f(p[0]), scale * t[0]))
    return f

  two, three, other_two = make(2.0), make(3.0), make(2.0)
  assert _key(two, 1.0) != _key(three, 1.0)
  # The classic primitive keys a rule by the jaxpr it traces to; under
  # jax_custom_jvp3 JAX's own equality holds the rule function itself, so
  # two closures never share (the safe side).
  assert (_key(two, 1.0) == _key(other_two, 1.0)) == (
      not jax.config.values.get("jax_custom_jvp3", False))
  assert _key(jax.nn.relu, X) == _key(jax.nn.relu, X)  # Calls itself.


def test_keys_differ_in_literals_types_and_wiring():
  assert _key(lambda x: x * 2.0, 1.0) != _key(lambda x: x * 3.0, 1.0)
  assert _key(lambda x: x * 2.0, 1.0) != _key(lambda x: x * 2.0, X)
  assert _key(lambda x, y: x - y, 1.0, 2.0) != _key(lambda x, y: y - x, 1.0,
                                                       2.0)
  assert _key(lambda x, y: x - y, 1.0, 2.0) == _key(lambda a, b: a - b, 3.0,
                                                       4.0)


def test_effects_and_traced_constants_are_unkeyable():
  def printing(x):
    jax.debug.print("{}", x)
    return x

  with pytest.raises(jax_compat.Unkeyable, match="effects"):
    _key(printing, 1.0)
  with pytest.raises(jax_compat.Unkeyable, match="Tracer"):
    jax_compat.value_key(jax.make_jaxpr(lambda x: x)(1.0).jaxpr.invars[0].aval
                         and _tracer(), {})


def _tracer():
  found = []
  jax.make_jaxpr(lambda x: found.append(x) or x)(1.0)
  return found[0]


# --- Plain JAX ----------------------------------------------------------------


def _layer(x, w1, w2):
  h = jnp.tanh(x @ w1)
  h = h - h.mean(-1, keepdims=True)
  h = h / jnp.sqrt((h * h).mean(-1, keepdims=True) + 1e-5)
  return x + jax.nn.relu(h) @ w2


def _named_layers(x, ws):
  for i, (w1, w2) in enumerate(ws):
    with jax.named_scope(f"layer_{i}"):
      x = _layer(x, w1, w2)
  return jnp.sum(jnp.exp(x * 0.01))


def _layer_calls(jaxpr) -> int:
  found = 0
  for eqn in jaxpr.eqns:
    found += eqn.primitive is jax_compat.jit_p and eqn.params["name"] == "layer"
    for sub in jax_compat.jaxprs_in_params(eqn.params):
      found += _layer_calls(getattr(sub, "jaxpr", sub))
  return found


@pytest.mark.ci  # Every primitive dispatched on its own: 3-4 s on 2 cores.
def test_named_scopes_share_under_vmap_and_grad(monkeypatch):
  keys = jax.random.split(jax.random.PRNGKey(0), 8)
  ws = [(0.3 * jax.random.normal(keys[i], (8, 8)),
         0.3 * jax.random.normal(keys[i + 4], (8, 8))) for i in range(4)]
  x = jax.random.normal(jax.random.PRNGKey(1), (3, 5, 8))
  step = jax.vmap(jax.value_and_grad(mpolicy.amp(_named_layers, HALF),
                                     argnums=1), in_axes=(0, None))

  def run():
    closed = jax.make_jaxpr(step)(x, ws)
    with jax.disable_jit():  # Primitive by primitive: no fusion rounds.
      values = jax_compat.eval_eagerly(closed, x, *jax.tree_util.tree_leaves(
          ws))
    return _layer_calls(closed.jaxpr), [np.asarray(v) for v in values]

  jax.clear_caches()
  calls, shared = run()
  jax.clear_caches()
  monkeypatch.setattr(repeats, "MIN_EQNS", 10**9)
  no_calls, inline = run()
  jax.clear_caches()
  assert calls >= 4 and no_calls == 0
  assert len(shared) == len(inline) == 9
  for a, b in zip(shared, inline):
    assert a.dtype == b.dtype and np.array_equal(a, b)


# --- Regions inside a layer's sub-jaxprs --------------------------------------


def _checkpointed_layer(x, w1, w2):
  def matmul(x, w):
    with jax.named_scope("mm"):
      return x @ w

  h = jax.checkpoint(matmul)(x, w1) * 1e-3 + 1.0
  h = h - h.mean(-1, keepdims=True)
  h = h / jnp.sqrt((h * h).mean(-1, keepdims=True) + 1e-5)
  return x + jnp.maximum(h, 0.0) @ w2


def _checkpointed_layers(x, ws):
  for i, (w1, w2) in enumerate(ws):
    with jax.named_scope(f"layer{i}"):
      x = _checkpointed_layer(x, w1, w2)
  return x


# Layer 2's first matmul overflows float16 (8 * 10 * 3000 > 65504).
_WS = [(jnp.full((8, 8), s, jnp.float32), jnp.full((8, 8), 0.1, jnp.float32))
       for s in (0.1, 0.1, 3000.0, 0.1)]
_X = jnp.full((4, 8), 10.0, jnp.float32)


# A remat3 construct keys by identity: layers that hold one do not share.
_REMAT3 = jax.config.values.get("jax_remat3", False)


def _evaluated(fn, *args, eager: bool = True):
  """``fn``'s program evaluated (``eager``: one primitive at a time, no
  fusion rounds), and how many layer calls it holds."""
  closed = jax.make_jaxpr(fn)(*args)
  leaves = jax.tree_util.tree_leaves(args)
  if eager:
    with jax.disable_jit():
      values = jax_compat.eval_eagerly(closed, *leaves)
  else:
    values = jax.jit(jax_compat.eval_eagerly, static_argnums=0)(
        closed, *leaves)
  calls = sum(e.primitive is jax_compat.jit_p
              and e.params["name"].startswith("layer")
              for e in closed.jaxpr.eqns)
  return calls, [np.asarray(v) for v in values]


def _shared_and_inline(fn, *args, monkeypatch, eager=True):
  jax.clear_caches()
  shared = _evaluated(fn, *args, eager=eager)
  jax.clear_caches()
  with monkeypatch.context() as m:
    m.setattr(repeats, "MIN_EQNS", 10**9)
    inline = _evaluated(fn, *args, eager=eager)
  jax.clear_caches()
  return shared, inline


def test_a_pattern_inside_a_layers_checkpoint_keeps_that_layer_apart(
    monkeypatch):
  f = mpolicy.amp(_checkpointed_layers, "p=f32,c=f16,o=f32")
  with mpolicy.push_policy("layer2/mm", "full"):
    (calls, shared), (no_calls, inline) = _shared_and_inline(
        f, _X, _WS, monkeypatch=monkeypatch)
  # layer0 (it reads the call's input); layer1 and layer3 share one body.
  assert (calls, no_calls) == ((0, 0) if _REMAT3 else (3, 0))
  assert np.isfinite(inline[0]).all()
  assert shared[0].dtype == inline[0].dtype
  assert np.array_equal(shared[0], inline[0])


@pytest.mark.ci  # Compiling the block formats' gradients: 20-30 s.
@pytest.mark.skipif(
    jax.config.values.get("jax_scan3", False),
    reason="under jax_scan3 JAX 0.12.1 cannot batch the scan3 loop of "
    "jnp.searchsorted, which the block formats' gradients run under vmap")
def test_a_block_format_inside_a_layers_checkpoint_keeps_keys_by_place(
    monkeypatch):
  ws = [(30 * jax.random.normal(jax.random.PRNGKey(i), (32, 32)),
         0.2 * jax.random.normal(jax.random.PRNGKey(10 + i), (32, 32)))
        for i in range(3)]
  x = jax.random.normal(jax.random.PRNGKey(20), (32, 32))

  def loss(ws, x):
    return jnp.sum(_checkpointed_layers(x, ws) ** 2)

  grad = jax.grad(mpolicy.amp(loss, "p=f32,c=bf16,o=f32"))
  with mpolicy.push_policy("*/mm", "p=f32,c=nvfp4,o=f32"):
    (calls, shared), (_, inline) = _shared_and_inline(
        grad, ws, x, monkeypatch=monkeypatch, eager=False)
  assert calls == 0  # Both programs are inline: compiled alike.
  assert len(shared) == len(inline) == 6
  for a, b in zip(shared, inline):
    assert a.dtype == b.dtype and np.array_equal(a, b)
