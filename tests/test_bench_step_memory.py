"""Smoke test of benchmarks/bench_step_memory.py on a small MLP."""

import pytest

from test_bench_smoke import _load


@pytest.mark.ci  # 6 s, a benchmark's measurement: once, in CI's newest job.
def test_the_donated_step_holds_the_gradients_not_a_second_copy():
  bench = _load("bench_step_memory")
  # Weights dominate: 0.8M parameters, a batch of 8.
  rows = bench.measure(bench.mlp_model(width=512, batch=8), "full", ks=(1, 2))
  mine = rows["make_train_step"]
  # The float32 gradients (4 bytes per parameter) and little more, where
  # jmp's select over new and old params and Adam state holds 12.
  assert 4 <= mine[1] <= 4.6, rows
  assert rows["jmp (select_tree)"][1] >= 11.5, rows
  # k = 2 adds the float32 accumulator, still well under the hand-written
  # accumulating step with a select.
  assert mine[2] <= 8.5 and rows["hand-written accum."][2] >= 11.5, rows
  table = bench.table(rows, (1, 2))
  assert table.splitlines()[0] == "| step | k=1 | k=2 |"
