"""Custom rules: a primitive run as a function of the user's says.

`OpRules.with_rule` hands a primitive to ``fn(policy, *args, **params)``;
`run` calls it and checks what it returns against the primitive's results.
"""

from __future__ import annotations

from mpolicy._src import dtypes
from mpolicy._src.rules import base


def rule_name(fn) -> str:
  """How `explain` names a custom rule: its module-qualified name.

  Args:
    fn: a rule function, possibly a `functools.partial`.

  Returns:
    ``"module.qualname"``, or ``"partial(module.qualname)"`` for a partial.

  >>> import functools
  >>> rule_name(functools.partial(rule_name))
  'partial(mpolicy._src.rules.custom.rule_name)'
  """
  inner = fn.func if hasattr(fn, "func") and callable(fn.func) else fn
  name = getattr(inner, "__qualname__", None) or getattr(inner, "__name__", None)
  if name is None:
    return repr(fn)
  module = getattr(inner, "__module__", None)
  name = f"{module}.{name}" if module and module != "builtins" else name
  return f"partial({name})" if inner is not fn else name



def run(op: base.Op, fn, key=None) -> list:
  """Runs the equation as the user's rule ``fn`` says (`OpRules.with_rule`;
  ``key``: the name it was given for, if not the primitive's)."""
  name = rule_name(fn)
  policy = op.region.policy if op.region is not None else None
  outs = _check_custom_outputs(op.eqn, fn(policy, *op.args, **op.eqn.params),
                               name)
  op.rule, op.why = "custom", f"custom rule {name}"
  if key is not None and key != op.eqn.primitive.name:
    op.why += f" (given for {key!r})"
  if op.region is not None:
    op.why += f"; policy from {op.decided_by}"
  floats = sorted({dtypes.dtype_of(o).name for o in outs
                   if dtypes.float_value(o)})
  op.ran_in = ",".join(floats) if floats else "-"
  return outs


def _check_custom_outputs(eqn, result, name: str) -> list:
  """A custom rule's ``result`` as a list, checked against ``eqn``'s outputs."""
  prim = eqn.primitive.name
  want = [v.aval for v in eqn.outvars]
  if eqn.primitive.multiple_results:
    if len(want) == 1 and hasattr(result, "shape"):
      result = [result]  # One result, as `pallas_call(...)(x)` returns it.
    if not isinstance(result, (tuple, list)):
      raise TypeError(
          f"custom rule {name} for {prim!r} returned {type(result).__name__}; "
          f"{prim!r} has {len(want)} results, so the rule must return a tuple "
          f"or list of {len(want)} arrays")
    outs = list(result)
  else:
    if isinstance(result, (tuple, list)):
      raise TypeError(
          f"custom rule {name} for {prim!r} returned a {type(result).__name__} "
          f"of {len(result)}; {prim!r} has one result, so the rule must "
          f"return one array")
    outs = [result]
  if len(outs) != len(want):
    raise ValueError(
        f"custom rule {name} for {prim!r} returned {len(outs)} outputs; the "
        f"primitive has {len(want)}")
  for i, (out, aval) in enumerate(zip(outs, want)):
    shape = getattr(out, "shape", None)
    if shape is None or not hasattr(out, "dtype"):
      raise TypeError(
          f"custom rule {name} for {prim!r}: output {i} is "
          f"{type(out).__name__}, not an array (return jax arrays, e.g. "
          f"from jax.lax or jax.numpy)")
    if tuple(shape) != tuple(aval.shape):
      raise ValueError(
          f"custom rule {name} for {prim!r}: output {i} has shape "
          f"{tuple(shape)}, the primitive's has {tuple(aval.shape)}; a rule "
          f"may choose the dtype, not the shape")
  return outs
