"""The entry points: `amp`, `full_precision`, and the call that runs them.

`interpret(fn)` traces ``fn`` to a jaxpr at its arguments' avals and
evaluates it with `interpreter.eval_jaxpr`, then casts the outputs. Called
outside any JAX transformation, the whole interpreted program is compiled
once per signature by a `jax.jit` (the cache below) rather than dispatched
primitive by primitive.
"""

from __future__ import annotations

from collections.abc import Callable
import contextlib
import dataclasses
import functools
import inspect
from typing import Any, Optional

import jax
import numpy as np

from mpolicy._src import arguments
from mpolicy._src import dtypes
from mpolicy._src import frameworks
from mpolicy._src import environment
from mpolicy._src import interpreter
from mpolicy._src import jax_compat
from mpolicy._src import op_rules as op_rules_lib
from mpolicy._src import policy as policy_lib
from mpolicy._src import observe
from mpolicy._src import regions

AMP_ATTRIBUTE = "__mpolicy_amp__"
"""Set on every interpreted function: ``(policy, rules)``."""

RUN_ATTRIBUTE = "__mpolicy_run__"
"""Set on every interpreted function: ``run(env, *args, **kwargs)`` runs it
once, traced, with ``env`` (an `environment.Env`) as its top environment."""


class _AtStep:
  """An interpreted function's ``at_step``: ``f.at_step(step)`` is ``f``
  with ``step`` (an integer scalar, traced or not) folded into the keys of
  its block matmuls (the NVFP4 recipe's randomness, `blocks.recipe`)."""

  def __init__(self, owner, call):
    self.owner, self._call = owner, call

  def __call__(self, step):
    return functools.wraps(self.owner)(
        lambda *args, **kwargs: self._call(args, kwargs, step))


def with_step(fn: Callable[..., Any], step: Any) -> Callable[..., Any]:
  """``fn`` called at ``step``: ``fn.at_step(step)`` if ``fn`` is an
  interpreted function itself (not a wrapper that copied its attributes);
  ``fn`` with ``step=step`` if it has a keyword-only ``step`` parameter (a
  loss that calls interpreted models, which passes it on with their
  ``at_step``); else ``fn``."""
  at = getattr(fn, "at_step", None)
  if isinstance(at, _AtStep) and at.owner is fn:
    return fn if step is None else at(step)
  if takes_step(fn):
    return functools.partial(fn, step=step)
  return fn


def takes_step(fn: Callable[..., Any]) -> bool:
  """Whether ``fn`` has a keyword-only parameter named ``step``."""
  try:
    parameter = inspect.signature(fn).parameters.get("step")
  except (TypeError, ValueError):
    return False
  return (parameter is not None
          and parameter.kind is inspect.Parameter.KEYWORD_ONLY)


def _is_array_leaf(x) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, jax_compat.Tracer))


def _static_key(x) -> Any:
  """A key for a static leaf that tells apart what only compares equal.

  ``1``, ``1.0`` and ``True`` are equal in Python but trace to different
  programs, so the type is part of the key. Floats key by their bits, so
  ``0.0`` and ``-0.0`` differ and a NaN matches itself.
  """
  if isinstance(x, float):
    return (type(x), x.hex())
  if isinstance(x, complex):
    return (type(x), x.real.hex(), x.imag.hex())
  return (type(x), x)


class _Static:
  """The non-array part of one call's arguments.

  ``leaves`` are the argument leaves with ``None`` where an array goes,
  ``treedef`` their structure and ``traced`` which leaves are arrays. It
  is the static argument of the eager cache's `jax.jit`, compared by type
  and value (see `_static_key`) as `jax.jit` tells static arguments apart:
  an entry made for ``f(x, 2)`` is not reused for ``f(x, 2.0)``.
  """

  def __init__(self, leaves, treedef, traced):
    self.leaves, self.treedef, self.traced = leaves, treedef, traced
    self._key = (tuple(_static_key(x) for x in leaves), treedef, traced)

  def hashable(self) -> bool:
    try:
      hash(self)
      return True
    except TypeError:
      return False

  def __hash__(self):
    return hash(self._key)

  def __eq__(self, other):
    return isinstance(other, _Static) and self._key == other._key


def split_arguments(args, kwargs) -> tuple[_Static, list]:
  """``(args, kwargs)`` as their static part and their array leaves.

  >>> import jax.numpy as jnp
  >>> static, arrays = split_arguments((jnp.ones(2), "tanh"), {"n": 3})
  >>> len(arrays), join_arguments(static, arrays)[0][1:], join_arguments(
  ...     static, arrays)[1]
  (1, ('tanh',), {'n': 3})
  """
  leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
  traced = tuple(_is_array_leaf(x) for x in leaves)
  static = _Static(tuple(None if t else x for x, t in zip(leaves, traced)),
                   treedef, traced)
  return static, [x for x, t in zip(leaves, traced) if t]


def join_arguments(static: _Static, arrays) -> tuple[tuple, dict]:
  """``(args, kwargs)`` again, from `split_arguments`' two parts."""
  it = iter(arrays)
  full = [next(it) if t else x for x, t in zip(static.leaves, static.traced)]
  return jax.tree_util.tree_unflatten(static.treedef, full)


def _is_output_leaf(x) -> bool:
  return _is_array_leaf(x) or isinstance(x, (bool, int, float, complex,
                                             np.generic))


def _check_outputs(fn, out) -> None:
  """Raises a `TypeError` naming any output leaf JAX cannot return."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(out)[0]:
    if not _is_output_leaf(leaf):
      where = jax.tree_util.keystr(path) or "(the whole output)"
      name = getattr(fn, "__qualname__", None) or repr(fn)
      raise TypeError(
          f"amp: the output of {name} at {where} is {leaf!r} of type "
          f"{type(leaf).__module__}.{type(leaf).__qualname__}, which is not a "
          "valid JAX type. An amp-wrapped function may return only arrays, "
          "Python numbers and bools, and pytrees of them; return other "
          "values from outside it.")


def _trace_user_fn(flat_fn, in_avals):
  """Traces the user's function; explains what amp cannot trace.

  An error a framework raises there (a Flax NNX module closed over by the
  function updating its variables) becomes the framework bridge's clearer
  one (see `frameworks.explained`).
  """
  try:
    return jax_compat.trace_to_closed_jaxpr(flat_fn, in_avals)
  except Exception as e:  # pylint: disable=broad-except
    better = frameworks.explained(e)
    if better is None:
      raise
    raise better from e


def interpret(fn: Callable[..., Any], *, policy=None,
              rules: Optional[op_rules_lib.OpRules] = None,
              cast_outputs: bool = True) -> Callable[..., Any]:
  """``fn`` re-run under the op rules (the engine behind `amp`).

  Array leaves of the arguments (JAX and numpy arrays, tracers) are traced;
  every other leaf (Python scalars and bools, strings, None, objects) is
  passed through as a static value.

  Args:
    fn: any JAX function.
    policy: a `Policy` or spec string that governs the whole call, or
      ``None`` (then only regions tagged by the Haiku bridge, registry name
      patterns and the ``full`` rule change anything).
    rules: the `OpRules` table; `DEFAULT_RULES` if ``None``.
    cast_outputs: if ``True``, floating outputs are cast to ``policy``'s
      output dtype (to the dtypes ``fn`` itself returns when no policy is
      given). If ``False``, they are cast back to the dtypes ``fn`` itself
      returns, so the interpreted function has ``fn``'s exact signature (the
      Haiku bridge: module outputs already follow their policies).

  Returns:
    The interpreted function, marked so that `explain` recognises it.
  """
  arguments.require_callable(fn, "amp", "fn", "the function to run under "
                             "the op rules: a JAX function, a Flax apply, an "
                             "Equinox module")
  rules = op_rules_lib.default_rules() if rules is None else rules
  if not isinstance(rules, op_rules_lib.OpRules):
    raise TypeError(f"rules must be an OpRules table, got {rules!r}")
  pol = None if policy is None else policy_lib.get_policy(policy)
  outer = (None if pol is None else
           regions.Region(policy=pol, decided_by=f"amp(policy={pol})"))
  config = interpreter.Config(rules=rules, outer=outer,
                              mode=interpreter.rules_mode(rules))

  # Framework objects updated in place (Flax NNX) go in and out as state.
  objects = frameworks.ObjectArguments()

  def run(static: _Static, arrays: list, step=None, env=None):
    return _run_call(fn, config, pol, cast_outputs, static, arrays, objects,
                     step, env)

  # The eager cache. Called outside any transformation, the interpreted
  # program is compiled once per signature by this `jax.jit` rather than
  # dispatched primitive by primitive. The registry's state is part of
  # JAX's cache key (see `registry`), so a change of it retraces.
  compiled = jax.jit(run, static_argnums=0)

  def call(args, kwargs, step):
    with objects.outside((args, kwargs)) as (pure, finish):
      static, arrays = split_arguments((pure,), {})
      eager = not any(isinstance(x, jax_compat.Tracer) for x in [*arrays, step])
      if eager and static.hashable():
        return finish(compiled(static, arrays, step))
      return finish(run(static, arrays, step))  # Under a transformation.

  @functools.wraps(fn)
  def interpreted(*args, **kwargs):
    return call(args, kwargs, None)

  def run_in(env, *args, **kwargs):
    with objects.outside((args, kwargs)) as (pure, finish):
      return finish(run(*split_arguments((pure,), {}), None, env))

  setattr(interpreted, AMP_ATTRIBUTE, (pol, rules))
  setattr(interpreted, RUN_ATTRIBUTE, run_in)
  interpreted.at_step = _AtStep(interpreted, call)  # type: ignore[attr-defined]
  return interpreted


def _run_call(fn, config: interpreter.Config, pol, cast_outputs: bool,
              static: _Static, arrays: list,
              objects: frameworks.ObjectArguments, step=None, env=None):
  """One call of an interpreted ``fn``: trace, interpret, cast outputs;
  ``step`` is folded into the block matmuls' keys (``None``: not); ``env``
  is the top environment (a new `environment.Env` if ``None``).

  Returns ``(states, output)`` as `ObjectArguments.inside_done` makes
  them: the state of the framework objects among the arguments (Flax NNX)
  after the call, and the output. Object state (there and in the output)
  keeps the dtypes it was traced in, for the caller to write back.
  """
  if pol is not None:
    policy_lib.require_x64(pol, f"amp(policy={pol})")
  out_trees, castable = [], []

  def flat_fn(*arrs):
    a, k = objects.inside(join_arguments(static, arrs)[0][0])
    with frameworks.module_policies():  # Flax linen class policies.
      out = fn(*a, **k)
    _check_outputs(fn, out)
    states, out = objects.inside_done((a, k), out)
    parts = jax.tree_util.tree_leaves(out, is_leaf=objects.is_state)
    castable.append([False] * len(jax.tree_util.tree_leaves(states)) +
                    [not objects.is_state(part) for part in parts
                     for _ in jax.tree_util.tree_leaves(part)])
    out_trees.append(jax.tree_util.tree_structure((states, out)))
    return jax.tree_util.tree_leaves((states, out))

  # Traced at the arguments' own avals, so that what `make_jaxpr` would
  # drop is kept: inside `shard_map`, which mesh axes a value varies over
  # (JAX then inserts the `pvary`s that mixing varying and replicated
  # values needs).
  closed = _trace_user_fn(flat_fn, [jax_compat.aval_of(a) for a in arrays])
  observe.count_run()
  env = environment.Env() if env is None else env
  env.step = step
  outs = interpreter.eval_jaxpr(
      closed.jaxpr, closed.consts, arrays,
      dataclasses.replace(config, region_cache={}, shared={}),
      jax_compat.current_scope_names(), env)
  final = []
  for i, (out, aval) in enumerate(zip(outs, closed.out_avals)):
    target = dtypes.aval_dtype(aval)
    # float64 outputs are never narrowed to the policy's output dtype, nor
    # is module state (it keeps the dtypes it had).
    if (cast_outputs and pol is not None and castable[-1][i]
        and not (dtypes.is_double(dtypes.dtype_of(out))
                 and not dtypes.is_double(pol.output_dtype))):
      target = pol.output_dtype
    if dtypes.float_value(out) and dtypes.is_float(target):
      out = env.cast(out, target)
    final.append(out)
  return jax.tree_util.tree_unflatten(out_trees[-1], final)


def amp(fn: Callable[..., Any], policy: Any = None, *,
        rules: Optional[op_rules_lib.OpRules] = None) -> Callable[..., Any]:
  """Runs each primitive of ``fn`` in the dtype the op rules give it.

  Like PyTorch autocast: matmuls and convolutions run in ``policy``'s compute
  dtype with float32 accumulation, fragile ops (exp, log, sums, ...) in
  float32, everything else in the dtype of its inputs. Inputs are not cast
  wholesale; floating outputs are cast to ``policy``'s output dtype. Under
  x64, float64 values are never narrowed: ops on them are not eligible for
  the compute dtype and float64 outputs stay float64, so ``amp(f, "full")``
  computes exactly what ``f`` does. Works
  under `jit`, `grad`, `vmap`, `pmap` and inside `shard_map`; the rules
  reach into nested `jit`, `scan`, `while_loop`, `cond`, `checkpoint`,
  `custom_jvp` and `custom_vjp`. The registry's class and name-pattern
  entries govern the Haiku and Flax linen module calls traced inside (so
  ``amp(hk.transform(f).apply)`` runs as ``transform_amp(f).apply``), and
  Flax NNX arguments are passed as `nnx.jit` passes them (all split in one
  graph, every write visible afterwards).

  >>> import jax, jax.numpy as jnp
  >>> f = amp(lambda x, w: jax.nn.relu(x @ w), "p=f32,c=bf16,o=f32")
  >>> f(jnp.ones((2, 3)), jnp.ones((3, 4))).dtype
  dtype('float32')
  >>> jax.make_jaxpr(f)(jnp.ones((2, 3)), jnp.ones((3, 4))).eqns[2].primitive
  amp_dot_general

  Args:
    fn: any JAX function (plain JAX, Flax, Equinox).
    policy: a `Policy` or spec string governing the whole call; ``None`` lets
      only registry name patterns (on `jax.named_scope`s) and the ``full``
      rule act.
    rules: an `OpRules` table; `DEFAULT_RULES` if ``None``.

  Returns:
    A function with ``fn``'s signature; its ``at_step(step)`` is the same
    function with ``step`` (an integer scalar, traced or not) folded into
    the keys of its block matmuls (`make_train_step` passes the optimizer's
    count). Non-array arguments (Python scalars,
    bools, strings, None) are passed through as static values; arguments of
    different types (``2`` and ``2.0``, ``1`` and ``True``) are never
    mistaken for each other. An output that is not an array, a Python
    number or a bool raises a `TypeError` naming its place in the output.

  Raises:
    TypeError: at once, if ``fn`` is not callable or ``rules`` is not an
      `OpRules`; ``ValueError`` for a malformed ``policy``.
    ValueError: when traced, if a policy that governs it (``policy`` or a
      registry entry) names float64 while ``jax_enable_x64`` is off: JAX
      would compute float32; the message says how to turn x64 on.

  See also: `full_precision`, `OpRules`, `explain`, `transform_amp`.
  """
  return interpret(fn, policy=policy, rules=rules, cast_outputs=True)


class full_precision(contextlib.ContextDecorator):  # pylint: disable=invalid-name
  """Context manager and decorator: inside, everything runs as written.

  The op rules are off in the block: no half matmuls, no float32 safety net;
  code on float32 inputs runs in float32.

  >>> import jax, jax.numpy as jnp
  >>> def f(x, w):
  ...   with full_precision():
  ...     return x @ w
  >>> f = amp(f, "p=f32,c=bf16,o=f32")
  >>> jax.make_jaxpr(f)(jnp.ones((2, 3)), jnp.ones((3, 4))).eqns[0].primitive
  dot_general

  Also usable as ``@full_precision()`` or ``@full_precision``.

  See also: `amp`, `set_policy`.
  """

  def __new__(cls, fn: Optional[Callable[..., Any]] = None):
    self = super().__new__(cls)
    if fn is not None:  # Used bare, as `@full_precision`.
      self.__init__()  # type: ignore[misc]
      return self(fn)
    return self

  def __init__(self, fn: Optional[Callable[..., Any]] = None) -> None:
    del fn
    self._stack: list[contextlib.ExitStack] = []

  def __enter__(self):
    stack = contextlib.ExitStack()
    stack.enter_context(regions.tagged(regions.FULL_PRECISION))
    self._stack.append(stack)
    return self

  def __exit__(self, *exc):
    return self._stack.pop().__exit__(*exc)
