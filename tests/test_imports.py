"""`import mpolicy` needs only JAX and numpy; the other packages load on use.

Haiku, optax, Flax and orbax are loaded only when a name that needs them is
used, and a name whose package is missing raises an `ImportError` saying
what to install. Each check runs in a fresh interpreter, since the test
process has every package loaded already.
"""

import ast
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import mpolicy

REPO = pathlib.Path(mpolicy.__file__).resolve().parents[1]
OPTIONAL = ("haiku", "optax", "flax", "orbax")


def _facts(script: str) -> dict:
  """Runs ``script`` in a fresh Python; it prints ``FACTS=<json>``."""
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join(
                 p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
  proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)],
                        cwd=REPO, env=env, capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0, proc.stderr[-4000:]
  line = [l for l in proc.stdout.splitlines() if l.startswith("FACTS=")][-1]
  return json.loads(line[len("FACTS="):])


def test_import_and_amp_load_no_optional_package():
  facts = _facts(f"""
      import json, sys
      import jax.numpy as jnp
      import mpolicy
      loaded = {{"import": [m for m in {OPTIONAL!r} if m in sys.modules]}}
      f = mpolicy.amp(lambda x, w: jnp.exp(x @ w).sum(), "p=f32,c=bf16,o=f32")
      out = f(jnp.ones((2, 3)), jnp.ones((3, 4)))
      report = mpolicy.explain(f, jnp.ones((2, 3)), jnp.ones((3, 4)))
      grad_fn = mpolicy.scaled_value_and_grad(lambda w: f(jnp.ones((2, 3)), w))
      grads = grad_fn(mpolicy.StaticLossScale(8.0), jnp.ones((3, 4)))
      loaded["amp"] = [m for m in {OPTIONAL!r} if m in sys.modules]
      print("FACTS=" + json.dumps({{
          "loaded": loaded, "out": str(out.dtype),
          "rows": len(report.rows), "grad": str(grads[3].dtype),
          "value": float(out)}}))
      """)
  assert facts["loaded"] == {"import": [], "amp": []}
  assert facts["out"] == "float32" and facts["grad"] == "float32"
  assert abs(facts["value"] - 8 * 20.0855) < 0.5  # exp(3), 8 times.
  assert facts["rows"] >= 2


def test_each_name_loads_only_its_own_package():
  facts = _facts(f"""
      import json, sys
      import mpolicy
      def loaded():
        return [m for m in {OPTIONAL!r} if m in sys.modules]
      seen = {{}}
      for name in ("stochastic_round", "make_train_step", "save_checkpoint",
                   "transform_amp"):
        getattr(mpolicy, name)
        seen[name] = loaded()
      print("FACTS=" + json.dumps(seen))
      """)
  assert facts["stochastic_round"] == []
  assert facts["make_train_step"] == ["optax"]
  # The checkpoint functions import orbax's checkpointer when they run.
  assert "haiku" not in facts["save_checkpoint"]
  assert {"haiku", "optax"} <= set(facts["transform_amp"])


def test_a_missing_package_names_what_to_install():
  facts = _facts("""
      import importlib.abc, json, sys
      import jax.numpy as jnp

      class Blocker(importlib.abc.MetaPathFinder):
        # Finds nothing for the blocked packages, as if not installed.
        def find_spec(self, name, path=None, target=None):
          if name.split(".")[0] in ("haiku", "optax", "orbax", "flax"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
          return None

      sys.meta_path.insert(0, Blocker())
      import mpolicy
      errors = {}
      for name in ("transform_amp", "with_policies", "make_train_step",
                   "skip_nonfinite", "save_checkpoint", "CheckpointManager",
                   "training", "checkpoint", "debug"):
        try:
          getattr(mpolicy, name)
          errors[name] = None
        except ImportError as e:
          errors[name] = [type(e).__name__, str(e)]
      out = mpolicy.amp(lambda x: x * 2, "p=f32,c=bf16,o=f32")(jnp.ones(3))
      print("FACTS=" + json.dumps({"errors": errors, "amp": str(out.dtype)}))
      """)
  assert facts["amp"] == "float32"
  errors = facts["errors"]
  assert errors["transform_amp"] == [
      "ImportError", "mpolicy.transform_amp needs haiku, which is not "
      "installed: pip install dm-haiku"]
  assert errors["with_policies"][1].endswith("pip install dm-haiku")
  assert errors["make_train_step"][1] == (
      "mpolicy.make_train_step needs optax, which is not installed: "
      "pip install optax")
  assert errors["skip_nonfinite"][1].endswith("pip install optax")
  assert errors["save_checkpoint"][1] == (
      "mpolicy.save_checkpoint needs orbax.checkpoint, which is not "
      "installed: pip install orbax-checkpoint")
  assert errors["CheckpointManager"][1].endswith(
      "pip install orbax-checkpoint")
  assert errors["training"][1] == (
      "mpolicy.training needs optax, which is not installed: "
      "pip install optax")
  assert errors["checkpoint"][1].endswith("pip install orbax-checkpoint")
  assert errors["debug"] is None


def _type_checking_imports() -> dict:
  """``name -> module`` of the ``if TYPE_CHECKING:`` block of __init__."""
  tree = ast.parse((REPO / "mpolicy" / "__init__.py").read_text())
  found = {}
  for node in tree.body:
    if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
      for statement in node.body:
        for alias in statement.names:
          found[alias.asname or alias.name] = statement.module
  return found


def test_the_lazy_table_and_the_type_checking_imports_agree():
  lazy = {name: module for name, (module, _) in mpolicy._LAZY.items()}
  assert lazy == _type_checking_imports()
  assert len(lazy) == 25


def test_every_public_name_is_listed_and_resolves():
  assert set(mpolicy.__all__) <= set(dir(mpolicy))
  assert set(mpolicy._LAZY) <= set(mpolicy.__all__)
  for name, (module, _) in mpolicy._LAZY.items():
    assert getattr(mpolicy, name) is getattr(sys.modules[module], name)
  assert "transform_amp" in vars(mpolicy)  # Cached: read once.


def test_the_doors_are_attributes_loaded_on_first_use():
  facts = _facts(f"""
      import json, sys
      import mpolicy
      def loaded():
        return [m for m in {OPTIONAL!r} if m in sys.modules]
      seen = {{"import": loaded(),
               "dir": [d for d in ("training", "debug", "checkpoint")
                       if d in dir(mpolicy)]}}
      seen["debug"] = [mpolicy.debug.explain is mpolicy.explain, loaded()]
      seen["training"] = [
          mpolicy.training.make_train_step is mpolicy.make_train_step,
          loaded()]
      seen["checkpoint"] = [
          mpolicy.checkpoint.CheckpointManager is mpolicy.CheckpointManager,
          loaded()]
      print("FACTS=" + json.dumps(seen))
      """)
  assert facts["import"] == []
  assert facts["dir"] == ["training", "debug", "checkpoint"]
  assert facts["debug"] == [True, []]
  assert facts["training"] == [True, ["optax"]]
  assert facts["checkpoint"][0] is True
  assert "haiku" not in facts["checkpoint"][1]
