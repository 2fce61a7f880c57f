"""Specification: the debugger and explain see through every construct amp
supports, and JAX's next-generation flags change none of their answers.

Each program overflows float16 in a float16 matmul inside the named scope
``layer``, inside its construct (a loop's iteration 3, a branch, a
checkpointed block with a policy, a custom derivative, a `shard_map` body,
before a Pallas kernel). `locate_nonfinite` names that op, module, dtype
and iteration; `compare_to_float32` and `explain` give their rows. With each
next-generation flag on alone (``jax_scan3``, ``jax_remat3``,
``jax_custom_vjp3``, ``jax_custom_jvp3``: those this JAX has), every answer
is the one with the flags off, wherever plain JAX runs the program (JAX
0.12's scan3 has no gradient: there the forward pass alone is compared).
"""

from __future__ import annotations

import collections
import contextlib

import jax
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec as P
import jax.numpy as jnp
import numpy as np
import pytest

import mpolicy

from _helpers import jax_error

HALF16 = "p=f32,c=f16,o=f32"
FLAGS = tuple(f for f in ("jax_scan3", "jax_remat3", "jax_custom_vjp3",
                          "jax_custom_jvp3") if f in jax.config.values)
W = jnp.eye(4, dtype=jnp.float32) * 8.0
BIG = jnp.full((2, 4), 100.0)  # 800, 6400, 51200, then inf in float16.
SMALL = jnp.linspace(0.1, 1.0, 8, dtype=jnp.float32).reshape(2, 4)


def _layer(c, w):
  with jax.named_scope("layer"):
    return c @ w


def _scan(w, x):
  c, _ = jax.lax.scan(lambda c, _: (_layer(c, w), None), x, None, length=4)
  return jnp.mean(c)


def _while(w, x):
  def body(state):
    i, c = state
    return i + 1, _layer(c, w)
  return jnp.mean(jax.lax.while_loop(lambda s: s[0] < 4, body, (0, x))[1])


def _cond(w, x):
  return jnp.mean(jax.lax.cond(jnp.sum(x) > -1e9,
                               lambda c: _layer(_layer(_layer(_layer(c, w), w),
                                                       w), w),
                               lambda c: c, x))


def _remat(w, x):
  block = jax.checkpoint(lambda c: _layer(_layer(c, w), w),
                         policy=jax.checkpoint_policies.dots_saveable)
  return jnp.mean(block(block(x)))


@jax.custom_jvp
def _twice(c, w):
  return _layer(_layer(c, w), w)


_twice.defjvp(lambda p, t: (_twice(*p), _twice(t[0], p[1])))


@jax.custom_vjp
def _twice_vjp(c, w):
  return _layer(_layer(c, w), w)


_twice_vjp.defvjp(lambda c, w: (_twice_vjp(c, w), (c, w)),
                  lambda res, g: (_layer(_layer(g, res[1].T), res[1].T),
                                  jnp.zeros_like(res[1])))


def _custom_jvp(w, x):
  return jnp.mean(_twice(_twice(x, w), w))


def _custom_vjp(w, x):
  return jnp.mean(_twice_vjp(_twice_vjp(x, w), w))


def _shard_map(w, x):
  mesh = jax.make_mesh((1,), ("d",))
  body = jax.shard_map(lambda c, w: _scan(w, c)[None], mesh=mesh,
                       in_specs=(P(), P()), out_specs=P())
  return jnp.mean(body(x, w))


def _copy_kernel(x_ref, o_ref):
  o_ref[...] = x_ref[...]


def _pallas(w, x):
  c = _layer(_layer(_layer(_layer(x, w), w), w), w)
  return jnp.mean(pl.pallas_call(
      _copy_kernel, out_shape=jax.ShapeDtypeStruct(c.shape, c.dtype),
      interpret=True)(c))


PROGRAMS = {"scan": _scan, "while": _while, "cond": _cond, "remat": _remat,
            "custom_jvp": _custom_jvp, "custom_vjp": _custom_vjp,
            "shard_map": _shard_map, "pallas": _pallas}
# The iteration the overflow happens in (loops only).
ITERATION = {"scan": 3, "while": 3, "shard_map": 3}


@contextlib.contextmanager
def flags(on=()):
  """Every next-generation flag off but those in ``on``; restored after."""
  before = {n: jax.config.values[n] for n in FLAGS}
  try:
    for n in FLAGS:
      jax.config.update(n, n in on)
    yield
  finally:
    for n, v in before.items():
      jax.config.update(n, v)


def _grad_runs(program) -> bool:
  """Whether plain JAX differentiates ``program`` under the flags in force."""
  return jax_error(jax.grad(program), W, SMALL) is None


_IGNORED = frozenset({"get", "swap", "new_ref", "freeze", "addupdate"})


def _explained(f) -> collections.Counter:
  """explain's rows of the compute ops: (primitive, dtype it ran in,
  scope), counted (references are how scan3 carries, not compute)."""
  rows = mpolicy.explain(f, W, SMALL).rows
  return collections.Counter(
      (r.primitive, r.ran_in, r.scope) for r in rows
      if r.primitive not in _IGNORED and "cast" not in r.rule)


def answers(name: str, grad: bool) -> dict:
  """What the debugger and explain say about program ``name``."""
  f = mpolicy.amp(PROGRAMS[name], HALF16)
  report = mpolicy.locate_nonfinite(f, W, BIG, grad=grad)
  table = mpolicy.compare_to_float32(f, W, SMALL, grad=grad)
  return {
      "located": report and (report.primitive, report.path, report.direction,
                             report.dtype, report.iteration, report.device,
                             report.fixed_by_float32, report.outputs),
      "rows": {r.name: (r.rel_error, r.grad_rel_error) for r in table.rows},
      "explained": _explained(f),
  }


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_the_debugger_sees_into_every_construct(name):
  with flags():
    got = answers(name, grad=_grad_runs(PROGRAMS[name]))  # Pallas: no grad.
  primitive, path, direction, dtype, iteration, device, fixed, _ = (
      got["located"])
  assert (primitive, path, direction, dtype) == (
      "dot_general", "layer", "forward", "float16")
  assert iteration == ITERATION.get(name)
  assert device == (0 if name == "shard_map" else None)
  assert fixed
  # A shard_map body is traced once for every device: compare_to_float32
  # checks it, but pairs no values inside it (it has no concrete ones).
  assert ("layer" in got["rows"]) == (name != "shard_map")
  assert got["explained"][("dot_general", "float16", "layer")] >= 1


# Which flag turns each program's construct into a new primitive.
OWN_FLAGS = {"scan": ("jax_scan3",), "shard_map": ("jax_scan3",),
             "remat": ("jax_remat3",), "custom_jvp": ("jax_custom_jvp3",),
             "custom_vjp": ("jax_custom_vjp3",)}
CASES = [(name, flag) for name, own in sorted(OWN_FLAGS.items())
         for flag in own if flag in FLAGS]


@pytest.mark.skipif(not CASES, reason="this JAX has no next-generation flags")
@pytest.mark.parametrize("name,flag", CASES)
def test_each_flag_alone_changes_no_answer(name, flag):
  with flags((flag,)):
    grad = _grad_runs(PROGRAMS[name])
    got = answers(name, grad)
  with flags():
    want = answers(name, grad)
  assert got["located"] == want["located"]
  assert got["rows"].keys() == want["rows"].keys()
  for key, (rel, grad_rel) in got["rows"].items():
    np.testing.assert_allclose(rel, want["rows"][key][0], rtol=1e-5)
    if grad_rel is not None or want["rows"][key][1] is not None:
      np.testing.assert_allclose(grad_rel, want["rows"][key][1], rtol=1e-5)
  assert got["explained"] == want["explained"]
