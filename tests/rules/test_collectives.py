"""`OpRules.with_collectives(sum_dtype=...)`: cross-device sums of half
values in the dtype asked, checked in the lowered StableHLO on 2, 4 and 8
simulated devices (a subprocess; the test process has one device)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

import mpolicy

from _helpers import facts_on_eight_devices


def test_with_collectives_keeps_the_rest_and_checks_its_argument():
  rules = mpolicy.DEFAULT_RULES.with_fp8(min_size=0)
  wide = rules.with_collectives(sum_dtype=jnp.float32)
  assert wide.collective_sum_dtype == np.float32
  assert wide.fp8 == rules.fp8 and set(wide) == set(rules)
  assert wide != rules and wide.with_collectives(sum_dtype=None) == rules
  assert "collectives=sum_dtype float32" in repr(wide)
  with pytest.raises(ValueError, match=r"sum_dtype must be a floating dtype "
                     r"\(e\.g\. jnp\.float32\) or None .* got <class "
                     r"'jax.numpy.int32'>"):
    rules.with_collectives(sum_dtype=jnp.int32)
  with pytest.raises(ValueError, match="got 'float33'"):
    rules.with_collectives(sum_dtype="float33")


SCRIPT = r'''
import json, re
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
import mpolicy

BF16 = "p=f32,c=bf16,o=bf16"
WIDE = mpolicy.DEFAULT_RULES.with_collectives(sum_dtype=jnp.float32)
x = jax.random.normal(jax.random.PRNGKey(0), (8, 64))
w = jax.random.normal(jax.random.PRNGKey(1), (64, 16)) / 8


def sums(text):
  """(op, result element type) of each all_reduce / reduce_scatter in
  StableHLO text: its region closes on a line `}) : (...) -> tensor<...>`."""
  found, lines = [], text.splitlines()
  for i, line in enumerate(lines):
    m = re.search(r'"stablehlo\.(all_reduce|reduce_scatter)"', line)
    if m:
      close = next(l for l in lines[i:] if "}) :" in l)
      found.append((m.group(1), re.findall(
          r"x(bf16|f32|f16)>", close.split("->")[-1])[0]))
  return sorted(found)


facts = {}
for n in (2, 4, 8):
  mesh = Mesh(np.array(jax.devices()[:n]), ("d",))
  def layer(xs, ws):  # a row-parallel layer: partial matmuls, summed
    partial = xs @ ws
    total = jax.lax.psum(partial, "d")
    mean = jax.lax.pmean(partial, "d")
    part = jax.lax.psum_scatter(partial, "d", scatter_dimension=1, tiled=True)
    return total, mean, part
  body = jax.shard_map(layer, mesh=mesh, in_specs=(P(None, "d"), P("d")),
                       out_specs=(P(), P(), P(None, "d")))
  for name, rules in (("bf16", None), ("wide", WIDE)):
    f = jax.jit(mpolicy.amp(body, BF16, rules=rules))
    out = f(x, w)
    facts[f"{n}/{name}/sums"] = sums(f.lower(x, w).as_text())
    facts[f"{n}/{name}/dtypes"] = [str(o.dtype) for o in out]
    facts[f"{n}/{name}/total"] = np.asarray(out[0], np.float32).tolist()
  # The float32 sum of the bfloat16 partials, rounded once to bfloat16.
  xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
  k = 64 // n
  partials = [(xb[:, i * k:(i + 1) * k].astype(jnp.float32)
               @ wb[i * k:(i + 1) * k].astype(jnp.float32)).astype(jnp.bfloat16)
              for i in range(n)]
  want = sum(p.astype(jnp.float32) for p in partials).astype(jnp.bfloat16)
  facts[f"{n}/want"] = np.asarray(want, np.float32).tolist()

mesh = Mesh(np.array(jax.devices()[:4]), ("d",))
body = jax.shard_map(lambda xs, ws: jax.lax.psum(xs @ ws, "d"), mesh=mesh,
                     in_specs=(P(None, "d"), P("d")), out_specs=P())
report = mpolicy.explain(mpolicy.amp(body, BF16, rules=WIDE), x, w)
facts["explain"] = [(r.primitive, r.ran_in, r.rule, r.decided_by)
                    for r in report.rows if "psum" in r.primitive]
# Under full_precision() a sum runs as written.
plain = jax.shard_map(
    lambda xs, ws: jax.lax.psum(xs.astype(jnp.bfloat16) @ ws.astype(
        jnp.bfloat16), "d"), mesh=mesh, in_specs=(P(None, "d"), P("d")),
    out_specs=P())
f = jax.jit(mpolicy.amp(mpolicy.full_precision()(plain), BF16, rules=WIDE))
facts["full_precision"] = sums(f.lower(x, w).as_text())
# FSDP under jax.grad of an amp-ed loss: the weight shard's all_gather and
# the replicated v's pvary (JAX's) transpose to a reduce-scatter and a psum.
def loss(ws, xs, v):
  return jnp.sum((xs @ jax.lax.all_gather(ws, "d", tiled=True) @ v)
                 .astype(jnp.float32))
for name, rules in (("bf16", None), ("wide", WIDE)):
  g = jax.jit(jax.shard_map(
      jax.grad(mpolicy.amp(loss, "p=bf16,c=bf16,o=f32", rules=rules),
               argnums=(0, 2)),
      mesh=mesh, in_specs=(P("d"), P("d"), P()), out_specs=(P("d"), P())))
  args = (w.astype(jnp.bfloat16)[:, :8], x.astype(jnp.bfloat16)[:, :64],
          jnp.ones((8, 2), jnp.bfloat16))
  facts[f"fsdp/{name}/sums"] = sums(g.lower(*args).as_text())
  facts[f"fsdp/{name}/dtypes"] = [str(o.dtype) for o in g(*args)]
print("FACTS=" + json.dumps(facts))
'''


@pytest.fixture(scope="module")
def facts():
  facts = facts_on_eight_devices(SCRIPT)
  return {k: ([tuple(x) if isinstance(x, list) else x for x in v]
              if isinstance(v, list) else v) for k, v in facts.items()}


@pytest.mark.ci  # A subprocess with 8 simulated devices: 15 s on 2 cores.
@pytest.mark.parametrize("n", [2, 4, 8])
def test_sums_run_in_float32_and_cast_back(facts, n):
  assert facts[f"{n}/bf16/sums"] == [("all_reduce", "bf16")] * 2 + [
      ("reduce_scatter", "bf16")]
  assert facts[f"{n}/wide/sums"] == [("all_reduce", "f32")] * 2 + [
      ("reduce_scatter", "f32")]
  assert facts[f"{n}/wide/dtypes"] == ["bfloat16"] * 3
  assert facts[f"{n}/wide/total"] == facts[f"{n}/want"]


@pytest.mark.ci
def test_explain_shows_the_sum_and_full_precision_keeps_it(facts):
  rows = facts["explain"]
  assert rows and all(r[1] == "float32" and r[2] == "sum in float32"
                      for r in rows), rows
  assert "OpRules.with_collectives" in rows[0][3]
  assert facts["full_precision"] == [("all_reduce", "bf16")]


@pytest.mark.ci
def test_fsdp_gradients_reduce_scatter_and_psum_in_float32(facts):
  assert facts["fsdp/bf16/sums"] == [("all_reduce", "bf16"),
                                     ("reduce_scatter", "bf16")]
  assert facts["fsdp/wide/sums"] == [("all_reduce", "f32"),
                                     ("reduce_scatter", "f32")]
  assert facts["fsdp/wide/dtypes"] == ["bfloat16", "bfloat16"]


def _results(fn, *args, platform="cuda"):
  """Element types of each dot_general / convolution result in ``fn``'s
  lowering for ``platform``."""
  text = jax.jit(fn).trace(*args).lower(
      lowering_platforms=(platform,)).as_text()
  return [re.findall(r"x(bf16|f32|f16)>", line.split("->")[-1])[0]
          for line in text.splitlines()
          if "stablehlo.dot_general" in line or "stablehlo.convolution" in line]


BF16 = "p=f32,c=bf16,o=bf16"
WIDE = mpolicy.DEFAULT_RULES.with_collectives(sum_dtype=jnp.float32)


def _loss(layer, rules):
  f = mpolicy.amp(layer, BF16, rules=rules)
  return jax.grad(lambda x, w: jnp.sum(f(x, w).astype(jnp.float32) ** 2),
                  argnums=(0, 1))


def test_under_jit_half_matmuls_give_the_partitioner_sum_dtype_results():
  # XLA's partitioner sums a matmul whose contracting dimension is sharded
  # on its result: on GPU and TPU the forward and backward matmuls ask for
  # float32 results under the option (bf16 without); CPU's always are.
  # (bfloat16 operands: a float32 one's gradient is float32 anyway.)
  x, w = jnp.ones((4, 8), jnp.bfloat16), jnp.ones((8, 2), jnp.bfloat16)
  matmul = lambda a, b: a @ b
  assert _results(_loss(matmul, None), x, w) == ["bf16"] * 3
  assert _results(_loss(matmul, WIDE), x, w) == ["f32"] * 3
  assert _results(_loss(matmul, WIDE), x, w, platform="cpu") == ["f32"] * 3
  got = jax.jit(_loss(matmul, WIDE))(x, w)
  want = jax.jit(_loss(matmul, None))(x, w)
  assert [g.dtype for g in got] == [jnp.bfloat16, jnp.bfloat16]
  np.testing.assert_array_equal(got[0], want[0])  # CPU: the same program.
  rows = mpolicy.explain(mpolicy.amp(matmul, BF16, rules=WIDE), x, w).rows
  assert "sums XLA's partitioner places on it run in it" in rows[-1].decided_by


def test_under_jit_half_convolutions_give_float32_results_too():
  conv = lambda a, k: jax.lax.conv_general_dilated(a, k, (1, 1), "SAME")
  x, k = (jnp.ones((2, 3, 8, 8), jnp.bfloat16),
          jnp.ones((4, 3, 3, 3), jnp.bfloat16))
  assert set(_results(_loss(conv, None), x, k)) == {"bf16"}
  assert set(_results(_loss(conv, WIDE), x, k)) == {"f32"}


def test_inside_shard_map_matmuls_keep_half_results():
  # There the sums are the program's own collectives (the rule above).
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
  body = jax.shard_map(lambda a, b: jax.lax.psum(a @ b, "d"), mesh=mesh,
                       in_specs=(P(None, "d"), P("d")), out_specs=P())
  x, w = jnp.ones((4, 8)), jnp.ones((8, 2))
  f = mpolicy.amp(body, BF16, rules=WIDE)
  assert _results(f, x, w) == ["bf16"]
