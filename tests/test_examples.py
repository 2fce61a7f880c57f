"""The examples run end to end as files, and their flags fail early and clearly.

Fast tests run every example script as a user would, `python
examples/<name>.py` (the porting recipes too), from another directory, with
a few tiny steps; a test checks that no script is left out. The Flax and
Equinox examples are skipped where those packages are not installed (the
`test` extra installs them). Slow tests (`-m slow`) call the training
functions in process: bfloat16 matches float32 on the digits, and float16
with a dynamic loss scale never puts a NaN into the params.
"""

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpolicy

from _helpers import all_eqns, multiplies_in

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")


def run_example(name, *args, cwd, timeout=300):
  """Runs examples/<name>.py as a script in `cwd`; (returncode, out, err).

  `name` may name a subfolder's script: "porting/haiku_jmp".
  """
  # PYTHONPATH only makes sure this checkout's mpolicy is the one imported.
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep
             + os.environ.get("PYTHONPATH", ""))
  proc = subprocess.run(
      [sys.executable, os.path.join(EXAMPLES, f"{name}.py"), *args], cwd=cwd,
      env=env, capture_output=True, text=True, timeout=timeout)
  return proc.returncode, proc.stdout, proc.stderr


def assert_ok(rc, out, err):
  assert rc == 0, f"exit {rc}\nstdout:\n{out}\nstderr:\n{err}"


def import_example(name):
  """Imports examples/<name>.py in this process (its siblings too)."""
  if EXAMPLES not in sys.path:
    sys.path.insert(0, EXAMPLES)
  return __import__(name)


def bf16_dots(fn, *args):
  """How many matmuls of `fn`'s jaxpr multiply in bfloat16."""
  return sum(1 for e in all_eqns(fn, *args)
             if "dot_general" in e.primitive.name
             and multiplies_in(e) == (np.dtype(jnp.bfloat16),) * 2)


# `Report.summary`'s line, as the tables' `explain` column shows it.
SUMMARY = re.compile(r"\d+ ops?: \d+ \w+(, \d+ \w+)*; "
                     r"casts: \d+ by op rules, \d+ by module policies, \d+ in the code")


def explain_cells(out):
  """Run name -> the `explain` cell (the last) of each row of the table."""
  rows = [l for l in out.splitlines()
          if l.startswith("| ") and not l.startswith("| run ")]
  return {l.split(" | ")[0][2:]: l.split(" | ")[-1].rstrip(" |") for l in rows}


# --- Each example, as a file, from another directory --------------------------

# The char transformer's model flags at their smallest.
TINY_MODEL = ("--seq_len=8", "--d_model=8", "--num_heads=2", "--num_layers=1")


@pytest.mark.ci  # The main job as a file at its defaults: 30 s of CPU.
def test_digits_cnn_at_its_defaults_prints_the_readme_table_and_plots(
    tmp_path):
  """One run of the main job, as the README runs it (plus a plot), serves
  the README's printed table (test_readme) and this file's checks."""
  from test_readme import check_main_job_prints_the_readme_table  # pylint: disable=g-import-not-at-top
  png = tmp_path / "digits.png"
  rc, out, err = run_example("digits_cnn", f"--plot={png}", cwd=tmp_path,
                             timeout=900)
  assert_ok(rc, out, err)
  check_main_job_prints_the_readme_table(out)
  assert ("| run | policy | loss scale | test accuracy | final loss | "
          "skipped steps | compile (s) | train time (s) | explain |") in out
  assert "| f32 | p=f32,c=f32,o=f32 | NoOp |" in out
  assert "| bf16 | p=f32,c=bf16,o=f32 | NoOp |" in out
  cells = explain_cells(out)
  assert all(SUMMARY.fullmatch(c) for c in cells.values()), cells
  assert cells["f32"].endswith("; casts: 0 by op rules, "
                               "0 by module policies, 0 in the code")  # Nothing to cast.
  assert "bfloat16" in cells["bf16"]
  assert "[bf16] test accuracy:" in out
  assert re.search(r"^\[bf16\] step +400/400 ", out, flags=re.M), out
  assert png.stat().st_size > 0


@pytest.mark.slow  # CI's oldest job runs it (.ci/run).
def test_char_transformer_with_attention_policy_and_dynamic_scale(tmp_path):
  rc, out, err = run_example(
      "char_transformer", "--steps=2", "--batch_size=2", *TINY_MODEL,
      "--log_every=1", "--attention_policy=full", "--mp_scale_type=Dynamic",
      cwd=tmp_path)
  assert_ok(rc, out, err)
  assert "| bf16+dynamic+attn:f32 | p=f32,c=bf16,o=f32 | Dynamic |" in out
  assert SUMMARY.fullmatch(explain_cells(out)["bf16+dynamic+attn:f32"])
  assert "| f32 |" not in out  # No --compare: no baseline.
  assert "[bf16+dynamic+attn:f32] test accuracy:" in out


@pytest.mark.slow  # Runs the example as a file (a compile of ~30 s).
def test_char_transformer_block_format_keeps_named_layers_in_bf16(tmp_path):
  rc, out, err = run_example(
      "char_transformer", "--steps=2", "--batch_size=2", *TINY_MODEL,
      "--log_every=1", "--mp_policy=p=f32,c=mxfp8,o=f32",
      "--keep_bf16=*/logits", cwd=tmp_path)
  assert_ok(rc, out, err)
  name = "mxfp8+bf16:*/logits"
  assert f"| {name} | p=f32,c=mxfp8,o=f32 | NoOp |" in out
  cells = explain_cells(out)[name]
  assert re.search(r"\d+ mxfp8", cells), cells


LESSON_TINY = ("--steps=3", "--batch_size=2", *TINY_MODEL, "--log_every=0")


@pytest.mark.slow
def test_loss_scaling_lesson_reports_underflow_for_three_runs(tmp_path):
  png = tmp_path / "lesson.png"
  rc, out, err = run_example("loss_scaling_lesson", *LESSON_TINY,
                             f"--plot={png}", cwd=tmp_path)
  assert_ok(rc, out, err)
  assert ("| run | loss scale | underflowed logit grads (mean) | "
          "underflowed logit grads (last 10 steps) |") in out
  rows = [l for l in out.splitlines() if l.startswith("| f")]
  assert [r.split(" | ")[0] for r in rows] == ["| f32", "| f16",
                                               "| f16+dynamic"]
  assert rows[0].split(" | ")[2] == "—"  # float32 has nothing to flush.
  assert rows[1].split(" | ")[2].endswith("%")
  assert png.stat().st_size > 0


@pytest.mark.slow  # CI's oldest job runs it (.ci/run).
def test_loss_scaling_lesson_nocompare_drops_the_float32_run(tmp_path):
  rc, out, err = run_example("loss_scaling_lesson", *LESSON_TINY,
                             "--nocompare", "--mp_scale_type=NoOp",
                             cwd=tmp_path)
  assert_ok(rc, out, err)
  rows = [l for l in out.splitlines() if l.startswith("| f")]
  assert [r.split(" | ")[0] for r in rows] == ["| f16"]


@pytest.mark.slow  # Not in CI: tests/test_optimizer_lesson.py runs it in process.
def test_optimizer_lesson_runs_as_a_file_and_tabulates_its_mode(tmp_path):
  rc, out, err = run_example("optimizer_lesson", *LESSON_TINY,
                             "--modes=stochastic", cwd=tmp_path)
  assert_ok(rc, out, err)
  assert "Optimizer lesson: char transformer d_model=8, 1 layers" in out
  rows = [l.split(" | ") for l in out.splitlines() if l.startswith("| ")]
  assert rows[0][:3] == ["| run", "bytes/param", "params never changed"]
  (row,) = rows[1:]  # One mode, no float32 baseline (no --compare).
  assert row[:2] == ["| stochastic", "6"]
  # Some parameters moved in 3 steps, and some did not (bf16 spacing).
  assert 0 < float(row[2].rstrip("%")) < 100
  assert 0 <= float(row[3].rstrip("%")) <= 100
  assert np.isfinite(float(row[4])) and row[5] == "+0.00%"  # vs itself.


# CI runs the recipes as files after the default run (.ci/run's example
# step: 7 s each), and tests/test_porting.py runs each in process by default.
_SLOW = {"marks": pytest.mark.slow}


@pytest.mark.parametrize("recipe, printed", [
    pytest.param("haiku_jmp", r"loss \d\.\d{3}, loss scale 32768\.0", **_SLOW),
    pytest.param("haiku_f32", r"loss \d\.\d{3}", **_SLOW),
    pytest.param("flax_linen", r"loss \d\.\d{3}", **_SLOW),
    pytest.param("equinox_mlp", r"loss \d\.\d{3}", **_SLOW),
])
def test_porting_recipe_runs_as_a_file(tmp_path, recipe, printed):
  pytest.importorskip({"flax_linen": "flax",
                       "equinox_mlp": "equinox"}.get(recipe, "haiku"))
  rc, out, err = run_example(f"porting/{recipe}", cwd=tmp_path)
  assert_ok(rc, out, err)
  assert re.fullmatch(printed, out.strip()), out


@pytest.mark.ci  # Two trainings, three exports: 25 s of CPU.
def test_digits_int8_runs_as_a_file_and_its_export_is_bit_exact(tmp_path):
  rc, out, err = run_example("digits_int8", "--steps=3", "--batch_size=16",
                             "--hidden=8", "--log_every=0", cwd=tmp_path)
  assert_ok(rc, out, err)
  assert re.search(r"^float32 test accuracy: 0\.\d{4}$", out, flags=re.M), out
  assert re.search(r"^int8 QAT test accuracy: 0\.\d{4}$", out, flags=re.M), out
  assert ("stored in int8: ['hidden']['w']['int8'], "
          "['logits']['w']['int8']") in out
  assert ("exported int8 artifact equals the jitted model bit for bit: True"
          in out)
  assert re.search(r"^serving artifact bytes: int8 [\d,]+ vs float32 [\d,]+ "
                   r"\(\d+\.\d\dx\)$", out, flags=re.M), out


@pytest.mark.slow  # Not in CI (27 s): tests/debugging checks suggest_policy.
def test_precision_islands_runs_as_a_file_and_tabulates_three_runs(tmp_path):
  rc, out, err = run_example(
      "precision_islands", "--steps=1", "--batch_size=2", *TINY_MODEL,
      "--max_evals=2", "--probes=1", "--rounds=1", cwd=tmp_path)
  assert_ok(rc, out, err)
  assert "suggest_policy: p=f32,c=f16,o=f32 on every module" in out
  assert "mpolicy.clear_policies()" in out
  rows = [l for l in out.splitlines() if l.startswith("| ")]
  assert [r.split(" | ")[0] for r in rows[1:]] == [
      "| float32", "| half", "| half + islands"]
  assert rows[1].split(" | ")[4] == "+0.0000"


# Imported by the scripts, not run: they define flags, print, load data or
# define a model, and have no `__main__` block.
LIBRARIES = {"digits_data", "mp_flags", "mp_report", "transformer_lm"}


def test_every_example_script_is_run_as_a_file_by_a_test():
  found = {os.path.relpath(os.path.join(folder, f), EXAMPLES)[:-3]
           for folder, _, files in os.walk(EXAMPLES)
           for f in files if f.endswith(".py")}
  with open(__file__) as f:
    source = f.read()
  tested = set(re.findall(r'run_example\(\s*"(\w+)"', source))
  tested |= {"porting/" + n for n in re.findall(
      r'^    (?:pytest\.param)?\("(\w+)", r"loss', source, flags=re.M)}
  assert found - LIBRARIES == tested, (
      "scripts without a test that runs them as a file: "
      f"{sorted(found - LIBRARIES - tested)}")
  importers = "".join(open(os.path.join(EXAMPLES, f"{n}.py")).read()
                      for n in found - LIBRARIES)
  for name in LIBRARIES:
    with open(os.path.join(EXAMPLES, f"{name}.py")) as f:
      assert "__main__" not in f.read(), f"{name}.py is a script: run it"
    assert re.search(rf"^(import|from) {name}\b", importers, flags=re.M), name


def test_lesson_counts_the_logit_gradients_float16_flushes():
  lesson = import_example("loss_scaling_lesson")
  # Two positions with logits (0, -20): the second class's gradient is
  # e**-20 / 4 = 5e-10, below float16's range; the first is exactly 0 in
  # float32 (1 - 2e-9 rounds to 1). Two positions with logits (0, 0):
  # gradients +-1/8. So 2 of the 6 nonzero entries flush without a scale.
  logits = jnp.array([[[0., -20.], [0., 0.]]] * 2)
  targets = jnp.zeros((2, 2), jnp.int32)
  percent = lambda scale, dtype: float(lesson.underflowed_percent(
      logits, targets, scale, dtype))
  assert percent(1., jnp.float16) == pytest.approx(100 * 2 / 6)
  assert percent(2.**15, jnp.float16) == 0.
  assert percent(1., jnp.bfloat16) == 0.


# --- Bad flags: a clear message at start-up, no traceback ---------------------


# Ten subprocesses (45 s of CPU) checking absl flag parsing, which does not
# depend on JAX's version: once, in CI's newest job (-m ci).
@pytest.mark.ci
@pytest.mark.parametrize("example, flag, message", [
    ("digits_cnn", "--mp_scale_type=Bogus",
     "flag --mp_scale_type=Bogus: value should be one of <NoOp|Static|Dynamic>"),
    ("digits_cnn", "--mp_policy=p=f17", "flag --mp_policy=p=f17:"),
    ("digits_cnn", "--mp_bn_policy=fulll", "flag --mp_bn_policy=fulll:"),
    ("digits_cnn", "--channels=4,x", "--channels must be a comma-separated"),
    ("char_transformer", "--corpus_files=bisect.py,missing.py",
     "no such file: missing.py"),
    ("char_transformer", "--attention_policy=c=f17",
     "flag --attention_policy=c=f17:"),
    ("loss_scaling_lesson", "--d_model=10", "--d_model must be a multiple"),
    ("optimizer_lesson", "--modes=master,sr",
     "--modes must be a comma-separated, non-empty subset of ('master', "),
    ("digits_cnn", "--plot=/dev/null/plots/x.png", "cannot write into"),
    ("digits_cnn", "--plot=.", "is a folder; give a file name"),
])
def test_bad_flag_fails_at_start_up(tmp_path, example, flag, message):
  rc, out, err = run_example(example, flag, "--steps=1", cwd=tmp_path,
                             timeout=120)
  assert rc != 0
  assert "FATAL Flags parsing error" in err
  assert message in err
  assert "Traceback" not in err
  assert "step" not in out  # Nothing trained.
  if "f17" in flag:  # A bad policy: get_policy's message is quoted after.
    assert "f17" in err.split(message)[1]


# --- The shared report ---------------------------------------------------------


def test_plot_has_a_panel_per_series_and_a_difference_panel(tmp_path):
  report = import_example("mp_report")
  import matplotlib.image  # pylint: disable=g-import-not-at-top

  def run(name, scale_type, losses, extra=None):
    log = report.Log(name, len(losses), log_every=0)
    for i, loss in enumerate(losses):
      log.record(loss, 1., True, **({k: v[i] for k, v in extra.items()}
                                     if extra else {}))
    return report.Run(name, "full", scale_type, {}, log)

  runs = [run("f32", "NoOp", [2., 1.]),
          run("f16", "Dynamic", [2., 1.], {"underflow": [0., 5.]})]
  height = lambda name: matplotlib.image.imread(tmp_path / name).shape[0]
  report.plot(runs, str(tmp_path / "two.png"))
  report.plot(runs[:1], str(tmp_path / "one.png"))
  report.plot(runs[:1], str(tmp_path / "new" / "folder" / "one.png"))
  assert (tmp_path / "new" / "folder" / "one.png").stat().st_size > 0
  # 2.6 inches at 100 dpi per panel: loss, difference, scale, underflow.
  assert height("two.png") == 4 * 260
  assert height("one.png") == 260  # Just the loss: no scale, no extras.


def test_explain_column_is_the_library_summary():
  report = import_example("mp_report")
  f = mpolicy.amp(lambda x, w: jnp.exp(x.astype(jnp.bfloat16) @ w),
                  "p=f32,c=bf16,o=f32")
  x, w = jnp.ones((2, 3)), jnp.ones((3, 4))
  line = report.explain_summary(f, x, w)
  assert line == mpolicy.explain(f, x, w).summary() == (
      "3 ops: 2 bfloat16, 1 float32; "
      "casts: 1 by op rules, 0 by module policies, 1 in the code")
  assert SUMMARY.fullmatch(line)


# --- Flax and Equinox ------------------------------------------------------------


@pytest.mark.ci  # Runs the script, 8 s on 2 cores.
def test_flax_example_runs_as_a_file(tmp_path):
  pytest.importorskip("flax")
  rc, out, err = run_example("flax_mlp", "--steps=3", "--batch_size=16",
                             "--log_every=1", cwd=tmp_path)
  assert_ok(rc, out, err)
  assert "| f32 | p=f32,c=f32,o=f32 | NoOp |" in out
  assert "| bf16 | p=f32,c=bf16,o=f32 | NoOp |" in out
  assert all(SUMMARY.fullmatch(c) for c in explain_cells(out).values())
  assert "[bf16] step     3/3" in out


@pytest.mark.ci  # 4-5 s, once: in CI's newest job, beside the file's run.
def test_flax_example_step_multiplies_in_bfloat16_and_updates_stats():
  pytest.importorskip("flax")
  flax_mlp = import_example("flax_mlp")
  params, stats, opt_state, step, _ = flax_mlp.setup("p=f32,c=bf16,o=f32",
                                                     hidden=16)
  x, y = jnp.ones((8, 64)), jnp.arange(8) % 10
  ls = mpolicy.NoOpLossScale()
  # Forward and backward of both layers.
  assert bf16_dots(step, params, stats, opt_state, ls, x, y) >= 4
  f32_step = flax_mlp.setup("full", hidden=16)[3]
  assert bf16_dots(f32_step, params, stats, opt_state, ls, x, y) == 0
  out = step(params, stats, opt_state, ls, x * jnp.arange(64.), y)
  assert bool(out.grads_finite)
  mean = out.model_state["norm"]["mean"][...]
  assert mean.dtype == jnp.float32 and float(jnp.abs(mean).max()) > 0


@pytest.mark.ci  # Runs the script, 5 s on 2 cores.
def test_equinox_example_runs_as_a_file(tmp_path):
  pytest.importorskip("equinox")
  rc, out, err = run_example("equinox_mlp", "--steps=3", "--batch_size=16",
                             "--log_every=1", "--nocompare",
                             "--mp_policy=p=f32,c=f16,o=f32",
                             "--mp_scale_type=Dynamic", cwd=tmp_path)
  assert_ok(rc, out, err)
  assert "| f16+dynamic | p=f32,c=f16,o=f32 | Dynamic |" in out
  assert SUMMARY.fullmatch(explain_cells(out)["f16+dynamic"])
  assert "| f32 |" not in out


@pytest.mark.ci  # 4-5 s, once: in CI's newest job, beside the file's run.
def test_equinox_example_step_multiplies_in_bfloat16():
  pytest.importorskip("equinox")
  equinox_mlp = import_example("equinox_mlp")
  model, opt_state, step, forward = equinox_mlp.setup("p=f32,c=bf16,o=f32",
                                                      hidden=16)
  x, y = jnp.ones((8, 64)), jnp.arange(8) % 10
  ls = mpolicy.DynamicLossScale(jnp.float32(2.**15))
  assert bf16_dots(step, model, opt_state, ls, x, y) >= 4
  assert forward(model, x).dtype == jnp.float32
  new_model, _, _, loss, finite = step(model, opt_state, ls, x, y)
  assert bool(finite) and np.isfinite(float(loss))
  assert not np.array_equal(new_model.hidden.weight, model.hidden.weight)


# --- Slow checks, in process ----------------------------------------------------


@pytest.fixture(scope="module")
def digits():
  return import_example("digits_cnn"), import_example("digits_data").load_digits()


@pytest.mark.slow
def test_bfloat16_accuracy_within_half_a_point_of_float32(digits):
  digits_cnn, data = digits
  f32 = digits_cnn.train(data, policy="full", log_every=0)
  bf16 = digits_cnn.train(data, policy="p=f32,c=bf16,o=f32", log_every=0)
  acc32 = 100 * f32.metrics["test accuracy"]
  acc16 = 100 * bf16.metrics["test accuracy"]
  assert acc32 > 95
  assert abs(acc16 - acc32) <= 0.5, (acc16, acc32)


@pytest.mark.slow
@pytest.mark.parametrize("initial_scale", [2.0**15, 2.0**30])
def test_float16_dynamic_scale_never_puts_nan_in_params(digits, initial_scale):
  digits_cnn, data = digits
  bad_steps = []

  def check(step, params, state):
    leaves = jax.tree_util.tree_leaves((params, state))
    if not all(np.isfinite(np.asarray(x)).all() for x in leaves):
      bad_steps.append(step)

  result = digits_cnn.train(data, policy="p=f32,c=f16,o=f32",
                            scale_type="Dynamic", scale_value=initial_scale,
                            log_every=0, callback=check)
  assert not bad_steps, f"non-finite params after steps {bad_steps[:5]}"
  assert all(np.isfinite(result.log.scale))
  if initial_scale > 2.0**20:  # Too big for float16: it must have backed off.
    assert result.log.skipped > 0
    assert result.log.scale[-1] < initial_scale
  assert result.metrics["test accuracy"] > 0.95


@pytest.mark.parametrize("flag", [
    # CI's newest job runs this one after the default run (7 s on 2 cores).
    pytest.param("", marks=pytest.mark.ci),
    # CI's oldest job runs these (.ci/run); tests/test_distributed.py checks
    # the same modes in process.
    pytest.param("--fsdp", marks=pytest.mark.slow),
    pytest.param("--shard_map", marks=pytest.mark.slow)])
def test_data_parallel_runs_as_a_file_and_compares_with_one_device(tmp_path,
                                                                   flag):
  rc, out, err = run_example("data_parallel", "--steps=3", "--batch_size=16",
                             *([flag] if flag else []), cwd=tmp_path)
  assert_ok(rc, out, err)
  mode = flag.lstrip("-") or "jit"
  assert f"{mode} on 8 devices: final loss" in out, out
  assert "one device:" in out and "max |param difference|" in out, out


@pytest.mark.slow
@pytest.mark.parametrize("flag", [
    "",
    # Run on request (-m slow); tests/test_distributed.py checks the same
    # modes in process.
    pytest.param("--fsdp", marks=pytest.mark.slow),
    pytest.param("--shard_map", marks=pytest.mark.slow)])
def test_data_parallel_runs_in_two_processes(tmp_path, flag):
  # The script starts itself twice (4 devices each), joined over localhost;
  # the whole process group is killed if it runs too long.
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep
             + os.environ.get("PYTHONPATH", ""))
  env.pop("XLA_FLAGS", None)
  proc = subprocess.Popen(
      [sys.executable, os.path.join(EXAMPLES, "data_parallel.py"),
       "--steps=3", "--batch_size=16", "--num_processes=2",
       *([flag] if flag else [])], cwd=tmp_path, env=env, text=True,
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
  try:
    out, err = proc.communicate(timeout=300)
  finally:
    if proc.poll() is None:
      os.killpg(proc.pid, 9)
      proc.wait()
  assert_ok(proc.returncode, out, err)
  mode = flag.lstrip("-") or "jit"
  assert f"{mode} on 8 devices in 2 processes: final loss" in out, out
  assert out.count("final loss") == 1, out  # Process 0 reports.
  # The same figures as one process with 8 devices.
  rc, one_out, one_err = run_example("data_parallel", "--steps=3",
                                     "--batch_size=16",
                                     *([flag] if flag else []), cwd=tmp_path)
  assert_ok(rc, one_out, one_err)
  figures = lambda text: re.findall(r"\d+\.\d+(?:e[-+]\d+)?", text)
  assert figures(out) == figures(one_out), (out, one_out)
