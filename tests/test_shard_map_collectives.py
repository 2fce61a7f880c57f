"""`amp` around `shard_map` bodies that need `pvary` and collectives.

The body of a `shard_map` is traced again by the interpreter; it must be
traced inside the mesh axes, or replicated operands (which JAX marks with
`pvary`) and collectives (`psum`, `pmean`, `all_gather`) find no axis.
Runs in a subprocess with 8 simulated CPU devices; the subprocess prints
one JSON object of facts for the tests to assert on.
"""

from __future__ import annotations


import pytest

# An 8-device script (5 s on 2 cores, and its cases): CI runs it after the
# default run, in both jobs (-m ci).
pytestmark = pytest.mark.ci


EIGHT_DEVICES = r'''
import json
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

import mpolicy
from _helpers import walk_eqns, multiplies_in, same_bits

mesh = Mesh(np.array(jax.devices()), ("d",))
HI = jax.lax.Precision.HIGHEST
kx, kw = jax.random.split(jax.random.PRNGKey(0))
x = jax.random.normal(kx, (16, 6))
w = jax.random.normal(kw, (6, 4)) / 3


def smap(body, in_specs, out_specs, **kw):
  return jax.shard_map(body, mesh=mesh, in_specs=in_specs,
                       out_specs=out_specs, **kw)


CASES = {
    # A sharded input times a replicated weight: JAX inserts a pvary.
    "mixed_specs": (smap(lambda a, b: jnp.tanh(jnp.dot(a, b, precision=HI)),
                         (P("d"), P()), P("d")), (x, w)),
    "psum": (smap(lambda a, b: jax.lax.psum(jnp.dot(a, b, precision=HI), "d"),
                  (P("d"), P()), P()), (x, w)),
    "pmean": (smap(lambda a: a - jax.lax.pmean(jnp.sum(a, 0), "d"),
                   (P("d"),), P("d")), (x,)),
    "all_gather": (smap(
        lambda a, b: jnp.dot(jax.lax.all_gather(a, "d", tiled=True), b,
                             precision=HI),
        (P("d"), P()), P("d")), (x, w)),
    "scale_only": (smap(lambda a: a * 2, (P("d"),), P("d")), (x,)),
    "psum_unchecked": (smap(
        lambda a, b: jax.lax.psum(jnp.dot(a, b, precision=HI), "d"),
        (P("d"), P()), P(), check_vma=False), (x, w)),
}
POLICIES = {"full": "full", "bf16": "p=f32,c=bf16,o=f32"}


def loss_of(fn):
  return lambda *args: jnp.sum(fn(*args) ** 2)


def err(a, b):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-6))


def facts_for(fn, args, spec):
  out = {}
  want = jax.jit(fn)(*args)
  amped = mpolicy.amp(fn, spec)
  got = jax.jit(amped)(*args)
  want_g = jax.jit(jax.grad(loss_of(fn), argnums=tuple(range(len(args)))))(
      *args)
  grad_fn = jax.jit(jax.grad(loss_of(amped), argnums=tuple(range(len(args)))))
  got_g = grad_fn(*args)
  out["same_bits"] = same_bits(got, want)
  out["grad_same_bits"] = same_bits(got_g, want_g)
  out["err"] = err(got, want)
  out["grad_err"] = max(err(g, h) for g, h in zip(got_g, want_g))
  out["out_dtype"] = str(got.dtype)
  out["grad_dtypes"] = [str(g.dtype) for g in got_g]
  out["finite"] = bool(np.all(np.isfinite(np.asarray(got))))
  eqns = list(walk_eqns(jax.make_jaxpr(amped)(*args)))
  out["dots"] = sorted({",".join(str(d) for d in multiplies_in(e))
                        for e in eqns if "dot_general" in e.primitive.name})
  out["grad_dots"] = sorted({
      ",".join(str(d) for d in multiplies_in(e))
      for e in walk_eqns(jax.make_jaxpr(grad_fn)(*args))
      if "dot_general" in e.primitive.name})
  out["collectives"] = sorted({e.primitive.name for e in eqns
                               if e.primitive.name.startswith(
                                   ("psum", "pmean", "all_gather", "pvary"))})
  out["exp_dtypes"] = sorted({str(e.invars[0].aval.dtype) for e in eqns
                              if e.primitive.name == "tanh"})
  return out


facts = {"devices": jax.device_count()}
for case, (fn, args) in CASES.items():
  for pol, spec in POLICIES.items():
    facts[f"{case}/{pol}"] = facts_for(fn, args, spec)
print("FACTS=" + json.dumps(facts))
'''

CASES = ("mixed_specs", "psum", "pmean", "all_gather", "scale_only",
         "psum_unchecked")




def test_runs_on_eight_devices(eight_devices):
  assert eight_devices["devices"] == 8


@pytest.mark.parametrize("case", CASES)
def test_full_policy_is_bitwise_the_plain_program(case, eight_devices):
  run = eight_devices[f"{case}/full"]
  assert run["same_bits"], run
  assert run["grad_same_bits"], run
  assert run["out_dtype"] == "float32"


@pytest.mark.parametrize("case", CASES)
def test_bf16_policy_is_close_to_float32_and_finite(case, eight_devices):
  run = eight_devices[f"{case}/bf16"]
  assert run["out_dtype"] == "float32"
  assert set(run["grad_dtypes"]) == {"float32"}
  assert run["finite"]
  assert run["err"] < 3e-2, run
  assert run["grad_err"] < 5e-2, run


@pytest.mark.parametrize("case", ["mixed_specs", "psum", "all_gather",
                                  "psum_unchecked"])
def test_bf16_policy_runs_body_matmuls_in_bfloat16(case, eight_devices):
  full, half = eight_devices[f"{case}/full"], eight_devices[f"{case}/bf16"]
  assert full["dots"] == ["float32,float32"]
  assert half["dots"] == ["bfloat16,bfloat16"], half
  assert half["grad_dots"] == ["bfloat16,bfloat16"], half


def test_collectives_stay_in_the_body(eight_devices):
  facts = eight_devices
  assert "psum" in " ".join(facts["psum/bf16"]["collectives"])
  assert "all_gather" in facts["all_gather/bf16"]["collectives"]
  assert "pvary" in facts["mixed_specs/bf16"]["collectives"]


def test_full_op_in_the_body_runs_in_float32(eight_devices):
  # tanh is unlisted: it runs in the dtype of its input, the bf16 matmul's.
  assert eight_devices["mixed_specs/bf16"]["exp_dtypes"] == ["bfloat16"]
  assert eight_devices["mixed_specs/full"]["exp_dtypes"] == ["float32"]
