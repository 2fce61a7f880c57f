"""JAX's next-generation higher-order primitives (``call_hi_primitive``).

With ``jax_scan3``, ``jax_remat3``, ``jax_custom_vjp3`` or
``jax_custom_jvp3`` on (JAX 0.10 has the first three, 0.12 all four),
`lax.scan`, `jax.checkpoint`, `jax.custom_vjp` and `jax.custom_jvp` stage one
primitive, ``call_hi_primitive``, whose one param ``_prim`` is an object of
a class per construct (``Scan3``, ``RematTraced``, ``CustomVJPTraced``,
``CustomJVPTraced``, ``CheckpointName``, ...). The object holds the
sub-computations as attributes: an open or closed jaxpr, a `Traced` (a
traced function with its jaxpr), Python rule functions. A scan's carry is
a mutable reference (``new_ref`` before the loop, ``get``/``swap`` in its
body) rather than an operand and a result.

Here each construct is read and rebuilt around a new jaxpr, whichever form
the installed JAX uses (open jaxprs in 0.12, closed ones in 0.10; different
constructor arguments): the rest of mpolicy asks for a construct's
``kind``, its body as a closed jaxpr, and a rebuilt object.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import functools
import inspect
import types
from typing import Any, Optional

import jax
from jax.experimental import hijax as _jex_hijax
from jax.extend import core as jex_core
from jax.extend import linear_util as _lu
from jax.interpreters import partial_eval as _pe
import jax.stages as _stages

# Private JAX (each listed, with what it is for, in `private`): the
# constructs' classes and the primitive applying them.
from jax._src import ad_checkpoint as _ad_checkpoint
from jax._src import core as _core
from jax._src import hijax as _hijax_module
from jax._src.lax.control_flow import loops as _loops

from mpolicy._src.jax_compat import internals as _i


call_hi_primitive_p = getattr(_hijax_module, "call_hi_primitive_p", None)

# The construct classes, by the kind mpolicy gives them (absent ones, from an
# older JAX, are left out).
_KINDS = {
    cls: kind for cls, kind in (
        (getattr(_loops, "Scan3", None), "scan"),
        (getattr(_ad_checkpoint, "RematTraced", None), "remat"),
        (getattr(_hijax_module, "CustomVJPTraced", None), "custom_vjp"),
        (getattr(_hijax_module, "CustomJVPTraced", None), "custom_jvp"),
        (getattr(_ad_checkpoint, "CheckpointName", None), "checkpoint_name"),
        (getattr(_ad_checkpoint, "CheckpointNameFwd", None),
         "checkpoint_name"),
    ) if cls is not None}

# The base classes of a construct, public in `jax.experimental.hijax`:
# `HiPrim` (JAX 0.12) or `VJPHiPrimitive` (0.10).
_HI_BASES = tuple(getattr(_jex_hijax, n) for n in ("HiPrim", "VJPHiPrimitive")
                  if hasattr(_jex_hijax, n))

KINDS = frozenset(_KINDS.values())
"""The kinds of construct mpolicy knows (``"scan"``, ``"remat"``, ...)."""


def hi_object(eqn) -> Optional[Any]:
  """The construct a ``call_hi_primitive`` equation applies, else None."""
  if call_hi_primitive_p is None or eqn.primitive is not call_hi_primitive_p:
    return None
  return eqn.params["_prim"]


def kind(obj) -> Optional[str]:
  """``"scan"``, ``"remat"``, ``"custom_vjp"``, ``"custom_jvp"``,
  ``"checkpoint_name"``, or None for a construct mpolicy does not know."""
  return _KINDS.get(type(obj))


def name(obj) -> str:
  """The construct's class name (``Scan3``, ``RematTraced``, ...)."""
  return type(obj).__name__


def is_construct(value) -> bool:
  return bool(_HI_BASES) and isinstance(value, _HI_BASES)


def construct_params(obj) -> dict:
  """The construct's own params (its sub-computations among them)."""
  return dict(getattr(obj, "params", {}))


def bind(obj, args) -> list:
  """Applies the construct ``obj`` to ``args`` (flat operands)."""
  return list(call_hi_primitive_p.bind(*args, _prim=obj))  # type: ignore[union-attr]  # JAX 0.12.


def _rebuild(obj, **changes):
  """A new object of ``obj``'s class: its constructor's arguments taken from
  ``changes``, else from ``obj`` (its params, or attributes)."""
  aliases = {"sym_zeros": "symbolic_zeros"}
  params = construct_params(obj)
  kwargs = {}
  for arg in list(inspect.signature(type(obj).__init__).parameters)[1:]:
    if arg in changes:
      kwargs[arg] = changes[arg]
    elif arg in params:
      kwargs[arg] = params[arg]
    elif aliases.get(arg) in params:
      kwargs[arg] = params[aliases[arg]]
    elif hasattr(obj, arg):
      kwargs[arg] = getattr(obj, arg)
  return type(obj)(**kwargs)


def _closed(jaxpr) -> jex_core.ClosedJaxpr:
  if isinstance(jaxpr, jex_core.ClosedJaxpr):
    return jaxpr
  return jex_core.ClosedJaxpr(jaxpr, ())


def _open_like(old, closed: jex_core.ClosedJaxpr):
  """``closed`` with its consts turned into leading invars, in the form
  (open or closed) ``old`` had, and the consts."""
  jaxpr, consts = _i.open_jaxpr_with_consts_first(closed)
  if isinstance(old, jex_core.ClosedJaxpr):
    return jex_core.ClosedJaxpr(jaxpr, ()), consts
  return jaxpr, consts


# --- Scan3: a loop whose carry lives in references ---------------------------


def scan_body(obj) -> jex_core.ClosedJaxpr:
  """The body of a ``Scan3``: one iteration, its carries as references, its
  consts and the slices of its scanned inputs as operands."""
  return _closed(obj.jaxpr)


def scan_loop(obj) -> tuple[int, bool, list]:
  """A ``Scan3``'s ``(length, reverse, scanned)``: ``scanned[i]`` says
  whether operand ``i`` is sliced per iteration (else a carry or const)."""
  params = construct_params(obj)
  return params["length"], params["reverse"], list(params["extensives"])


def scan_rebuild(obj, body: jex_core.ClosedJaxpr) -> tuple[Any, list]:
  """A ``Scan3`` running ``body``; its consts become leading operands (not
  scanned over). Returns the new object and the consts to prepend."""
  jaxpr, consts = _open_like(obj.jaxpr, body)
  extensives = [False] * len(consts) + list(obj.extensives)
  new = _rebuild(obj, jaxpr=jaxpr, extensives=extensives)
  if not new.effects:
    # The loop writes its carries' references: effects on its operands.
    # JAX 0.12's Scan3 does not declare them, so `jit` drops a loop whose
    # results are only in those references (a `fori_loop`) as dead code,
    # and the carries come back as they entered. Declared here, it stays.
    new.effects = frozenset(_core.positional_effects(getattr(jaxpr, "jaxpr",
                                                             jaxpr)))
  return new, consts


# --- RematTraced: jax.checkpoint --------------------------------------------


def remat_body(obj) -> jex_core.ClosedJaxpr:
  return _closed(obj.jaxpr)


def remat_rebuild(obj, body: jex_core.ClosedJaxpr) -> tuple[Any, list]:
  """A ``RematTraced`` running ``body`` (policy kept); its consts become
  leading operands. Returns the new object and the consts to prepend."""
  jaxpr, consts = _open_like(obj.jaxpr, body)
  changes = {"jaxpr": jaxpr}
  prevent_cse = construct_params(obj).get("prevent_cse")
  if isinstance(prevent_cse, tuple):
    changes["prevent_cse"] = (False,) * len(consts) + prevent_cse
  return _rebuild(obj, **changes), consts


def remat_policy(obj):
  return construct_params(obj).get("policy")


# --- CustomVJPTraced / CustomJVPTraced ----------------------------------------


def custom_primal(obj) -> Optional[jex_core.ClosedJaxpr]:
  """The primal function's jaxpr of a custom_vjp/custom_jvp construct."""
  traced = construct_params(obj).get("traced")
  return getattr(traced, "jaxpr", None)


def _traced_with(traced, jaxpr: jex_core.ClosedJaxpr, out_tree=None):
  """``traced`` (a `jax.stages.Traced`) with another jaxpr of the same
  argument and result structure (or results in ``out_tree``)."""
  args = [list(jaxpr.in_avals), dict(traced._params, jaxpr=jaxpr),  # pylint: disable=protected-access
          traced._in_tree, out_tree or traced.out_tree, traced._consts]  # pylint: disable=protected-access
  if "_fun_sourceinfo" in _stages.Traced.__slots__:
    args.append(traced._fun_sourceinfo)  # pylint: disable=protected-access
  return _stages.Traced(*args)


def custom_vjp_fwd(obj) -> Callable[..., Any]:
  return construct_params(obj)["fwd"]


def custom_vjp_rebuild(obj, primal: jex_core.ClosedJaxpr, fwd) -> Any:
  """The custom_vjp construct with another primal jaxpr (same avals) and
  forward rule; its backward rule is kept."""
  traced = _traced_with(construct_params(obj)["traced"], primal)
  return _rebuild(obj, traced=traced, fwd=fwd)


def _jvp_rule_for(rule, traced, symbolic_zeros):
  """``rule`` (a ``CustomJVPTraced``'s) made again for ``traced``: JAX's
  wrapper of the user's JVP function checks its outputs against the primal
  function's result types, which change when the primal is re-typed. A
  rule JAX derived otherwise (under `vmap`) is returned as it is."""
  make = getattr(_hijax_module, "_custom_jvp_rule", None)
  code = getattr(rule, "__code__", None)
  if make is None or code is None or not rule.__qualname__.startswith(
      "_custom_jvp_rule."):
    return rule
  # What `make` takes beyond ``traced`` is what ``rule`` closes over (JAX
  # 0.12.1 adds ``args_ft``, the operands' tree, and keeps
  # ``symbolic_zeros`` only as the construct's param). There the rule
  # checks its outputs against the user function's result tree, which the
  # construct's flat ``traced`` does not have.
  cells = dict(zip(code.co_freevars,
                   (c.cell_contents for c in rule.__closure__ or ())))
  cells.setdefault("symbolic_zeros", symbolic_zeros)
  if "out_tree" in cells:
    traced = _traced_with(traced, traced.jaxpr, cells["out_tree"])
  names = list(inspect.signature(make).parameters)[1:]
  missing = [n for n in names if n not in cells]
  if missing:
    raise NotImplementedError(
        f"mpolicy cannot re-type the JVP rule of custom_jvp "
        f"{traced.fun_name!r} under jax_custom_jvp3: JAX {jax.__version__} "
        f"makes the rule from {', '.join(map(repr, missing))}, which the "
        f"rule does not hold. Run with jax_custom_jvp3 off.")
  return keep_name(make(traced, *(cells[n] for n in names)), rule)


def custom_jvp_rebuild(obj, primal: jex_core.ClosedJaxpr, wrap) -> Any:
  """The custom_jvp construct with another primal jaxpr (its operands'
  dtypes may differ) and JVP rule ``wrap(rule, written)``: ``rule`` is its
  JVP rule made for the new primal's result types, ``written`` the rule as
  it came, checked against the result types the function was written with
  (a rule that computes its primal output itself gives those)."""
  params = construct_params(obj)
  traced = _traced_with(params["traced"], primal)
  in_avals = jax.tree_util.tree_unflatten(obj.in_tree, list(primal.in_avals))
  rule = _jvp_rule_for(params["jvp_rule"], traced, params["symbolic_zeros"])
  return _rebuild(obj, traced=traced, jvp_rule=wrap(rule, params["jvp_rule"]),
                  in_avals=in_avals)


def checkpoint_name_rebuild(obj, aval) -> Any:
  """A ``CheckpointName`` for a value of ``aval`` (same name)."""
  return _rebuild(obj, aval=aval)


# --- What a construct carries -------------------------------------------------


def jaxprs_in_params(params) -> list:
  """The jaxprs (open or closed) found in an equation's params, those a
  next-generation construct (``call_hi_primitive``'s object) holds
  included."""
  found = []
  for value in params.values():
    for v in (value if isinstance(value, (tuple, list)) else (value,)):
      if isinstance(v, (jex_core.Jaxpr, jex_core.ClosedJaxpr)):
        found.append(v)
      elif is_construct(v):
        found.extend(jaxprs_in(v))
  return found


def jaxprs_in(obj) -> list:
  """The jaxprs (open or closed) a construct holds, nested ones included."""
  found = []
  for value in construct_params(obj).values():
    for v in (value if isinstance(value, (tuple, list)) else (value,)):
      if isinstance(v, (jex_core.Jaxpr, jex_core.ClosedJaxpr)):
        found.append(v)
      elif isinstance(v, _stages.Traced):
        found.append(v.jaxpr)
      elif is_construct(v):
        found.extend(jaxprs_in(v))
  return found


def is_sub_computation(value) -> bool:
  """Whether a param value is, or produces, a computation of its own: a
  jaxpr, a traced function, a thunk that traces one (a linear_util
  function, as custom derivatives hold their rules), or a construct
  holding any of these or a rule function.

  A plain function in a first-order primitive's params is not one (a PRNG
  implementation's, a host callback's Python code: the callbacks are
  kernels, see `internals.KERNEL_PRIMITIVES`).
  """
  if isinstance(value, (jex_core.Jaxpr, jex_core.ClosedJaxpr, _stages.Traced,
                        _lu.WrappedFun)):
    return True
  if is_construct(value):
    return any(is_sub_computation(v) or (callable(v) and not isinstance(v, type))
               for v in _flat(construct_params(value)))
  return False


def _flat(params) -> list:
  out: list = []
  for value in params.values():
    out.extend(value if isinstance(value, (tuple, list)) else (value,))
  return out


def sub_computations(params) -> list:
  """The param values of an equation that are, or produce, computations
  (see `is_sub_computation`)."""
  return [v for v in _flat(params) if is_sub_computation(v)]


# --- Running a Python rule through an interpreter -----------------------------


def _dynamic(x) -> bool:
  return isinstance(x, (jax.Array, _i.Tracer))


def trace_rule(fn, args: Sequence[Any]):
  """Traces ``fn(*args)`` (a custom rule of JAX's: pytrees in and out, some
  leaves static) into a closed jaxpr over its array leaves.

  Returns:
    ``(closed, dynamic, finish)``: the jaxpr; the array leaves of ``args``
    (its operands); and ``finish(outs)``, which puts the jaxpr's outputs
    back into the result's structure (with its static leaves).
  """
  leaves, treedef = jax.tree_util.tree_flatten(args)
  which = [_dynamic(x) for x in leaves]
  dynamic = [x for x, d in zip(leaves, which) if d]
  out_cell = []

  def flat_fn(*dyn):
    it = iter(dyn)
    full = [next(it) if d else x for x, d in zip(leaves, which)]
    result = fn(*jax.tree_util.tree_unflatten(treedef, full))
    out_leaves, out_tree = jax.tree_util.tree_flatten(result)
    out_which = [_dynamic(x) for x in out_leaves]
    out_cell.append((out_leaves, out_tree, out_which))
    return [x for x, d in zip(out_leaves, out_which) if d]

  debug = jex_core.DebugInfo(
      "mpolicy rule", getattr(fn, "__name__", "rule"),
      tuple(f"a{i}" for i in range(len(dynamic))), None)
  wrapped = _lu.wrap_init(flat_fn, debug_info=debug)
  jaxpr, _, consts = _pe.trace_to_jaxpr_dynamic(
      wrapped, [jax.typeof(x) for x in dynamic])
  closed = jex_core.ClosedJaxpr(jaxpr, consts)
  out_leaves, out_tree, out_which = out_cell[-1]

  def finish(outs):
    it = iter(outs)
    full = [next(it) if d else x for x, d in zip(out_leaves, out_which)]
    return jax.tree_util.tree_unflatten(out_tree, full)

  finish.out_dynamic = out_which  # type: ignore[attr-defined]
  return closed, dynamic, finish


def eval_closed(closed: jex_core.ClosedJaxpr, args) -> list:
  """Evaluates a closed jaxpr on ``args`` where this is called."""
  return list(jex_core.jaxpr_as_fun(closed)(*args))


def eval_rebinding(closed: jex_core.ClosedJaxpr, args, rebind) -> list:
  """Evaluates ``closed`` on ``args`` where this is called, one equation at
  a time under its own name stack: ``rebind(eqn, invals)`` returns an
  equation's outputs, or ``None`` to bind it as it is."""
  env = dict(zip(closed.jaxpr.constvars, closed.consts))
  env.update(zip(closed.jaxpr.invars, args))
  read = lambda v: v.val if isinstance(v, jex_core.Literal) else env[v]
  base = _i.current_name_stack()
  for eqn in closed.jaxpr.eqns:
    invals = [read(v) for v in eqn.invars]
    with _i.eqn_context_under(base, eqn):
      outs = rebind(eqn, invals)
      if outs is None:
        outs = _i.bind(eqn.primitive, invals, eqn.params)
        outs = list(outs) if eqn.primitive.multiple_results else [outs]
    env.update((v, x) for v, x in zip(eqn.outvars, outs)
               if not isinstance(v, jex_core.DropVar))
  return [read(v) for v in closed.jaxpr.outvars]


def find_nested(closed: jex_core.ClosedJaxpr, pred) -> Optional[tuple]:
  """``(eqn, found)``: the first equation ``found`` in the sub-jaxprs
  (nested ones included) of an equation ``eqn`` of ``closed`` for which
  ``pred(found, transforms)`` holds, else ``None``; ``transforms`` are
  those on the name stacks of ``found`` and of its enclosing equations."""
  for eqn in closed.jaxpr.eqns:
    found = _find_inside(eqn, pred, ())
    if found is not None:
      return eqn, found
  return None


def _find_inside(eqn, pred, outer: tuple) -> Optional[Any]:
  outer = outer + _i.eqn_transforms(eqn)
  for sub in jaxprs_in_params(eqn.params):
    for e in getattr(sub, "jaxpr", sub).eqns:
      if pred(e, outer + _i.eqn_transforms(e)):
        return e
      found = _find_inside(e, pred, outer)
      if found is not None:
        return found
  return None


def keep_name(fn, like):
  """``fn`` under the name (and docs) of ``like``: JAX prints rule names."""
  return functools.update_wrapper(fn, like) if isinstance(
      like, types.FunctionType) else fn


