"""Smoke test of benchmarks/bench_optimizer_memory.py at its smallest sizes."""

import importlib.util
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "benchmarks")


@pytest.fixture(scope="module")
def bench():
  spec = importlib.util.spec_from_file_location(
      "_bench_optimizer_memory", os.path.join(BENCH, "bench_optimizer_memory.py"))
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses look their module up here.
  spec.loader.exec_module(module)
  return module


@pytest.mark.ci  # Runs the benchmark, 10 s on 2 cores.
def test_float32_adam_holds_12_bytes_and_the_6_byte_mode_6(bench):
  model = bench.gpt_model(scale=64)
  variants = [bench.VARIANTS[0], bench.VARIANTS[-1]]
  assert [v.name for v in variants] == [
      "float32 Adam", "6-byte (bf16 params + moments, SR)"]
  f32, six = (bench.measure(model, v) for v in variants)
  count = f32["params"]
  # Adam's step counter (4 bytes); the 6-byte mode has two more counters.
  assert f32["bytes/param"] == pytest.approx(12 + 4 / count)
  assert six["bytes/param"] == pytest.approx(6 + 12 / count)
  assert f32["temp MiB"] > 0 and six["temp MiB"] > 0


@pytest.mark.ci  # Runs the benchmark, 5 s on 2 cores.
def test_the_exact_master_mode_holds_8_bytes(bench):
  model = bench.gpt_model(scale=64)
  variant, = [v for v in bench.VARIANTS if v.name.startswith("8-byte")]
  eight = bench.measure(model, variant)
  # Adam's step counter (4 bytes) and the moments' rounding counter.
  assert eight["bytes/param"] == pytest.approx(8 + 8 / eight["params"])
