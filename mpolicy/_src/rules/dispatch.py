"""How one first-order primitive runs: its rules, looked up in order.

1. A custom rule the `OpRules` table holds for the primitive
   (`OpRules.with_rule`; a Pallas kernel's by its name first, see
   `kernels.rule_keys`), except inside `full_precision()`.
2. The primitive's ``special`` rule (`facts`), if it has one; it may
   decline by returning ``None``.
3. The rule of the class the `OpRules` table gives the primitive (see
   `classes`): ``lower``, ``full``, ``promote``, ``None`` for primitives it
   does not list, and `base.AS_WRITTEN` inside `full_precision()` and where
   a policy that computes in float32 or wider governs: there no class or
   special rule applies, and the code runs exactly as written.

A rule takes an `base.Op` (the equation, its arguments and what governs
it), returns the outputs, and notes on the `Op` what it decided, which
becomes a row of `explain`.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from mpolicy._src import dtypes
from mpolicy._src import jax_compat
from mpolicy._src import policy as policy_lib
from mpolicy._src import observe
from mpolicy._src import regions
from mpolicy._src.rules import base
from mpolicy._src.rules import classes
from mpolicy._src.rules import custom
from mpolicy._src.rules import kernels
from mpolicy._src.rules import special


def run(env: base.RuleEnv, eqn, invals, rules: base.RuleTable,
        region: Optional[regions.Region],
        names: tuple[str, ...], quiet: bool = False) -> list:
  """Runs one first-order equation by its rules; records it for `explain`.

  Args:
    env: the environment of the enclosing jaxpr.
    eqn: the equation.
    invals: its input values.
    rules: the op-rule table in force (a `RuleTable`: an `OpRules`).
    region: what governs it (``None``: nothing).
    names: its scope names (for the recorded row and policy casts).
    quiet: if ``True``, it is no row of `explain` (see `observe`).

  Returns:
    The output values.
  """
  del quiet  # Observers read it from the equation (`observe.Equation`).
  casts_before = env.inserted
  wide = region is not None and _wide_policy(region.policy)
  as_written = region is not None and (region.full_precision or wide)
  policy = None if region is None or as_written else region.policy
  entry = table_entry(eqn, invals)
  op = base.Op(eqn=eqn, env=env, rules=rules, region=region,
               args=list(invals), names=names, entry=entry,
               op_class=base.AS_WRITTEN if as_written else rules.class_of(
                   entry or eqn.primitive.name))
  if wide:
    assert region is not None and region.policy is not None  # Wide: governed.
    op.why = (f"policy {region.policy} from {region.decided_by} computes in "
              f"{np.dtype(region.policy.compute_dtype).name}: no op rule "
              "applies, runs as written")
  if policy is not None:
    # Matmuls and convolutions may go to the format (their family decides);
    # everything else computes in the policy's compute dtype.
    op.matmul_format = policy.matmul_format
  op.policy = policy
  facts = op.facts

  try:
    outs = _apply(op, rules, region)
  except FloatingPointError as e:  # `jax_debug_infs` / `jax_debug_nans`.
    raise non_finite_error(op, e) from None

  if facts.keeps_param and invals and len(outs) == 1:
    _keep_param(env, eqn, invals, outs[0])
  if (facts.spreads and len(outs) == 1 and invals
      and np.size(invals[0]) < np.size(outs[0])):
    env.mark_spread(outs[0])
  if facts.keeps_constant and len(outs) == 1:
    value = env.const_of(invals[0])
    if value is not None:
      env.mark_const(outs[0], value)
  if observe.active():
    # A cast in the traced code (or made for a module's policy) is the
    # code's own, even though the environment makes it: not counted.
    inserted = (0 if op.rule in special.CODE_CASTS
                else env.inserted - casts_before)
    observe.decided(_decision(op, invals, outs, names, inserted))
  return outs


def run_in_float32(env: base.RuleEnv, eqn, invals, rules: base.RuleTable,
                   names: tuple[str, ...], quiet: bool = False) -> list:
  """Runs ``eqn`` in float32 (an op-level island, `observe.in_float32`):
  half operands cast up, then as written (`run`); a cast to a narrower
  float keeps its float32 operand."""
  invals = [env.cast(x, np.float32) if dtypes.float_value(x)
            and dtypes.is_half(dtypes.dtype_of(x)) else x for x in invals]
  if (eqn.primitive is jax_compat.convert_element_type_p
      and dtypes.is_half(jax_compat.cast_target(eqn)[0])
      and dtypes.float_value(invals[0])):
    return [invals[0]]
  return run(env, eqn, invals, rules, regions.FULL_PRECISION, names,
             quiet=quiet)


def _keep_param(env: base.RuleEnv, eqn, invals, out) -> None:
  """A re-arrangement of a parameter is a parameter. One of a parameter
  cast down (a tied embedding table that the code casts to bfloat16 and
  transposes for the output head) has as its wider source the same
  re-arrangement of the parameter, made only if a rule asks for it (the
  float8 placement does: the head is a weight matmul)."""
  x = invals[0]
  if env.is_param(x):
    env.mark_param(out)
  elif env.from_param(x) and not env.has_wider(out):

    def rearranged():
      (wide,) = base.bind(eqn, [env.wider_source(x), *invals[1:]])
      env.mark_param(wide)
      return wide

    env.mark_wider(out, rearranged, param=True)


def table_entry(eqn, invals) -> Optional[str]:
  """``"square"`` for a ``mul`` of a float16 value by itself (``x * x``,
  as `jnp.linalg.norm` squares), whose result overflows float16 beyond 256
  as ``x ** 2`` does; ``None`` (the primitive's own entry) otherwise."""
  if (eqn.primitive.name == "mul" and len(invals) == 2
      and eqn.invars[0] is eqn.invars[1]
      and dtypes.dtype_of(invals[0]) == np.float16):
    return "square"
  return None


def _apply(op: base.Op, rules: base.RuleTable,
           region: Optional[regions.Region]) -> list:
  """The outputs of ``op`` by its custom, special or class rule."""
  fn, key = ((None, None) if region is not None and region.full_precision
             else custom_rule(rules, op.eqn))
  if fn is not None:
    return custom.run(op, fn, key)
  outs = op.facts.special(op) if op.facts.special is not None else None
  if outs is None:
    outs = classes.CLASS_RULES[op.op_class](op)
  return outs


def non_finite_error(op: base.Op, error: FloatingPointError):
  """JAX's ``jax_debug_infs``/``jax_debug_nans`` error for a value ``op``
  made, naming the op of the traced code it came from (JAX names the
  primitive it dispatched, which may be a cast or a half matmul mpolicy
  made for it), where it was written, and what it ran in.

  >>> import jax, jax.numpy as jnp, mpolicy
  >>> f = mpolicy.amp(lambda x: x @ x, "p=f32,c=f16,o=f32")
  >>> with jax.debug_infs(True), jax.disable_jit():  # Op by op.
  ...   try:
  ...     jax.block_until_ready(f(jnp.full((2, 2), 300.0)))
  ...   except FloatingPointError as e:
  ...     print(str(e).split(";")[0])
  mpolicy: dot_general gave inf or NaN under amp
  """
  where = jax_compat.user_location(op.eqn) or "an unknown line"
  ran = sorted({dtypes.dtype_of(a).name for a in op.args
                if dtypes.float_value(a)}) or ["-"]
  governs = (f"policy {op.region.policy} from {op.region.decided_by}"
             if op.region is not None and op.region.policy is not None
             else "no policy")
  advice = ("A value past the half dtype's range (65504 for float16) "
            "overflows to inf: compute that part in float32 (a float32 "
            "policy on its module or scope, or `mpolicy.full_precision()`), "
            "or use bfloat16, which has float32's range." if any(
                dtypes.is_half(dtypes.dtype_of(a)) for a in op.args
                if dtypes.float_value(a))
            else "It ran in the dtypes the code has: without amp it gives "
            "inf or NaN too.")
  return FloatingPointError(
      f"mpolicy: {op.prim.name} gave inf or NaN under amp; written at "
      f"{where}, run in {','.join(ran)} ({op.rule or 'as traced'}; "
      f"{governs}). JAX reported: {error}. {advice}")


def custom_rule(rules, eqn) -> tuple:
  """``(fn, key)``: the custom rule `rules` gives ``eqn`` by its most
  specific key, or ``(None, None)``."""
  for key in kernels.rule_keys(eqn):
    fn = rules.rule_of(key)
    if fn is not None:
      return fn, key
  return None, None


def _wide_policy(policy: Optional[policy_lib.Policy]) -> bool:
  """Whether ``policy`` computes in float32 or wider (``full``, say): where
  it governs, the code runs as written."""
  if policy is None:
    return False
  return not dtypes.is_half(policy.compute_dtype)


def _decision(op: base.Op, invals, outs, names, casts: int) -> observe.Decision:
  if op.ran_in is not None:
    ran = [op.ran_in]
  else:
    ran = sorted({dtypes.dtype_of(a).name for a in op.args
                  if dtypes.float_value(a)})
    if not ran or op.rule in special.CODE_CASTS:
      ran = sorted({dtypes.dtype_of(o).name for o in outs})  # Its result.
  return observe.Decision(
      scope=op.scope,
      module_class=op.region.module_class if op.region is not None else None,
      primitive=op.prim.name,
      in_dtypes=tuple(dtypes.dtype_of(a).name for a in invals),
      ran_in=",".join(ran) if ran else "-",
      rule=op.rule,
      decided_by=op.why,
      casts=casts)
