"""Helpers shared by the tests: walking jaxprs, comparing bits, poisoning
gradients, running on 8 devices."""

import jax
import jax.numpy as jnp
import numpy as np

from mpolicy._src import jax_compat


def walk_eqns(jaxpr):
  """Every equation of a (closed or open) jaxpr, sub-jaxprs included."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in jax_compat.jaxprs_in_params(eqn.params):
      yield from walk_eqns(sub)


def all_eqns(fn, *args):
  """Every equation of ``fn``'s jaxpr at ``args``, sub-jaxprs included."""
  return list(walk_eqns(jax.make_jaxpr(fn)(*args)))


def bits(tree):
  """Each leaf's dtype and raw bytes."""
  return [(np.asarray(x).dtype, np.asarray(x).tobytes())
          for x in jax.tree_util.tree_leaves(tree)]


def same_bits(a, b) -> bool:
  """Whether two pytrees have the same structure and bit-identical leaves."""
  return (jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
          and bits(a) == bits(b))


def facts_on_eight_devices(script: str) -> dict:
  """Runs ``script`` in a Python with 8 simulated CPU devices.

  The script prints one line ``FACTS=<json>``; the parsed JSON is returned.
  The pytest process itself keeps its single device.
  """
  import json  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top
  import pathlib  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top

  import pytest  # pylint: disable=g-import-not-at-top

  repo = pathlib.Path(__file__).resolve().parents[1]
  env = dict(os.environ)
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                      " --xla_force_host_platform_device_count=8").strip()
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = os.pathsep.join(
      p for p in (str(repo), str(repo / "tests"), env.get("PYTHONPATH")) if p)
  proc = subprocess.run([sys.executable, "-c", script], cwd=repo, env=env,
                        capture_output=True, text=True, timeout=300)
  if proc.returncode != 0:
    pytest.fail("multi-device subprocess failed:\n" + proc.stderr[-4000:])
  line = [l for l in proc.stdout.splitlines() if l.startswith("FACTS=")][-1]
  return json.loads(line[len("FACTS="):])


def record(facts: dict, name: str, fn) -> None:
  """In an ``eight_devices`` script: ``facts[name] = fn()``, or the
  exception it raised as ``{"error": ...}``, so that one defect does not
  hide the others."""
  try:
    facts[name] = fn()
  except Exception as e:  # pylint: disable=broad-except
    facts[name] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}


def fact(facts: dict, name: str):
  """The fact ``name`` of an ``eight_devices`` script that records a case's
  exception as ``{"error": ...}``; fails the test with that error."""
  value = facts[name]
  assert not (isinstance(value, dict) and "error" in value), value
  return value


def multiplies_in(eqn) -> tuple:
  """The dtypes an equation's operands are multiplied in.

  mpolicy's matmul primitive takes float32 parameters as they are and casts
  them to its ``compute_dtype`` inside (so their gradients skip a round trip
  through half); for it, that dtype is what the operands run in. For any
  other equation it is the operands' own dtypes.
  """
  compute = eqn.params.get("compute_dtype")
  if compute is not None:
    return tuple(np.dtype(compute) for _ in eqn.invars)
  return tuple(np.dtype(v.aval.dtype) for v in eqn.invars)


@jax.custom_vjp
def poison(x, factor):
  """Identity forward; multiplies the cotangent by ``factor`` (1, inf or
  nan), to make one gradient non-finite on purpose."""
  del factor
  return x


poison.defvjp(lambda x, f: (x, f),
              lambda f, ct: (ct * f.astype(ct.dtype), jnp.zeros_like(f)))


def damage_arrays(path) -> None:
  """Cuts in half every data file of a `save_checkpoint` checkpoint's
  arrays (its metadata stays readable)."""
  import os  # pylint: disable=g-import-not-at-top
  for root, _, names in os.walk(os.path.join(path, "state")):
    for name in names:
      if os.sep + "d" in root:
        with open(os.path.join(root, name), "r+b") as f:
          f.truncate(os.path.getsize(f.name) // 2)
