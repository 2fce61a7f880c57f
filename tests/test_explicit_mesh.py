"""Gradients of `transform_amp` on a mesh built with `jax.make_mesh`.

A batch sharded over ``"data"``, parameters left on one device (as
``init`` made them), the mesh in use through `jax.set_mesh`: with
explicit axes, JAX cannot guess the sharding of a weight gradient that
contracts the sharded batch, so mpolicy's transposes name it as JAX's own
`dot_general` transpose does. Axis types are named (``axis_types=``), so
the tests mean the same on every supported JAX. One subprocess with 8
simulated CPU devices computes every fact (a failure is recorded as that
case's error); the tests assert on them.
"""

from __future__ import annotations

import pytest

from _helpers import facts_on_eight_devices


_SCRIPT = r'''
import json
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import mpolicy
from _helpers import all_eqns, multiplies_in

assert jax.device_count() == 8
HALF = "p=f32,c=bf16,o=f32"
mpolicy.set_policy(hk.Module, HALF)
mpolicy.set_policy(hk.BatchNorm, "full")


def mlp(x):
  return hk.nets.MLP([32, 16, 4])(x.reshape(x.shape[0], -1))


def conv(x):
  x = hk.Conv2D(8, 3)(x)
  x = jax.nn.relu(hk.BatchNorm(True, True, 0.9)(x, True))
  return hk.Linear(4)(x.reshape(x.shape[0], -1))


x = jax.random.normal(jax.random.PRNGKey(1), (32, 6, 6, 2))


def flat(tree):
  return np.concatenate([np.ravel(np.asarray(a, np.float32))
                         for a in jax.tree_util.tree_leaves(tree)])


def relerr(a, b):
  a, b = flat(a), flat(b)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def amp_ops(fn, *args):
  """The dtype every amp matmul / convolution in the jaxpr multiplies in."""
  return [str(multiplies_in(e)[0]) for e in all_eqns(fn, *args)
          if e.primitive.name.startswith("amp_")]


CASES = __CASES__
facts = {}
for name, forward in (("mlp", mlp), ("conv", conv)):
  plain = hk.transform_with_state(forward)
  amped = mpolicy.transform_amp_with_state(forward)
  params, state = plain.init(jax.random.PRNGKey(0), x)

  def grad_of(apply):
    loss = lambda p, x: jnp.mean(apply(p, state, None, x)[0] ** 2)
    return jax.jit(jax.grad(loss))

  want_plain = grad_of(plain.apply)(params, x)  # One device, float32.
  want_amp = grad_of(amped.apply)(params, x)    # One device, bf16.
  facts[name] = {"one_device_vs_plain": relerr(want_amp, want_plain)}
  for case in CASES:
    if not case.startswith(name + "/"):
      continue
    _, types, placement = case.split("/")
    placed = placement == "placed"
    mesh = jax.make_mesh((8,), ("data",),
                         axis_types=(getattr(AxisType, types),))
    with jax.set_mesh(mesh):
      xs = jax.device_put(x, NamedSharding(mesh, P("data")))
      ps = (jax.device_put(params, NamedSharding(mesh, P())) if placed
            else params)
      out = {}
      for who, apply in (("plain", plain.apply), ("amp", amped.apply)):
        try:
          got = grad_of(apply)(ps, xs)
          out[who] = {"vs_plain": relerr(got, want_plain),
                      "vs_one_device": relerr(got, want_amp if who == "amp"
                                              else want_plain)}
        except Exception as e:  # Recorded: one case does not hide others.
          out[who] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
      if "error" not in out["amp"]:
        out["amp"]["ops"] = amp_ops(grad_of(amped.apply), ps, xs)
      facts[case] = out

print("FACTS=" + json.dumps(facts))
'''

# The bugs' cases run by default; the slow sweep adds dense layers on a
# placed mesh and both models under Auto axes.
CASES = ["mlp/Explicit/unplaced", "conv/Explicit/unplaced",
         "conv/Explicit/placed"]
ALL_CASES = [f"{m}/{c}" for m in ("mlp", "conv")
             for c in ("Explicit/unplaced", "Explicit/placed", "Auto/unplaced")]
EIGHT_DEVICES = _SCRIPT.replace("__CASES__", repr(CASES))


def _check_gradient(facts, case):
  got = facts[case]["amp"]
  assert "error" not in got, got
  # The same program as on one device; the order of sums differs, and
  # with it an occasional bfloat16 rounding.
  assert got["vs_one_device"] < 5e-3, got
  # As close to plain Haiku's gradient as on one device.
  one_device = facts[case.split("/")[0]]["one_device_vs_plain"]
  assert one_device < 3e-2 and got["vs_plain"] < 1.25 * one_device, (
      got, one_device)
  # Each layer's forward and weight-gradient products, and every input
  # gradient but the first layer's: all half x half.
  layers = 3 if case.startswith("mlp") else 2
  assert len(got["ops"]) == 3 * layers - 1, got
  assert set(got["ops"]) == {"bfloat16"}, got


def _check_plain_parity(facts, case):
  plain, amp = facts[case]["plain"], facts[case]["amp"]
  if "error" in plain:
    # Only JAX's own convolution transpose, with a kernel on no mesh: JAX
    # cannot name its gradient's sharding; mpolicy's transpose does.
    assert case == "conv/Explicit/unplaced", plain
    assert "ShardingTypeError" in plain["error"], plain
  else:
    assert plain["vs_plain"] < 1e-5, plain
  assert "error" not in amp, amp


@pytest.mark.ci  # An 8-device script, 11 s on 2 cores.
@pytest.mark.parametrize("case", CASES)
def test_the_gradient_is_one_devices_and_stays_bfloat16(eight_devices, case):
  _check_gradient(eight_devices, case)


@pytest.mark.ci  # The same script (see above).
@pytest.mark.parametrize("case", CASES)
def test_where_plain_haiku_runs_amp_runs_too(eight_devices, case):
  _check_plain_parity(eight_devices, case)


@pytest.mark.slow
def test_every_model_on_explicit_and_auto_meshes():
  facts = facts_on_eight_devices(_SCRIPT.replace("__CASES__", repr(ALL_CASES)))
  for case in ALL_CASES:
    _check_gradient(facts, case)
    _check_plain_parity(facts, case)
