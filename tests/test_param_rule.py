"""The parameter rule: float32 arrays that enter `amp` meet half values in half.

Arguments and closed-over constants of an `amp` call (and reshapes,
broadcasts, transposes and slices of them) are parameters or inputs. Where
one is wider than the governing compute dtype and meets half values in an op
without a rule, it is used in the compute dtype, as Haiku's policies cast
parameters: ``x @ w + b`` adds the bias in half and the ReLU after it runs in
half. Values that `full` ops made in float32 are not parameters and still
promote, or (under bfloat16) combine with half values by the rules for
statistics: ``x - mean(x)`` subtracts the mean's two bfloat16 parts.
"""

import jax
import jax.numpy as jnp
import numpy as np

import mpolicy

from _helpers import recorded_rows
from _helpers import walk_eqns

F32 = jnp.dtype(jnp.float32)
BF16 = jnp.dtype(jnp.bfloat16)
HALF = "p=f32,c=bf16,o=f32"
KEY = jax.random.PRNGKey(0)


def _eqns(fn, *args, name):
  return [e for e in walk_eqns(jax.make_jaxpr(fn)(*args))
          if e.primitive.name == name]


def _shaped(eqns, shape):
  """The equations whose result has ``shape``."""
  return [e for e in eqns if e.outvars[0].aval.shape == shape]


def _in_dtypes(eqns):
  return [tuple(jnp.dtype(v.aval.dtype) for v in e.invars) for e in eqns]


def _mlp(params, x):
  for w, b in params[:-1]:
    x = jax.nn.relu(x @ w + b)
  w, b = params[-1]
  return x @ w + b


def _mlp_args(width=16, depth=4):
  ks = jax.random.split(KEY, depth + 1)
  params = [(jax.random.normal(k, (width, width)) / np.sqrt(width),
             jax.random.normal(k, (width,)) * 0.1) for k in ks[:depth]]
  return params, jax.random.normal(ks[-1], (8, width))


def test_bias_add_and_relu_of_a_plain_mlp_run_in_half():
  f = mpolicy.amp(_mlp, HALF)
  args = _mlp_args()
  adds = _in_dtypes(_eqns(f, *args, name="add"))
  assert adds == [(BF16, BF16)] * 4
  relus = _in_dtypes(_eqns(f, *args, name="max"))
  assert relus and all(d == (BF16, BF16) for d in relus), relus


def test_most_of_a_plain_mlp_runs_in_half():
  f = mpolicy.amp(_mlp, HALF)
  with recorded_rows() as rows:
    jax.make_jaxpr(f)(*_mlp_args())
  # Only the broadcasts of the four float32 biases run in float32 (then
  # they are cast): everything else runs in bfloat16.
  wide = [r.primitive for r in rows if r.ran_in != "bfloat16"]
  assert wide == ["broadcast_in_dim"] * 4, wide
  assert sum(r.ran_in == "bfloat16" for r in rows) >= 11


def test_x_minus_mean_of_x_is_not_cast_to_half_as_a_parameter_would_be():
  # The float32 mean is no parameter: it is not rounded to bfloat16 and
  # subtracted in one go (digits would cancel), but subtracted as its two
  # bfloat16 parts (see the op rules' `_stored_half`).
  f = mpolicy.amp(lambda x: x - jnp.mean(x, -1, keepdims=True), HALF)
  x = 50 + jax.random.normal(KEY, (4, 8))
  subs = _in_dtypes(_shaped(_eqns(f, x, name="sub"), (4, 8)))
  assert subs == [(BF16, BF16)] * 2, subs
  xb = np.asarray(x.astype(jnp.bfloat16), np.float32)
  np.testing.assert_allclose(f(x), xb - np.asarray(x).mean(-1, keepdims=True),
                             atol=2e-2)
  # The same holds for a half activation.
  g = mpolicy.amp(lambda x, w: (lambda h: h - jnp.mean(h, -1, keepdims=True))(
      x @ w), HALF)
  subs = _in_dtypes(_shaped(_eqns(g, x, jnp.eye(8), name="sub"), (4, 8)))
  assert subs == [(BF16, BF16)] * 2, subs
  np.testing.assert_allclose(g(x, jnp.eye(8)),
                             xb - xb.mean(-1, keepdims=True), atol=2e-2)


def test_reshaped_transposed_and_sliced_params_are_still_params():
  def fn(x, w, b):
    h = x @ w
    return (h + b.reshape(1, -1)[:, :8] + w.T[:1, :8]) * 2.0
  f = mpolicy.amp(fn, HALF)
  x, w, b = jnp.ones((4, 8)), jnp.ones((8, 8)), jnp.ones(16)
  adds = _in_dtypes(_eqns(f, x, w, b, name="add"))
  assert adds == [(BF16, BF16)] * 2


def test_closed_over_constants_are_params():
  b = jnp.arange(16.0)
  f = mpolicy.amp(lambda x, w: x @ w + b, HALF)
  adds = _in_dtypes(_eqns(f, jnp.ones((4, 8)), jnp.ones((8, 16)), name="add"))
  assert adds == [(BF16, BF16)]


def test_params_passed_into_a_nested_jit_are_still_params():
  inner = jax.jit(lambda h, b: jax.nn.relu(h + b))
  f = mpolicy.amp(lambda x, w, b: inner(x @ w, b), HALF)
  adds = _in_dtypes(_eqns(f, jnp.ones((4, 8)), jnp.ones((8, 16)),
                          jnp.ones(16), name="add"))
  assert adds == [(BF16, BF16)]


def test_float32_activation_into_a_nested_jit_is_no_param():
  # Inside the jit, the float32 mean is an argument of the sub-jaxpr but
  # not of the amp call: it still promotes.
  inner = jax.jit(lambda h, m: h - m)
  f = mpolicy.amp(lambda x, w: inner(x @ w, jnp.mean(x @ w, -1,
                                                        keepdims=True)), HALF)
  subs = _shaped(_eqns(f, jnp.ones((4, 8)), jnp.ones((8, 16)), name="sub"),
                 (4, 16))
  # Not rounded and subtracted once, as a parameter would be: subtracted
  # as the two bfloat16 parts of the float32 statistic.
  assert [jnp.dtype(e.outvars[0].aval.dtype) for e in subs] == [BF16, BF16]


def test_without_a_policy_params_promote_as_written():
  f = mpolicy.amp(lambda x, b: x + b)
  adds = _in_dtypes(_eqns(f, jnp.ones(4, BF16), jnp.ones(4), name="add"))
  assert adds == [(F32, F32)]


def test_under_a_float32_policy_nothing_is_cast_down():
  f = mpolicy.amp(_mlp, "full")
  adds = _in_dtypes(_eqns(f, *_mlp_args(), name="add"))
  assert adds == [(F32, F32)] * 4


def test_bias_gradient_sums_in_float32():
  def loss(params, x):
    return jnp.sum(_mlp(params, x))
  g = jax.grad(mpolicy.amp(loss, HALF))
  params, x = _mlp_args()
  jaxpr = jax.make_jaxpr(g)(params, x)
  # The bias gradients are sums of the output cotangent over the batch:
  # every batch-axis sum runs on float32 inputs.
  batch_sums = [e for e in walk_eqns(jaxpr) if e.primitive.name == "reduce_sum"
                and e.invars[0].aval.shape == (8, 16)
                and e.params["axes"] == (0,)]
  assert len(batch_sums) == 4
  assert all(jnp.dtype(e.invars[0].aval.dtype) == F32 for e in batch_sums)
  grads = g(params, x)
  assert all(gb.dtype == F32 for _, gb in grads)


def test_the_half_mlp_stays_close_to_float32():
  params, x = _mlp_args(width=64)
  want = _mlp(params, x)
  got = mpolicy.amp(_mlp, HALF)(params, x)
  assert got.dtype == F32
  err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
  assert err < 3e-2, err
  gw = jax.grad(lambda p: jnp.sum(_mlp(p, x) ** 2))(params)
  gh = jax.grad(lambda p: jnp.sum(mpolicy.amp(_mlp, HALF)(p, x) ** 2))(params)
  for (a, b), (c, d) in zip(gw, gh):
    for want, got in ((a, c), (b, d)):
      rel = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
      assert rel < 5e-2, rel


def test_vmapped_per_example_layer_with_bias_and_relu_runs_under_grad():
  """Equinox style: a per-example layer (bias, then ReLU) under `vmap`."""
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
  params = (jax.random.normal(k1, (32, 64)), jnp.zeros(32),
            jax.random.normal(k2, (10, 32)), jnp.zeros(10))
  x = jax.random.normal(k3, (16, 64))
  net = lambda p, xi: p[2] @ jax.nn.relu(p[0] @ xi + p[1]) + p[3]
  loss = lambda p, x: jax.vmap(lambda xi: net(p, xi))(x).sum()
  f = mpolicy.amp(lambda p, x: jax.vmap(lambda xi: net(p, xi))(x),
                  "p=f32,c=bf16,o=f32")
  grads = jax.jit(jax.grad(lambda p, x: f(p, x).sum()))(params, x)
  want = jax.grad(loss)(params, x)
  for g, w in zip(grads, want):
    assert g.dtype == jnp.float32
    np.testing.assert_allclose(g, w, rtol=0.05, atol=0.05 * np.abs(w).max())
