"""Training in two JAX processes joined by `jax.distributed`, against one.

The runs (`_mp_runs.py`): `two`, 2 processes with 2 CPU devices each (one
mesh of 4 devices spanning both), and `one`, one process with 4; the slow
tests read `two_more` and `one_more`, the same with more checks. Sums
across processes go through gloo in another order than within one
process, so values match the one-process run to float32 rounding, and the
two processes match each other bit for bit.
"""

import pytest

from _mp_runs import close, one, one_more, two, two_more  # pylint: disable=unused-import
from _mp_runs import MORE_TRAINING, TRAINING

# --- Training -----------------------------------------------------------------


@pytest.mark.ci  # Two- and one-process runs, 17 s on 2 cores.
@pytest.mark.parametrize("check", TRAINING)
def test_both_processes_see_the_same_results(two, check):
  assert two[0][check] == two[1][check]


@pytest.mark.slow
@pytest.mark.parametrize("check", MORE_TRAINING)
def test_both_processes_see_the_same_results_of_more_checks(two_more, check):
  assert two_more[0][check] == two_more[1][check]


def _trains_as_one_process(got, want):
  assert got["finite"] == want["finite"] == [True, True, False, True]
  assert got["scale"] == want["scale"]
  close(got["loss"], want["loss"])
  close(got["w1"], want["w1"])


@pytest.mark.ci  # The same runs (see above).
def test_jit_with_named_sharding_trains_as_one_process(one, two):
  _trains_as_one_process(two[0]["data_parallel"], one["data_parallel"])


@pytest.mark.ci  # The same runs (see above).
def test_fsdp_trains_as_one_process(one, two):
  # The checkpoint checks train two steps with FSDP params before saving.
  close(two[0]["checkpoint"]["saved"]["w1"], one["checkpoint"]["w1"])


@pytest.mark.slow
def test_fsdp_with_a_skipped_step_trains_as_one_process(one_more, two_more):
  _trains_as_one_process(two_more[0]["fsdp"], one_more["fsdp"])


@pytest.mark.ci  # The same runs (see above).
def test_an_inf_in_the_last_process_rows_skips_the_step_on_both(two):
  for facts in two:
    run = facts["data_parallel"]
    assert run["finite"][2] is False
    assert run["digest"][2] == run["digest"][1]  # Params untouched.
    assert run["scale"][2] == run["scale"][1] / 2


@pytest.mark.slow
def test_fsdp_keeps_the_weights_split_across_processes(two, two_more):
  assert two_more[0]["fsdp"]["w1_spec"] == "('data',)"
  assert two[0]["data_parallel"]["w1_spec"] == "()"
  close(two_more[0]["fsdp"]["w1"], two[0]["data_parallel"]["w1"])


# The same runs (25 s by default). In one process, the default run's
# training/test_redo_on_overflow.py::test_pmap_and_shard_map_devices_retry_together
# covers a shard_map step that averages and skips.
@pytest.mark.ci
def test_shard_map_averages_gradients_and_state_over_both_processes(one, two):
  got, want = two[0]["shard_map"], one["shard_map"]
  assert got["finite"] == want["finite"] == [True, True, False, True]
  assert got["digest"][2] == got["digest"][1]
  assert got["state"][2] == got["state"][1]  # Skipped: the state too.
  assert got["scale"] == want["scale"]
  close(got["loss"][:2] + got["loss"][3:], want["loss"][:2] + want["loss"][3:])
  close(got["mean"], want["mean"])


@pytest.mark.slow
def test_fp8_scales_are_shared_across_processes(one_more, two_more):
  got, want = two_more[0]["fp8"], one_more["fp8"]
  assert got["jit_out"] == want["jit_out"]  # Bit for bit.
  assert got["jit_grad"] == want["jit_grad"]
  assert got["map_out"] == want["map_out"]
  close(got["map_grad"], want["map_grad"])


def _distinct(rows):
  return len({tuple(r) for r in rows})


@pytest.mark.slow
@pytest.mark.parametrize("where", ["jit", "shard_map"])
def test_stochastic_rounding_draws_bits_per_shard(one_more, two_more, where):
  got = two_more[0]["stochastic_rounding"][where]
  assert _distinct(got) == 4, "shards on different processes rounded alike"
  assert got == one_more["stochastic_rounding"][where]


@pytest.mark.slow
def test_a_replicated_value_rounds_alike_on_every_device(two_more):
  assert _distinct(two_more[0]["stochastic_rounding"]["replicated"]) == 1


@pytest.mark.slow
def test_gradient_accumulation_trains_as_one_process(one_more, two_more):
  got, want = two_more[0]["microbatches"], one_more["microbatches"]
  assert got["finite"] == want["finite"] == [True, True, True]
  close(got["loss"], want["loss"])
  close(got["w1"], want["w1"])
