"""The slow sweep of test_accumulation_devices: every mode at every k.

`shard_map` with and without `check_vma`, `pmap`, `jax.jit` with
`NamedSharding` (data parallel and FSDP), FSDP inside `shard_map`, at
k = 1, 2 and 8, on 8 simulated devices.
"""

from __future__ import annotations

import pytest

import test_accumulation_devices as _base
from test_accumulation_devices import (  # pylint: disable=unused-import
    test_a_bad_microbatch_on_one_device_skips_everywhere,
    test_check_accumulation_compares_across_devices,
    test_every_mode_and_k_gives_the_one_device_step,
    test_gradients_are_reduced_once_after_the_microbatches,
    test_half_gradients_are_reduced_in_float32,
    test_pmap_reduces_after_the_microbatches_too,
    test_under_jit_xla_reduces_inside_the_loop_on_cpu,
    test_model_state_is_threaded_and_averaged_once,
)

pytestmark = pytest.mark.slow

EIGHT_DEVICES = _base.EIGHT_DEVICES.replace("FULL = False", "FULL = True")
assert EIGHT_DEVICES != _base.EIGHT_DEVICES


def test_the_sweep_covers_every_mode(eight_devices):
  runs = set(eight_devices["runs"])
  for mode in ("shard_map vma=True", "shard_map vma=False", "jit",
               "jit fsdp"):
    assert {f"{mode} k={k}" for k in (1, 2, 8)} <= runs
  assert {"pmap k=1", "pmap k=8", "shard_map fsdp k=2"} <= runs
  assert sorted(eight_devices["state runs"]) == [False, True]


def test_pmap_reduces_after_the_microbatches_at_every_k(eight_devices):
  for k in (1, 2, 8):
    assert eight_devices[f"pmap k={k} collectives inside"] == []
