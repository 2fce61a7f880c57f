"""Checkpoint checks run inside the processes `test_multiprocess.py` launches.

The state is what a training loop holds: params split by rows over every
device (FSDP) or replicated, Adam's state, a loss scale, a PRNG key, a step
number and a numpy value. A run saves it; runs with another number of
processes or devices restore it. Each check returns JSON facts: digests of
the whole values, shardings, and the type and message of each error.
"""

from __future__ import annotations

import os
import shutil

import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

import mpolicy
from _helpers import damage_arrays
from _mp_training import digest, init_params, mesh, place, put, whole, data
from _mp_training import loss_fn, POLICY

TX = optax.adam(1e-2)
STEP = jax.jit(mpolicy.make_train_step(mpolicy.amp(loss_fn, POLICY), TX))


def fresh(layout="fsdp"):
  """A new state on this run's devices. The loss scale, key, step and
  numpy value are made as a training script makes them: with `jnp` and
  numpy, outside `jit`, so each process holds its own copy."""
  params = place(init_params(), layout)
  return {"params": params, "opt_state": TX.init(params),
          "loss_scale": mpolicy.DynamicLossScale(jnp.float32(2. ** 15),
                                                 period=3),
          "key": jax.random.key(4), "step": 0,
          "seen": np.zeros(3, np.int64)}


def train(state, steps):
  x, y = data()
  for _ in range(steps):
    out = STEP(state["params"], state["opt_state"], state["loss_scale"],
               put(x, P("data")), put(y, P("data")))
    state = dict(state, params=out.params, opt_state=out.opt_state,
                 loss_scale=out.loss_scale, step=state["step"] + 1,
                 key=jax.random.split(state["key"])[0],
                 seen=state["seen"] + 1)
  return state


def abstract(layout="fsdp"):
  """`jax.eval_shape` of `fresh`, params placed by `layout` (None: no
  shardings anywhere)."""
  shapes = jax.eval_shape(lambda: fresh("replicated"))
  if layout is None:
    return shapes
  placed = place(init_params(), layout)
  return dict(shapes, params={
      k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=placed[k].sharding)
      for k, v in shapes["params"].items()})


def specs(tree):
  spec = lambda s: str(tuple(s.spec)) if hasattr(s, "spec") else "single"
  return {jax.tree_util.keystr(p): spec(v.sharding)
          for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]
          if isinstance(v, jax.Array)}


def outcome(fn):
  """`[error type, message]` of `fn()`, or `["ok", repr of the result]`."""
  try:
    result = fn()
  except Exception as e:  # pylint: disable=broad-except
    return [type(e).__name__, str(e)]
  return ["ok", repr(result)[:100]]


def summary(state):
  return {"digest": digest(state), "specs": specs(state),
          "w1": whole(state["params"]["w1"]).tolist(),
          "step": [type(state["step"]).__name__, state["step"]],
          "seen": [type(state["seen"]).__name__, str(state["seen"].dtype),
                   state["seen"].tolist()]}


def save_reference(path):
  """The one-process run: two steps, saved."""
  state = train(fresh(), 2)
  mpolicy.save_checkpoint(path, state)
  return summary(state)


def sync(name):
  multihost_utils.sync_global_devices(name)


def across_processes(reference_path, path):
  """The run of several processes: restore, save, resume, and the errors."""
  facts = {}
  # From the one-process run: FSDP over this run's devices, and abstract.
  restored = mpolicy.restore_checkpoint(reference_path, fresh())
  facts["from_one"] = summary(restored)
  facts["from_one_abstract"] = summary(mpolicy.restore_checkpoint(
      reference_path, abstract(None)))
  # Saved here, after two steps, and restored into a fresh state.
  state = train(fresh(), 2)
  mpolicy.save_checkpoint(path, state)
  facts["saved"] = summary(state)
  facts["files"] = sorted(os.listdir(os.path.dirname(path)))
  back = mpolicy.restore_checkpoint(path, fresh())
  facts["restored"] = summary(back)
  facts["restored_committed"] = {
      "loss_scale": back["loss_scale"].loss_scale.committed,
      "key": back["key"].committed}
  facts["resumed"] = digest(train(back, 2)) == digest(train(state, 2))
  facts["replicated"] = summary(mpolicy.restore_checkpoint(
      path, abstract("replicated")))
  manager = mpolicy.CheckpointManager(path + "_steps", max_to_keep=2)
  for step in (1, 2, 3):
    manager.save(step, dict(state, step=step))
  facts["manager"] = {"steps": manager.all_steps(),
                      "latest": manager.restore(fresh())["step"]}
  facts["errors"] = errors(path, state)
  facts["after_errors"] = summary(mpolicy.restore_checkpoint(path, fresh()))
  return facts


def errors(path, state):
  """Each error, on every process; the calls after them still agree."""
  me = jax.process_index()
  out = {}
  out["exists"] = outcome(lambda: mpolicy.save_checkpoint(path, state))
  out["differs"] = outcome(lambda: mpolicy.save_checkpoint(
      path + "_differs", dict(state, seen=np.full(3, me))))
  out["other_path"] = outcome(lambda: mpolicy.save_checkpoint(
      f"{path}_p{me}", state))
  out["tree_on_one"] = outcome(lambda: mpolicy.save_checkpoint(
      path + "_tree", dict(state, extra=1.) if me == 1 else state))
  out["path_on_one"] = outcome(lambda: mpolicy.save_checkpoint(
      None if me == 1 else path + "_none", state))
  out["template_on_one"] = outcome(lambda: mpolicy.restore_checkpoint(
      path, dict(fresh(), step=jnp.zeros(3)) if me == 1 else fresh()))
  out["template_none"] = outcome(lambda: mpolicy.restore_checkpoint(path,
                                                                    None))
  damaged = path + "_damaged"
  if me == 0:
    shutil.copytree(path, damaged)
    damage_arrays(damaged)
  sync("damaged")
  out["damaged"] = outcome(lambda: mpolicy.restore_checkpoint(damaged,
                                                              fresh()))
  out["left_behind"] = sorted(n for n in os.listdir(os.path.dirname(path))
                              if "mpolicy-tmp" in n)
  return out


def fewer_devices(path, layout):
  """A run with fewer processes or devices restores the checkpoint."""
  return {"fsdp": summary(mpolicy.restore_checkpoint(path, fresh(layout))),
          "abstract": summary(mpolicy.restore_checkpoint(path,
                                                         abstract(None)))}
