"""One loss-scaled driver: every gradient function runs on `scaling.drive`.

`scaled_value_and_grad`, `make_train_step` and gradient accumulation share
one implementation of scale, differentiate, unscale, check and adjust;
accumulation supplies only how one attempt's gradients are computed. The
house limits (functions of at most 60 code lines, files of at most 600
lines) are checked over the whole package here.
"""

from __future__ import annotations

import ast
import io
import pathlib
import re
import tokenize

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpolicy
from mpolicy._src.training import accumulation
from mpolicy._src.training import microbatches
from mpolicy._src.training import scaling

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "mpolicy"


def _loss(p, x, y):
  return jnp.mean((x @ p["w"] - y) ** 2)


def _params_and_batch():
  x = jnp.linspace(-1., 1., 24, dtype=jnp.float32).reshape(8, 3)
  y = jnp.linspace(0., 2., 8, dtype=jnp.float32).reshape(8, 1)
  return {"w": jnp.full((3, 1), 0.5, jnp.float32)}, x, y


@pytest.mark.parametrize("build", ["scaled_value_and_grad", "k=1", "k=4",
                                   "sum_count"])
def test_every_gradient_function_runs_on_the_one_driver(monkeypatch, build):
  calls = []
  drive = scaling.drive

  def counting(attempt, *args, **kwargs):
    calls.append(attempt)
    return drive(attempt, *args, **kwargs)

  monkeypatch.setattr(scaling, "drive", counting)
  tx = optax.sgd(0.1)
  params, x, y = _params_and_batch()
  ls = mpolicy.DynamicLossScale(jnp.float32(2. ** 10))
  if build == "scaled_value_and_grad":
    out = mpolicy.scaled_value_and_grad(_loss)(ls, params, x, y)
    grads = out[3]
  else:
    if build == "sum_count":
      loss_fn = lambda p, x, y: (jnp.sum((x @ p["w"] - y) ** 2), x.shape[0])
      step = mpolicy.make_train_step(loss_fn, tx, microbatches=2,
                                     loss_reduction="sum_count")
    else:
      step = mpolicy.make_train_step(_loss, tx, microbatches=int(build[2:]))
    out = step(params, tx.init(params), ls, x, y)
    grads = jax.tree_util.tree_map(lambda a, b: (a - b) / 0.1, params,
                                   out.params)
  assert len(calls) == 1
  want = jax.grad(_loss)(params, x, y)
  np.testing.assert_allclose(np.asarray(grads["w"]), np.asarray(want["w"]),
                             rtol=2e-6)
  new_scale = out[0] if build == "scaled_value_and_grad" else out.loss_scale
  assert float(new_scale.loss_scale) == 2. ** 10


def test_accumulation_takes_no_private_name_of_scaling():
  source = pathlib.Path(accumulation.__file__).read_text()
  assert not re.findall(r"scaling\._\w+", source)
  assert "jax.value_and_grad" not in source  # It differentiates in scaling.


def test_a_retry_redoes_the_whole_accumulated_attempt_at_a_lower_scale():
  """max_retries runs on the driver for accumulation too: a float16
  cotangent of 2**17 or 2**16 is inf, so the step backs off twice and
  applies the mean gradient at 2**15 (the loss is linear, so no product
  in its backward pass can overflow at 2**15, however XLA orders it)."""
  loss = lambda p, x: jnp.sum(p["w"].astype(jnp.float16) * x)
  tx = optax.sgd(1e-3)
  params = {"w": jnp.ones(4, jnp.float32)}
  x = jnp.full((4, 4), 1 / 16, jnp.float16)
  ls = mpolicy.DynamicLossScale(jnp.float32(2. ** 17))
  step = mpolicy.make_train_step(loss, tx, microbatches=2, max_retries=3)
  out = jax.jit(step)(params, tx.init(params), ls, x)
  assert bool(out.grads_finite)
  assert float(out.loss_scale.loss_scale) == 2. ** 15
  # Each microbatch sums 2 rows: d/dw = 2 / 16; the mean of the two too.
  np.testing.assert_array_equal(np.asarray(out.params["w"]),
                                np.float32(1) - np.float32(1e-3 / 8))
  out = jax.jit(mpolicy.make_train_step(loss, tx, microbatches=2))(
      params, tx.init(params), ls, x)
  assert not bool(out.grads_finite)
  assert float(out.loss_scale.loss_scale) == 2. ** 16


@pytest.mark.parametrize("shape", [(12,), (12, 2), (12, 1, 3)])
@pytest.mark.parametrize("k", [1, 3, 4])
def test_the_split_is_strided(shape, k):
  """Microbatch i holds rows i, i + k, ..."""
  x = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
  batch = microbatches.split((x,), {}, k, None, None, "test")
  assert batch.xs[0].shape == (k, 12 // k) + shape[1:]
  for i in range(k):
    np.testing.assert_array_equal(np.asarray(batch.xs[0][i]), x[i::k])


# --- The house limits -------------------------------------------------------


def _code_lines(path: pathlib.Path) -> list[tuple[int, str]]:
  """`(code lines, name)` per function: lines holding code, not blank,
  comment-only or docstring lines (nested functions count in theirs)."""
  source = path.read_text()
  tree = ast.parse(source)
  docs = set()
  for node in ast.walk(tree):
    body = getattr(node, "body", None)
    if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                          ast.AsyncFunctionDef)) and body
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)):
      docs.update(range(body[0].lineno, body[0].end_lineno + 1))
  skip = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
          tokenize.DEDENT, tokenize.ENDMARKER)
  code = set()
  for tok in tokenize.generate_tokens(io.StringIO(source).readline):
    if tok.type not in skip:
      code.update(l for l in range(tok.start[0], tok.end[0] + 1)
                  if l not in docs)
  return [(sum(l in code for l in range(node.lineno, node.end_lineno + 1)),
           f"{path}:{node.lineno} {node.name}")
          for node in ast.walk(tree)
          if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_no_function_is_over_60_code_lines():
  sizes = [s for p in sorted(PACKAGE.rglob("*.py")) for s in _code_lines(p)]
  assert len(sizes) > 500  # The whole package was read.
  assert [s for s in sizes if s[0] > 60] == []


def test_no_file_is_over_600_lines():
  lengths = {str(p.relative_to(ROOT)): len(p.read_text().splitlines())
             for p in PACKAGE.rglob("*.py")}
  assert lengths["mpolicy/_src/loss_scale.py"] > 100
  assert {p: n for p, n in lengths.items() if n > 600} == {}


def test_the_line_counter_counts_code_only(tmp_path):
  path = tmp_path / "m.py"
  path.write_text('def f(x):\n  """Doc.\n\n  More.\n  """\n  # A comment.\n\n'
                  '  y = (x +\n       1)\n  return y\n')
  assert _code_lines(path)[0][0] == 4
