"""JAX internals: every import of `jax._src` and `jax.extend` in mpolicy
but the distributed client's (`processes.py`).

Small, version-independent helpers over name stacks, jaxprs and
primitives. Nothing here knows about policies.
"""

from __future__ import annotations

from collections.abc import Iterator
import contextlib
import linecache
import sys
from typing import Optional

import jax
from jax.extend import core as jex_core
from jax.extend import linear_util as _lu
from jax.extend import source_info_util as _siu
from jax.extend.core import primitives as _jex_primitives
from jax.experimental import hijax as _jex_hijax
from jax.interpreters import ad as _ad
from jax.interpreters import batching as _batching
from jax.interpreters import mlir as _mlir
from jax.interpreters import partial_eval as _pe

# The rest is private JAX (each listed, with what it is for, in `private`).
from jax._src import config as _config
from jax._src import core as _core
from jax._src import source_info_util as _siu_private
from jax._src.interpreters import ad as _ad_private
from jax._src.interpreters import partial_eval as _pe_private
from jax._src.lax import lax as _lax_internal

# --- Name stacks ------------------------------------------------------------

# JAX's private source_info_util is the only place the Scope/Transform entries
# of a name stack are defined; `jax.extend` re-exports the functions but not them.
_Scope = _siu_private.Scope
_Transform = _siu_private.Transform


def scope_names(name_stack) -> tuple[str, ...]:
  """The plain scope names of a name stack, outermost first.

  Transform entries (`jvp(...)`, `transpose(...)`, `vmap(...)`) are dropped:
  they wrap the scopes under AD and batching but are not scopes themselves.
  """
  names = []
  for entry in getattr(name_stack, "stack", ()):
    if isinstance(entry, _Scope):  # type: ignore[misc]  # JAX's generic alias.
      names.append(entry.name)
    elif not isinstance(entry, _Transform):  # type: ignore[misc]  # Unknown kind: read its name.
      name = getattr(entry, "name", None)
      if isinstance(name, str):
        names.append(name)
  return tuple(names)


def current_scope_names() -> tuple[str, ...]:
  """Scope names of the name stack in force at this point of tracing."""
  return scope_names(_siu.current_name_stack())


def eqn_scope_names(eqn) -> tuple[str, ...]:
  """Scope names recorded on a jaxpr equation (relative inside sub-jaxprs)."""
  return scope_names(eqn.source_info.name_stack)


def current_name_stack():
  """The name stack in force at this point of tracing (an opaque object)."""
  return _siu.current_name_stack()


@contextlib.contextmanager
def eqn_context_under(base_stack, eqn, drop: int = 0,
                      keep: Optional[int] = None) -> Iterator[None]:
  """Like `eqn_context`, with the equation's name stack under ``base_stack``.

  Name stacks inside a traced jaxpr are relative to where it was traced, so
  an interpreter re-binding equations prefixes them with the name stack in
  force where it runs (empty inside a fresh trace); ``drop`` leaves out the
  equation's first entries (those of a call it is now inside), ``keep``
  keeps only its first ones (those of the call made in its place).
  """
  stack = eqn.source_info.name_stack
  stack = stack if keep is None else stack[:keep]
  with _siu.user_context(eqn.source_info.traceback,
                         name_stack=base_stack + (stack[drop:] if drop
                                                  else stack)):
    yield


# --- Where an equation was written -------------------------------------------

# JAX frames that only forward a call (a traced array's methods, jit's
# dispatch): the JAX function the user's code called lies further in.
_FORWARDERS = ("<locals>.meth", "<locals>.op", "reraise_with_filtered_traceback",
               "cache_miss", "_run_python_pjit", "_cpp_pjit")


def called_jax_function(eqn) -> Optional[tuple[str, str]]:
  """The JAX function the user's code called to make ``eqn``.

  From the equation's traceback: the JAX-internal frame next to the
  innermost frame outside JAX (forwarding frames skipped).

  Returns:
    ``(file name, function name)`` of that frame; ``("", "")`` when no
    frame of the traceback lies outside JAX (JAX made ``eqn`` on its own,
    inside a function it traced itself); ``None`` when the traceback is
    unknown or ``eqn`` was made by code outside JAX directly.
  """
  traceback = getattr(eqn.source_info, "traceback", None)
  if traceback is None:
    return None
  frames = list(traceback.frames)  # Innermost first.
  i = next((i for i, frame in enumerate(frames)
            if _siu_private.is_user_filename(frame.file_name)), None)
  if i is None:
    return "", ""
  for frame in reversed(frames[:i]):
    if not any(f in frame.function_name for f in _FORWARDERS):
      return frame.file_name, frame.function_name
  return None


def user_source(eqn) -> str:
  """The source text of the user's call that made ``eqn`` ('' if unknown)."""
  user = _siu_private.user_frame(getattr(eqn.source_info, "traceback", None))
  if user is None:
    return ""
  last = max(user.start_line, getattr(user, "end_line", user.start_line))
  return "".join(linecache.getline(user.file_name, n)
                 for n in range(user.start_line, last + 1))


def user_location(eqn, library_dirs: tuple[str, ...] = ()) -> str:
  """``file:line`` of the innermost frame that made ``eqn`` outside JAX and
  outside ``library_dirs`` (directory prefixes); ``""`` if unknown."""
  traceback = getattr(eqn.source_info, "traceback", None)
  if traceback is None:
    return ""
  for frame in traceback.frames:  # Innermost first.
    name = frame.file_name
    if (_siu_private.is_user_filename(name)
        and not name.startswith(library_dirs)):
      return f"{name}:{frame.line_num}"
  return ""


def eqn_transforms(eqn) -> tuple[str, ...]:
  """The transforms recorded on an equation's name stack (``"jvp"``,
  ``"transpose"``, ``"vmap"``, ...), outermost first."""
  return tuple(entry.name
               for entry in getattr(eqn.source_info.name_stack, "stack", ())
               if isinstance(entry, _Transform))  # type: ignore[misc]


# --- Jaxpr types ------------------------------------------------------------

# The class of every traced value (`jax.extend.core.Tracer` where it exists).
Tracer = jex_core.Tracer if hasattr(jex_core, "Tracer") else jax.core.Tracer

# Tracers of forward-mode and linearizing autodiff (`jax.jvp`, `jax.grad`).
AUTODIFF_TRACERS = (_ad.JVPTracer, _ad_private.LinearizeTracer)

ClosedJaxpr = jex_core.ClosedJaxpr
Jaxpr = jex_core.Jaxpr
Literal = jex_core.Literal
DropVar = jex_core.DropVar


# --- Primitives, matched by identity ----------------------------------------


@contextlib.contextmanager
def manual_axes_context(mesh, manual: frozenset,
                        check_vma: Optional[bool]) -> Iterator[None]:
  """Where a `shard_map` body over ``mesh``, manual over ``manual``, may be
  traced again.

  Inside, the manual mesh axes are bound (so `pvary` and collectives such
  as `psum` find them), the abstract mesh marks them manual, and
  varying-axes checking is ``check_vma`` (unchanged if ``None``): what JAX
  itself sets up when it traces a `shard_map` body.
  """
  manual_all = manual | frozenset(getattr(mesh, "manual_axes", ()))
  abstract = mesh.abstract_mesh.update_axis_types(
      {n: jax.sharding.AxisType.Manual for n in manual})
  with contextlib.ExitStack() as stack:
    stack.enter_context(_core.extend_axis_env_nd(
        [(k, v) for k, v in mesh.shape.items() if k in manual_all]))
    stack.enter_context(jax.sharding.use_abstract_mesh(abstract))
    if check_vma is not None:
      stack.enter_context(_config._check_vma(check_vma))  # pylint: disable=protected-access
    yield


# Primitive names that only some supported JAX versions define: name ->
# (first version that has it, first version that no longer has it), None
# for open ends. Every other name mpolicy looks up (here and in the rule
# registrations) must exist in the installed JAX: a test checks
# `absent_primitive_names()` against this list, so a misspelt or removed
# name cannot be skipped silently.
VERSION_SPECIFIC_PRIMITIVES: dict[str, tuple] = {
    # Replaced by `eval_jaxpr` (present in 0.10.2, gone in 0.12; see `calls`).
    "closed_call": (None, (0, 12, 0)),
    "call": (None, (0, 12, 0)),
    # New element-wise primitives (`rules.classes` gives each its rule).
    **dict.fromkeys(("log2", "one_minus_square"), ((0, 11, 2), None)),
    "polynomial": ((0, 12, 0), None),
    **dict.fromkeys(("acospi", "asinpi", "atan2pi", "atanpi", "cospi",
                     "sinpi", "tanpi", "exp2m1", "log2p1", "fma", "fmuladd"),
                    ((0, 12, 1), None)),
}

_absent: set[str] = set()


def absent_primitive_names() -> frozenset[str]:
  """The primitive names looked up (by `primitives_named` and at import)
  that the installed JAX does not define."""
  return frozenset(_absent)


broadcast_in_dim_p = jax.lax.broadcast_in_dim_p
gather_p = jax.lax.gather_p
dot_general_p = jax.lax.dot_general_p
conv_general_dilated_p = jax.lax.conv_general_dilated_p
convert_element_type_p = jax.lax.convert_element_type_p
bitcast_convert_type_p = jax.lax.bitcast_convert_type_p
scan_p = jax.lax.scan_p
while_p = jax.lax.while_p
cond_p = jax.lax.cond_p
jit_p = _jex_primitives.jit_p
remat_p = _jex_primitives.remat_p
custom_jvp_call_p = _jex_primitives.custom_jvp_call_p
custom_vjp_call_p = _jex_primitives.custom_vjp_call_p
linear_solve_p = jax.lax.linear_solve_p


def _registered_named(*names: str) -> list:
  """The primitives named ``names`` among those JAX registered a lowering
  or a JVP rule for (at import; the first registered wins a shared name),
  None, recorded as absent, for a name none has. A lookup for the few
  primitives JAX exports under no public name, without walking modules."""
  found: dict = {}
  for table in (_mlir._lowerings, _ad.primitive_jvps):  # pylint: disable=protected-access
    for p in list(table):
      found.setdefault(p.name, p)
  _absent.update(n for n in names if n not in found)
  return [found.get(n) for n in names]


# Host callbacks (`jax.pure_callback`, `jax.experimental.io_callback`,
# `jax.debug.callback` and `jax.debug.print`): Python code that receives its
# operands as arrays of the dtypes it was traced with. `rules.kernels`
# registers their facts; the rest of mpolicy reads those.
(pure_callback_p, io_callback_p, debug_callback_p, shard_map_p,
 ref_addupdate_p, inspect_sharding_p) = _registered_named(
     "pure_callback", "io_callback", "debug_callback", "shard_map",
     "addupdate", "inspect_sharding")

CALLBACK_PRIMITIVES = frozenset(
    p for p in (pure_callback_p, io_callback_p, debug_callback_p)
    if p is not None)


# Reads and writes of mutable array references (a scan3 loop's carries).
ref_get_p = _jex_primitives.get_p
ref_swap_p = _jex_primitives.swap_p

try:  # Pallas kernels (importing the primitive's module costs a few ms).
  from jax._src.pallas import pallas_call as _pallas_call  # pylint: disable=g-import-not-at-top
  pallas_call_p = _pallas_call.pallas_call_p
except (ImportError, AttributeError):
  pallas_call_p = None  # type: ignore[assignment]  # No Pallas here.

# Primitives that run code mpolicy does not see into as kernels: host
# callbacks and Pallas kernels. Their operands arrive in the dtypes they
# were traced with (an explicit rule each, and the ``kernel`` fact the rest
# of mpolicy reads; see `rules.kernels`).
KERNEL_PRIMITIVES = frozenset(
    p for p in (*CALLBACK_PRIMITIVES, pallas_call_p,
                inspect_sharding_p)
    if p is not None)



_primitives_cache: dict = {}


def loaded_primitives(packages) -> list:
  """The `Primitive` objects at the top level of the loaded modules of
  ``packages`` (each package's own module and its submodules)."""
  found: dict = {}
  for module_name, module in list(sys.modules.items()):
    if module is None or not any(module_name == p or
                                 module_name.startswith(p + ".")
                                 for p in packages):
      continue
    try:
      values = list(vars(module).values())
    except TypeError:
      continue
    found.update((id(v), v) for v in values
                 if isinstance(v, jex_core.Primitive))
  return list(found.values())


def _primitives(packages: tuple[str, ...]) -> dict:
  """Name -> `Primitive` for the primitives of ``packages``' loaded modules
  (cached until more modules are loaded)."""
  key = (packages, len(sys.modules))
  hit = _primitives_cache.get(key)
  if hit is not None:
    return hit
  found = {p.name: p for p in _mlir._lowerings}  # pylint: disable=protected-access
  found.update((p.name, p) for p in loaded_primitives(packages))
  # A name two primitives share (Pallas's SparseCore defines its own
  # `swap` and `get`) means JAX's own: the one `jax.extend.core.primitives`
  # exports, whichever modules happen to be loaded.
  found.update((p.name, p) for p in vars(_jex_primitives).values()
               if isinstance(p, jex_core.Primitive))
  _primitives_cache.clear()
  _primitives_cache[key] = found
  return found


def public_primitives() -> list:
  """The distinct primitives `jax.extend.core.primitives` exports (JAX's
  public list of its primitives), sorted by name."""
  found = {id(p): p for p in vars(_jex_primitives).values()
           if isinstance(p, jex_core.Primitive)}
  return sorted(found.values(), key=lambda p: p.name)


def primitive_names(packages=("jax",)) -> frozenset[str]:
  """Names of the primitives defined in the loaded modules of ``packages``.

  Every `Primitive` object found at the top level of a loaded module of
  one of those packages (``jax`` covers `jax.lax`, its linear algebra,
  collectives, control flow, random numbers, ...), plus every primitive
  that has a lowering.
  """
  return frozenset(_primitives(tuple(packages)))


def primitives_named(names) -> list:
  """The `Primitive` objects of JAX's with these names; names the
  installed JAX does not define are left out (and recorded: see
  `absent_primitive_names`)."""
  found = _primitives(("jax",))
  _absent.update(n for n in names if n not in found)
  return [found[n] for n in names if n in found]


def bind(primitive, args, params):
  """Binds ``primitive`` with eqn-style params (turns jaxprs into subfuns)."""
  return primitive.bind(*args, **primitive.get_bind_params(params))


def aval_of(x):
  """The abstract value of an array, tracer or scalar."""
  return jax.typeof(x)


def trace_to_closed_jaxpr(fn, in_avals, like=None) -> ClosedJaxpr:
  """Traces ``fn(*args) -> list`` at ``in_avals`` (weak types kept).

  The trace starts with an empty name stack, as JAX's own sub-traces do.
  ``like``, a jaxpr, lends its debug info (names shown in jaxprs).
  """
  debug = getattr(like, "debug_info", None)
  if (debug is None or debug.arg_names is None
      or len(debug.arg_names) != len(in_avals)):
    debug = jex_core.DebugInfo(
        "mpolicy", "mpolicy", tuple(f"a{i}" for i in range(len(in_avals))),
        None)
  else:
    debug = debug._replace(result_paths=None)
  wrapped = _lu.wrap_init(lambda *a: list(fn(*a)), debug_info=debug)
  jaxpr, _, consts = _pe.trace_to_jaxpr_dynamic(wrapped, list(in_avals))
  return jex_core.ClosedJaxpr(jaxpr, consts)


def eval_eagerly(closed: ClosedJaxpr, *args) -> list:
  """Evaluates ``closed`` one equation at a time (each primitive dispatched
  on its own, from JAX's per-primitive cache: nothing the size of the
  program is compiled)."""
  return list(jex_core.jaxpr_as_fun(closed)(*args))


def open_jaxpr_with_consts_first(closed: ClosedJaxpr):
  """``(jaxpr, consts)``: the consts turned into leading invars."""
  return _pe_private.convert_constvars_jaxpr(closed.jaxpr), list(closed.consts)


def call_thunk(thunk, *args):
  """Calls a `lu.WrappedFun` (a custom rule's jaxpr thunk) on ``args``."""
  return thunk.call_wrapped(*args)


def wrap_thunk(fn, like):
  """A `lu.WrappedFun` calling ``fn``, with the debug info of ``like``."""
  return _lu.wrap_init(fn, debug_info=like.debug_info)


# --- Defining a primitive ---------------------------------------------------

def new_primitive(name: str) -> jex_core.Primitive:
  return jex_core.Primitive(name)


def define_bilinear(primitive, lhs_transpose, rhs_transpose) -> None:
  """JVP and transpose rules for a primitive bilinear in its two operands."""
  _ad.defbilinear(primitive, lhs_transpose, rhs_transpose)


def define_lowering(primitive, composite, platform=None) -> None:
  """Lowers ``primitive`` by lowering ``composite`` (a JAX function).

  ``platform`` (``"cuda"``, ``"rocm"``, ``"tpu"``, ...) makes it the lowering
  for that backend only; ``None`` is the default for every other backend.
  """
  _mlir.register_lowering(
      primitive, _mlir.lower_fun(composite, multiple_results=False),
      platform=platform)


# --- Devices: which mesh axes a value varies over ---------------------------


def varying_axes(x) -> frozenset:
  """The manual mesh axes ``x`` varies over (its vma); empty outside a
  `shard_map` body or with ``check_vma=False``."""
  mat = getattr(jax.typeof(x), "mat", None)
  return frozenset(getattr(mat, "varying", ()) or ())


def check_vma_enabled() -> bool:
  """Whether values are typed with the axes they vary over (`shard_map`'s
  ``check_vma``), as set where this is traced."""
  return bool(_config._check_vma.value)  # pylint: disable=protected-access


def manual_axes() -> frozenset:
  """The mesh axes a `shard_map` body being traced is manual over."""
  return frozenset(jax.sharding.get_abstract_mesh().manual_axes)


def bound_axis_names() -> frozenset:
  """Every named axis bound where this is traced (`pmap`, `shard_map`)."""
  return frozenset(jex_core.unsafe_get_axis_names_DO_NOT_USE())


def make_varying(x, axes):
  """``x`` marked as varying over ``axes`` too (a no-op where it does)."""
  axes = tuple(a for a in axes if a not in varying_axes(x))
  return jax.lax.pcast(x, axes, to="varying") if axes else x


def out_varying_axes(fn, *args) -> list:
  """The vma of each output leaf of ``fn(*args)``, traced, not run."""
  closed = jax.make_jaxpr(fn)(*args)
  return [frozenset(getattr(getattr(a, "mat", None), "varying", ()) or ())
          for a in closed.out_avals]


def define_batching(primitive, rule) -> None:
  _batching.primitive_batchers[primitive] = rule


def dot_general_batch_dim_nums(ndims, batch_dims, dimension_numbers):
  """JAX's new dimension numbers for a vmapped dot_general."""
  return _lax_internal._dot_general_batch_dim_nums(  # pylint: disable=protected-access
      ndims, batch_dims, dimension_numbers)


def with_dtype(aval, dtype, weak_type: bool = False):
  """``aval`` with another dtype (keeps shape, sharding, vma, ...); a
  reference's aval (``Ref{f32[3]}``) gets a reference to that dtype."""
  inner = getattr(aval, "inner_aval", None)
  if inner is not None:
    return aval.update(inner_aval=with_dtype(inner, dtype, weak_type))
  return aval.update(dtype=dtype, weak_type=weak_type)


def with_sharding(aval, sharding):
  """``aval`` with another sharding (keeps shape, dtype, vma, ...)."""
  return aval.update(sharding=sharding)


def is_ref(x) -> bool:
  """Whether ``x`` (a value or an aval) is a mutable array reference."""
  return isinstance(getattr(x, "aval", x), _jex_hijax.AbstractRef)


def tangent_aval(aval):
  return aval.to_tangent_aval()


def conv_transpose(side: str, ct, known, operand_aval, **params):
  """JAX's own transpose of `conv_general_dilated` for one operand.

  ``side`` is ``"lhs"`` or ``"rhs"``, the operand whose cotangent is made;
  ``known`` is the other operand, ``operand_aval`` the transposed one's
  abstract value (shape, dtype, sharding). ``params`` are the primitive's,
  ``preferred_element_type`` and ``out_sharding`` included. JAX's rule holds
  the bookkeeping: flipped kernels, transposed specs, VJP paddings, group
  axes reshaped in and out.
  """
  undefined = _ad.UndefinedPrimal(operand_aval)
  rule = _ad.primitive_transposes[conv_general_dilated_p]  # Bilinear.
  if side == "lhs":
    return rule(ct, undefined, known, **params)[0]
  return rule(ct, known, undefined, **params)[1]


def conv_batch(batched_args, batch_dims, **params):
  """JAX's conv_general_dilated batching rule: ``(out, out_dim)``.

  The rule is a "fancy" batcher whose first argument (the vmapped axis's
  data) it reads only to shard the result; with ``out_sharding=None`` it
  is never read, so None stands in for it.
  """
  rule = _batching.fancy_primitive_batchers[conv_general_dilated_p]
  return rule(None, batched_args, batch_dims, **params)


__all__ = [
    "absent_primitive_names",
    "aval_of",
    "bind",
    "bitcast_convert_type_p",
    "bound_axis_names",
    "broadcast_in_dim_p",
    "CALLBACK_PRIMITIVES",
    "is_ref",
    "KERNEL_PRIMITIVES",
    "pallas_call_p",
    "ref_addupdate_p",
    "ref_get_p",
    "ref_swap_p",
    "call_thunk",
    "called_jax_function",
    "check_vma_enabled",
    "ClosedJaxpr",
    "Jaxpr",
    "cond_p",
    "conv_batch",
    "conv_general_dilated_p",
    "conv_transpose",
    "convert_element_type_p",
    "current_name_stack",
    "current_scope_names",
    "custom_jvp_call_p",
    "custom_vjp_call_p",
    "define_batching",
    "define_bilinear",
    "define_lowering",
    "dot_general_batch_dim_nums",
    "dot_general_p",
    "DropVar",
    "eqn_context_under",
    "eqn_scope_names",
    "eqn_transforms",
    "eval_eagerly",
    "gather_p",
    "jit_p",
    "loaded_primitives",
    "linear_solve_p",
    "Literal",
    "make_varying",
    "manual_axes",
    "manual_axes_context",
    "new_primitive",
    "open_jaxpr_with_consts_first",
    "out_varying_axes",
    "primitive_names",
    "public_primitives",
    "primitives_named",
    "remat_p",
    "scan_p",
    "scope_names",
    "shard_map_p",
    "tangent_aval",
    "trace_to_closed_jaxpr",
    "Tracer",
    "AUTODIFF_TRACERS",
    "user_location",
    "user_source",
    "varying_axes",
    "VERSION_SPECIFIC_PRIMITIVES",
    "while_p",
    "with_dtype",
    "with_sharding",
    "wrap_thunk",
]
