"""transform_amp and amp across 8 CPU devices: pmap, shard_map and grads.

Runs in a subprocess with `--xla_force_host_platform_device_count=8`; the
subprocess prints one JSON object of facts for the tests to assert on.
"""

from __future__ import annotations


import pytest


EIGHT_DEVICES = r'''
import json
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

import mpolicy

facts = {"devices": jax.device_count()}
mpolicy.set_policy(hk.Module, "p=f32,c=bf16,o=f32")
model = mpolicy.transform_amp(lambda x: hk.nets.MLP([32, 4])(x))
plain = hk.transform(lambda x: hk.nets.MLP([32, 4])(x))
x = jax.random.normal(jax.random.PRNGKey(1), (8, 16, 8))
params = model.init(jax.random.PRNGKey(0), x[0])
want = jax.vmap(lambda xs: plain.apply(params, None, xs))(x)


def dots(fn, *args):
  found = []
  def walk(jaxpr):
    for e in jaxpr.eqns:
      if "dot_general" in e.primitive.name:
        compute = e.params.get("compute_dtype")  # Casts inside, see lowp.
        found.append([str(compute or v.aval.dtype) for v in e.invars])
      for v in e.params.values():
        for s in (v if isinstance(v, (tuple, list)) else (v,)):
          if hasattr(s, "eqns") or hasattr(s, "jaxpr"):
            walk(getattr(s, "jaxpr", s))
  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return found


def err(a, b):
  return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b))))


pmapped = jax.pmap(lambda xs: model.apply(params, None, xs))
out = pmapped(x)
facts["pmap"] = {"dtype": str(out.dtype), "err": err(out, want),
                 "dots": dots(pmapped, x)}

mesh = Mesh(np.array(jax.devices()), ("d",))
sharded = jax.jit(jax.shard_map(
    lambda xs: model.apply(params, None, xs[0])[None], mesh=mesh,
    in_specs=P("d"), out_specs=P("d")))
out = sharded(x)
facts["shard_map"] = {"dtype": str(out.dtype), "err": err(out, want),
                      "dots": dots(sharded, x)}


def loss(p, xs):
  return jnp.mean(model.apply(p, None, xs) ** 2)


grads = jax.pmap(lambda xs: jax.lax.pmean(jax.grad(loss)(params, xs), "d"),
                 axis_name="d")(x)
leaves = jax.tree_util.tree_leaves(grads)
facts["pmap_grad"] = {
    "dtypes": sorted({str(g.dtype) for g in leaves}),
    "same_on_every_device": all(
        bool(np.all(np.asarray(g) == np.asarray(g)[:1])) for g in leaves),
    "finite": all(bool(np.all(np.isfinite(np.asarray(g)))) for g in leaves),
}
print("FACTS=" + json.dumps(facts))
'''




@pytest.mark.parametrize("mode", ["pmap", "shard_map"])
def test_transform_amp_runs_bf16_matmuls_on_eight_devices(mode, eight_devices):
  facts = eight_devices
  assert facts["devices"] == 8
  run = facts[mode]
  assert run["dtype"] == "float32"
  assert run["dots"] and all(d == ["bfloat16", "bfloat16"]
                             for d in run["dots"]), run["dots"]
  assert run["err"] < 0.05


def test_pmapped_grads_are_float32_and_agree_across_devices(eight_devices):
  grad = eight_devices["pmap_grad"]
  assert grad["dtypes"] == ["float32"]
  assert grad["same_on_every_device"] and grad["finite"]
