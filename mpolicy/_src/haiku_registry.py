"""Registry lookup for Haiku modules: which entry governs a module call.

`registry` keeps the table and matches name patterns without Haiku;
`class_lookup` walks a module class's MRO for any framework. This module
adds what needs Haiku's classes: the ``hk.Module`` default and
`explain_policy` (which also explains Flax linen classes, whose default is
the entry on ``nn.Module``). The Haiku bridge calls `region_for_module` for
every module call it intercepts.

Precedence for a module call, most specific first:

1. a pattern matching the module's own full name (most `/`-components,
   then fewest wildcards, then the longest pattern);
2. the nearest class in the module's MRO with a policy, `hk.Module` excepted;
3. what governs the enclosing module call or named scope (inheritance);
4. the policy set on `hk.Module` (the default);
5. nothing: the code runs as written.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import haiku as hk

from mpolicy._src import class_lookup
from mpolicy._src import policy as policy_lib
from mpolicy._src import regions
from mpolicy._src import registry


def region_for_module(name: str, cls: type,
                      enclosing: Optional[regions.Region]
                      ) -> Optional[regions.Region]:
  """Which policy governs a call of module ``name`` of class ``cls``.

  Args:
    name: the module's full Haiku name (``encoder/~/mlp/~/linear_1``).
    cls: the module's class.
    enclosing: what governs the enclosing module call or named scope.

  Returns:
    The governing `Region`, or ``None`` when nothing governs (rule 5). It
    is marked ``inherited`` when it comes from ``enclosing`` (rule 3).

  >>> import haiku as hk
  >>> from mpolicy._src import registry
  >>> with registry.push_policy(hk.Linear, "p=f32,c=bf16,o=f32"):
  ...   region = region_for_module("mlp/~/linear_0", hk.Linear, None)
  >>> print(region.policy, "from", region.decided_by)
  p=f32,c=bf16,o=f32 from class hk.Linear
  """
  return class_lookup.region_for_call(name, cls, enclosing, hk.Module)


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


def _is_module_class(value) -> bool:
  return isinstance(value, type) and registry.root_class(value) is not None


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
      ``nn.Module``).

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
  if isinstance(module_name_or_class, str):
    name, cls = module_name_or_class, module_class
  elif _is_module_class(module_name_or_class):
    name, cls = None, module_name_or_class
  else:
    raise TypeError(
        "explain_policy: expected a module name string or a Haiku or Flax "
        f"linen module class; got {module_name_or_class!r}.")
  if cls is not None and not _is_module_class(cls):
    raise TypeError(
        "explain_policy: module_class must be a Haiku or Flax linen module "
        f"class; got {cls!r}.")
  root = hk.Module if cls is None else registry.root_class(cls)
  table = registry.snapshot()
  subject = name if name is not None else registry.key_name(cls)
  candidates: list[str] = []
  patterns = (registry.matching_patterns(name, table)
              if name is not None else [])
  candidates += [repr(p) for p in patterns]
  entry = (class_lookup.class_entry(cls, table, root)
           if cls is not None else None)
  if entry is not None:
    candidates.append(registry.key_name(entry))
  default = registry.lookup(table, root)
  if default is not None:
    candidates.append(registry.key_name(root))
  if patterns:
    key, rule, why = patterns[0], 1, (
        f"pattern {patterns[0]!r} (rule 1: a pattern on the module's own "
        "name)")
  elif entry is not None:
    key, rule, why = entry, 2, (
        f"class {registry.key_name(entry)} (rule 2: nearest class in the "
        "MRO)")
  elif default is not None:
    key, rule, why = root, 4, (
        f"default {registry.key_name(root)} (rule 4), unless an enclosing module call or "
        "named scope has a policy (rule 3)")
  else:
    return PolicyExplanation(
        policy=None, key=None, rule=5, candidates=(),
        reason=(f"{subject}: no entry matches; it inherits the policy of an "
                "enclosing module call or named scope if there is one "
                "(rule 3), otherwise it runs as written (rule 5)."))
  policy = registry.lookup(table, key)
  return PolicyExplanation(
      policy=policy, key=key, rule=rule, candidates=tuple(candidates),
      reason=f"{subject}: {policy} from {why}.")
