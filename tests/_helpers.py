"""Helpers shared by the tests: walking jaxprs, comparing bits, poisoning
gradients, running on 8 devices."""

import contextlib
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


def jax_error(fn, *args):
  """The type of the exception plain JAX raises running ``fn(*args)``, or
  None: which combinations JAX supports (a scan under ``jax_scan3`` has no
  gradient in JAX 0.12), so a test checks amp against JAX where JAX runs
  and expects the same refusal where it does not."""
  try:
    jax.block_until_ready(fn(*args))
  except Exception as e:  # pylint: disable=broad-except
    return type(e)
  return None


def checkpoints(fn, *args) -> list:
  """``(policy, body jaxpr)`` of each `jax.checkpoint` in ``fn``'s jaxpr,
  classic (``remat2``) or under ``jax_remat3``."""
  out = []
  for eqn in all_eqns(fn, *args):
    obj = jax_compat.hijax.hi_object(eqn)
    if eqn.primitive is jax_compat.remat_p:
      out.append((jax_compat.sub_jaxpr(eqn, "policy"),
                  jax_compat.sub_jaxpr(eqn)))
    elif obj is not None and jax_compat.hijax.kind(obj) == "remat":
      out.append((jax_compat.hijax.remat_policy(obj),
                  jax_compat.hijax.remat_body(obj)))
  return out


def loop_carry_dtypes(fn, *args) -> list:
  """The dtype each loop carry of ``fn``'s scans keeps inside the body
  (classic ``scan``: the body's carry inputs and outputs; ``jax_scan3``:
  the references the body reads and writes)."""
  out = []
  for eqn in all_eqns(fn, *args):
    obj = jax_compat.hijax.hi_object(eqn)
    if eqn.primitive is jax_compat.scan_p:
      _, n_carry = jax_compat.scan_counts(eqn.params)
      start = jax_compat.scan_counts(eqn.params)[0]
      body = jax_compat.sub_jaxpr(eqn)
      ins = [a.dtype for a in body.in_avals[start:start + n_carry]]
      outs = [a.dtype for a in body.out_avals[:n_carry]]
      assert ins == outs, (ins, outs)
      out += ins
    elif obj is not None and jax_compat.hijax.kind(obj) == "scan":
      body = jax_compat.hijax.scan_body(obj)
      out += [a.dtype for a in body.in_avals if jax_compat.is_ref(a)]
  return out


def overflowing_flax_net():
  """A Flax linen net whose float16 output overflows: ``(model, variables,
  x)``, every variable 1 (hidden: 30001; out: 120005 > 65504)."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top

  class Net(nn.Module):

    @nn.compact
    def __call__(self, x):
      return nn.Dense(1, name="out")(nn.Dense(4, name="hidden")(x))

  model = Net()
  x = jnp.full((2, 3), 10000.0)
  variables = jax.tree_util.tree_map(
      lambda v: v * 0 + 1.0, model.init(jax.random.PRNGKey(0), x))
  return model, variables, x


@contextlib.contextmanager
def recorded_rows():
  """The rows `explain` would show of what the interpreter runs inside
  (the decisions it tells observers, probes left out)."""
  from mpolicy._src import observe  # pylint: disable=g-import-not-at-top
  rows = []

  class _Rows(observe.Observer):

    def after(self, eq, invals, outs):
      if eq.decision is not None and not eq.quiet:
        rows.append(eq.decision)

  with observe.watching(_Rows()):
    yield rows
