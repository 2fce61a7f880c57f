"""The optimizer's lesson: its helpers by default, the runs slow.

The default run also runs the lesson as a file, one mode with tiny
settings (tests/test_examples.py).
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), "examples")


@pytest.fixture(scope="module")
def lesson():
  if EXAMPLES not in sys.path:
    sys.path.insert(0, EXAMPLES)
  return __import__("optimizer_lesson")


@pytest.fixture(scope="module")
def corpus(lesson):
  return lesson.char_transformer.load_corpus()


@pytest.mark.slow
@pytest.mark.parametrize("mode,nbytes", [("stochastic", 6), ("low_bits", 8)])
def test_tiny_run_keeps_bfloat16_and_counts_unchanged_params(
    lesson, corpus, mode, nbytes):
  config = lesson.char_transformer.ModelConfig(
      seq_len=8, d_model=8, num_heads=2, num_layers=1)
  r = lesson.run(corpus, config, mode=mode, steps=3, batch_size=2,
                 log_every=0)
  series = r.log.extra[lesson.NEVER_CHANGED]
  assert len(series) == 3 and 0 < series[-1] < 100
  assert all(a >= b for a, b in zip(series, series[1:]))  # Never grows.
  assert np.isfinite(r.metrics["final loss"])
  assert 0 <= r.metrics["unchanged by a step"] <= 100
  table = lesson.lesson_table([r])
  assert f"| {mode} | {nbytes} |" in table and "+0.00%" in table


def test_never_changed_percent_counts_false_flags(lesson):
  changed = {"a": jnp.array([True, False, False, False]),
             "b": jnp.array([[True, True], [True, False]])}
  assert float(lesson.never_changed_percent(changed)) == 50.0


def test_unchanged_percent_compares_new_and_old(lesson):
  old = {"w": jnp.arange(4.0)}
  new = {"w": jnp.array([0.0, 1.0, 5.0, 5.0])}
  assert float(lesson.unchanged_percent(new, old)) == 50.0


def test_bad_mode_lists_the_modes(lesson):
  with pytest.raises(ValueError, match=r"'f32' or one of \('master', "):
    lesson.optimizer_for("sr", 1e-3)


@pytest.mark.slow
def test_full_lesson_nearest_stalls_and_stochastic_matches_master(
    lesson, corpus):
  config = lesson.char_transformer.ModelConfig()
  runs = {m: lesson.run(corpus, config, mode=m, log_every=0)
          for m in lesson.MODES}
  final = {m: r.metrics["final loss"] for m, r in runs.items()}
  never = {m: r.metrics["never changed"] for m, r in runs.items()}
  assert abs(final["stochastic"] / final["master"] - 1) < 0.01
  assert abs(final["low_bits"] / final["master"] - 1) < 0.01
  assert final["nearest"] > final["master"] * 1.01
  assert never["nearest"] > 2 * never["stochastic"]
  assert never["nearest"] > 2 * never["master"]
  still = {m: r.metrics["unchanged by a step"] for m, r in runs.items()}
  assert still["nearest"] > still["stochastic"] + 3
