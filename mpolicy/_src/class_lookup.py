"""Which registry entry governs a module call, for any module framework.

One function, `decide`, reads the table for a module; the interceptor of
every framework (`module_calls`) and `explain_policy` both ask it. ``root``
is the framework's base module class: its entry is the default for every
module (rule 4), never a class entry. This module imports no framework.

Precedence, most specific first:

1. a pattern matching the module's own full name (most `/`-components,
   then fewest wildcards, then the longest pattern);
2. the nearest class in the module's MRO with a policy, ``root`` excepted;
3. what governs the enclosing module call or named scope (inheritance);
4. the policy set on ``root`` (the default);
5. nothing: the code runs as written.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional, Union

from mpolicy._src import frameworks
from mpolicy._src import policy as policy_lib
from mpolicy._src import regions
from mpolicy._src import registry

# What `explain_policy` says after the winning entry, per rule.
_WHY = {
    1: "(rule 1: a pattern on the module's own name)",
    2: "(rule 2: nearest class in the MRO)",
    4: ("(rule 4), unless an enclosing module call or named scope has a "
        "policy (rule 3)"),
}


def class_entry(cls: type, table: dict,
                root: Optional[type]) -> Optional[type]:
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


@dataclasses.dataclass(frozen=True)
class TableMatch:
  """What the table says of one module, before inheritance (rule 3).

  Attributes:
    patterns: the patterns matching its name, most specific first.
    entry: the nearest class of its MRO with an entry, if any.
    default: its framework's root class, if that has an entry.
    table: the `registry.snapshot` decided on.
  """
  patterns: tuple[str, ...]
  entry: Optional[type]
  default: Optional[type]
  table: dict

  @property
  def rule(self) -> int:
    """The rule that decides without an enclosing call: 1, 2, 4 or 5."""
    if self.patterns:
      return 1
    if self.entry is not None:
      return 2
    return 4 if self.default is not None else 5

  @property
  def key(self) -> Optional[registry.Key]:
    """The winning registry key, or ``None`` (rule 5)."""
    if self.patterns:
      return self.patterns[0]
    return self.entry if self.entry is not None else self.default

  @property
  def policy(self) -> Optional[policy_lib.Policy]:
    key = self.key
    return None if key is None else registry.lookup(self.table, key)

  @property
  def source(self) -> str:
    """The winning entry in words: ``pattern 'enc'``, ``class hk.Linear``,
    ``default hk.Module``."""
    kind = {1: "pattern", 2: "class", 4: "default"}[self.rule]
    return f"{kind} {registry.key_name(self.key)}"  # type: ignore[arg-type]  # Rules 1-4 have one.

  def candidates(self) -> tuple[str, ...]:
    """Every entry that matched, most specific first, as names."""
    keys = [*self.patterns, self.entry, self.default]
    return tuple(registry.key_name(k) for k in keys if k is not None)


def decide(name: Optional[str], cls: Optional[type], root: Optional[type],
           table: Optional[dict] = None) -> TableMatch:
  """What the registry holds for module ``name`` of class ``cls``.

  Args:
    name: the module's full name, or ``None`` (no pattern can match).
    cls: the module's class, or ``None`` (no class entry).
    root: its framework's base module class (the default's key), or
      ``None``.
    table: a `registry.snapshot`; this thread's entries if ``None``.

  >>> class Module: pass
  >>> class Dense(Module): pass
  >>> with registry.push_policy("head", "full"):
  ...   decision = decide("head", Dense, Module)
  >>> decision.rule, decision.source, decision.candidates()
  (1, "pattern 'head'", ("'head'",))
  """
  table = registry.snapshot() if table is None else table
  patterns = (tuple(registry.matching_patterns(name, table))
              if name is not None else ())
  entry = class_entry(cls, table, root) if cls is not None else None
  default = (root if root is not None
             and registry.lookup(table, root) is not None else None)
  return TableMatch(patterns, entry, default, table)


def region_for_call(name: str, cls: type,
                    enclosing: Optional[regions.Region], root: Optional[type]
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
  own, default = _regions_for(registry.state(), name, cls, root)
  region = own
  if region is None and enclosing is not None:
    if enclosing.full_precision:
      return None
    if enclosing.policy is not None:
      source = enclosing.module_name or enclosing.decided_by
      region = regions.Region(
          policy=enclosing.policy, decided_by=f"inherited from {source}",
          module_name=name, module_class=registry.key_name(cls),
          inherited=True)
  region = default if region is None else region
  if region is not None and region.policy is not None:
    policy_lib.require_x64(region.policy,
                           f"module {name!r} ({region.decided_by})")
  return region


@functools.lru_cache(maxsize=4096)
def _regions_for(state: tuple, name: str, cls: type, root: Optional[type]
                 ) -> tuple[Optional[regions.Region], Optional[regions.Region]]:
  """The regions the table (``state``: `registry.state`) gives a call of
  module ``name`` of class ``cls`` without an enclosing call: its own entry
  (rules 1, 2) and the default (rule 4); ``None`` where there is none.

  Read once per table, module name and class: a deep model's calls of
  one module find the answer here.
  """
  del state  # The cache key: the table `decide` reads.
  decision = decide(name, cls, root)
  if decision.rule == 5:
    return None, None
  region = regions.Region(policy=decision.policy, decided_by=decision.source,
                          module_name=name,
                          module_class=registry.key_name(cls))
  return (region, None) if decision.rule in (1, 2) else (None, region)


@dataclasses.dataclass(frozen=True)
class PolicyExplanation:
  """Which registry entry governs a module, and why.

  Attributes:
    policy: the winning policy, or ``None`` if nothing governs.
    key: the registry key that won (a class or a pattern), or ``None``.
    rule: the precedence rule that decided (1 pattern, 2 class, 4 default,
      5 none). Rule 3, inheritance, depends on the call site and is
      described in ``reason``.
    reason: a sentence saying why.
    candidates: every entry that matched, most specific first.

  See also: `explain_policy`, which returns it.
  """
  policy: Optional[policy_lib.Policy]
  key: Optional[registry.Key]
  rule: int
  reason: str
  candidates: tuple[str, ...] = ()

  def __str__(self) -> str:
    lines = [self.reason]
    if len(self.candidates) > 1:
      lines.append("  also matched: " + ", ".join(self.candidates[1:]))
    return "\n".join(lines)


def _class_framework(value: Any) -> Optional[frameworks.Framework]:
  """The framework of a module class that can key the registry, if any."""
  framework = frameworks.framework_of(value)
  if framework is not None and framework.class_policies:
    return framework
  return None


def explain_policy(module_name_or_class: Union[str, type],
                   module_class: Optional[type] = None) -> PolicyExplanation:
  """Says which registry entry governs a module and why.

  >>> import haiku as hk, mpolicy
  >>> mpolicy.set_policy(hk.BatchNorm, "full")
  >>> print(mpolicy.explain_policy(hk.BatchNorm))
  hk.BatchNorm: p=f32,c=f32,o=f32 from class hk.BatchNorm (rule 2: nearest class in the MRO).
  >>> mpolicy.clear_policies()

  Args:
    module_name_or_class: a full module name (``"encoder/~/linear_0"``) or
      a module class.
    module_class: with a name, the module's class, so class entries count
      (and, for a Flax linen class, the default is the one on
      ``nn.Module``). With a name alone the default is the one on
      ``hk.Module``.

  Returns:
    A `PolicyExplanation`; ``str()`` of it reads as a sentence. A policy
    inherited from an enclosing call (rule 3) depends on where the module is
    called, so it is not decided here: the reason says so.

  Raises:
    TypeError: if ``module_name_or_class`` is neither a string nor a Haiku
      or Flax linen module class, or ``module_class`` is given and is not
      one.

  See also: `explain` for what each primitive ran in.
  """
  kinds = " or ".join(f.name for f in frameworks.WITH_CLASS_POLICIES)
  if isinstance(module_name_or_class, str):
    name, cls = module_name_or_class, module_class
  elif _class_framework(module_name_or_class) is not None:
    name, cls = None, module_name_or_class
  else:
    raise TypeError(
        f"explain_policy: expected a module name string or a {kinds} "
        f"module class; got {module_name_or_class!r}.")
  framework = frameworks.HAIKU if cls is None else _class_framework(cls)
  if framework is None:
    raise TypeError(
        f"explain_policy: module_class must be a {kinds} module class; got "
        f"{cls!r}.")
  decision = decide(name, cls, framework.root())
  subject = name if name is not None else registry.key_name(cls)  # type: ignore[arg-type]  # The class given.
  if decision.rule == 5:
    return PolicyExplanation(
        policy=None, key=None, rule=5, candidates=(),
        reason=(f"{subject}: no entry matches; it inherits the policy of an "
                "enclosing module call or named scope if there is one "
                "(rule 3), otherwise it runs as written (rule 5)."))
  why = f"{decision.source} {_WHY[decision.rule]}"
  return PolicyExplanation(
      policy=decision.policy, key=decision.key, rule=decision.rule,
      candidates=decision.candidates(),
      reason=f"{subject}: {decision.policy} from {why}.")
