#!/usr/bin/env python
# Standalone repro (found by examples/data_parallel.py): run with
#   python benchmarks/repro_xla_cpu_inflight_abort.py
# Pure JAX, no mpolicy. XLA:CPU (jaxlib 0.10.2), 8 simulated devices: a jitted
# step whose gradient is summed across the devices (an all-reduce), called in
# a loop without waiting, aborts the process once the host is 32 steps ahead:
#   rendezvous.cc: Termination timeout for `all reduce RendezvousKey{...}` of
#   40 seconds exceeded. ... Expected 8 threads to join the rendezvous, but
#   only 7 of them arrived on time.  (then "Fatal Python error: Aborted")
# Why (read from the threads of a stuck process with gdb): each device of a
# step is launched by a task on the client's thread pool, which has one
# thread per device, enough for one collective. The launch takes a slot of
# the device's in-flight semaphore (32 computations) and blocks while it
# holds a pool thread when the device has 32 queued. The oldest queued step
# then finds 7 free threads for its 8 participants, and its all-reduce waits
# for a thread that waits for that step: 7 of 8 arrive, XLA aborts after 40 s.
# Nothing in the step decides it (a select, a lax.cond, or no skip at all
# abort alike); what does is how far the host runs ahead. At most 31 steps
# in flight: no abort (3000 steps, jaxlib 0.10.2). jaxlib 0.12.0.1 finished
# 6000 steps with no bound, twice.
#
# The child processes run: unbounded (expected to abort on jaxlib 0.10.2,
# about a minute: XLA warns after 20 s and aborts after 40 more), then at
# most --in_flight steps ahead (waiting for the step that many back).
import argparse
import collections
import os
import subprocess
import sys
import time


def child(steps: int, in_flight: int) -> None:
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8")
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  mesh = Mesh(np.array(jax.devices()), ("data",))
  loss = lambda w, x: jnp.mean(jnp.tanh(x @ w) ** 2)
  step = jax.jit(lambda w, x: w - 0.1 * jax.grad(loss)(w, x))
  w = jax.device_put(jnp.ones((64, 64)) / 8, NamedSharding(mesh, P()))
  x = jax.device_put(jnp.ones((64, 64)), NamedSharding(mesh, P("data")))
  pending = collections.deque()
  start = time.perf_counter()
  for _ in range(steps):
    w = step(w, x)  # The batch split over 'data': the gradient is summed.
    pending.append(w)
    if in_flight and len(pending) > in_flight:
      pending.popleft().block_until_ready()
  w.block_until_ready()
  print(f"finished {steps} steps in {time.perf_counter() - start:.1f} s")


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--steps", type=int, default=3000)
  parser.add_argument("--in_flight", type=int, default=4,
                      help="the bounded run's steps ahead of the devices")
  parser.add_argument("--child_in_flight", type=int, default=None,
                      help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child_in_flight is not None:
    child(args.steps, args.child_in_flight)
    return
  import jax  # pylint: disable=g-import-not-at-top
  print(f"jax {jax.__version__}, 8 simulated CPU devices, {args.steps} steps")
  for in_flight in (0, args.in_flight):
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), f"--steps={args.steps}",
         f"--child_in_flight={in_flight}"],
        capture_output=True, text=True, timeout=600, check=False)
    arrived = [l for l in proc.stderr.splitlines() if "Termination" in l]
    what = ("aborted: " + arrived[0].split("exceeded. ")[-1] if arrived else
            proc.stdout.strip() or f"exit {proc.returncode}")
    label = "no bound" if not in_flight else f"at most {in_flight} ahead"
    print(f"{label}: exit {proc.returncode}; {what}")


if __name__ == "__main__":
  main()
