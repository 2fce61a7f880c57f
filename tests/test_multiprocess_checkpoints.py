"""Checkpoints across processes: saved by 2 processes, restored by 1 and
back, FSDP and replicated, with one-process guarantees and errors.

The runs (`_mp_runs.py`): `one` (1 process, 4 devices) saves after two
steps; `two` (2 processes, 2 devices each) restores it, saves its own,
and meets the errors; `fewer` (1 process, 2 devices) restores `two`'s.
The state (`_mp_checkpoints.py`) holds FSDP params, Adam's state, a loss
scale, a PRNG key, a step number and a numpy value.
"""

import pytest

from _mp_runs import fewer, one, two  # pylint: disable=unused-import

# Two- and one-process runs (10-17 s on 2 cores): CI runs them after the
# default run, in both jobs (-m ci).
pytestmark = pytest.mark.ci

FSDP = "('data',)"


def test_a_checkpoint_of_one_process_restores_in_two(one, two):
  for facts in two:
    got = facts["checkpoint"]["from_one"]
    want = one["checkpoint"]
    assert got["digest"] == want["digest"]
    assert got["specs"]["['params']['w1']"] == FSDP  # The template's mesh.
    assert got["step"] == ["int", 2] and got["seen"] == want["seen"]


def test_two_processes_save_once_and_restore_bit_for_bit(two):
  facts = two[0]["checkpoint"]
  assert facts["restored"]["digest"] == facts["saved"]["digest"]
  assert two[1]["checkpoint"]["restored"] == facts["restored"]
  assert facts["restored"]["specs"]["['params']['w1']"] == FSDP
  assert facts["restored"]["specs"]["['opt_state'][0].mu['w1']"] == FSDP
  assert facts["restored"]["seen"] == ["ndarray", "int64", [2, 2, 2]]
  assert facts["files"] == ["checkpoint"]  # No temporary directory left.


def test_fresh_leaves_come_back_free_to_join_sharded_arguments(two):
  # The template's loss scale and key were made with jnp, outside jit.
  for facts in two:
    assert facts["checkpoint"]["restored_committed"] == {
        "loss_scale": False, "key": False}
    assert facts["checkpoint"]["resumed"]  # Two more steps, bit for bit.


def test_a_template_places_the_leaves(two):
  facts = two[0]["checkpoint"]
  replicated = facts["replicated"]
  assert replicated["digest"] == facts["saved"]["digest"]
  assert replicated["specs"]["['params']['w1']"] == "()"


def test_leaves_without_a_sharding_are_replicated_when_the_devices_changed(
    one, two):
  # eval_shape's template has no shardings; the one-process run's devices
  # are gone.
  for facts in two:
    got = facts["checkpoint"]["from_one_abstract"]
    assert got["digest"] == one["checkpoint"]["digest"]
    assert set(got["specs"].values()) == {"()"}
    assert got["seen"] == ["ndarray", "int64", [2, 2, 2]]  # As saved.


def test_one_process_with_fewer_devices_restores_two_processes(two, fewer):
  saved = two[0]["checkpoint"]["saved"]
  got = fewer["checkpoint"]
  assert got["fsdp"]["digest"] == saved["digest"]
  assert got["fsdp"]["specs"]["['params']['w1']"] == FSDP  # Over 2 devices.
  assert got["abstract"]["digest"] == saved["digest"]
  assert set(got["abstract"]["specs"].values()) == {"()"}


def test_a_checkpoint_manager_keeps_the_last_steps_across_processes(two):
  for facts in two:
    assert facts["checkpoint"]["manager"] == {"steps": [2, 3], "latest": 3}


def _errors(two):
  return [facts["checkpoint"]["errors"] for facts in two]


@pytest.mark.parametrize("name, kind, words", [
    ("exists", "FileExistsError", "already exists; pass overwrite=True"),
    ("differs", "ValueError", "['seen'] differ between process 0 and "
     "process 1"),
    ("other_path", "ValueError", "every process must pass the same path"),
    ("tree_on_one", "ValueError", "process 1's tree differs from process "
     "0's"),
    ("path_on_one", "TypeError", "path must be a directory path"),
    ("template_on_one", "ValueError", "['step']: checkpoint has int32[], "
     "template wants float32[3]"),
    ("template_none", "TypeError", "template is None; pass a pytree like "
     "the one saved"),
    ("damaged", "ValueError", "the checkpoint is damaged"),
])
def test_every_process_raises_the_same_error(two, name, kind, words):
  for errors in _errors(two):
    got_kind, message = errors[name]
    assert got_kind == kind, message
    assert words in message, message


@pytest.mark.parametrize("name, failing", [
    ("exists", 0), ("path_on_one", 1), ("template_on_one", 1)])
def test_an_error_on_one_process_is_raised_on_the_others(two, name, failing):
  for index, errors in enumerate(_errors(two)):
    message = errors[name][1]
    elsewhere = f"[raised on process {failing} of 2; every process stopped]"
    assert (elsewhere in message) == (index != failing), message


def test_after_the_errors_the_processes_still_agree(two):
  for facts in two:
    assert facts["checkpoint"]["after_errors"]["digest"] == (
        facts["checkpoint"]["saved"]["digest"])
    assert facts["checkpoint"]["errors"]["left_behind"] == []
