"""The fuzzer's random programs: generated from a seed, run `amp`-ed and
plain, and the checks that compare them (see test_fuzz.py)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import random
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import mpolicy

from _helpers import same_bits

HI = jax.lax.Precision.HIGHEST
_LIMIT = 40.0  # Bound on any value's magnitude (float16 tops at 65504).
_SHAPE = (4, 4)

# Operation name -> number of value operands.
_FIRST_ORDER = {
    "add": 2, "sub": 2, "mul": 2, "div": 2, "max": 2, "dot": 2, "dot_t": 2,
    "rowdot": 2, "concat": 2, "select": 2,
    "exp": 1, "logabs1": 1, "tanh": 1, "logistic": 1, "sum": 1, "rmax": 1,
    "reshape": 1, "transpose": 1, "ipow": 1, "scalar": 1, "const": 1,
}
# Drawn only where a test asks for them (`_program(..., ops=...)`): scatters
# and window reductions (whose combiners were traced for float32), a host
# callback, and float64 constants meeting float32 values (x64 only).
# The scatters, reductions and the callback take a matmul's result (of
# their two operands) as their first operand.
_COMBINER_OPS = {"scatter_add": 2, "scatter_max": 2, "window_sum": 2,
                 "cumsum": 2}
_CALLBACK_OPS = {"callback": 2}
_X64_OPS = {"dot64": 1, "add64": 1}
_FIRST_ORDER.update(_COMBINER_OPS)
_FIRST_ORDER.update(_CALLBACK_OPS)
_FIRST_ORDER.update(_X64_OPS)
_EXTRA_OPS = frozenset(_COMBINER_OPS) | frozenset(_CALLBACK_OPS) | frozenset(
    _X64_OPS)
# Matmuls are what half policies change most: drawn three times as often.
_OPS = sorted(set(_FIRST_ORDER) - _EXTRA_OPS)
_WEIGHTS = [3.0 if op in ("dot", "dot_t", "rowdot") else 1.0 for op in _OPS]
# "full_precision" is no primitive: a block of the sub-program under
# `mpolicy.full_precision()` (a no-op in the plain program).
_HIGHER_ORDER = ("jit", "scan", "fori", "while", "cond", "checkpoint",
                 "custom_jvp", "custom_vjp", "full_precision")


# --- Programs -----------------------------------------------------------------


@dataclasses.dataclass
class Step:
  """One operation: ``op`` on env values ``args`` (indices), with ``extra``
  (a constant, an axis) and ``subs`` (sub-programs of higher-order ops)."""
  op: str
  args: tuple[int, ...]
  extra: Any = None
  subs: tuple["Program", ...] = ()

  def render(self, indent: str) -> list[str]:
    head = f"{indent}v = {self.op}({', '.join(f'v{i}' for i in self.args)}"
    head += f"; {self.extra!r})" if self.extra is not None else ")"
    lines = [head]
    for k, sub in enumerate(self.subs):
      lines.append(f"{indent}  sub{k}(" + ", ".join(
          f"v{i}" for i in range(sub.n_in)) + "):")
      lines += sub.render(indent + "    ")
    return lines


@dataclasses.dataclass
class Program:
  """Steps over ``n_in`` inputs; env value ``i`` is input ``i`` or the result
  of step ``i - n_in``; the last value is the output."""
  n_in: int
  steps: list[Step]

  def render(self, indent: str = "") -> list[str]:
    out = []
    for k, step in enumerate(self.steps):
      lines = step.render(indent)
      lines[0] = lines[0].replace("v =", f"v{self.n_in + k} =", 1)
      out += lines
    return out

  def __str__(self):
    return "\n".join(self.render())


class _Gen:
  """Draws programs whose values stay within ``_LIMIT``."""

  def __init__(self, seed: int, higher: tuple[str, ...], depth: int,
               extra_ops: tuple[str, ...] = ()):
    self.rng = random.Random(seed)
    self.higher = higher
    self.depth = depth
    # The extra families leave out `max`: where its operands nearly tie,
    # half rounding flips which one its gradient goes to, and the error
    # would be the tie's, not the extra ops'.
    base = [(op, wt) for op, wt in zip(_OPS, _WEIGHTS)
            if not (extra_ops and op == "max")]
    self.ops = [op for op, _ in base] + sorted(extra_ops)
    # Extra ops are drawn as often as matmuls, so they meet their results.
    self.weights = [wt for _, wt in base] + [3.0] * len(extra_ops)

  def pick(self, bounds: list[float]) -> int:
    # Prefer recent values, so programs are chains more than fans.
    n = len(bounds)
    weights = [1.0 + 2.0 * (i >= n - 2) for i in range(n)]
    return self.rng.choices(range(n), weights)[0]

  def program(self, in_bounds: list[float], n_steps: int,
              depth: int) -> tuple[Program, float]:
    bounds = list(in_bounds)
    steps = []
    for _ in range(n_steps):
      step, bound = self.step(bounds, depth)
      steps.append(step)
      bounds.append(bound)
    return Program(len(in_bounds), steps), bounds[-1]

  def step(self, bounds: list[float], depth: int) -> tuple[Step, float]:
    rng = self.rng
    if depth < self.depth and self.higher and rng.random() < 0.3:
      return self.higher_step(bounds, depth)
    for _ in range(20):
      op = rng.choices(self.ops, self.weights)[0]
      args = tuple(self.pick(bounds) for _ in range(_FIRST_ORDER[op]))
      extra = None
      if op in ("sum", "rmax", "concat"):
        extra = rng.randrange(2)
      elif op == "ipow":
        extra = rng.choice((2, 3))
      elif op == "scalar":
        extra = rng.choice((0.5, 2.0, -1.5, 3))
      elif op in ("const", "dot64", "add64"):
        extra = rng.randrange(1000)
      elif op == "select":
        extra = (rng.randrange(2), rng.choice((0.0, 0.5, -0.3)))
      bound = _bound(op, [bounds[i] for i in args], extra)
      if bound <= _LIMIT:
        return Step(op, args, extra), bound
    return Step("tanh", (len(bounds) - 1,)), 1.0

  def higher_step(self, bounds: list[float], depth: int) -> tuple[Step, float]:
    rng = self.rng
    op = rng.choice(self.higher)
    n_args = rng.choice((1, 2))
    args = tuple(self.pick(bounds) for _ in range(n_args))
    in_bounds = [bounds[i] for i in args]
    n_steps = rng.randint(1, 4)
    if op in ("scan", "fori", "while"):
      # The carry is squashed by tanh after each iteration.
      in_bounds[0] = max(in_bounds[0], 1.0)
      sub, sub_bound = self.program(in_bounds, n_steps, depth + 1)
      length = rng.choice((1, 2, 3))
      bound = 1.0 + sub_bound if op == "scan" else max(in_bounds[0], 1.0)
      return Step(op, args, length, (sub,)), bound
    if op == "cond":
      a, bound_a = self.program(in_bounds, n_steps, depth + 1)
      b, bound_b = self.program(in_bounds, rng.randint(1, 4), depth + 1)
      extra = (rng.randrange(2), rng.choice((0.0, 1.0)))
      return Step(op, args, extra, (a, b)), max(bound_a, bound_b)
    sub, bound = self.program(in_bounds, n_steps, depth + 1)
    return Step(op, args, None, (sub,)), bound


def _bound(op: str, b: list[float], extra) -> float:
  if op in ("add", "sub"):
    return b[0] + b[1]
  if op == "mul":
    return b[0] * b[1]
  if op in ("dot", "dot_t"):
    return b[0] * b[1]  # Scaled by 1/4 after a 4-term contraction.
  if op == "rowdot":
    return b[0] * b[1]
  if op in ("max", "concat", "select"):
    return max(b)
  if op == "exp":
    return float(np.exp(b[0])) if b[0] <= 3.0 else np.inf
  if op == "logabs1":
    return float(np.log1p(b[0]))
  if op in ("tanh", "logistic"):
    return 1.0
  if op in ("const", "add64"):
    return b[0] + 1.0
  if op in _COMBINER_OPS or op in _CALLBACK_OPS:
    m = b[0] * b[1]  # Their matmul.
    if op == "scatter_add":
      return m + 2 * b[1]  # Row 2 receives two rows.
    if op == "scatter_max":
      return max(m, b[1])
    if op == "callback":
      return m * 0.5 + 1.0
    return m  # window_sum and cumsum are scaled.
  if op == "ipow":
    return b[0] ** extra
  if op == "scalar":
    return b[0] if extra == 3 else b[0] * abs(extra)  # a + 3 - 3, or a * c.
  # div, sum (a mean), rmax, reshape, transpose, dot64 (a 4-term
  # contraction with entries in [-1, 1], scaled).
  return b[0]


def _program(seed: int, *, higher=_HIGHER_ORDER, depth: int = 2,
             ops: tuple[str, ...] = ()) -> Program:
  gen = _Gen(seed, tuple(higher), depth, tuple(ops))
  n_steps = gen.rng.randint(3, 8)
  program, _ = gen.program([3.0, 3.0], n_steps, 0)
  return program


# --- Running a program ----------------------------------------------------------


def _first_order(op: str, a, b, extra, raw):
  lax = jax.lax
  if op == "add":
    return a + b
  if op == "sub":
    return lax.sub(a, b)
  if op == "mul":
    return lax.mul(a, b)
  if op == "div":
    return lax.div(a, jnp.abs(b) + 1)
  if op == "max":
    return lax.max(a, b)
  if op == "dot":
    return lax.dot_general(a, b, (([1], [0]), ([], [])), precision=HI) * 0.25
  if op == "dot_t":
    return lax.dot_general(a, b, (([0], [0]), ([], [])), precision=HI) * 0.25
  if op == "rowdot":
    row = lax.dot_general(a, b, (([1], [1]), ([0], [0])), precision=HI) * 0.25
    return lax.broadcast_in_dim(row, _SHAPE, (0,))
  if op == "concat":
    both = lax.concatenate([a, b], extra)
    start = (2, 0) if extra == 0 else (0, 2)
    return lax.slice(both, start, (start[0] + 4, start[1] + 4))
  if op == "select":
    which, thr = extra
    return lax.select(raw[which] > thr, a, b)
  if op == "exp":
    return lax.exp(a)
  if op == "logabs1":
    return lax.log(jnp.abs(a) + 1)
  if op == "tanh":
    return lax.tanh(a)
  if op == "logistic":
    return jax.nn.sigmoid(a)
  if op == "sum":
    return lax.broadcast_in_dim(jnp.sum(a, axis=extra) * 0.25, _SHAPE,
                                (1 - extra,))
  if op == "rmax":
    return lax.broadcast_in_dim(jnp.max(a, axis=extra), _SHAPE, (1 - extra,))
  if op == "reshape":
    return lax.reshape(lax.transpose(lax.reshape(a, (2, 8)), (1, 0)), _SHAPE)
  if op == "transpose":
    return lax.transpose(a, (1, 0))
  if op == "ipow":
    return lax.integer_pow(a, extra)
  if op == "scalar":
    return a * extra if extra != 3 else a + extra - 3
  if op in _COMBINER_OPS or op in _CALLBACK_OPS:
    m = lax.dot_general(a, b, (([1], [0]), ([], [])), precision=HI) * 0.25
    if op == "scatter_add":  # A message pass: rows added into rows.
      return m.at[_SCATTER_ROWS].add(b)
    if op == "scatter_max":
      return m.at[_SCATTER_ROWS].max(b)
    if op == "window_sum":  # A 2x2 sum pool, scaled.
      return lax.reduce_window(m, 0.0, lax.add, (2, 2), (1, 1), "SAME") * 0.25
    if op == "cumsum":
      return jnp.cumsum(m, axis=0) * 0.25
    return _callback_tanh(m)
  if op == "dot64":  # float32 @ a closed-over float64 constant.
    w64 = np.random.default_rng(extra).uniform(-1, 1, _SHAPE)
    return (jnp.matmul(a, w64, precision=HI) * 0.25).astype(a.dtype)
  if op == "add64":
    c64 = np.random.default_rng(extra).uniform(-1, 1, _SHAPE)
    return (a + c64).astype(a.dtype)
  if op == "const":  # A closed-over float32 numpy constant.
    return a + np.random.default_rng(extra).uniform(-1, 1, _SHAPE).astype(
        np.float32)
  raise ValueError(op)


_SCATTER_ROWS = np.array([0, 2, 2, 1], np.int32)  # int32 under x64 too.


def _host_tanh(x, traced):
  """A host callback's body; it insists on the dtype the code was traced
  with (float32, or float64 in the float64 reference run)."""
  x = np.asarray(x)
  if x.dtype != traced:
    raise TypeError(f"the host callback received {x.dtype}, not {traced}")
  return np.tanh(x)


def _callback_tanh(a):
  """``a / 2`` plus a host ``tanh(a)`` (a constant to differentiation: a
  pure callback has no derivative)."""
  y = jax.pure_callback(functools.partial(_host_tanh, traced=a.dtype),
                        jax.ShapeDtypeStruct(a.shape, a.dtype),
                        jax.lax.stop_gradient(a), vmap_method="sequential")
  return a * 0.5 + y


def _run(program: Program, vals: list, raw) -> Any:
  env = list(vals)
  for step in program.steps:
    args = [env[i] for i in step.args]
    if step.subs:
      out = _higher_order(step, args, raw)
    else:
      out = _first_order(step.op, args[0], args[-1], step.extra, raw)
    env.append(out)
  return env[-1]


def _higher_order(step: Step, args: list, raw):
  """Runs a higher-order step. The raw inputs (read by predicates) are
  passed to its body as operands, never closed over."""
  op = step.op
  lax = jax.lax
  n = len(args)
  sub = _sub_fn(step.subs[0], n)
  args = [*args, *raw]
  if op == "jit":
    return jax.jit(sub)(*args)
  if op == "checkpoint":
    return jax.checkpoint(sub)(*args)
  if op == "full_precision":
    with mpolicy.full_precision():
      return sub(*args)
  if op == "custom_jvp":
    fn = jax.custom_jvp(sub)
    fn.defjvp(lambda primals, tangents: jax.jvp(sub, primals, tangents))
    return fn(*args)
  if op == "custom_vjp":
    fn = jax.custom_vjp(sub)
    fn.defvjp(lambda *a: (sub(*a), a),
              lambda res, g: jax.vjp(sub, *res)[1](g))
    return fn(*args)
  if op == "cond":
    which, thr = step.extra
    other = _sub_fn(step.subs[1], n)
    return lax.cond(jnp.sum(raw[which]) > thr, sub, other, *args)
  carry, consts = args[0], args[1:]
  if op == "scan":
    def body(c, _):
      y = sub(c, *consts)
      return jnp.tanh(y), y
    final, ys = lax.scan(body, carry, None, length=step.extra)
    return final + jnp.sum(ys, axis=0) * (1.0 / step.extra)
  if op == "fori":
    return lax.fori_loop(0, step.extra,
                         lambda i, c: jnp.tanh(sub(c, *consts)), carry)
  if op == "while":
    def cond_fn(ic):
      return ic[0] < step.extra

    def body_fn(ic):
      return ic[0] + 1, jnp.tanh(sub(ic[1], *consts))

    return lax.while_loop(cond_fn, body_fn, (0, carry))[1]
  raise ValueError(op)


def _sub_fn(program: Program, n: int):
  """``program`` as a function of its ``n`` values, then the raw inputs."""
  def fn(*vals):
    return _run(program, list(vals[:n]), tuple(vals[n:]))
  return fn


def _as_fn(program: Program):
  def f(x, w):
    return _run(program, [x, w], (x, w))
  return f


def _inputs(seed: int, batch: int = 0):
  kx, kw = jax.random.split(jax.random.PRNGKey(seed))
  shape = ((batch,) if batch else ()) + _SHAPE
  return (jax.random.uniform(kx, shape, minval=-3.0, maxval=3.0),
          jax.random.uniform(kw, shape, minval=-3.0, maxval=3.0))


def _describe(seed: int, program: Program, what: str) -> str:
  return (f"fuzz seed {seed}: {what}\nprogram (inputs v0=x, v1=w):\n"
          f"{program}")


# --- Properties -------------------------------------------------------------------


def _loss(fn, r):
  return lambda x, w: jnp.sum(fn(x, w).astype(r.dtype) * r)


_FORWARD_ONLY = ("jit", "vmap", "jvp", "jacfwd")


def _programs(seed: int, ops: tuple[str, ...] = ()) -> dict[str, Program]:
  """The seed's programs. Reverse mode cannot enter a while_loop and forward
  mode cannot enter a custom_vjp: each mode gets one it can differentiate."""
  return {
      "rev": _program(seed, higher=[h for h in _HIGHER_ORDER if h != "while"],
                      ops=ops),
      "fwd": _program(seed, higher=[h for h in _HIGHER_ORDER
                                    if h != "custom_vjp"], ops=ops),
  }


def _runner(mode: str, seed: int, dtype=None, jitter: float = 0.0):
  """``run(fn)``: ``fn`` under ``mode`` at the seed's inputs (drawn in
  float32; cast to ``dtype`` when run, where one is given), each element
  scaled by ``1 ± jitter`` (random signs) where ``jitter`` is given."""
  def wobble(*arrays):
    keys = jax.random.split(jax.random.PRNGKey(seed + 13), len(arrays))
    return tuple(a * (1 + jitter * jax.random.rademacher(k, a.shape, a.dtype))
                 for a, k in zip(arrays, keys))
  x, w = wobble(*_inputs(seed))
  r = jax.random.normal(jax.random.PRNGKey(seed + 1), _SHAPE)
  tx, tw = _inputs(seed + 7)
  xs, ws = wobble(*_inputs(seed, batch=3))
  c = (lambda *a: a) if dtype is None else (
      lambda *a: tuple(v.astype(dtype) for v in a))
  return {
      "jit": lambda fn: jax.jit(fn)(*c(x, w)),
      "grad": lambda fn: jax.jit(jax.grad(_loss(fn, *c(r)), argnums=(0, 1)))(
          *c(x, w)),
      "vmap": lambda fn: jax.jit(jax.vmap(fn))(*c(xs, ws)),
      "jvp": lambda fn: jax.jit(lambda a, b: jax.jvp(fn, (a, b), c(tx, tw)))(
          *c(x, w)),
      "jacfwd": lambda fn: jax.jit(jax.jacfwd(fn, argnums=(0, 1)))(*c(x, w)),
  }[mode]


def check_full_is_bitwise(seed: int, ops: tuple[str, ...] = ()) -> None:
  """`amp(f, "full")` is bitwise ``f`` under jit, grad and jvp."""
  programs = _programs(seed, ops)
  for mode in ("jit", "grad", "jvp"):
    program = programs["fwd" if mode in _FORWARD_ONLY else "rev"]
    f = _as_fn(program)
    run = _runner(mode, seed)
    want, got = run(f), run(mpolicy.amp(f, "full"))
    assert same_bits(got, want), _describe(
        seed, program, f"amp(f, 'full') differs from f under {mode}")


def _norm(tree) -> float:
  """The 2-norm of all the arrays of ``tree`` at once, in float64."""
  return float(np.sqrt(sum(np.sum(np.square(np.asarray(x, np.float64)))
                           for x in jax.tree_util.tree_leaves(tree))))


def _diff(a, b):
  return jax.tree_util.tree_map(
      lambda x, y: np.asarray(x, np.float64) - np.asarray(y, np.float64), a, b)


def _err(got, want, scale: float = 0.0) -> float:
  """``||got - want|| / max(||want||, scale)``, over all the arrays of the
  pytrees at once (as the precision debugger measures relative error).

  Relative, so a small output is held to the same standard as a large one.
  ``scale`` stands in for ``||want||`` where float32's own rounding error
  is larger than ``want`` (see `half_errors`). A ``want`` of exact zeros
  (and no scale) needs ``got`` to be zeros too (else inf).
  """
  diff, size = _norm(_diff(got, want)), max(_norm(want), scale)
  if size == 0:
    return 0.0 if diff == 0 else float("inf")
  return diff / size


# The tolerance, in units of the compute dtype's unit roundoff u (half its
# epsilon: 2 ** -8 for bfloat16, 2 ** -11 for float16), the relative error
# of one rounding. A program's rounding error is about the unit roundoff
# times the number of roundings on its paths times its condition number;
# the float32 program makes the same roundings with u = 2 ** -24.
# `half_errors` divides by the larger of the output's size and float32's
# own error over float32's u (see `_reference`), so about 1 u is expected
# whatever the program's depth and conditioning. But float32's error is
# one sample of a sum of random roundings, and the half program's another
# (with more roundings: its casts of inputs and parameters), so their
# ratio varies by several times from program to program: 16 u. Measured
# on seeds 0-51 and 200-211, five modes each (this project's AMD EPYC, jax
# 0.12.0.1, 2026-11-25): at most 1.8 u for bfloat16 and 2.3 u for float16,
# median 0.2-0.3 u; one of the slow run's seeds reaches 8.3 u (seed 93,
# float16 under jit).
UNIT_ROUNDOFF = {"bf16": 2.0 ** -8, "f16": 2.0 ** -11}
_F32_U = 2.0 ** -24
TOLERANCE_IN_U = 16
_TOLERANCE = {p: TOLERANCE_IN_U * u for p, u in UNIT_ROUNDOFF.items()}
_POLICIES = {"bf16": "p=f32,c=bf16,o=f32", "f16": "p=f32,c=f16,o=f32"}
_MODES = ("jit", "grad", "vmap", "jvp", "jacfwd")


@contextlib.contextmanager
def x64_everywhere():
  """float64 on, for every thread. `jax.enable_x64` is a thread-local
  context: a host callback that XLA runs on one of its own threads sees it
  off, and JAX hands it float32 views of float64 operands (and refuses its
  float64 results): the long fuzzer's seed 229 met that."""
  previous = jax.config.jax_enable_x64
  jax.config.update("jax_enable_x64", True)
  try:
    yield
  finally:
    jax.config.update("jax_enable_x64", previous)


@functools.lru_cache(maxsize=16)
def _reference(seed: int, mode: str, ops: tuple[str, ...]):
  """``(want, scale)``: the float32 program's output under ``mode``, and
  the scale a half program's error is measured against where it exceeds
  the output's size. Both in units of float32's unit roundoff u32, the
  larger of: float32's own error (against a float64 run), about the size
  of the values it rounded times the program's condition number, large
  after a cancellation to about zero; and how far a relative u32
  perturbation of the inputs moves the output, the condition number with
  respect to the inputs, which a half program also rounds."""
  program = _programs(seed, ops)["fwd" if mode in _FORWARD_ONLY else "rev"]
  f = _as_fn(program)
  want = _runner(mode, seed)(f)
  run64 = _runner(mode, seed, jnp.float64)
  with x64_everywhere():
    exact = jax.block_until_ready(run64(f))
  moved = _runner(mode, seed, jitter=_F32_U)(f)
  return want, max(_norm(_diff(want, exact)),
                   _norm(_diff(moved, want))) / _F32_U


def half_errors(seed: int, policy: str,
                ops: tuple[str, ...] = ()) -> dict[str, float]:
  """Relative errors of `amp(f, policy)` vs ``f`` per mode (over each
  mode's outputs at once, see `_err`); raises on
  NaN or inf where ``f`` is finite, or on a dtype or shape change."""
  programs = _programs(seed, ops)
  errors = {}
  for mode in _MODES:
    program = programs["fwd" if mode in _FORWARD_ONLY else "rev"]
    f = _as_fn(program)
    want, scale = _reference(seed, mode, ops)
    got = _runner(mode, seed)(mpolicy.amp(f, _POLICIES[policy]))
    pairs = list(zip(jax.tree_util.tree_leaves(got),
                     jax.tree_util.tree_leaves(want)))
    for a, b in pairs:
      assert a.shape == b.shape and a.dtype == b.dtype == np.float32, _describe(
          seed, program, f"{policy} {mode}: {a.dtype}{a.shape} returned for "
          f"{b.dtype}{b.shape}")
      a, b = np.asarray(a), np.asarray(b)
      assert not (np.isfinite(b) & ~np.isfinite(a)).any(), _describe(
          seed, program, f"{policy} {mode}: non-finite where float32 is finite")
    errors[mode] = _err(got, want, scale)
  return errors, programs


def check_half_is_close(seed: int, policy: str,
                        ops: tuple[str, ...] = ()) -> None:
  errors, programs = half_errors(seed, policy, ops)
  for mode, err in errors.items():
    program = programs["fwd" if mode in _FORWARD_ONLY else "rev"]
    assert err <= _TOLERANCE[policy], _describe(
        seed, program, f"{policy} {mode}: relative error {err:.3g} = "
        f"{err / UNIT_ROUNDOFF[policy]:.1f} u > {TOLERANCE_IN_U} u")


def check_sharing_is_bitwise(seed: int, policy: str) -> None:
  """`amp(f, policy)` computes the same bits with its shortcuts (shared
  layers, reused interpretations of sub-jaxprs) as without them
  (``DEFAULT_RULES.with_sharing(False)``), under jit, grad and jvp."""
  programs = _programs(seed)
  unshared = mpolicy.DEFAULT_RULES.with_sharing(False)
  for mode in ("jit", "grad", "jvp"):
    program = programs["fwd" if mode in _FORWARD_ONLY else "rev"]
    f = _as_fn(program)
    run = _runner(mode, seed)
    got = run(mpolicy.amp(f, _POLICIES[policy]))
    want = run(mpolicy.amp(f, _POLICIES[policy], rules=unshared))
    assert same_bits(got, want), _describe(
        seed, program, f"sharing on and off differ under {mode} ({policy})")
