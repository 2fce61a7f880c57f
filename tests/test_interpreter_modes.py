"""The interpreter's modes: objects the one loop is given, not flags in it.

The loop (`eval_jaxpr` and the functions it calls, `Scope`) asks its
`Mode` at each decision; what differs between the rules, the sharing plan
and the replay lives in the mode classes. A new mode that leaves a decision
out cannot be made.
"""

from __future__ import annotations

import ast
import inspect
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mpolicy._src import interpreter
from mpolicy._src import policy as policy_lib
from mpolicy._src import regions
from mpolicy._src.amp import amp
from mpolicy._src.op_rules import DEFAULT_RULES

MODES = (interpreter.Rules, interpreter.Sharing, interpreter.Replay)
# What selects a mode, read anywhere: the replay's state, the sharing
# switch, a mode's type.
MODE_FLAGS = {"step", "sharing", "binds", "traced", "outs_read"}
MODE_NAMES = {"Rules", "Sharing", "Replay", "Step"}


def _outside_modes(tree: ast.Module):
  """The top-level statements of ``tree`` but the mode classes (and the
  replay's `Stepper`, which it lends to step rules) and `rules_mode` (which
  picks a mode from the rule table)."""
  for node in tree.body:
    if isinstance(node, ast.ClassDef) and node.name in {
        "Mode", "Stepper", *MODE_NAMES}:
      continue
    if isinstance(node, ast.FunctionDef) and node.name == "rules_mode":
      continue
    yield node


def _flag_checks(source: str) -> list[str]:
  found = []
  for top in _outside_modes(ast.parse(source)):
    for node in ast.walk(top):
      if isinstance(node, ast.Attribute) and node.attr in MODE_FLAGS:
        found.append(f"line {node.lineno}: .{node.attr}")
      if (isinstance(node, ast.Call) and ast.unparse(node.func) == "isinstance"
          and MODE_NAMES & {n.id for n in ast.walk(node.args[1])
                            if isinstance(n, ast.Name)}):
        found.append(f"line {node.lineno}: {ast.unparse(node)}")
  return sorted(found)


def test_the_loop_reads_no_mode_flag():
  source = pathlib.Path(interpreter.__file__).read_text()
  assert _flag_checks(source) == []
  # The scan finds such checks where they are.
  assert _flag_checks("def run(config):\n"
                      "  if config.step is not None:\n"
                      "    return config.rules.sharing\n"
                      "  return isinstance(config.mode, Replay)\n") == [
                          "line 2: .step", "line 3: .sharing",
                          "line 4: isinstance(config.mode, Replay)"]


def test_the_loop_asks_only_the_mode():
  """`observe.active()` is asked once in the loop: whether to tell the
  observers. What a watched run changes otherwise is the mode's."""
  source = pathlib.Path(interpreter.__file__).read_text()
  tree = ast.parse(source)
  calls = [(getattr(top, "name", None), node.lineno)
           for top in _outside_modes(tree) for node in ast.walk(top)
           if isinstance(node, ast.Call)
           and ast.unparse(node.func) == "observe.active"]
  assert [name for name, _ in calls] == ["_observed"], calls


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.__name__)
def test_each_mode_makes_every_decision(mode):
  decisions = interpreter.Mode.__abstractmethods__
  assert {"region", "enter", "shared", "liveness", "describe",
          "first_order", "higher_order", "reuses_traces"} == decisions
  assert not inspect.isabstract(mode)
  for name in decisions:
    assert getattr(mode, name) is not getattr(interpreter.Mode, name), name
  assert isinstance(mode(), interpreter.Mode)


@pytest.mark.parametrize(
    "left_out", sorted(interpreter.Mode.__abstractmethods__))
def test_a_mode_missing_a_decision_cannot_be_made(left_out):
  body = {name: (lambda self, *args: None)
          for name in interpreter.Mode.__abstractmethods__ if name != left_out}
  incomplete = type("Incomplete", (interpreter.Mode,), body)
  with pytest.raises(TypeError, match=left_out):
    incomplete()


def test_the_rule_table_picks_the_mode():
  assert type(interpreter.rules_mode(DEFAULT_RULES)) is interpreter.Sharing
  assert type(interpreter.rules_mode(
      DEFAULT_RULES.with_sharing(False))) is interpreter.Rules


def test_a_mode_given_to_the_loop_runs_it():
  """The same jaxpr under `Rules` (lowered to bfloat16) and `Replay` (as
  written), by the one loop."""
  closed = jax.make_jaxpr(lambda x, w: x @ w)(
      np.ones((2, 3), np.float32), np.ones((3, 4), np.float32))
  args = [jnp.full((2, 3), 1.0 + 2.0 ** -10, jnp.float32),
          jnp.ones((3, 4), jnp.float32)]
  half = "p=f32,c=bf16,o=f32"
  outer = regions.Region(policy=policy_lib.get_policy(half),
                         decided_by="test")
  ruled = interpreter.eval_jaxpr(
      closed.jaxpr, closed.consts, args,
      interpreter.Config(rules=DEFAULT_RULES, outer=outer,
                         mode=interpreter.Rules()), ())
  replayed = interpreter.replay(closed, args)
  assert ruled[0].dtype == jnp.bfloat16
  assert replayed[0].dtype == jnp.float32
  np.testing.assert_array_equal(
      replayed[0], np.full((2, 4), 3 * (1 + 2.0 ** -10), np.float32))
  np.testing.assert_array_equal(ruled[0].astype(np.float32),
                                np.full((2, 4), 3, np.float32))
  np.testing.assert_array_equal(amp(lambda x, w: x @ w, policy=half)(*args),
                                ruled[0].astype(np.float32))
