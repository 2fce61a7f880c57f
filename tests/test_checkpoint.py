"""Specification of orbax checkpoints: dtypes, validation, faults, resume."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpolicy
from mpolicy._src import checkpoint
from mpolicy._src.checkpoint import digests
from mpolicy._src.checkpoint import leaves as checkpoint_leaves
from mpolicy._src import loss_scale as ls_lib

from _helpers import poison
from _helpers import same_bits


def _key_bits(tree):
  """`tree` with typed PRNG keys as their raw data, for `same_bits`."""
  return jax.tree_util.tree_map(
      lambda x: jax.random.key_data(x) if checkpoint_leaves.is_key(x) else x, tree)


def _every_kind():
  special = [0.1, -0.0, np.inf, -np.inf, np.nan, 1e-8]
  return {
      "bf16": jnp.asarray(special, jnp.bfloat16),
      "f16": jnp.asarray(special, jnp.float16),
      "f32": jnp.asarray(special, jnp.float32),
      "e4m3": jnp.asarray([0.5, -2., 448., np.nan], jnp.float8_e4m3fn),
      "e5m2": jnp.asarray([0.5, -2., 57344., np.inf], jnp.float8_e5m2),
      "i32": jnp.arange(3, dtype=jnp.int32),
      "flag": jnp.array(True),
      "key": jax.random.key(7),
      "rbg_key": jax.random.key(7, impl="rbg"),
      "np": np.arange(2.0),
      "step": 5,
  }


def test_round_trip_is_bitwise_for_every_dtype(tmp_path):
  tree = _every_kind()
  checkpoint.save_checkpoint(tmp_path / "ckpt", tree)
  restored = checkpoint.restore_checkpoint(tmp_path / "ckpt", tree)
  assert same_bits(_key_bits(restored), _key_bits(tree))
  assert restored["key"].dtype == tree["key"].dtype
  assert restored["rbg_key"].dtype == tree["rbg_key"].dtype
  assert isinstance(restored["np"], np.ndarray)
  assert isinstance(restored["bf16"], jax.Array)
  assert type(restored["step"]) is int and restored["step"] == 5


def test_an_empty_array_is_named_before_anything_is_written(tmp_path):
  # orbax stores no zero-size arrays; the leaf is named up front, on every
  # process, instead of orbax failing in the middle of the write.
  for empty in (jnp.zeros((0, 3), jnp.bfloat16), np.zeros((2, 0), np.int32)):
    with pytest.raises(ValueError, match=r"save_checkpoint: leaf \['e'\] "
                       r"has no elements \(shape \(\d, \d\)\), and orbax "
                       "stores no zero-size arrays"):
      checkpoint.save_checkpoint(tmp_path / "ckpt", {"w": jnp.ones(2),
                                                     "e": empty})
  assert os.listdir(tmp_path) == []


def test_restore_into_an_eval_shape_template(tmp_path):
  tx = mpolicy.skip_nonfinite(optax.adam(1e-3))
  init = lambda: (tx.init({"w": jnp.ones(3, jnp.float8_e5m2)}),
                  ls_lib.DynamicLossScale(2. ** 15, period=7),
                  jax.random.key(1))
  state = init()
  checkpoint.save_checkpoint(tmp_path / "ckpt", state)
  restored = checkpoint.restore_checkpoint(tmp_path / "ckpt",
                                           jax.eval_shape(init))
  assert same_bits(_key_bits(restored), _key_bits(state))
  assert restored[1].period == 7
  assert all(isinstance(x, jax.Array)
             for x in jax.tree_util.tree_leaves(restored))


def test_the_checkpoint_is_an_orbax_directory_keyed_by_keystr(tmp_path):
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  tree = ({"linear": {"w": jnp.full(2, 1.5, jnp.bfloat16)}}, jnp.ones(3))
  checkpoint.save_checkpoint(tmp_path / "ckpt", tree)
  state = ocp.StandardCheckpointer().restore(tmp_path / "ckpt" / "state")
  assert sorted(state) == ["[0]['linear']['w']", "[1]"]
  assert state["[0]['linear']['w']"].dtype == jnp.bfloat16
  assert np.asarray(state["[0]['linear']['w']"]).tolist() == [1.5, 1.5]


def test_restore_lists_every_mismatch(tmp_path):
  checkpoint.save_checkpoint(tmp_path / "ckpt", {
      "a": jnp.ones(2), "b": jnp.ones(2), "c": jnp.ones(2, jnp.bfloat16)})
  template = {"a": jnp.ones(3), "c": jnp.ones(2), "d": jnp.ones(1)}
  with pytest.raises(ValueError) as e:
    checkpoint.restore_checkpoint(tmp_path / "ckpt", template)
  msg = str(e.value)
  assert "missing from the checkpoint: ['d']" in msg
  assert "in the checkpoint but not in the template: ['b']" in msg
  assert "['a']: checkpoint has float32[2], template wants float32[3]" in msg
  assert "['c']: checkpoint has bfloat16[2], template wants float32[2]" in msg


def test_loss_scale_settings_are_saved_and_a_differing_template_is_refused(
    tmp_path):
  saved = {"ls": ls_lib.DynamicLossScale(2. ** 10, period=10, factor=4,
                                         min_loss_scale=2.),
           "static": ls_lib.StaticLossScale(128.)}
  checkpoint.save_checkpoint(tmp_path / "ckpt", saved)
  template = {"ls": ls_lib.DynamicLossScale(2. ** 15),
              "static": ls_lib.StaticLossScale(256.)}
  with pytest.raises(ValueError) as e:
    checkpoint.restore_checkpoint(tmp_path / "ckpt", template)
  msg = str(e.value)
  assert ("['ls']: the checkpoint's DynamicLossScale has period=10, the "
          "template's DynamicLossScale has period=2000") in msg
  assert "has factor=4, the template's DynamicLossScale has factor=2" in msg
  assert "min_loss_scale=2.0" in msg and "min_loss_scale=1.0" in msg
  assert "has loss_scale=128.0" in msg and "loss_scale=256.0" in msg
  same = {"ls": ls_lib.DynamicLossScale(2., period=10, factor=4,
                                        min_loss_scale=2.),
          "static": ls_lib.StaticLossScale(128.)}
  restored = checkpoint.restore_checkpoint(tmp_path / "ckpt", same)
  assert float(restored["ls"].loss_scale) == 2. ** 10
  assert (restored["ls"].period, restored["ls"].factor,
          restored["ls"].min_loss_scale) == (10, 4, 2.)


def test_weak_scalars_come_back_weak(tmp_path):
  tree = {"lr": jnp.asarray(1e-3), "ls": jnp.float32(2.)}
  checkpoint.save_checkpoint(tmp_path / "ckpt", tree)
  restored = checkpoint.restore_checkpoint(tmp_path / "ckpt", tree)
  assert restored["lr"].weak_type and not restored["ls"].weak_type


def test_an_existing_checkpoint_is_replaced_only_when_asked(tmp_path):
  path = tmp_path / "ckpt"
  checkpoint.save_checkpoint(path, {"w": jnp.ones(2)})
  with pytest.raises(FileExistsError, match="overwrite=True"):
    checkpoint.save_checkpoint(path, {"w": jnp.zeros(2)})
  checkpoint.save_checkpoint(path, {"w": jnp.full(2, 3.)}, overwrite=True)
  assert checkpoint.restore_checkpoint(
      path, {"w": jnp.ones(2)})["w"].tolist() == [3., 3.]
  assert os.listdir(tmp_path) == ["ckpt"]


def test_racing_saves_to_one_path_leave_one_whole_checkpoint(tmp_path):
  trees = [{"w": jnp.full((64,), i, jnp.bfloat16), "i": jnp.int32(i)}
           for i in range(4)]
  for round_ in range(3):
    path = tmp_path / f"ckpt{round_}"
    barrier = threading.Barrier(len(trees))
    outcomes = [None] * len(trees)

    def save(i, path=path, barrier=barrier, outcomes=outcomes):
      barrier.wait()
      try:
        checkpoint.save_checkpoint(path, trees[i])
        outcomes[i] = "saved"
      except FileExistsError:
        outcomes[i] = "refused"

    threads = [threading.Thread(target=save, args=(i,)) for i in range(4)]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    assert outcomes.count("saved") == 1, outcomes
    assert outcomes.count("refused") == 3, outcomes
    restored = checkpoint.restore_checkpoint(path, trees[0])
    assert same_bits(restored, trees[outcomes.index("saved")])
  assert sorted(os.listdir(tmp_path)) == ["ckpt0", "ckpt1", "ckpt2"]


_RACER = r"""
import glob, sys, time
import jax.numpy as jnp
from mpolicy._src import checkpoint
from mpolicy._src.checkpoint import leaves as checkpoint_leaves
i, path, n = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
tree = {"w": jnp.full((4096,), i, jnp.bfloat16), "i": jnp.int32(i)}
open(f"{path}.ready{i}", "w").close()
while len(glob.glob(path + ".ready*")) < n:  # Start together.
  time.sleep(0.001)
try:
  checkpoint.save_checkpoint(path, tree)
  print("saved")
except FileExistsError:
  print("refused")
"""


@pytest.mark.ci  # 5-7 s (subprocesses or a sharded mesh): once, in CI's newest job; the other tests here check the same save/restore paths on both ends.
def test_racing_processes_leave_one_whole_checkpoint(tmp_path):
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=repo, JAX_PLATFORMS="cpu")
  path = str(tmp_path / "ckpt")
  procs = [subprocess.Popen([sys.executable, "-c", _RACER, str(i), path, "3"],
                            env=env, cwd=repo,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True) for i in range(3)]
  outcomes = [p.communicate(timeout=120)[0].strip() for p in procs]
  assert sorted(outcomes) == ["refused", "refused", "saved"], outcomes
  winner = outcomes.index("saved")
  template = {"w": jnp.zeros((4096,), jnp.bfloat16), "i": jnp.int32(0)}
  restored = checkpoint.restore_checkpoint(path, template)
  assert int(restored["i"]) == winner
  assert np.all(np.asarray(restored["w"], np.float32) == winner)
  assert sorted(os.listdir(tmp_path)) == [
      "ckpt", "ckpt.ready0", "ckpt.ready1", "ckpt.ready2"]


def test_a_failed_save_leaves_nothing_behind(tmp_path, monkeypatch):
  with pytest.raises(TypeError, match=r"leaf \['bad'\] is of type object"):
    checkpoint.save_checkpoint(tmp_path / "a", {"bad": object()})

  def fail(src, dst):
    raise OSError(f"disk full moving {src} to {dst}")

  monkeypatch.setattr(os, "rename", fail)
  with pytest.raises(OSError, match="disk full"):
    checkpoint.save_checkpoint(tmp_path / "b", {"w": jnp.ones(2)})
  assert os.listdir(tmp_path) == []


def _save_and_damage(tmp_path, damage):
  path = tmp_path / "ckpt"
  tree = {"w": jnp.arange(1000, dtype=jnp.float32)}
  checkpoint.save_checkpoint(path, tree)
  damage(path)
  return path, tree


def _truncate_every_file(directory):
  for root, _, files in os.walk(directory):
    for name in files:
      with open(os.path.join(root, name), "r+b") as f:
        f.truncate(max(0, os.path.getsize(f.name) // 2))


@pytest.mark.parametrize("damage", [
    lambda p: _truncate_every_file(p / "state"),
    lambda p: _truncate_every_file(p / "meta"),
    lambda p: [os.remove(p / "meta" / f) for f in os.listdir(p / "meta")],
    lambda p: (p / "meta" / "metadata").write_text('{"format": "other"}'),
], ids=["arrays", "metadata", "no-metadata", "foreign-metadata"])
def test_a_damaged_checkpoint_raises_value_error(tmp_path, damage):
  path, tree = _save_and_damage(tmp_path, damage)
  with pytest.raises(ValueError, match="checkpoint"):
    checkpoint.restore_checkpoint(path, tree)


_DAMAGED_READS = r"""
import os, tempfile
import jax, jax.numpy as jnp, numpy as np
from mpolicy._src import checkpoint
from _helpers import damage_arrays
tree = {"w": jnp.arange(1000.), "v": jnp.ones(5000), "k": jax.random.key(0),
        "n": np.ones(3), "s": jnp.int32(3)}
for i in range(6):
  path = os.path.join(tempfile.mkdtemp(), "ckpt")
  checkpoint.save_checkpoint(path, tree)
  damage_arrays(path)
  try:
    checkpoint.restore_checkpoint(path, tree)
  except ValueError as e:
    print("damaged" if "the checkpoint is damaged" in str(e) else e)
"""


@pytest.mark.ci  # 5-7 s (subprocesses or a sharded mesh): once, in CI's newest job; the other tests here check the same save/restore paths on both ends.
def test_a_damaged_checkpoint_leaves_nothing_to_print_at_exit():
  # orbax reads the arrays concurrently and stops at the first error; the
  # reads in flight, the tasks whose errors nobody read and the coroutines
  # never awaited used to print tracebacks, often at interpreter exit.
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join([repo, os.path.join(repo, "tests")]))
  proc = subprocess.run([sys.executable, "-c", _DAMAGED_READS], env=env,
                        cwd=repo, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.split() == ["damaged"] * 6, proc.stdout
  assert proc.stderr == "", proc.stderr


def test_64_bit_host_values_restore_into_an_eval_shape_template(tmp_path):
  init = lambda: {"f": np.float64(1 + 2. ** -40), "i": np.int64(2 ** 40),
                  "a": np.arange(3.), "step": 7, "w": jnp.ones(2)}
  checkpoint.save_checkpoint(tmp_path / "ckpt", init())
  template = jax.eval_shape(init)  # float32 and int32 without x64.
  assert template["f"].dtype == jnp.float32
  restored = checkpoint.restore_checkpoint(tmp_path / "ckpt", template)
  assert type(restored["f"]) is np.float64 and restored["f"] == 1 + 2. ** -40
  assert type(restored["i"]) is np.int64 and restored["i"] == 2 ** 40
  assert restored["a"].dtype == np.float64 and restored["a"].tolist() == [
      0., 1., 2.]
  assert type(restored["step"]) is int and restored["step"] == 7
  assert isinstance(restored["w"], jax.Array)
  wrong = dict(template, f=jax.ShapeDtypeStruct((), jnp.int32))
  with pytest.raises(ValueError, match=r"\['f'\]: checkpoint has float64\[\], "
                     r"template wants int32\[\]"):
    checkpoint.restore_checkpoint(tmp_path / "ckpt", wrong)


def test_numpy_scalars_restore_into_numpy_scalars(tmp_path):
  tree = {"s": np.float32(2.5), "b": np.bool_(True), "h": np.float16(3.)}
  checkpoint.save_checkpoint(tmp_path / "ckpt", tree)
  template = {"s": np.float32(0), "b": np.bool_(False), "h": np.float16(0)}
  restored = checkpoint.restore_checkpoint(tmp_path / "ckpt", template)
  assert type(restored["s"]) is np.float32 and restored["s"] == 2.5
  assert type(restored["b"]) is np.bool_ and restored["b"]
  assert type(restored["h"]) is np.float16 and restored["h"] == 3.


def test_a_missing_template_or_path_is_named(tmp_path):
  checkpoint.save_checkpoint(tmp_path / "ckpt", {"w": jnp.ones(2)})
  with pytest.raises(TypeError, match="template is None; pass a pytree like "
                     "the one saved.*jax.eval_shape"):
    checkpoint.restore_checkpoint(tmp_path / "ckpt", None)
  with pytest.raises(TypeError, match="restore_checkpoint: path must be a "
                     "directory path.*got NoneType"):
    checkpoint.restore_checkpoint(None, {"w": jnp.ones(2)})
  with pytest.raises(TypeError, match="save_checkpoint: path must be a "
                     "directory path.*got int"):
    checkpoint.save_checkpoint(3, {"w": jnp.ones(2)})


def test_what_is_not_a_checkpoint_is_named(tmp_path):
  with pytest.raises(FileNotFoundError, match="no checkpoint at"):
    checkpoint.restore_checkpoint(tmp_path / "nothing", {})
  np.savez(tmp_path / "old.npz", w=np.ones(2))
  with pytest.raises(ValueError, match="is a file.*numpy.load"):
    checkpoint.restore_checkpoint(tmp_path / "old.npz", {"w": jnp.ones(2)})
  (tmp_path / "empty").mkdir()
  with pytest.raises(ValueError, match="not a readable mpolicy checkpoint"):
    checkpoint.restore_checkpoint(tmp_path / "empty", {"w": jnp.ones(2)})


def test_the_npz_helpers_are_gone_with_a_pointer_to_orbax():
  for name in ("tree_to_arrays", "arrays_to_tree"):
    with pytest.raises(AttributeError, match="mpolicy.save_checkpoint|"
                       "mpolicy.restore_checkpoint"):
      getattr(mpolicy, name)


_poison = poison


def _loss(params, x, y, factor, key):
  p = jax.tree_util.tree_map(lambda v: v.astype(jnp.float16), params)
  keep = jax.random.bernoulli(key, 0.9, x.shape)
  h = jnp.tanh((x * keep).astype(jnp.float16) @ _poison(p["w1"], factor))
  out = (h @ p["w2"]).astype(jnp.float32)
  return jnp.mean((out - y) ** 2)


@pytest.mark.parametrize("half", [jnp.float16, jnp.bfloat16])
def test_resume_is_bitwise_identical_to_an_uninterrupted_run(tmp_path, half):
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
  params32 = {"w1": jax.random.normal(k1, (4, 16)) * 0.5,
              "w2": jax.random.normal(k2, (16, 1)) * 0.3}
  x = jax.random.normal(k3, (64, 4))
  y = jnp.cos(x[:, :1])
  tx = mpolicy.skip_nonfinite(mpolicy.master_weights(optax.adam(1e-2)))
  grad_fn = mpolicy.scaled_value_and_grad(_loss, grad_dtype=jnp.float32)

  @jax.jit
  def step(params, opt_state, loss_scale, key, factor):
    key, sub = jax.random.split(key)
    loss_scale, finite, _, grads = grad_fn(loss_scale, params, x, y, factor,
                                           sub)
    updates, opt_state = tx.update(grads, opt_state, params,
                                   grads_finite=finite)
    return (optax.apply_updates(params, updates), opt_state, loss_scale, key)

  bad = {3, 8, 9}  # Steps with an injected inf: the skip state matters too.

  def run(state, steps):
    for i in steps:
      state = step(*state, jnp.float32(jnp.inf if i in bad else 1.))
    return state

  def fresh():
    params, opt_state = mpolicy.init_master_weights(tx, params32, half)
    return (params, opt_state, ls_lib.DynamicLossScale(2. ** 15, period=4),
            jax.random.key(42))

  uninterrupted = run(fresh(), range(16))
  checkpoint.save_checkpoint(tmp_path / "step6", run(fresh(), range(6)))
  template = jax.eval_shape(fresh)
  resumed = run(checkpoint.restore_checkpoint(tmp_path / "step6", template),
                range(6, 16))
  assert same_bits(_key_bits(resumed), _key_bits(uninterrupted))
  assert resumed[0]["w1"].dtype == half
  assert int(resumed[1].total_notfinite) >= len(bad)


EIGHT_DEVICES = r"""
import json, tempfile
import jax, jax.numpy as jnp, numpy as np, optax
from jax.sharding import NamedSharding, PartitionSpec as P
import mpolicy

mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
row, rep = NamedSharding(mesh, P("d")), NamedSharding(mesh, P())
tx = mpolicy.master_weights(optax.adam(1e-2))
x = jax.device_put(jax.random.normal(jax.random.PRNGKey(1), (64, 16)), row)
y = jax.device_put(jnp.sin(x[:, :1]), row)

def loss_fn(params, x, y):
  h = jnp.tanh(x.astype(jnp.bfloat16) @ params["w1"])
  return jnp.mean(((h @ params["w2"]).astype(jnp.float32) - y) ** 2)

step = jax.jit(mpolicy.make_train_step(loss_fn, tx))

def fresh():
  k1, k2 = jax.random.split(jax.random.PRNGKey(0))
  params32 = {"w1": jax.random.normal(k1, (16, 32)) * .3,
              "w2": jax.random.normal(k2, (32, 1)) * .3}
  params, opt_state = jax.tree_util.tree_map(
      lambda v: jax.device_put(v, row if v.shape == (16, 32) else rep),
      mpolicy.init_master_weights(tx, params32, jnp.bfloat16))
  ls = jax.device_put(mpolicy.DynamicLossScale(2. ** 15, period=3), rep)
  return params, opt_state, ls, jax.device_put(jax.random.key(3), rep)

def run(state, steps):
  params, opt_state, ls, key = state
  for i in steps:
    out = step(params, opt_state, ls, x * (jnp.inf if i == 4 else 1.), y)
    params, opt_state, ls = out.params, out.opt_state, out.loss_scale
    key = jax.random.split(key)[0]
  return params, opt_state, ls, key

bits = lambda t: [np.asarray(jax.random.key_data(v) if jax.dtypes.issubdtype(
    v.dtype, jax.dtypes.prng_key) else v).tobytes()
    for v in jax.tree_util.tree_leaves(t)]
specs = lambda t: [repr(tuple(v.sharding.spec))
                   for v in jax.tree_util.tree_leaves(t)]
path = tempfile.mkdtemp() + "/step5"
mpolicy.save_checkpoint(path, run(fresh(), range(5)))
template = fresh()
restored = mpolicy.restore_checkpoint(path, template)
resumed = run(restored, range(5, 10))
uninterrupted = run(fresh(), range(10))
abstract = jax.tree_util.tree_map(
    lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=rep), template)
replicated = mpolicy.restore_checkpoint(path, abstract)
print("FACTS=" + json.dumps({
    "devices": len(jax.devices()),
    "w1_spec": list(restored[0]["w1"].sharding.spec),
    "w1_shards": len(restored[0]["w1"].addressable_shards),
    "specs_match": specs(restored) == specs(template),
    "bitwise": bits(resumed) == bits(uninterrupted),
    "replicated_specs": sorted(set(specs(replicated))),
    "replicated_same_values": bits(replicated) == bits(restored),
}))
"""


@pytest.mark.ci  # 5-7 s (subprocesses or a sharded mesh): once, in CI's newest job; the other tests here check the same save/restore paths on both ends.
def test_sharded_state_resumes_bitwise_with_the_template_shardings(eight_devices):
  facts = eight_devices
  assert facts["devices"] == 8
  assert facts["w1_spec"] == ["d"]
  assert facts["w1_shards"] == 8
  assert facts["specs_match"]
  assert facts["bitwise"]
  assert facts["replicated_specs"] == ["()"]
  assert facts["replicated_same_values"]


def _flip_one_bit_of_the_largest_data_file(path):
  files = [os.path.join(root, name)
           for root, _, names in os.walk(os.path.join(path, "state"))
           for name in names if os.sep + "d" in root]
  largest = max(files, key=os.path.getsize)
  data = bytearray(open(largest, "rb").read())
  data[len(data) // 2] ^= 4  # Inside the stored values, past any header.
  with open(largest, "wb") as f:
    f.write(bytes(data))


def test_a_flipped_bit_in_a_leaf_is_refused_naming_the_leaf(tmp_path):
  # The largest leaf's values are random, stored as they are: a flipped bit
  # in them reads back as another value unless a checksum catches it.
  tree = {"w": jax.random.normal(jax.random.key(0), (1000,)),
          "b": jnp.ones(7, jnp.bfloat16), "step": 3}
  checkpoint.save_checkpoint(tmp_path / "ckpt", tree)
  assert checkpoint.restore_checkpoint(tmp_path / "ckpt", tree)["step"] == 3
  _flip_one_bit_of_the_largest_data_file(tmp_path / "ckpt")
  with pytest.raises(ValueError, match=r"leaf \['w'\] of .*ckpt does not "
                     "match the checksum saved with it: the checkpoint is "
                     "damaged"):
    checkpoint.restore_checkpoint(tmp_path / "ckpt", tree)


def test_a_checksum_is_the_same_for_any_split_of_the_array():
  x = np.arange(24, dtype=np.float32).reshape(4, 6)
  whole = digests._piece(x, (), x.shape, None)
  parts = [digests._piece(x[r, c], (r, c), x.shape, None)
           for r in (slice(0, 1), slice(1, 4)) for c in (slice(0, 5),
                                                         slice(5, 6))]
  assert sum(parts) % 2 ** 64 == whole
  moved = x.copy()
  moved[[0, 1]] = moved[[1, 0]]  # Same values, other places.
  assert digests._piece(moved, (), x.shape, None) != whole
  flipped = x.copy()
  flipped.view(np.uint32)[2, 3] ^= 1
  assert digests._piece(flipped, (), x.shape, None) != whole


def test_a_save_stopped_between_its_renames_leaves_the_old_checkpoint_found(
    tmp_path, monkeypatch):
  path = tmp_path / "ckpt"
  checkpoint.save_checkpoint(path, {"w": jnp.ones(2)})
  rename = os.rename

  def dies_after_moving_the_old_one(src, dst):
    if os.path.basename(dst) == "ckpt":  # The new one's rename: never done.
      raise KeyboardInterrupt("the process dies here")
    rename(src, dst)

  monkeypatch.setattr(os, "rename", dies_after_moving_the_old_one)
  with pytest.raises(KeyboardInterrupt):
    checkpoint.save_checkpoint(path, {"w": jnp.full(2, 2.)}, overwrite=True)
  monkeypatch.setattr(os, "rename", rename)
  assert not os.path.exists(path)  # The old one waits beside it:
  template = {"w": jnp.zeros(2)}
  assert checkpoint.restore_checkpoint(path, template)["w"].tolist() == [1, 1]
  with pytest.raises(FileExistsError, match="overwrite=True"):
    checkpoint.save_checkpoint(path, {"w": jnp.zeros(2)})
  checkpoint.save_checkpoint(path, {"w": jnp.full(2, 3.)}, overwrite=True)
  assert checkpoint.restore_checkpoint(path, template)["w"].tolist() == [3, 3]
  assert os.listdir(tmp_path) == ["ckpt"]


def test_saving_inside_jit_asks_for_concrete_arrays(tmp_path):
  @jax.jit
  def step(w):
    checkpoint.save_checkpoint(tmp_path / "ckpt", {"w": w})
    return w

  with pytest.raises(TypeError, match=r"save_checkpoint needs concrete "
                     r"arrays, but leaf \['w'\] is a traced value .* inside "
                     "jax.jit .* Call it outside jit"):
    step(jnp.ones(2))
  assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("url", ["gs://bucket/ckpt", "s3://bucket/run/step_1",
                                 "gs:/bucket/ckpt"])
def test_a_url_is_refused_before_anything_is_written(tmp_path, monkeypatch,
                                                     url):
  import pathlib  # pylint: disable=g-import-not-at-top
  monkeypatch.chdir(tmp_path)
  scheme = url.split(":")[0]
  words = f"{scheme}:// URL; mpolicy checkpoints go to a directory"
  for path in (url, pathlib.Path(url)):  # pathlib makes gs:// gs:/.
    with pytest.raises(ValueError, match=words):
      checkpoint.save_checkpoint(path, {"w": jnp.ones(2)})
    with pytest.raises(ValueError, match=words):
      checkpoint.restore_checkpoint(path, {"w": jnp.ones(2)})
    with pytest.raises(ValueError, match=words):
      mpolicy.CheckpointManager(path)
  assert os.listdir(tmp_path) == []


def test_the_checkpoint_door_holds_the_flat_names():
  from mpolicy import checkpoint as door  # pylint: disable=g-import-not-at-top
  assert sorted(door.__all__) == ["CheckpointManager", "restore_checkpoint",
                                  "save_checkpoint"]
  for name in door.__all__:
    assert getattr(door, name) is getattr(mpolicy, name)
