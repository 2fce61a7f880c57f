"""Training across 8 simulated devices: one cross-device contract.

Every mode (pmap; shard_map with replicated, FSDP-sharded and
tensor-parallel parameters on 1-D and 2-D meshes, check_vma on and off;
jax.jit with NamedSharding; explicit sharding) is compared with the
one-device gradient of the same loss. One subprocess with
`--xla_force_host_platform_device_count=8` computes every fact (a failure in
one mode is recorded as that mode's error, not a crash), and the tests
below assert on them.
"""

from __future__ import annotations

import pytest

from _helpers import fact

# An 8-device script (10-17 s on 2 cores): CI runs it after the default
# run, in both jobs (-m ci).
pytestmark = pytest.mark.ci


EIGHT_DEVICES = r'''
import json, re
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import mpolicy
import os

N = jax.device_count()
assert N == 8, N
from _helpers import record
facts = {}
guard = lambda name, fn: record(facts, name, fn)

def relerr(a, b):
  a = jax.tree_util.tree_leaves(a); b = jax.tree_util.tree_leaves(b)
  return max(float(jnp.linalg.norm(jnp.asarray(x, jnp.float32) - jnp.asarray(y, jnp.float32))
                   / jnp.linalg.norm(jnp.asarray(y, jnp.float32))) for x, y in zip(a, b))

smap = lambda f, mesh, i, o, cv=True: jax.jit(jax.shard_map(
    f, mesh=mesh, in_specs=i, out_specs=o, check_vma=cv))
mesh1 = Mesh(np.array(jax.devices()), ("d",))
mesh2 = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
POLICY = "p=f32,c=bf16,o=f32"
LS = mpolicy.DynamicLossScale(jnp.float32(2. ** 15))

k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
x = jax.random.normal(k1, (64, 16))
y = jnp.sin(x[:, :4])
params = {"w1": jax.random.normal(k2, (16, 32)) / 4, "w2": jax.random.normal(k3, (32, 4)) / 6}

def mlp_loss(p, x, y):
  h = jnp.tanh(x @ p["w1"])
  return jnp.mean((h @ p["w2"] - y) ** 2)
loss = mpolicy.amp(mlp_loss, POLICY)
_, _, ref_loss, ref = mpolicy.scaled_value_and_grad(loss)(LS, params, x, y)
ref_loss = float(ref_loss)
facts["one_device_loss"] = ref_loss

# --- 1-D: pmap, shard_map replicated (check_vma on/off), FSDP -----------------
def grads_pmap():
  g = mpolicy.scaled_value_and_grad(loss, axis_name="d")
  out = jax.pmap(lambda p, x, y: g(LS, p, x, y)[2:], axis_name="d",
                 in_axes=(None, 0, 0))(params, x.reshape(8, 8, 16), y.reshape(8, 8, 4))
  return {"loss": float(out[0][0]), "relerr": relerr(jax.tree.map(lambda t: t[0], out[1]), ref)}
guard("pmap", grads_pmap)

def grads_replicated(cv):
  g = mpolicy.scaled_value_and_grad(loss, axis_name="d")
  def body(p, x, y):
    _, finite, l, gr = g(LS, p, x, y)
    return l, gr, finite
  l, gr, _ = smap(body, mesh1, (P(), P("d"), P("d")), P(), cv)(params, x, y)
  return {"loss": float(l), "relerr": relerr(gr, ref)}
guard("replicated_vma", lambda: grads_replicated(True))
guard("replicated_novma", lambda: grads_replicated(False))

FS = {"w1": P("d"), "w2": P("d")}
def fsdp_loss(p, x, y):
  full = jax.tree.map(lambda w: jax.lax.all_gather(w, "d", tiled=True), p)
  return loss(full, x, y)
def grads_fsdp():
  g = mpolicy.scaled_value_and_grad(fsdp_loss, axis_name="d")
  def body(p, x, y):
    _, finite, l, gr = g(LS, p, x, y)
    return l, gr, finite
  l, gr, finite = smap(body, mesh1, (FS, P("d"), P("d")), (P(), FS, P()))(params, x, y)
  return {"loss": float(l), "relerr": relerr(gr, ref), "finite": bool(finite)}
guard("fsdp", grads_fsdp)

# --- 2-D: data x model, Megatron MLP --------------------------------------------
TP = {"w1": P(None, "model"), "w2": P("model", None)}
def tp_loss(p, x, y):
  h = jnp.tanh(x @ p["w1"])
  out = jax.lax.psum(h @ p["w2"], "model")
  return jnp.mean((out - y) ** 2)
tp_amp = mpolicy.amp(tp_loss, POLICY)
def grads_2d(axis_name, cv=True):
  g = mpolicy.scaled_value_and_grad(tp_amp, axis_name=axis_name)
  def body(p, x, y, ls):
    ls, finite, l, gr = g(ls, p, x, y)
    return l, gr, finite, ls
  l, gr, finite, ls = smap(body, mesh2, (TP, P("data"), P("data"), P()),
                           (P(), TP, P(), P()), cv)(params, x, y, LS)
  return {"loss": float(l), "relerr": relerr(gr, ref), "finite": bool(finite)}
guard("tp_data", lambda: grads_2d("data"))
guard("tp_both", lambda: grads_2d(("data", "model")))
guard("tp_data_novma", lambda: grads_2d("data", cv=False))

# --- A NaN on one device, sharded params: every device skips ------------------
from _helpers import poison
def tp_loss_poison(p, x, y, f):
  h = poison(jnp.tanh(x @ p["w1"]), f[0])
  out = jax.lax.psum(h @ p["w2"], "model")
  return jnp.mean((out - y) ** 2)
def skip_2d(use_make_step):
  tx = mpolicy.skip_nonfinite(optax.adam(1e-2))
  g = mpolicy.scaled_value_and_grad(mpolicy.amp(tp_loss_poison, POLICY), axis_name="data")
  def body(p, s, ls, x, y, f):
    ls, finite, l, gr = g(ls, p, x, y, f)
    u, s = tx.update(gr, s, p, grads_finite=finite)
    return optax.apply_updates(p, u), s, ls, finite[None]
  sspec = mpolicy.SkipNonFiniteState(
      inner_state=(optax.ScaleByAdamState(count=P(), mu=TP, nu=TP), optax.EmptyState()),
      notfinite_count=P(), last_finite=P(), total_notfinite=P())
  f = jnp.ones(8).at[5].set(jnp.nan)  # device 5 only: data 2, model 1
  fn = smap(body, mesh2, (TP, sspec, P(), P("data"), P("data"), P(("data", "model"))),
            (TP, sspec, P(), P(("data", "model"))))
  s0 = tx.init(params)
  p1, s1, ls1, fl = fn(params, s0, LS, x, y, f)
  same = all(bool(jnp.array_equal(a, b)) for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(params)))
  p2, _, _, fl2 = fn(params, s0, LS, x, y, jnp.ones(8))
  moved = not any(bool(jnp.array_equal(a, b)) for a, b in zip(jax.tree.leaves(p2), jax.tree.leaves(params)))
  return {"flags": np.asarray(fl).tolist(), "params_kept": same,
          "count": int(s1.inner_state[0].count), "loss_scale": float(ls1.loss_scale),
          "finite_flags": np.asarray(fl2).tolist(), "moved": moved}
guard("skip_2d", lambda: skip_2d(False))

def skip_fsdp_make_step():
  step = mpolicy.make_train_step(fsdp_loss_f, optax.adam(1e-2), axis_name="d")
  tx = optax.adam(1e-2)
  sspec = (optax.ScaleByAdamState(count=P(), mu=FS, nu=FS), optax.EmptyState())
  fn = smap(lambda p, s, ls, x, y, f: step(p, s, ls, x, y, f)[:4], mesh1,
            (FS, sspec, P(), P("d"), P("d"), P("d")), (FS, sspec, P(), P()))
  f = jnp.ones(8).at[3].set(jnp.inf)
  p1, s1, ls1, fin = fn(params, tx.init(params), LS, x, y, f)
  same = all(bool(jnp.array_equal(a, b)) for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(params)))
  return {"finite": bool(fin), "params_kept": same, "loss_scale": float(ls1.loss_scale)}
def fsdp_loss_f(p, x, y, f):
  full = jax.tree.map(lambda w: jax.lax.all_gather(w, "d", tiled=True), p)
  def inner(full, x, y, f):
    h = poison(jnp.tanh(x @ full["w1"]), f[0])
    return jnp.mean((h @ full["w2"] - y) ** 2)
  return mpolicy.amp(inner, POLICY)(full, x, y, f)
guard("skip_fsdp_make_step", skip_fsdp_make_step)

# --- Accumulation: skip_nonfinite(optax.MultiSteps(...)), FSDP, one bad device --
def multisteps_fsdp():
  tx = mpolicy.skip_nonfinite(optax.MultiSteps(optax.sgd(0.5), 2))
  g = mpolicy.scaled_value_and_grad(fsdp_loss_f, axis_name="d")
  s0 = tx.init(params)
  sspec = jax.tree.map(lambda _: P(), s0)
  sspec = sspec._replace(inner_state=sspec.inner_state._replace(acc_grads=FS))
  def body(p, s, ls, x, y, f):
    ls, finite, _, gr = g(ls, p, x, y, f)
    u, s = tx.update(gr, s, p, grads_finite=finite)
    return optax.apply_updates(p, u), s, ls
  fn = smap(body, mesh1, (FS, sspec, P(), P("d"), P("d"), P("d")), (FS, sspec, P()))
  bad = jnp.ones(8).at[3].set(jnp.nan)     # device 3's shard only
  p1, s1, ls1 = fn(params, s0, LS, x, y, jnp.ones(8))
  p2, s2, ls2 = fn(p1, s1, ls1, x, y, bad)
  p3, s3, _ = fn(p2, s2, ls2, x[::-1], y[::-1], jnp.ones(8))
  same = lambda a, b: all(bool(jnp.array_equal(u, v)) for u, v in
                          zip(jax.tree.leaves(a), jax.tree.leaves(b)))
  one = mpolicy.scaled_value_and_grad(loss)
  mean = jax.tree.map(lambda a, b: (a + b) / 2, one(LS, params, x, y)[3],
                      one(LS, params, x[::-1], y[::-1])[3])
  want = jax.tree.map(lambda w, d: w - 0.5 * d, params, mean)
  return {"bad_kept_state": same(s2.inner_state, s1.inner_state) and same(p2, params),
          "total_notfinite": int(s2.total_notfinite), "loss_scale": float(ls2.loss_scale),
          "gradient_step": int(s3.inner_state.gradient_step), "relerr": relerr(p3, want)}
guard("multisteps_fsdp", multisteps_fsdp)

# --- BatchNorm-style state under shard_map(out_specs=P()) ----------------------
def bn_state():
  def loss_fn(p, state, x, y):
    mean = x.mean(0)
    new_state = {"mean": 0.9 * state["mean"] + 0.1 * mean, "count": state["count"] + 1}
    return mlp_loss(p, x - mean, y), new_state
  tx = optax.sgd(0.1)
  step = mpolicy.make_train_step(loss_fn, tx, has_state=True, axis_name="d")
  state = {"mean": jnp.zeros(16), "count": jnp.zeros([], jnp.int32)}
  fn = smap(lambda p, st, s, ls, x, y: step(p, st, s, ls, x, y).model_state, mesh1,
            (P(), P(), P(), P(), P("d"), P("d")), P())
  out = fn(params, state, tx.init(params), LS, x, y)
  want = 0.1 * x.reshape(8, 8, 16).mean(1).mean(0)
  return {"mean_err": float(jnp.abs(out["mean"] - want).max()), "count": int(out["count"])}
guard("bn_state", bn_state)

# --- Explicit sharding: grad through amp with the batch sharded ---------------
def explicit():
  from jax.sharding import AxisType
  mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
  xs = jax.device_put(x, NamedSharding(mesh, P("data")))
  ys = jax.device_put(y, NamedSharding(mesh, P("data")))
  ps = jax.device_put(params, NamedSharding(mesh, P()))
  out = {}
  with (jax.set_mesh(mesh) if hasattr(jax, 'set_mesh') else jax.sharding.use_mesh(mesh)):
    gr = jax.jit(jax.grad(loss))(ps, xs, ys)
    out["bf16_relerr"] = relerr(gr, ref)
    out["bf16_replicated"] = all(e is None for e in gr["w1"].sharding.spec)
    f8 = mpolicy.amp(mlp_loss, "p=f32,c=f8,o=f32")
    gr8 = jax.jit(jax.grad(f8))(ps, xs, ys)
    out["f8_relerr"] = relerr(gr8, ref)
    dims = (((1,), (0,)), ((), ()))
    f_os = lambda p, x: jax.lax.dot_general(x, p["w1"], dims, out_sharding=P("data", None)).sum()
    rows = mpolicy.explain(mpolicy.amp(f_os, "p=f32,c=f8,o=f32"), ps, xs).rows
    out["f8_out_sharding_why"] = [(r.ran_in, r.decided_by) for r in rows if "dot" in r.primitive]
  return out
guard("explicit", explicit)

# --- The reduction dtype, in the lowered program ------------------------------
# The lowered StableHLO is what the program asks the backend for: XLA:CPU's
# compiler runs a bf16 all-reduce in f32 by itself, a GPU does not.
BF = jax.tree.map(lambda w: w.astype(jnp.bfloat16), params)
def lowered_collectives(text):
  """(op, element type) of each non-scalar all-reduce / reduce-scatter."""
  out = set()
  for m in re.finditer(r'"stablehlo\.(all_reduce|reduce_scatter)"\(.*?\}\) : '
                       r'\((.*?)\) ->', text, re.S):
    for t in re.findall(r"tensor<[\dx]+x(\w+)>", m.group(2)):
      out.add((m.group(1), t))
  return sorted(out)
def compiled_collectives(hlo):
  """The same from compiled HLO, where XLA:CPU marks a bf16 reduction it
  promoted to f32 `_promoted`: the type before promotion is reported."""
  out = set()
  for line in hlo.splitlines():
    m = re.search(r"= (.*?) (all-reduce|reduce-scatter|all-reduce-start)\(", line)
    if not m:
      continue
    for t, dims in re.findall(r"(bf16|f16|f32|f64|s32|pred)\[([\d,]*)\]", m.group(1)):
      if dims:  # scalars are the loss / flag, not gradients
        out.add((m.group(2).replace("-start", "").replace("-", "_"),
                 "bf16" if "_promoted" in line and t == "f32" else t))
  return sorted(out)
def step_grads(p, x, y, rd, train_step=False):
  if train_step:
    step = mpolicy.make_train_step(loss, optax.sgd(0.1), axis_name="d", reduce_dtype=rd)
    return step(p, optax.sgd(0.1).init(p), LS, x, y).params
  return mpolicy.scaled_value_and_grad(loss, axis_name="d", reduce_dtype=rd)(LS, p, x, y)[3]
def reduce_dtypes():
  out = {}
  f32, bf16 = jnp.float32, jnp.bfloat16
  for name, pp, rd in (("bf16_default", BF, f32), ("bf16_asked_bf16", BF, bf16),
                       ("f32_asked_bf16", params, bf16), ("f32_default", params, f32),
                       ("bf16_none", BF, None)):
    for cv in (True, False):
      f = smap(lambda p, x, y: step_grads(p, x, y, rd), mesh1, (P(), P("d"), P("d")), P(), cv)
      out[f"shard_map_{'vma' if cv else 'novma'}_{name}"] = lowered_collectives(
          f.trace(pp, x, y).lower().as_text())
    f = jax.pmap(lambda p, x, y: step_grads(p, x, y, rd), axis_name="d", in_axes=(None, 0, 0))
    out["pmap_" + name] = lowered_collectives(
        f.lower(pp, x.reshape(8, 8, 16), y.reshape(8, 8, 4)).as_text())
  f = smap(lambda p, x, y: step_grads(p, x, y, f32, True), mesh1, (P(), P("d"), P("d")), P())
  out["make_train_step_bf16"] = lowered_collectives(f.trace(BF, x, y).lower().as_text())
  fs = mpolicy.scaled_value_and_grad(fsdp_loss, axis_name="d")
  f = smap(lambda p, x, y: fs(LS, p, x, y)[3], mesh1, (FS, P("d"), P("d")), FS)
  out["fsdp_bf16"] = lowered_collectives(f.trace(BF, x, y).lower().as_text())
  # jit + NamedSharding: the partitioner inserts the sum when compiling.
  g0 = mpolicy.scaled_value_and_grad(loss)
  f = jax.jit(lambda p, x, y: g0(LS, p, x, y)[3])
  xs = jax.device_put(x, NamedSharding(mesh1, P("d"))); ys = jax.device_put(y, NamedSharding(mesh1, P("d")))
  for name, pp in (("f32", params), ("bf16", BF)):
    out["jit_" + name] = compiled_collectives(f.lower(pp, xs, ys).compile().as_text())
  return out
guard("reduce", reduce_dtypes)

def bf16_grads(cv):
  g = mpolicy.scaled_value_and_grad(loss, axis_name="d")
  l, gr = smap(lambda p, x, y: g(LS, p, x, y)[2:], mesh1, (P(), P("d"), P("d")), P(), cv)(BF, x, y)
  _, _, _, want = mpolicy.scaled_value_and_grad(loss)(LS, BF, x, y)
  return {"relerr": relerr(gr, want), "dtypes": sorted({str(v.dtype) for v in jax.tree.leaves(gr)})}
guard("bf16_vma", lambda: bf16_grads(True))
guard("bf16_novma", lambda: bf16_grads(False))

print("FACTS=" + json.dumps(facts))
'''
TOL = 5e-3  # bf16 compute: the one-device gradient has the same rounding.




@pytest.fixture
def facts(eight_devices):
  return eight_devices


@pytest.mark.parametrize("mode", ["pmap", "replicated_vma", "replicated_novma",
                                  "fsdp", "tp_data"])
def test_gradients_are_the_one_device_gradients(facts, mode):
  got = fact(facts, mode)
  assert got["relerr"] < TOL, got
  assert abs(got["loss"] - facts["one_device_loss"]) < 1e-3, got


def test_a_model_axis_named_as_data_axis_says_what_to_pass(facts):
  error = facts["tp_both"]["error"]
  assert error.startswith("ValueError"), error
  assert "['model']" in error and "pass axis_name='data'" in error, error


def test_check_vma_off_with_a_model_axis_is_refused(facts):
  error = facts["tp_data_novma"]["error"]
  assert error.startswith("ValueError") and "check_vma=True" in error, error
  assert "['model']" in error, error


def test_nan_on_one_device_skips_everywhere_with_sharded_params(facts):
  got = fact(facts, "skip_2d")
  assert got["flags"] == [False] * 8, got          # agreed over data & model
  assert got["params_kept"] and got["count"] == 0, got
  assert got["loss_scale"] == 2. ** 14, got
  assert got["finite_flags"] == [True] * 8 and got["moved"], got


def test_make_train_step_fsdp_skips_on_all_devices(facts):
  got = fact(facts, "skip_fsdp_make_step")
  assert got == {"finite": False, "params_kept": True,
                 "loss_scale": 2. ** 14}, got


def test_multisteps_drops_one_device_s_bad_mini_batch_on_every_device(facts):
  got = fact(facts, "multisteps_fsdp")
  assert got["bad_kept_state"] and got["total_notfinite"] == 1, got
  assert got["loss_scale"] == 2. ** 14 and got["gradient_step"] == 1, got
  assert got["relerr"] < TOL, got  # sgd on the mean of the two good ones


def test_batchnorm_state_is_averaged_over_the_data_axis(facts):
  got = fact(facts, "bn_state")
  assert got["mean_err"] < 1e-6 and got["count"] == 1, got


def test_grad_through_amp_under_explicit_sharding(facts):
  got = fact(facts, "explicit")
  assert got["bf16_relerr"] < TOL, got
  assert got["bf16_replicated"], got  # the parameter's own sharding
  assert got["f8_relerr"] < 0.1, got
  assert got["f8_out_sharding_why"] and all(
      ran == "bfloat16" and "not float8_e4m3fn: the dot names an out_sharding"
      in why for ran, why in got["f8_out_sharding_why"]), got


AR_F32, AR_BF16 = [["all_reduce", "f32"]], [["all_reduce", "bf16"]]


@pytest.mark.parametrize("mode", ["shard_map_vma", "shard_map_novma", "pmap"])
def test_the_gradient_sum_runs_in_reduce_dtype_in_the_lowered_program(
    facts, mode):
  got = fact(facts, "reduce")
  assert got[f"{mode}_bf16_default"] == AR_F32, got   # float32 by default
  assert got[f"{mode}_f32_default"] == AR_F32, got
  assert got[f"{mode}_bf16_asked_bf16"] == AR_BF16, got
  assert got[f"{mode}_f32_asked_bf16"] == AR_BF16, got
  assert got[f"{mode}_bf16_none"] == AR_BF16, got      # None: the leaf's dtype


def test_make_train_step_sums_bf16_gradients_in_float32(facts):
  assert fact(facts, "reduce")["make_train_step_bf16"] == AR_F32


def test_fsdp_reduce_scatter_runs_in_reduce_dtype(facts):
  # The transpose of the user's all_gather (JAX's AD writes it) too.
  assert fact(facts, "reduce")["fsdp_bf16"] == [["reduce_scatter", "f32"]]


def test_jit_named_sharding_sum_is_the_partitioner_s(facts):
  got = fact(facts, "reduce")
  # GSPMD sums the weight-gradient dot's output, which on CPU is the float32
  # accumulator even for bf16 parameters (compiled HLO: no lowered sum).
  assert got["jit_f32"] == AR_F32 and got["jit_bf16"] == AR_F32, got


@pytest.mark.parametrize("mode", ["bf16_vma", "bf16_novma"])
def test_bf16_params_get_the_one_device_gradients_in_bf16(facts, mode):
  got = fact(facts, mode)
  assert got["relerr"] < 1e-2 and got["dtypes"] == ["bfloat16"], got
