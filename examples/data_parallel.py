"""Data-parallel mixed-precision training on N devices, against one device.

An MLP with BatchNorm on scikit-learn's digits (no download), trained with
`mpolicy.make_train_step` (dynamic loss scale, skipped non-finite steps):

* default: `jax.jit` with `NamedSharding`, the batch split over a 'data'
  mesh axis, parameters replicated; GSPMD inserts the gradient sums.
* `--fsdp`: the same, with each weight matrix sharded over 'data' (FSDP).
* `--shard_map`: the step inside `jax.shard_map` with
  `make_train_step(axis_name='data', has_state=True)`: gradients averaged
  over 'data', the finiteness flag agreed, BatchNorm's running statistics
  averaged (BatchNorm normalises with each device's own batch statistics,
  as under `pmap`).
* `--microbatches=k` (any mode): each batch runs as k strided microbatches
  with float32 gradient sums and one update (`make_train_step(...,
  microbatches=k)`); the one-device run uses the same k.

On CPU the devices are simulated (8 unless `XLA_FLAGS` already sets
`--xla_force_host_platform_device_count`). Run it as a file from any
directory: `python examples/data_parallel.py --steps=50`.

Many processes, one mesh: `--num_processes=2` starts the script twice on
this machine (4 simulated devices each, joined by `jax.distributed` over
localhost, CPU collectives through gloo); the mesh spans the 8 devices of
both, and each process feeds only its own rows of every batch
(`jax.make_array_from_process_local_data`). On a cluster, start one copy
per host with `--cluster` instead: `jax.distributed.initialize()` then
reads the cluster's environment (SLURM, Open MPI, Kubernetes, Cloud TPU).
"""

from __future__ import annotations

import collections
import os
import socket
import subprocess
import sys
import time
import traceback

_COUNT = "--xla_force_host_platform_device_count"
_ASKED = _COUNT[2:] in os.environ.get("XLA_FLAGS", "")  # Devices named.
if not _ASKED:
  os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" {_COUNT}=8"

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

# Sibling modules in examples/ (the script's directory is on sys.path).
import digits_data
import mp_flags

import mpolicy

FLAGS = flags.FLAGS
flags.adopt_module_key_flags(mp_flags)
flags.DEFINE_bool("fsdp", False, "Shard the weight matrices over 'data'.")
flags.DEFINE_bool("shard_map", False, "Run the step inside jax.shard_map.")
flags.DEFINE_integer(
    "num_processes", 1, "Run as this many JAX processes on this machine, "
    "joined over localhost, each feeding its own rows of every batch.",
    lower_bound=1)
flags.DEFINE_bool("cluster", False, "Join a cluster's other processes: "
                  "jax.distributed.initialize() reads its environment.")
flags.DEFINE_integer("process_id", None, "Set by --num_processes for the "
                     "processes it starts.")
flags.DEFINE_string("coordinator_address", None, "Set by --num_processes "
                    "for the processes it starts.")
flags.DEFINE_integer(
    "microbatches", 1, "Accumulate gradients over this many microbatches "
    "per batch (1: none); divides each device's share of --batch_size.")
flags.register_validator("microbatches", lambda k: k >= 1,
                         message="--microbatches must be at least 1.")

HIDDEN = 64
# Steps dispatched ahead of the devices at most. jaxlib 0.10's CPU client
# aborts a multi-device step with collectives once a device has 32
# computations queued (a launch waits for a slot while holding one of the
# threads the all-reduce needs: "only 7 of them arrived", about 1 run in 8
# of 50 steps); a few steps ahead keep the host and the devices overlapped.
IN_FLIGHT = 4


def init(key):
  k1, k2 = jax.random.split(key)
  params = {"w1": jax.random.normal(k1, (64, HIDDEN)) / 8,
            "b1": jnp.zeros(HIDDEN), "scale": jnp.ones(HIDDEN),
            "w2": jax.random.normal(k2, (HIDDEN, 10)) / 8, "b2": jnp.zeros(10)}
  state = {"mean": jnp.zeros(HIDDEN), "var": jnp.ones(HIDDEN)}
  return params, state


def forward(params, state, x, y):
  """Cross-entropy and the new BatchNorm running statistics."""
  h = x @ params["w1"] + params["b1"]
  mean, var = h.mean(0), h.var(0)
  h = (h - mean) * jax.lax.rsqrt(var + 1e-5) * params["scale"]
  logits = jax.nn.relu(h) @ params["w2"] + params["b2"]
  loss = -jnp.mean(jnp.take_along_axis(
      jax.nn.log_softmax(logits), y[:, None], axis=1))
  new_state = {"mean": 0.9 * state["mean"] + 0.1 * mean,
               "var": 0.9 * state["var"] + 0.1 * var}
  return loss, new_state


def train(mesh, data, mode):
  """Final loss and params; ``mode``: 'one', 'jit', 'fsdp' or 'shard_map'."""
  loss_fn = mpolicy.amp(forward, FLAGS.mp_policy)
  tx = optax.adam(FLAGS.learning_rate)
  params, state = init(jax.random.PRNGKey(FLAGS.seed))
  opt_state, loss_scale = tx.init(params), mp_flags.loss_scale()
  idx = digits_data.batches(len(data.x_train), FLAGS.batch_size, FLAGS.steps,
                            FLAGS.seed)
  x_all = data.x_train.reshape(len(data.x_train), -1)
  if mode == "shard_map":
    step = make_shard_map_step(mesh, loss_fn, tx, params, opt_state,
                               loss_scale)
  else:
    step = jax.jit(mpolicy.make_train_step(
        loss_fn, tx, has_state=True, microbatches=FLAGS.microbatches))
  if mode in ("jit", "fsdp", "shard_map"):
    put = lambda tree, spec: jax.device_put(tree, NamedSharding(mesh, spec))
    if mode == "fsdp":
      shard = lambda p: put(p, P("data") if p.ndim == 2 else P())
      params = jax.tree.map(shard, params)
      opt_state = tx.init(params)
    else:
      params = put(params, P())
  loss, in_flight = None, collections.deque()
  for batch in idx:
    x, y = x_all[batch], data.y_train[batch]
    if mode == "one":
      x, y = jnp.asarray(x), jnp.asarray(y)
    else:
      x, y = feed(mesh, x), feed(mesh, y)
    out = step(params, state, opt_state, loss_scale, x, y)
    params, state, opt_state = out.params, out.model_state, out.opt_state
    loss_scale, loss = out.loss_scale, out.value
    in_flight.append(loss)
    if len(in_flight) > IN_FLIGHT:  # Wait for the step IN_FLIGHT back.
      in_flight.popleft().block_until_ready()
  return float(loss), params


def feed(mesh, rows):
  """This process's share of a batch, as one array split over 'data'.

  Every process knows the whole batch here; a data loader on a cluster
  reads only the rows of its process (`jax.devices()` lists each
  process's devices together, so process p holds the p-th share).
  """
  share = len(rows) // jax.process_count()
  mine = rows[jax.process_index() * share:(jax.process_index() + 1) * share]
  return jax.make_array_from_process_local_data(
      NamedSharding(mesh, P("data")), mine, rows.shape)


def make_shard_map_step(mesh, loss_fn, tx, params, opt_state, loss_scale):
  step = mpolicy.make_train_step(loss_fn, tx, has_state=True,
                                 axis_name="data",
                                 microbatches=FLAGS.microbatches)
  rep = lambda tree: jax.tree.map(lambda _: P(), tree)

  def body(params, state, opt_state, loss_scale, x, y):
    return step(params, state, opt_state, loss_scale, x, y)

  out_specs = mpolicy.TrainStepResult(
      rep(params), rep(opt_state), rep(loss_scale), P(), P(), P())
  return jax.jit(jax.shard_map(
      body, mesh=mesh,
      in_specs=(rep(params), P(), rep(opt_state), rep(loss_scale), P("data"),
                P("data")),
      out_specs=out_specs))


def launch_processes(n: int) -> None:
  """Runs this script in `n` processes joined over localhost; waits."""
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  env = dict(os.environ)
  if not _ASKED:  # 8 devices in all; XLA_FLAGS's count is per process.
    env["XLA_FLAGS"] = env["XLA_FLAGS"].replace(f"{_COUNT}=8",
                                                f"{_COUNT}={8 // n}")
  procs = [subprocess.Popen(
      [sys.executable, os.path.abspath(__file__), *sys.argv[1:],
       f"--process_id={i}", f"--coordinator_address=localhost:{port}"],
      env=env) for i in range(n)]
  while any(p.poll() is None for p in procs):
    if any(p.returncode for p in procs):  # One failed: stop the others.
      for p in procs:
        if p.poll() is None:
          p.kill()
    time.sleep(0.05)
  codes = [p.returncode for p in procs]
  if any(codes):
    sys.exit(f"data_parallel: the processes exited with {codes}")


def exit_at_once(*error) -> None:
  """An error ends this process now: jax.distributed's exit handler would
  wait for the other processes, which may be waiting for this one."""
  traceback.print_exception(*error)
  sys.stderr.flush()
  os._exit(1)  # pylint: disable=protected-access


def join() -> None:
  """Joins the other processes, if any (before JAX's first computation)."""
  if FLAGS.process_id is not None:  # Started by --num_processes.
    sys.excepthook = exit_at_once
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(FLAGS.coordinator_address, FLAGS.num_processes,
                               FLAGS.process_id)
  elif FLAGS.cluster:
    jax.distributed.initialize()


def whole(x) -> np.ndarray:
  """The whole value of an array, also one split across processes."""
  if not x.is_fully_addressable:
    x = multihost_utils.process_allgather(x, tiled=True)
  return np.asarray(x)


def main() -> None:
  if FLAGS.num_processes > 1 and FLAGS.process_id is None:
    launch_processes(FLAGS.num_processes)
    return
  join()
  data = digits_data.load_digits()
  n = jax.device_count()
  mesh = Mesh(np.array(jax.devices()), ("data",))
  mode = "shard_map" if FLAGS.shard_map else "fsdp" if FLAGS.fsdp else "jit"
  if FLAGS.batch_size % (n * FLAGS.microbatches):
    raise app.UsageError(
        f"--microbatches={FLAGS.microbatches} must divide each device's "
        f"share of --batch_size={FLAGS.batch_size} over {n} devices: use a "
        f"batch size that is a multiple of {n * FLAGS.microbatches}.")
  one_loss, one_params = train(None, data, "one")  # Each process alone.
  loss, params = train(mesh, data, mode)
  diff = max(float(np.max(np.abs(whole(a) - whole(b)))) for a, b in zip(
      jax.tree.leaves(params), jax.tree.leaves(one_params)))
  where = (f" in {jax.process_count()} processes"
           if jax.process_count() > 1 else "")
  if jax.process_index() == 0:
    print(f"{mode} on {n} devices{where}: final loss {loss:.4f}; one "
          f"device: {one_loss:.4f}; max |param difference| {diff:.2e}")


if __name__ == "__main__":
  mp_flags.run(main, steps=200, batch_size=64, learning_rate=3e-3)
