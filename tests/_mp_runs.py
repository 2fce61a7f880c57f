"""The launches that the multi-process tests read, each run once per session.

Three launches on localhost (`_multiprocess.launch`: gloo collectives, a
free port, a timeout, every process killed on failure), each run once per
test session however pytest-xdist spreads the tests over workers:

* `one`: one process with 4 devices, the run to compare with; it also
  saves a checkpoint.
* `two`: 2 processes with 2 devices each, the same mesh of 4 devices
  spanning both; it restores `one`'s checkpoint, saves its own, and meets
  every error a checkpoint can raise across processes.
* `fewer`: one process with 2 devices restores `two`'s checkpoint.
* `one_more` and `two_more` (for the slow tests): the training checks
  left out of `one` and `two` to keep the default run short.

The checks themselves are in `_mp_training.py` and `_mp_checkpoints.py`.
"""

import numpy as np
import pytest

from _multiprocess import launch, once

TRAINING = ["data_parallel", "shard_map"]
MORE_TRAINING = ["fsdp", "fp8", "stochastic_rounding", "microbatches"]

SCRIPT = r"""
import _mp_checkpoints as checkpoints
import _mp_training as training
kind, directory, other, checks = ARGS
facts = {name: training.CHECKS[name]() for name in checks}
path = directory + "/checkpoint"
if kind == "one":
  facts["checkpoint"] = checkpoints.save_reference(path)
elif kind == "two":
  facts["checkpoint"] = checkpoints.across_processes(other, path)
elif kind == "fewer":
  facts["checkpoint"] = checkpoints.fewer_devices(other, "fsdp")
facts["path"] = path
report(**facts)
"""


@pytest.fixture(scope="module")
def one(tmp_path_factory):
  return once(tmp_path_factory, "one", lambda d: launch(
      SCRIPT, 1, 4, args=["one", str(d), None, TRAINING])[0])


@pytest.fixture(scope="module")
def two(tmp_path_factory, one):
  return once(tmp_path_factory, "two", lambda d: launch(
      SCRIPT, 2, 2, args=["two", str(d), one["path"], TRAINING],
      timeout=240))


@pytest.fixture(scope="module")
def fewer(tmp_path_factory, two):
  return once(tmp_path_factory, "fewer", lambda d: launch(
      SCRIPT, 1, 2, args=["fewer", str(d), two[0]["path"], []])[0])


@pytest.fixture(scope="module")
def one_more(tmp_path_factory):
  return once(tmp_path_factory, "one_more", lambda d: launch(
      SCRIPT, 1, 4, args=["train", str(d), None, MORE_TRAINING])[0])


@pytest.fixture(scope="module")
def two_more(tmp_path_factory):
  return once(tmp_path_factory, "two_more", lambda d: launch(
      SCRIPT, 2, 2, args=["train", str(d), None, MORE_TRAINING]))


def close(a, b):
  np.testing.assert_allclose(np.asarray(a, np.float64),
                             np.asarray(b, np.float64), rtol=1e-5, atol=1e-6)


