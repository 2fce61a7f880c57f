"""Training checks run inside the processes `test_multiprocess.py` launches.

Each check trains or rounds on a mesh of every device of the run (4: one
process with 4 devices, or 2 processes with 2 each), each process feeding
its own rows of the batch, and returns JSON facts: losses, flags, digests
and values of the results, gathered whole on every process. The tests
compare the processes with each other and with the one-process run.
"""

from __future__ import annotations

import hashlib

import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import mpolicy

BATCH, FEATURES, HIDDEN = 32, 8, 16
POLICY = "p=f32,c=bf16,o=f32"


def mesh() -> Mesh:
  return Mesh(np.array(jax.devices()), ("data",))


def put(value, spec):
  """`value` (the whole array, known to every process) as a global array;
  each process gives only the part its devices hold, as a data loader
  feeding its own rows would."""
  value = np.asarray(value)
  sharding = NamedSharding(mesh(), spec)
  index = sharding.addressable_devices_indices_map(value.shape).values()
  parts = tuple(
      slice(min(i[d].start or 0 for i in index),
            max(value.shape[d] if i[d].stop is None else i[d].stop
                for i in index))
      for d in range(value.ndim))
  return jax.make_array_from_process_local_data(sharding, value[parts],
                                                value.shape)


def whole(x) -> np.ndarray:
  """The whole value of a (possibly global) array, on every process."""
  if not hasattr(x, "dtype"):
    return np.asarray(x)
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    x = multihost_utils.process_allgather(x, tiled=True)
  return np.asarray(x)


def digest(tree) -> str:
  h = hashlib.sha256()
  for leaf in jax.tree_util.tree_leaves(tree):
    value = whole(leaf)
    h.update(f"{value.dtype}{value.shape}".encode())
    h.update(np.ascontiguousarray(value).tobytes())
  return h.hexdigest()[:16]


def data(seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(BATCH, FEATURES)).astype(np.float32)
  y = np.sin(x[:, :1]).astype(np.float32)
  return x, y


def init_params(seed=1):
  rng = np.random.default_rng(seed)
  return {"w1": (rng.normal(size=(FEATURES, HIDDEN)) / 3).astype(np.float32),
          "b1": np.zeros(HIDDEN, np.float32),
          "w2": (rng.normal(size=(HIDDEN, 1)) / 4).astype(np.float32)}


def loss_fn(params, x, y):
  h = jnp.tanh(x @ params["w1"] + params["b1"])
  return jnp.mean((h @ params["w2"] - y) ** 2)


def loss_with_state(params, state, x, y):
  """The MLP with a BatchNorm-like running mean of the hidden layer."""
  h = x @ params["w1"] + params["b1"]
  mean = h.mean(0)
  h = jnp.tanh(h - mean)
  loss = jnp.mean((h @ params["w2"] - y) ** 2)
  return loss, {"mean": 0.9 * state["mean"] + 0.1 * mean}


def place(params, layout):
  """Replicated params, or FSDP: each weight matrix split by rows."""
  spec = lambda v: P("data") if layout == "fsdp" and v.ndim == 2 else P()
  return {k: jax.device_put(v, NamedSharding(mesh(), spec(v)))
          for k, v in params.items()}


def _batches(steps, bad_step):
  """The batch of each step; at `bad_step` the last row (the last
  process's) holds an inf."""
  x, y = data()
  for i in range(steps):
    xb = x.copy()
    if i == bad_step:
      xb[-1, 0] = np.inf
    yield xb, y


def data_parallel(layout="replicated", steps=4, bad_step=2, **step_kw):
  """`jit` + `NamedSharding`: the batch split over 'data' across processes."""
  tx = optax.adam(1e-2)
  step = jax.jit(mpolicy.make_train_step(
      mpolicy.amp(loss_fn, POLICY), tx, **step_kw))
  params = place(init_params(), layout)
  opt_state = tx.init(params)
  loss_scale = mpolicy.DynamicLossScale(jnp.float32(2. ** 15), period=2)
  facts = {"loss": [], "finite": [], "scale": [], "digest": []}
  for xb, yb in _batches(steps, bad_step):
    out = step(params, opt_state, loss_scale, put(xb, P("data")),
               put(yb, P("data")))
    params, opt_state, loss_scale = out.params, out.opt_state, out.loss_scale
    facts["loss"].append(float(whole(out.value)))
    facts["finite"].append(bool(whole(out.grads_finite)))
    facts["scale"].append(float(whole(loss_scale.loss_scale)))
    facts["digest"].append(digest(params))
  facts["w1"] = whole(params["w1"]).tolist()
  facts["w1_spec"] = str(tuple(params["w1"].sharding.spec))
  facts["opt_digest"] = digest(opt_state)
  return facts


def shard_map_step(steps=4, bad_step=2):
  """`make_train_step(axis_name='data', has_state=True)` in `shard_map`
  over a mesh that spans the processes: gradients averaged, the flag
  agreed, the running mean averaged."""
  tx = optax.adam(1e-2)
  step = mpolicy.make_train_step(mpolicy.amp(loss_with_state, POLICY), tx,
                                 has_state=True, axis_name="data")
  params = place(init_params(), "replicated")
  state = {"mean": jax.device_put(jnp.zeros(HIDDEN),
                                  NamedSharding(mesh(), P()))}
  opt_state = tx.init(params)
  loss_scale = mpolicy.DynamicLossScale(jnp.float32(2. ** 15), period=2)
  rep = lambda tree: jax.tree.map(lambda _: P(), tree)
  out_specs = mpolicy.TrainStepResult(rep(params), rep(opt_state),
                                      rep(loss_scale), P(), P(), rep(state))
  run = jax.jit(jax.shard_map(
      step, mesh=mesh(),
      in_specs=(rep(params), rep(state), rep(opt_state), rep(loss_scale),
                P("data"), P("data")), out_specs=out_specs))
  facts = {"loss": [], "finite": [], "digest": [], "state": []}
  for xb, yb in _batches(steps, bad_step):
    out = run(params, state, opt_state, loss_scale, put(xb, P("data")),
              put(yb, P("data")))
    params, opt_state, loss_scale = out.params, out.opt_state, out.loss_scale
    state = out.model_state
    facts["loss"].append(float(whole(out.value)))
    facts["finite"].append(bool(whole(out.grads_finite)))
    facts["digest"].append(digest(params))
    facts["state"].append(digest(state))
  facts["scale"] = float(whole(loss_scale.loss_scale))
  facts["mean"] = whole(state["mean"]).tolist()
  return facts


def fp8():
  """`c=f8`, one scale per tensor: the rows of process 0 are 1000 times
  smaller than the others, so the scales need the amax of every process."""
  rules = mpolicy.DEFAULT_RULES.with_fp8(min_size=0, scaling="per_tensor")
  f8 = mpolicy.amp(lambda x, w: x @ w, "p=f32,c=f8,o=bf16", rules=rules)
  rng = np.random.default_rng(2)
  x = rng.normal(size=(BATCH, 16)).astype(np.float32)
  x[:BATCH // 2] *= 1e-3
  w = rng.normal(size=(16, 8)).astype(np.float32)
  xs, ws = put(x, P("data")), put(w, P())
  loss = lambda w, x: f8(x, w).astype(jnp.float32).sum()
  mapped = jax.shard_map(f8, mesh=mesh(), in_specs=(P("data"), P()),
                         out_specs=P("data"))
  mapped_loss = lambda w, x: mapped(x, w).astype(jnp.float32).sum()
  return {
      "jit_out": whole(jax.jit(f8)(xs, ws)).astype(np.float32).tolist(),
      "jit_grad": whole(jax.jit(jax.grad(loss))(ws, xs)).tolist(),
      "map_out": whole(jax.jit(mapped)(xs, ws)).astype(np.float32).tolist(),
      "map_grad": whole(jax.jit(jax.grad(mapped_loss))(ws, xs)).tolist(),
  }


def stochastic_rounding():
  """Rounding a value half a bfloat16 step above 1 (up or down with
  probability 1/2, so two shards of 64 values agree by chance with
  probability 2**-64): sharded over devices of both processes (each shard
  must draw its own bits), and replicated (every device must draw the
  same)."""
  n = len(jax.devices())
  x = np.full((n * 64,), 1 + 2. ** -8, np.float32)
  key = jax.random.PRNGKey(5)
  sr = lambda x, k: mpolicy.stochastic_round(x, jnp.bfloat16, k)
  jitted = whole(jax.jit(sr)(put(x, P("data")), key))
  mapped = jax.jit(jax.shard_map(sr, mesh=mesh(), in_specs=(P("data"), P()),
                                 out_specs=P("data")))
  in_shards = whole(mapped(put(x, P("data")), key))
  each = jax.jit(jax.shard_map(lambda x, k: sr(x, k)[None], mesh=mesh(),
                               in_specs=(P(), P()), out_specs=P("data")))
  replicated = whole(each(put(x[:64], P()), key))
  as_bits = lambda a: a.astype(np.float32).reshape(n, -1).tolist()
  return {"jit": as_bits(jitted), "shard_map": as_bits(in_shards),
          "replicated": as_bits(replicated)}


def microbatches():
  """Gradient accumulation over 2 microbatches, data parallel."""
  return data_parallel(steps=3, bad_step=None, microbatches=2)


CHECKS = {"data_parallel": data_parallel,
          "fsdp": lambda: data_parallel("fsdp"),
          "shard_map": shard_map_step, "fp8": fp8,
          "stochastic_rounding": stochastic_rounding,
          "microbatches": microbatches}
