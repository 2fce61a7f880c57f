"""The porting recipes (examples/porting/*.py, shown in docs/porting.md) run as written."""

import pathlib
import re
import runpy

import jax
import pytest

import mpolicy

# 4-7 s each: once, in CI's newest job; CI's oldest job runs every recipe
# as a file (tests/test_examples.py, -k porting_recipe).
pytestmark = pytest.mark.ci

ROOT = pathlib.Path(__file__).resolve().parent.parent
PORTING = ROOT / "examples" / "porting"
RECIPES = ("haiku_jmp.py", "haiku_f32.py", "flax_linen.py", "equinox_mlp.py")


def _run(name: str) -> dict:
  return runpy.run_path(str(PORTING / name), run_name="__main__")


def _dots(report) -> dict:
  """Each matmul row's scope -> the dtype it ran in."""
  return {r.scope: r.ran_in for r in report.rows
          if r.primitive.endswith("dot_general")}


def test_every_recipe_is_shown_in_the_porting_page_as_it_is_in_its_file():
  page = (ROOT / "docs" / "porting.md").read_text()
  blocks = re.findall(r"```py\n(.*?)```", page, flags=re.S)
  for name in RECIPES:
    text = (PORTING / name).read_text()
    assert text in blocks, f"docs/porting.md does not show examples/porting/{name}"
  assert sorted(p.name for p in PORTING.glob("*.py")) == sorted(RECIPES)


def test_haiku_jmp_recipe_ports_policies_and_loss_scale(capsys):
  ns = _run("haiku_jmp.py")
  assert "loss scale 32768.0" in capsys.readouterr().out
  report = mpolicy.explain(ns["model"].apply, ns["params"], None, ns["x"])
  assert set(_dots(report).values()) == {"bfloat16"}
  norm = [r for r in report.rows if r.module_class == "hk.LayerNorm"]
  assert norm and all(r.ran_in == "float32" for r in norm)
  assert isinstance(ns["loss_scale"], mpolicy.DynamicLossScale)


def test_float32_haiku_recipe_multiplies_in_bf16_with_f32_params():
  ns = _run("haiku_f32.py")
  report = mpolicy.explain(ns["model"].apply, ns["params"], None, ns["x"])
  assert list(_dots(report).values()) == ["bfloat16"] * 3
  assert ns["model"].apply(ns["params"], None, ns["x"]).dtype == "float32"


def test_flax_linen_recipe_runs_batchnorm_in_f32_and_dense_in_bf16():
  pytest.importorskip("flax")
  ns = _run("flax_linen.py")
  variables = {"params": ns["params"], "batch_stats": ns["batch_stats"]}
  report = mpolicy.explain(ns["apply"], variables, ns["x"], False)
  assert set(_dots(report).values()) == {"bfloat16"}
  norm = [r for r in report.rows if r.module_class == "nn.BatchNorm"]
  assert norm and all(r.ran_in == "float32" for r in norm)


def test_equinox_recipe_runs_the_named_head_in_f32():
  pytest.importorskip("equinox")
  ns = _run("equinox_mlp.py")
  dots = _dots(mpolicy.explain(ns["forward"], ns["model"], ns["x"]))
  head = [ran for scope, ran in dots.items() if "head" in scope]
  body = [ran for scope, ran in dots.items() if "head" not in scope]
  assert head == ["float32"] and body and set(body) == {"bfloat16"}
