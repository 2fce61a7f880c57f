"""The 8-device `jax.jit` training step, run as a file (a `ci` test's script).

`python tests/_eight_device_steps.py [--steps=N] [--in_flight=K]` trains a
small MLP with `mpolicy.make_train_step` (float16 compute, dynamic loss
scale, adam), jitted over 8 simulated CPU devices with the batch split over
a 'data' mesh axis, as `examples/data_parallel.py` does, keeping at most K
steps dispatched ahead of the devices (the example's bound; 0: none). One
step in the middle gets a NaN batch. Prints one JSON object: steps run,
steps skipped, whether the NaN step left params and optimizer state bit for
bit, the last loss. jaxlib 0.10's CPU client can abort such a loop when the
host runs 32 steps ahead (see benchmarks/repro_xla_cpu_inflight_abort.py).
"""

import argparse
import collections
import json
import os
import sys

# pylint: disable=g-import-not-at-top,wrong-import-position
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import mpolicy


def loss(params, x, y):
  h = jax.nn.relu(x @ params["w1"] + params["b1"])
  return jnp.mean((h @ params["w2"] - y) ** 2)


def bits(tree):
  return [np.asarray(a).tobytes() for a in jax.tree.leaves(tree)]


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--steps", type=int, default=120)
  parser.add_argument("--in_flight", type=int, default=4)
  args = parser.parse_args()
  assert jax.device_count() == 8, jax.devices()
  mesh = Mesh(np.array(jax.devices()), ("data",))
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
  params = {"w1": jax.random.normal(k1, (16, 32)) / 4, "b1": jnp.zeros(32),
            "w2": jax.random.normal(k2, (32, 4)) / 4}
  tx = optax.adam(1e-2)
  step = jax.jit(mpolicy.make_train_step(
      mpolicy.amp(loss, "p=f32,c=f16,o=f32"), tx))
  params = jax.device_put(params, NamedSharding(mesh, P()))
  opt_state, scale = tx.init(params), mpolicy.DynamicLossScale(2.0 ** 15)
  split = NamedSharding(mesh, P("data"))
  x = jax.device_put(jax.random.normal(k3, (64, 16)), split)
  y = jax.device_put(jnp.ones((64, 4)), split)
  bad = args.steps // 2
  pending, skipped, before = collections.deque(), [], None
  for i in range(args.steps):
    batch = x * jnp.nan if i == bad else x
    if i == bad:
      before = (params, opt_state)
    out = step(params, opt_state, scale, batch, y)
    if i == bad:
      after = (out.params, out.opt_state)
    params, opt_state, scale = out.params, out.opt_state, out.loss_scale
    skipped.append(out.grads_finite)
    pending.append(out.value)
    if args.in_flight and len(pending) > args.in_flight:
      pending.popleft().block_until_ready()
  print(json.dumps({
      "steps": len(skipped),
      "skipped": [i for i, f in enumerate(skipped) if not bool(f)],
      "bad_step": bad,
      "kept_bit_for_bit": bits(before) == bits(after),
      "last_loss": float(out.value),
  }))


if __name__ == "__main__":
  # Before JAX makes its CPU client (on first use, in main), not at import:
  # pytest's doctest collection imports this file into its own process.
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8")
  main()
