"""The README's Python examples run as written and do what it says they do.

The blocks run once, in order, as a reader would run them; while the
registry still holds the policies they set, the fixture records what the
README promises about them (dtypes, `explain`'s rows, the lowered program,
a non-finite step), and each test checks one promise.
"""

import contextlib
import io
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpolicy

from _helpers import same_bits

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def _python_blocks():
  text = README.read_text()
  return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def _dtypes(tree):
  return set(str(np.asarray(x).dtype) if not hasattr(x, "dtype")
             else str(x.dtype) for x in jax.tree_util.tree_leaves(tree))


def _ran_in(report, primitive, **where):
  """The dtypes the rows of ``primitive`` ran in (matching ``where``)."""
  return [r.ran_in for r in report.rows if r.primitive.endswith(primitive)
          and all(getattr(r, k) == v for k, v in where.items())]


def _dots(hlo_text):
  """``(operand dtypes, result dtype)`` of every dot_general in StableHLO."""
  return re.findall(r"stablehlo\.dot_general .*: \(tensor<[\dx]*x(\w+)>, "
                    r"tensor<[\dx]*x(\w+)>\) -> tensor<[\dx]*x(\w+)>",
                    hlo_text)


@pytest.fixture(scope="module")
def readme():
  mpolicy.clear_policies()
  ns, out, after = {}, io.StringIO(), []
  with contextlib.redirect_stdout(out):
    for block in _python_blocks():
      exec(compile(block, str(README), "exec"), ns)  # pylint: disable=exec-used
      after.append(dict(ns))  # Later blocks reuse names (`y`).
  ns = next(a for a in after if "train_step" in a)  # The Haiku quickstart.
  facts = {"haiku_ns": ns, "printed": out.getvalue()}
  model, params, state, x = ns["model"], ns["params"], ns["state"], ns["x"]
  facts["haiku"] = mpolicy.explain(model.apply, params, state, None, x, True)
  # A step whose gradients are not finite (a NaN input).
  # The README's step donates its first three arguments: it gets copies, so
  # the originals stay readable for the comparison.
  before = (params, state, ns["opt_state"], ns["loss_scale"])
  copies = jax.tree.map(jnp.copy, before)
  facts["nan_step"] = before, ns["train_step"](
      *copies, x.at[0, 0, 0, 0].set(jnp.nan), ns["y"])
  ns = facts["ns"] = after[-1]  # The quickstart of any JAX function.
  fast, weights, inputs = ns["fast"], ns["weights"], ns["inputs"]
  facts["fast"] = mpolicy.explain(fast, weights, inputs)
  facts["fast_grad_hlo"] = jax.jit(jax.grad(
      lambda w, i: fast(w, i).sum())).lower(weights, inputs).as_text()
  facts["regions"] = mpolicy.explain(mpolicy.amp(ns["f"]), inputs, weights[0])
  mpolicy.clear_policies()
  return facts


def test_readme_has_examples():
  assert len(_python_blocks()) >= 3


def test_haiku_params_and_batchnorm_state_are_float32(readme):
  ns = readme["haiku_ns"]
  assert _dtypes(ns["params"]) == {"float32"}  # p=f32 for every module.
  # BatchNorm's averages in float32 (its counters are int32).
  assert _dtypes(ns["state"]) == {"float32", "int32"}
  assert all(x.dtype == jnp.float32 for path, x in
             jax.tree_util.tree_flatten_with_path(ns["state"])[0]
             if "counter" not in jax.tree_util.keystr(path))


def test_haiku_step_is_finite_and_keeps_the_loss_scale(readme):
  ns = readme["haiku_ns"]
  assert np.isfinite(float(ns["loss"])) and ns["loss"].dtype == jnp.float32
  assert float(ns["loss_scale"].loss_scale) == 2. ** 15
  assert int(ns["loss_scale"].counter) == 1  # One finite step counted.


def test_haiku_non_finite_step_changes_nothing_but_the_loss_scale(readme):
  (params, state, opt_state, loss_scale), out = readme["nan_step"]
  new_params, new_state, new_opt_state, new_loss_scale, loss = out
  assert not np.isfinite(float(loss))
  assert same_bits(new_params, params) and same_bits(new_state, state)
  assert same_bits(new_opt_state, opt_state)
  assert float(new_loss_scale.loss_scale) == float(loss_scale.loss_scale) / 2


def test_haiku_explain_shows_half_convs_and_matmuls_and_float32_batchnorm(
    readme):
  report = readme["haiku"]
  assert _ran_in(report, "conv_general_dilated") == ["bfloat16"]
  assert _ran_in(report, "dot_general", module_class="hk.Linear") == [
      "bfloat16"]
  norm = _ran_in(report, "", module_class="hk.BatchNorm")
  assert len(norm) > 5 and set(norm) == {"float32"}
  # The printed table is the same report: a row per primitive, and why.
  printed = readme["printed"]
  assert str(report) in printed
  assert re.search(r"conv_general_dilated +bfloat16,bfloat16 +bfloat16 +"
                   r"lower \(convolution: half inputs, float32 accumulation",
                   printed)
  assert "from class hk.BatchNorm" in printed


def test_any_function_matmuls_are_bf16_with_float32_accumulation(readme):
  assert readme["ns"]["fast"](readme["ns"]["weights"],
                              readme["ns"]["inputs"]).dtype == jnp.float32
  assert _ran_in(readme["fast"], "dot_general") == ["bfloat16"] * 3
  # Forward and backward: bf16 x bf16 operands, float32 results.
  dots = _dots(readme["fast_grad_hlo"])
  assert len(dots) == 8, readme["fast_grad_hlo"]
  assert set(dots) == {("bf16", "bf16", "f32")}
  assert _dtypes(readme["ns"]["grads"]) == {"float32"}


def test_any_function_log_softmax_runs_exp_log_and_sums_in_float32(readme):
  report = readme["fast"]
  for primitive in ("exp", "log", "reduce_sum"):
    ran = _ran_in(report, primitive, rule="full")
    assert ran and set(ran) == {"float32"}, primitive


def test_regions_encoder_in_bf16_full_precision_as_written(readme):
  report = readme["regions"]
  assert _ran_in(report, "dot_general", scope="encoder") == ["bfloat16"]
  (row,) = [r for r in report.rows
            if r.primitive.endswith("dot_general") and r.scope != "encoder"]
  # `h @ w.T` as written: bf16 h with f32 w promotes to float32.
  assert row.ran_in == "float32" and row.decided_by == "full_precision()"
  assert readme["ns"]["y"].dtype == jnp.float32


# --- The main job's printed output ------------------------------------------------

EXAMPLES = README.parent / "examples"
# Columns whose figures move with the machine's load: never compared.
TIMES = ("compile (s)", "train time (s)")


def fenced_blocks(text: str) -> list[tuple[str, str]]:
  """``(info string, body)`` of every fenced block, in order."""
  return re.findall(r"^```(\w*)\n(.*?)^```$", text, flags=re.S | re.M)


def _printed_block(marker: str) -> str:
  """The README's plain fenced block (printed output) containing ``marker``."""
  (block,) = [b for info, b in fenced_blocks(README.read_text())
              if not info and marker in b]
  return block


def _table(text: str) -> tuple[list[str], dict[str, dict[str, str]]]:
  """The columns and, per run, the cells of a printed `mp_report` table."""
  lines = [l for l in text.splitlines() if l.startswith("| ")]
  header = [c.strip() for c in lines[0].strip("|").split("|")]
  rows = {}
  for line in lines[1:]:
    cells = [c.strip() for c in line.strip("|").split("|")]
    rows[cells[0]] = dict(zip(header, cells))
  return header, rows


def _digits_cnn():
  import sys  # pylint: disable=import-outside-toplevel
  if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))
  import digits_cnn  # pylint: disable=import-outside-toplevel
  return digits_cnn


def _explain_cell(digits_cnn, data, policy, bn_policy):
  """The `explain` cell `digits_cnn.train` prints for a run (the same
  model, policies and call; no training: the counts do not depend on it)."""
  import haiku as hk  # pylint: disable=import-outside-toplevel
  forward = lambda x, is_training: digits_cnn.DigitsCNN()(x, is_training)
  # float32 params and state, as the runs' `p=f32` policies make them
  # (plain Haiku's init: `transform_amp`'s runs op by op, a minute).
  params, state = hk.transform_with_state(forward).init(
      jax.random.PRNGKey(0), data.x_train[:64], True)
  with mpolicy.push_policy(digits_cnn.DigitsCNN, policy), \
       mpolicy.push_policy(hk.BatchNorm, bn_policy):
    model = mpolicy.transform_amp_with_state(forward)
    return digits_cnn.mp_report.explain_summary(
        model.apply, params, state, None, data.x_test[:8], False)


def test_main_job_output_is_the_run_it_describes():
  """The README's table has the columns and runs `mp_report` prints, each
  with the policy its `explain` line was measured under, and that line is
  the one the script's model gives."""
  header, rows = _table(_printed_block("digits: 1437 train"))
  digits_cnn = _digits_cnn()
  assert header == _table(digits_cnn.mp_report.table(
      [], digits_cnn.METRICS))[0]
  assert list(rows) == ["f32", "bf16"]
  assert [r["policy"] for r in rows.values()] == [
      str(mpolicy.get_policy("full")),
      str(mpolicy.get_policy(digits_cnn.FLAGS["mp_policy"].default))]
  data = digits_cnn.digits_data.load_digits()
  assert rows["f32"]["explain"] == _explain_cell(digits_cnn, data, "full",
                                                 "full")
  assert rows["bf16"]["explain"] == _explain_cell(
      digits_cnn, data, digits_cnn.FLAGS["mp_policy"].default, "full") == (
          "38 ops: 19 bfloat16, 19 float32; "
          "casts: 0 by op rules, 12 by module policies, 0 in the code")


def test_the_op_rules_page_quotes_the_same_summary():
  _, rows = _table(_printed_block("digits: 1437 train"))
  page = " ".join((README.parent / "docs" / "op_rules.md").read_text().split())
  assert f"reads `{rows['bf16']['explain']}`" in page


def check_main_job_prints_the_readme_table(stdout: str) -> None:
  """The main job's output at its defaults (`python examples/digits_cnn.py`)
  is the README's table: tests/test_examples.py's
  test_digits_cnn_at_its_defaults_prints_the_readme_table_and_plots runs it
  once, as a file, for its own checks and these."""
  printed = _printed_block("digits: 1437 train")
  assert stdout.splitlines()[0].replace(
      jax.__version__, "0.10.2") == printed.splitlines()[0]
  header, rows = _table(printed)
  real_header, real_rows = _table(stdout)
  assert header == real_header and list(rows) == list(real_rows)
  for name, row in rows.items():
    for column in header:
      if column in TIMES:
        continue
      if column in ("test accuracy", "final loss"):
        # The same seed and batches; XLA:CPU's threaded reductions and
        # another JAX move the last digits (see docs/examples.md).
        tolerance = 0.01 if column == "test accuracy" else 0.001
        assert abs(float(row[column]) - float(real_rows[name][column])) <= (
            tolerance), (name, column, real_rows[name][column])
      else:
        assert row[column] == real_rows[name][column], (name, column)
