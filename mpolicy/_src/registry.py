"""The policy registry: which policy governs a module call or a named scope.

Keys are Haiku module classes (looked up along the MRO) or name patterns
(`fnmatch` globs over full Haiku module names, or over `jax.named_scope`
paths in plain JAX code). `set_policy` writes a process-global table;
`push_policy` overlays it for the current thread only, so several threads
may trace under different pushes at once. Classes are keyed by module and
qualified name, so a policy survives an `importlib.reload` of the module
that defines the class.

The registry's state is part of every `jax.jit` cache key: a function
compiled under one state is retraced, never reused, under another (a
`set_policy` after the first call, or another thread's push).

Precedence for a module call, most specific first:

1. a pattern matching the module's own full name (most `/`-components,
   then fewest wildcards, then the longest pattern);
2. the nearest class in the module's MRO with a policy, `hk.Module` excepted;
3. what governs the enclosing module call or named scope (inheritance);
4. the policy set on `hk.Module` (the default);
5. nothing: the code runs as written.
"""

from __future__ import annotations

from collections.abc import Iterator
import contextlib
import dataclasses
import fnmatch
import threading
from typing import Any, Optional, Union

import haiku as hk
import jax

from mpolicy._src import policy as policy_lib
from mpolicy._src import regions

Key = Union[type, str]
PolicyLike = Any  # A Policy, a jmp.Policy or a spec string.

_WILDCARDS = "*?["


def _check_key(key: Any) -> Key:
  """Returns ``key`` if it can key the registry, else raises a clear error."""
  if isinstance(key, str):
    if not key.strip():
      raise ValueError(
          "set_policy: a name pattern must be a non-empty string such as "
          "'encoder' or '*/attention'; got an empty string.")
    if key != key.strip():
      raise ValueError(
          f"set_policy: the name pattern {key!r} has leading or trailing "
          "spaces; module names never do. Use "
          f"{key.strip()!r}.")
    return key
  if isinstance(key, type) and issubclass(key, hk.Module):
    return key
  raise TypeError(
      "set_policy: the key must be a Haiku module class (e.g. hk.BatchNorm, "
      "or hk.Module for everything) or a non-empty name pattern string "
      f"(e.g. 'encoder/~/mlp', '*/attention'); got {key!r} of type "
      f"{type(key).__name__}.")


def _check_policy(policy: PolicyLike) -> policy_lib.Policy:
  """Normalises ``policy`` to a `Policy`, raising a clear error otherwise."""
  if policy is None:
    raise TypeError(
        "set_policy: policy is None. To remove a policy use "
        "clear_policy(key); to set one pass a Policy, a jmp.Policy or a "
        "spec string such as 'p=f32,c=bf16,o=f32'.")
  return policy_lib.get_policy(policy)


def key_name(key: Key) -> str:
  """A readable name for a registry key (``hk.BatchNorm``, ``'enc*'``)."""
  if isinstance(key, str):
    return repr(key)
  module = key.__module__
  if module.startswith("haiku"):
    return f"hk.{key.__qualname__}"
  return f"{module}.{key.__qualname__}"


@dataclasses.dataclass(frozen=True)
class _ClassKey:
  """How a module class keys the table: by where it is defined.

  A module reloaded with `importlib.reload` makes new class objects with the
  same module and qualified name; keyed this way, they keep their policy.
  """
  module: str
  qualname: str


def _table_key(key: Key) -> Any:
  """The table key of a checked registry key.

  Patterns key by themselves. Classes key by (module, qualified name), so a
  reloaded class finds its policy, except classes defined inside a function
  (``<locals>`` in the qualified name): a factory makes a new class per
  call, and these key by the class object so they do not share a policy.
  """
  if isinstance(key, str) or "<locals>" in key.__qualname__:
    return key
  return _ClassKey(key.__module__, key.__qualname__)


_MODULE_KEY = _table_key(hk.Module)


class _Push:
  """One active `push_policy` of one thread (mutable: a clear cancels it)."""

  __slots__ = ("key", "policy")

  def __init__(self, key, policy: Optional[policy_lib.Policy]):
    self.key = key
    self.policy = policy  # None once `clear_policy` cancelled the push.


# Two JAX user contexts make the registry part of every jit cache key, so
# a compiled function traced under one registry state is never reused under
# another: JAX retraces instead. The global table is only ever written as
# the global value of `_GLOBAL_STATE`; this thread's active pushes are only
# ever the thread-local value of `_PUSHED_STATE`. Both values are hashable
# snapshots.
_GLOBAL_STATE = jax.make_user_context(default_value=frozenset())
_PUSHED_STATE = jax.make_user_context(default_value=())


class _Registry:
  """Global entries plus a per-thread stack of pushed entries."""

  def __init__(self):
    self._lock = threading.Lock()
    self._global: dict[Any, policy_lib.Policy] = {}
    self._local = threading.local()

  def _pushed(self) -> list[_Push]:
    pushed = getattr(self._local, "pushed", None)
    if pushed is None:
      pushed = self._local.pushed = []
    return pushed

  def _publish_global(self) -> None:
    # Called with the lock held, so the published value is the table's.
    _GLOBAL_STATE.set_global(frozenset(self._global.items()))

  def _publish_pushed(self) -> None:
    value = tuple((p.key, p.policy) for p in self._pushed()
                  if p.policy is not None)
    # Entering sets this thread's value; it is replaced, never exited, at
    # the next change of this thread's pushes.
    _PUSHED_STATE(value).__enter__()

  def set(self, key: Key, policy: policy_lib.Policy) -> None:
    with self._lock:
      self._global[_table_key(key)] = policy
      self._publish_global()

  def clear(self, key: Key) -> None:
    key = _table_key(key)
    with self._lock:
      self._global.pop(key, None)
      self._publish_global()
    cancelled = False
    for push in self._pushed():
      if push.key == key and push.policy is not None:
        push.policy = None
        cancelled = True
    if cancelled:
      self._publish_pushed()

  def clear_all(self) -> None:
    with self._lock:
      self._global.clear()
      self._publish_global()
    for push in self._pushed():
      push.policy = None
    self._publish_pushed()

  def push(self, key: Key, policy: policy_lib.Policy) -> _Push:
    token = _Push(_table_key(key), policy)
    self._pushed().append(token)
    self._publish_pushed()
    return token

  def pop(self, token: _Push) -> None:
    pushed = self._pushed()
    for i in range(len(pushed) - 1, -1, -1):
      if pushed[i] is token:
        del pushed[i]
        break
    self._publish_pushed()

  def snapshot(self) -> dict[Any, policy_lib.Policy]:
    """The entries in force for this thread: global, then pushes on top.

    Classes appear under their table keys (see `_table_key`).
    """
    with self._lock:
      table = dict(self._global)
    for push in self._pushed():
      if push.policy is not None:
        table[push.key] = push.policy
    return table


_REGISTRY = _Registry()


def set_policy(key: Key, policy: PolicyLike) -> None:
  """Registers ``policy`` for a module class or a name pattern, globally.

  >>> import haiku as hk, mpolicy
  >>> mpolicy.set_policy(hk.BatchNorm, "full")
  >>> mpolicy.set_policy("encoder/~/attention", "p=f32,c=bf16,o=f32")
  >>> str(mpolicy.policy_for(hk.BatchNorm))
  'p=f32,c=f32,o=f32'
  >>> mpolicy.clear_policies()

  Args:
    key: a Haiku module class (the policy covers its subclasses too;
      ``hk.Module`` sets the default for everything; classes are keyed by
      module and qualified name, so a policy outlives an `importlib.reload`
      of their module) or a name pattern over
      full Haiku module names (``"encoder"``, ``"encoder/~/mlp/~/linear_1"``,
      ``"*/attention"``; `fnmatch` wildcards) which in plain JAX code is
      matched against `jax.named_scope` paths.
    policy: a `Policy`, a ``jmp.Policy`` or a spec string for `get_policy`.

  Raises:
    TypeError, ValueError: for a bad key or policy; nothing is registered.

  See also: `push_policy`, `clear_policy`, `explain_policy`.
  """
  key = _check_key(key)
  policy = _check_policy(policy)
  _REGISTRY.set(key, policy)


def policy_for(key: Key) -> Optional[policy_lib.Policy]:
  """The policy set for exactly this key (no MRO, no patterns), or ``None``.

  >>> import haiku as hk, mpolicy
  >>> mpolicy.policy_for(hk.Linear) is None
  True

  See also: `explain_policy` for what actually governs a module.
  """
  key = _check_key(key)
  return _REGISTRY.snapshot().get(_table_key(key))


def clear_policy(key: Key) -> None:
  """Removes the policy for exactly this key; a missing key is no error.

  It removes the global entry (for every thread) and cancels this thread's
  active `push_policy` blocks for the key: until they exit, the key has no
  policy in this thread, and a later `set_policy` of it takes effect at
  once. When a cancelled block exits it restores nothing. Other threads'
  pushes are theirs and stay.

  >>> import haiku as hk, mpolicy
  >>> mpolicy.set_policy(hk.Linear, "half")
  >>> mpolicy.clear_policy(hk.Linear)
  >>> mpolicy.policy_for(hk.Linear) is None
  True

  See also: `clear_policies`, `set_policy`.
  """
  _REGISTRY.clear(_check_key(key))


def clear_policies() -> None:
  """Removes every policy: the global entries and this thread's pushes.

  As with `clear_policy`, this thread's active `push_policy` blocks are
  cancelled (they restore nothing on exit); other threads' pushes stay.

  >>> import mpolicy
  >>> mpolicy.clear_policies()

  See also: `clear_policy`.
  """
  _REGISTRY.clear_all()


@contextlib.contextmanager
def push_policy(key: Key, policy: PolicyLike) -> Iterator[None]:
  """Sets a policy for this thread while the context is active.

  What was there before (set or pushed) is restored on exit, even on error.
  Other threads do not see the push. While the block is active the push
  shadows a `set_policy` of the same key; `clear_policy` of the key cancels
  the push.

  >>> import haiku as hk, mpolicy
  >>> with mpolicy.push_policy(hk.Linear, "p=f32,c=bf16,o=f32"):
  ...   print(mpolicy.policy_for(hk.Linear))
  p=f32,c=bf16,o=f32
  >>> mpolicy.policy_for(hk.Linear) is None
  True

  See also: `set_policy`.
  """
  key = _check_key(key)
  policy = _check_policy(policy)
  token = _REGISTRY.push(key, policy)
  try:
    yield
  finally:
    _REGISTRY.pop(token)


# --- Resolution ---------------------------------------------------------------


def _specificity(pattern: str) -> tuple[int, int, int]:
  """Sort key: more components, then fewer wildcards, then longer."""
  wildcards = sum(pattern.count(c) for c in _WILDCARDS)
  return (pattern.count("/") + 1, -wildcards, len(pattern))


def _matching_patterns(name: str,
                       table: dict[Key, policy_lib.Policy]) -> list[str]:
  """Patterns matching ``name``, most specific first."""
  found = [k for k in table
           if isinstance(k, str) and fnmatch.fnmatchcase(name, k)]
  return sorted(found, key=_specificity, reverse=True)


def _class_entry(cls: type, table: dict[Key, policy_lib.Policy]
                 ) -> Optional[type]:
  """The nearest class in ``cls``'s MRO with a policy, ``hk.Module`` aside."""
  for base in cls.__mro__:
    if base is hk.Module:
      return None
    if _table_key(base) in table:
      return base
  return None


def module_class_name(cls: type) -> str:
  """``hk.Linear`` for Haiku's classes, the qualified name otherwise."""
  return key_name(cls)


def region_for_module(name: str, cls: type,
                      enclosing: Optional[regions.Region]
                      ) -> Optional[regions.Region]:
  """Which policy governs a call of module ``name`` of class ``cls``.

  Args:
    name: the module's full Haiku name (``encoder/~/mlp/~/linear_1``).
    cls: the module's class.
    enclosing: what governs the enclosing module call or named scope.

  Returns:
    The governing `Region`, or ``None`` when nothing governs (rule 5).
  """
  table = _REGISTRY.snapshot()
  cls_name = module_class_name(cls)

  def region(policy, decided_by, inherited=False):
    return regions.Region(policy=policy, decided_by=decided_by,
                          module_name=name, module_class=cls_name,
                          inherited=inherited)

  patterns = _matching_patterns(name, table)
  if patterns:
    return region(table[patterns[0]], f"pattern {patterns[0]!r}")
  entry = _class_entry(cls, table)
  if entry is not None:
    return region(table[_table_key(entry)], f"class {key_name(entry)}")
  if enclosing is not None:
    if enclosing.full_precision:
      return None
    if enclosing.policy is not None:
      source = enclosing.module_name or enclosing.decided_by
      return region(enclosing.policy, f"inherited from {source}",
                    inherited=True)
  if _MODULE_KEY in table:
    return region(table[_MODULE_KEY], "default hk.Module")
  return None


def region_for_scopes(names: tuple[str, ...],
                      outer: Optional[regions.Region] = None
                      ) -> Optional[regions.Region]:
  """What governs code traced under the scope ``names`` (outermost first).

  Markers written by the Haiku bridge or `full_precision()` set the region
  directly. Any other scope extends a path, and a registered pattern that
  matches the path governs what is inside (rule 3). The innermost
  decision wins; ``outer`` is what governs outside all the scopes.
  """
  table = _REGISTRY.snapshot()
  has_patterns = any(isinstance(k, str) for k in table)
  region = outer
  path: list[str] = []
  for name in names:
    marked = regions.region_of_marker(name)
    if marked is not None:
      region = marked
      continue
    if name.startswith(regions.MARKER_PREFIX):
      continue  # A marker from another process's table: ignore it.
    path.append(name)
    if has_patterns and not (region is not None and region.full_precision):
      scope = "/".join(path)
      patterns = _matching_patterns(scope, table)
      if patterns:
        region = regions.Region(policy=table[patterns[0]],
                                decided_by=f"pattern {patterns[0]!r}",
                                module_name=scope, inherited=True)
  return region


# --- Explanation -------------------------------------------------------------


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
  key: Optional[Key]
  rule: int
  reason: str
  candidates: tuple[str, ...] = ()

  def __str__(self) -> str:
    lines = [self.reason]
    if len(self.candidates) > 1:
      lines.append("  also matched: " + ", ".join(self.candidates[1:]))
    return "\n".join(lines)


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
    module_class: with a name, the module's class, so class entries count.

  Returns:
    A `PolicyExplanation`; ``str()`` of it reads as a sentence. A policy
    inherited from an enclosing call (rule 3) depends on where the module is
    called, so it is not decided here: the reason says so.

  See also: `explain` for what each primitive ran in.
  """
  if isinstance(module_name_or_class, str):
    name, cls = module_name_or_class, module_class
  elif (isinstance(module_name_or_class, type)
        and issubclass(module_name_or_class, hk.Module)):
    name, cls = None, module_name_or_class
  else:
    raise TypeError(
        "explain_policy: expected a module name string or a Haiku module "
        f"class; got {module_name_or_class!r}.")
  if cls is not None and not (isinstance(cls, type)
                              and issubclass(cls, hk.Module)):
    raise TypeError(
        f"explain_policy: module_class must be a Haiku module class; got "
        f"{cls!r}.")
  table = _REGISTRY.snapshot()
  subject = name if name is not None else key_name(cls)
  candidates: list[str] = []
  patterns = _matching_patterns(name, table) if name is not None else []
  candidates += [repr(p) for p in patterns]
  entry = _class_entry(cls, table) if cls is not None else None
  if entry is not None:
    candidates.append(key_name(entry))
  if _MODULE_KEY in table:
    candidates.append("hk.Module")
  if patterns:
    key, rule, why = patterns[0], 1, (
        f"pattern {patterns[0]!r} (rule 1: a pattern on the module's own "
        "name)")
  elif entry is not None:
    key, rule, why = entry, 2, (
        f"class {key_name(entry)} (rule 2: nearest class in the MRO)")
  elif _MODULE_KEY in table:
    key, rule, why = hk.Module, 4, (
        "default hk.Module (rule 4), unless an enclosing module call or "
        "named scope has a policy (rule 3)")
  else:
    return PolicyExplanation(
        policy=None, key=None, rule=5, candidates=(),
        reason=(f"{subject}: no entry matches; it inherits the policy of an "
                "enclosing module call or named scope if there is one "
                "(rule 3), otherwise it runs as written (rule 5)."))
  policy = table[_table_key(key)]
  return PolicyExplanation(
      policy=policy, key=key, rule=rule, candidates=tuple(candidates),
      reason=f"{subject}: {policy} from {why}.")


def state_key() -> frozenset:
  """A hashable snapshot of the entries in force for this thread.

  Classes appear under their table keys (module and qualified name).
  """
  return frozenset(_REGISTRY.snapshot().items())
