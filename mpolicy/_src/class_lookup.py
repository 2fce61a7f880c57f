"""Which registry entry governs one module call, for any module framework.

A framework bridge (Haiku, Flax linen) asks `region_for_call` with the
call's full module name, its class and what governs the enclosing call.
``root`` is the framework's base module class: its entry is the default for
every module (rule 4), never a class entry. This module imports no
framework.

Precedence, most specific first:

1. a pattern matching the module's own full name (most `/`-components,
   then fewest wildcards, then the longest pattern);
2. the nearest class in the module's MRO with a policy, ``root`` excepted;
3. what governs the enclosing module call or named scope (inheritance);
4. the policy set on ``root`` (the default);
5. nothing: the code runs as written.
"""

from __future__ import annotations

from typing import Optional

from mpolicy._src import policy as policy_lib
from mpolicy._src import regions
from mpolicy._src import registry


def class_entry(cls: type, table: dict, root: type) -> Optional[type]:
  """The nearest class in ``cls``'s MRO with an entry in ``table``.

  The walk stops at ``root``: its entry is the default (rule 4), which an
  enclosing call's policy outranks, so it is never a class entry.

  >>> class Base: pass
  >>> class Layer(Base): pass
  >>> class Wide(Layer): pass
  >>> class_entry(Wide, {registry._table_key(Layer): "half"}, Base).__name__
  'Layer'
  >>> class_entry(Wide, {registry._table_key(Base): "half"}, Base) is None
  True
  """
  for base in cls.__mro__:
    if base is root:
      return None
    if registry.lookup(table, base) is not None:
      return base
  return None


def region_for_call(name: str, cls: type,
                    enclosing: Optional[regions.Region], root: type
                    ) -> Optional[regions.Region]:
  """Which policy governs a call of module ``name`` of class ``cls``.

  Args:
    name: the module's full name (``encoder/~/mlp/~/linear_1`` in Haiku,
      ``encoder/Dense_0`` in Flax linen).
    cls: the module's class.
    enclosing: what governs the enclosing module call or named scope.
    root: the framework's base module class (``hk.Module``,
      ``flax.linen.Module``), whose entry is the default.

  Returns:
    The governing `Region`, or ``None`` when nothing governs (rule 5). It
    is marked ``inherited`` when it comes from ``enclosing`` (rule 3).

  >>> class Module: pass
  >>> class Dense(Module): pass
  >>> with registry.push_policy("head", "full"):
  ...   print(region_for_call("head", Dense, None, Module).decided_by)
  pattern 'head'
  """
  table = registry.snapshot()
  cls_name = registry.key_name(cls)

  def region(policy, decided_by, inherited=False):
    policy_lib.require_x64(policy, f"module {name!r} ({decided_by})")
    return regions.Region(policy=policy, decided_by=decided_by,
                          module_name=name, module_class=cls_name,
                          inherited=inherited)

  patterns = registry.matching_patterns(name, table)
  if patterns:
    return region(registry.lookup(table, patterns[0]),
                  f"pattern {patterns[0]!r}")
  entry = class_entry(cls, table, root)
  if entry is not None:
    return region(registry.lookup(table, entry),
                  f"class {registry.key_name(entry)}")
  if enclosing is not None:
    if enclosing.full_precision:
      return None
    if enclosing.policy is not None:
      source = enclosing.module_name or enclosing.decided_by
      return region(enclosing.policy, f"inherited from {source}",
                    inherited=True)
  default = registry.lookup(table, root)
  if default is not None:
    return region(default, f"default {registry.key_name(root)}")
  return None
