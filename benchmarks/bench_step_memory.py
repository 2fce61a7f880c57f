"""A training step's XLA temp memory, with donation and gradient accumulation.

For the GPT of the GPU preset (training_gpu.py, at `--gpt_scale`) and the
12.6M-parameter `hk.nets.MLP` (1024 -> 2048 x 3 -> 1024, batch 64), with
Adam, float32 and bf16 compute ("p=f32,c=bf16,o=f32", float32 params),
prints `compiled.memory_analysis().temp_size_in_bytes` of the jitted step
(what the step needs beyond its arguments and results) in bytes per
parameter, with the params and optimizer state donated
(`jax.jit(step, donate_argnums=(0, 1))`) and, at k = 1, without (then
plus the results, which need buffers of their own).

Steps, all under `mpolicy.transform_amp` (one forward for all) and a
`DynamicLossScale`:

  make_train_step        `mpolicy.make_train_step(loss, adam, microbatches=k)`.
  jmp (select_tree)      k = 1: the step of jmp's README, hand-written: scale,
                         grad, unscale, `all_finite`, update, then
                         `select_tree(finite, new, old)` over params and state.
  hand-written, no skip  k = 1: grad, update, apply; no loss scale, no skip
                         (the floor: the update of a layer can start before
                         the other layers' gradients exist).
  hand-written accum.    k > 1: a `lax.scan` over strided microbatches
                         adding unscaled gradients into float32, the mean,
                         `all_finite`, update, `select_tree`.

  python benchmarks/bench_step_memory.py                  # a few minutes
  python benchmarks/bench_step_memory.py --gpt_scale=8 --models=gpt
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable

import haiku as hk
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import optax

import mpolicy

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
import bench_optimizer_memory  # pylint: disable=g-import-not-at-top,wrong-import-position
import training_cpu  # pylint: disable=g-import-not-at-top,wrong-import-position

POLICIES = {"float32": "full", "bf16 compute": "p=f32,c=bf16,o=f32"}
KS = (1, 2, 4, 8)


def mlp_model(width: int = 2048, batch: int = 64) -> bench_optimizer_memory.Model:
  x = jnp.zeros((batch, width // 2))

  def loss(x):
    out = hk.nets.MLP([width] * 3 + [width // 2])(x)
    return jnp.mean((out.astype(jnp.float32) - 1.) ** 2)

  return bench_optimizer_memory.Model(
      "MLP", f"hk.nets.MLP {width // 2} -> {width} x 3 -> {width // 2}, "
      f"batch {batch}", loss, x)


# --- The hand-written steps -----------------------------------------------------


def jmp_step(loss, tx):
  """jmp's README step: select_tree over the new and old params and state."""

  def step(params, opt_state, ls, batch):
    grads = jax.grad(lambda p: ls.scale(loss(p, batch)))(params)
    return select_update(tx, ls.unscale(grads), params, opt_state, ls)

  return step


def select_update(tx, grads, params, opt_state, ls):
  """jmp's skip: the update, then `select_tree` of new and old."""
  finite = mpolicy.all_finite(grads)
  updates, new_state = tx.update(grads, opt_state, params)
  new_params = optax.apply_updates(params, updates)
  params, opt_state = mpolicy.select_tree(
      finite, (new_params, new_state), (params, opt_state))
  return params, opt_state, ls.adjust(finite)


def plain_step(loss, tx):
  """No loss scale, no skip."""

  def step(params, opt_state, ls, batch):
    grads = jax.grad(loss)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, ls

  return step


def accumulating_step(loss, tx, k):
  """A scan over strided microbatches, float32 sums, then jmp's skip."""

  def step(params, opt_state, ls, batch):
    micro = jnp.swapaxes(batch.reshape((-1, k) + batch.shape[1:]), 0, 1)

    def body(acc, mb):
      grads = jax.grad(lambda p: ls.scale(loss(p, mb)))(params)
      grads = ls.unscale(jax.tree_util.tree_map(
          lambda g: g.astype(jnp.float32), grads))
      return jax.tree_util.tree_map(jnp.add, acc, grads), None

    zeros = jax.tree_util.tree_map(
        lambda p: jnp.zeros(p.shape, jnp.float32), params)
    acc, _ = lax.scan(body, zeros, micro)
    grads = jax.tree_util.tree_map(lambda a, p: (a / k).astype(p.dtype), acc,
                                   params)
    return select_update(tx, grads, params, opt_state, ls)

  return step


# --- Measuring ---------------------------------------------------------------------


def temp_per_param(step: Callable[..., Any], args: tuple, count: int,
                   donate: bool) -> float:
  """XLA temp per parameter; without donation, plus the results (they
  cannot be written into the arguments' buffers)."""
  compiled = jax.jit(step, donate_argnums=(0, 1) if donate else ()).lower(
      *args).compile()
  stats = compiled.memory_analysis()
  fresh = stats.output_size_in_bytes - stats.alias_size_in_bytes
  return (stats.temp_size_in_bytes + (0 if donate else fresh)) / count


def measure(model: bench_optimizer_memory.Model, policy: str,
            ks=KS) -> dict[str, dict[int, float]]:
  """`{row: {k: temp bytes per parameter}}` for one model and policy, at
  the `ks` that divide its batch."""
  ks = [k for k in ks if model.batch.shape[0] % k == 0]
  with mpolicy.push_policy(hk.Module, policy):
    transformed = mpolicy.transform_amp(model.loss)
    params = jax.eval_shape(transformed.init, jax.random.PRNGKey(0),
                            model.batch)
    loss = lambda p, batch: transformed.apply(p, None, batch)
    tx = optax.adam(bench_optimizer_memory.LEARNING_RATE)
    args = (params, jax.eval_shape(tx.init, params),
            mpolicy.DynamicLossScale(jnp.float32(2. ** 15)), model.batch)
    count = sum(int(np.prod(p.shape))
                for p in jax.tree_util.tree_leaves(params))
    rows: dict[str, dict[int, float]] = {}

    def add(row, k, step, donate=True):
      rows.setdefault(row, {})[k] = temp_per_param(step, args, count, donate)

    for k in ks:
      add("make_train_step", k,
          mpolicy.make_train_step(loss, tx, microbatches=k))
      if k == 1:
        add("make_train_step, not donated (+ new results)", k,
            mpolicy.make_train_step(loss, tx), donate=False)
        add("jmp (select_tree)", k, jmp_step(loss, tx))
        add("hand-written, no skip", k, plain_step(loss, tx))
      else:
        add("hand-written accum.", k, accumulating_step(loss, tx, k))
  rows["parameters"] = {1: count}
  return rows


def table(rows: dict[str, dict[int, float]], ks=KS) -> str:
  lines = ["| step | " + " | ".join(f"k={k}" for k in ks) + " |",
           "|---|" + "---|" * len(ks)]
  for row, by_k in rows.items():
    if row == "parameters":
      continue
    lines.append(f"| {row} | " + " | ".join(
        f"{by_k[k]:.2f}" if k in by_k else "" for k in ks) + " |")
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--gpt_scale", type=int, default=1,
                      help="divides the GPU preset GPT's sizes (1: real size)")
  parser.add_argument("--models", default="mlp,gpt",
                      help="comma-separated: mlp, gpt")
  parser.add_argument("--policies", default="float32,bf16 compute",
                      help="comma-separated: " + ", ".join(POLICIES))
  parser.add_argument("--ks", default=",".join(map(str, KS)),
                      help="microbatch counts (those dividing the batch run)")
  args = parser.parse_args(argv)
  ks = tuple(int(k) for k in args.ks.split(","))
  print(training_cpu.machine_header())
  print("XLA temp of the jitted step, bytes per parameter; params and Adam "
        "state donated unless said.")
  models = {"mlp": mlp_model,
            "gpt": lambda: bench_optimizer_memory.gpt_model(args.gpt_scale)}
  for name in args.models.split(","):
    model = models[name]()
    for policy in args.policies.split(","):
      rows = measure(model, POLICIES[policy], ks)
      print(f"\n{model.name}, {policy}: {model.description} "
            f"({rows['parameters'][1]:,} parameters)")
      print(table(rows, ks), flush=True)


if __name__ == "__main__":
  main()
