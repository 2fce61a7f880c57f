"""The policy registry: a table from keys to policies, and name matching.

Keys are module classes of a framework with a method hook (Haiku, Flax
linen: see `frameworks`) or name patterns (`fnmatch` globs over full
module names, or over `jax.named_scope` paths in plain JAX code).
`set_policy` writes a process-global table; `push_policy` overlays it for
the current thread only, so several threads may trace under different
pushes at once. Classes are keyed by module and qualified name, so a policy
survives an `importlib.reload` of the module that defines the class.

The registry's state is part of every `jax.jit` cache key: a function
compiled under one state is retraced, never reused, under another (a
`set_policy` after the first call, or another thread's push).

This module imports no framework: class keys are checked against the
framework records, which look the root classes up in `sys.modules` (if a
framework is not imported, no class can subclass its root), so the
interpreter, which resolves named scopes through `region_for_scopes`, runs
without any. Which entry governs a module call (the MRO walk, the root
class's default) and `explain_policy` live in `class_lookup`.

For code under named scopes, the most specific pattern matching the scope
path (most `/`-components, then fewest wildcards, then the longest
pattern) governs what is inside, and the innermost decision wins.
"""

from __future__ import annotations

from collections.abc import Iterator
import contextlib
import dataclasses
import fnmatch
import re
import threading
from typing import Any, Optional, Union

import jax

from mpolicy._src import frameworks
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
    _check_pattern(key)
    return key
  if isinstance(key, type):
    framework = frameworks.framework_of(key)
    if framework is not None and framework.class_policies:
      return key
    if framework is not None:
      raise TypeError(
          f"set_policy: {framework.name} module classes "
          f"({framework.alias}.Module and its subclasses) cannot key the "
          f"registry; got {key_name(key)}. {framework.name} has no method hook "
          "that could apply a class policy. Give the layer's call a "
          "jax.named_scope and set a policy on a name pattern over the "
          "scope path instead (e.g. set_policy('*/attention', ...)).")
  accepted = ", ".join(
      f"a {f.name} module class (e.g. {f.alias}.BatchNorm, or "
      f"{f.alias}.Module for everything)"
      for f in frameworks.WITH_CLASS_POLICIES)
  raise TypeError(
      f"set_policy: the key must be {accepted} or a non-empty name "
      "pattern string (e.g. 'encoder/~/mlp', '*/attention'); got "
      f"{key!r} of type {type(key).__name__}.")


# A module class written as a string: ``"hk.Linear"``, ``"nn.Dense"``.
_CLASS_AS_STRING = re.compile(
    r"^(hk|haiku|nn|linen|flax\.linen|nnx|flax\.nnx|eqx|equinox)\.[A-Za-z_]\w*$")


def _check_pattern(key: str) -> None:
  """Raises a clear error for a name pattern that can never match.

  >>> for bad in ("encoder/", "hk.Linear"):
  ...   try:
  ...     _check_pattern(bad)
  ...   except ValueError as e:
  ...     print(str(e).split(". ")[-1])
  For the module 'encoder' and everything inside it use 'encoder' (children inherit its policy); for what is inside it only, 'encoder/*'.
  Pass the class itself: set_policy(hk.Linear, policy) (Haiku and Flax linen classes).
  """
  if _CLASS_AS_STRING.match(key):
    alias, name = key.rsplit(".", 1)
    raise ValueError(
        f"set_policy: {key!r} looks like a module class written as a "
        f"string. A string keys a name pattern over module names (such as "
        f"'encoder/~/linear' or '*/attention'), and no module name reads "
        f"{key!r}, so it would never match. Pass the class itself: "
        f"set_policy({alias}.{name}, policy) (Haiku and Flax linen classes).")
  parts = key.split("/")
  if "" in parts:
    inner = "/".join(p for p in parts if p)
    hint = (f"For the module {inner!r} and everything inside it use "
            f"{inner!r} (children inherit its policy); for what is inside it "
            f"only, {inner + '/*'!r}." if inner else
            "Use '*' for every module.")
    raise ValueError(
        f"set_policy: the name pattern {key!r} has an empty component (a "
        "leading, trailing or doubled '/'), and no module name or scope "
        f"path has one, so it would never match. {hint}")


def _check_policy(policy: PolicyLike) -> policy_lib.Policy:
  """Normalises ``policy`` to a `Policy`, raising a clear error otherwise."""
  if policy is None:
    raise TypeError(
        "set_policy: policy is None. To remove a policy use "
        "clear_policy(key); to set one pass a Policy, a jmp.Policy or a "
        "spec string such as 'p=f32,c=bf16,o=f32'.")
  return policy_lib.get_policy(policy)


def key_name(key: Key) -> str:
  """A readable name for a registry key.

  Args:
    key: a name pattern or a class.

  Returns:
    ``repr`` of a pattern; a class as its framework's users write it
    (``hk.Linear``, ``nn.Dense``; see `frameworks.class_name`), or with its
    module and qualified name if it belongs to no framework.

  >>> key_name("enc*")
  "'enc*'"
  >>> key_name(dict)
  'builtins.dict'
  """
  if isinstance(key, str):
    return repr(key)
  return frameworks.class_name(key)


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
  if (isinstance(key, (str, _ClassKey))
      or "<locals>" in key.__qualname__):
    return key
  return _ClassKey(key.__module__, key.__qualname__)


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
    self._global_state: frozenset = frozenset()
    self._local = threading.local()

  def _pushed(self) -> list[_Push]:
    pushed = getattr(self._local, "pushed", None)
    if pushed is None:
      pushed = self._local.pushed = []
    return pushed

  def _publish_global(self) -> None:
    # Called with the lock held, so the published value is the table's.
    self._global_state = frozenset(self._global.items())
    _GLOBAL_STATE.set_global(self._global_state)

  def _publish_pushed(self) -> None:
    # This thread holds at most one entered context, whose value is its
    # active pushes: each change exits it (restoring the value before any
    # push) and enters one with the new value, unless none is left.
    value = tuple((p.key, p.policy) for p in self._pushed()
                  if p.policy is not None)
    self._local.state = value
    entered = getattr(self._local, "entered", None)
    if entered is not None:
      entered.__exit__(None, None, None)
      self._local.entered = None
    if value:
      entered = _PUSHED_STATE(value)
      entered.__enter__()
      self._local.entered = entered

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

  def state(self) -> tuple:
    """A hashable value equal for equal tables of this thread (the global
    entries, then this thread's active pushes)."""
    return self._global_state, getattr(self._local, "state", ())

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

  >>> import mpolicy
  >>> mpolicy.set_policy("encoder", "full")
  >>> mpolicy.set_policy("encoder/~/attention", "p=f32,c=bf16,o=f32")
  >>> str(mpolicy.policy_for("encoder"))
  'p=f32,c=f32,o=f32'
  >>> mpolicy.clear_policies()

  With Haiku, ``mpolicy.set_policy(hk.BatchNorm, "full")`` keys a class
  the same way.

  Args:
    key: a Haiku module class (the policy covers its subclasses too;
      ``hk.Module`` sets the default for everything; classes are keyed by
      module and qualified name, so a policy outlives an `importlib.reload`
      of their module), a Flax linen module class (governs its calls under
      `amp`; ``nn.Module`` sets the default) or a name pattern over
      full Haiku module names (``"encoder"``, ``"encoder/~/mlp/~/linear_1"``,
      ``"*/attention"``; `fnmatch` wildcards), over linen module paths
      (``"encoder/Dense_0"``) under `amp`, and in plain JAX code over
      `jax.named_scope` paths.
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

  >>> import mpolicy
  >>> mpolicy.policy_for("encoder") is None
  True

  See also: `explain_policy` for what actually governs a module.
  """
  return lookup(snapshot(), _check_key(key))


def clear_policy(key: Key) -> None:
  """Removes the policy for exactly this key; a missing key is no error.

  It removes the global entry (for every thread) and cancels this thread's
  active `push_policy` blocks for the key: until they exit, the key has no
  policy in this thread, and a later `set_policy` of it takes effect at
  once. When a cancelled block exits it restores nothing. Other threads'
  pushes are theirs and stay.

  >>> import mpolicy
  >>> mpolicy.set_policy("encoder", "half")
  >>> mpolicy.clear_policy("encoder")
  >>> mpolicy.policy_for("encoder") is None
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

  >>> import mpolicy
  >>> with mpolicy.push_policy("encoder", "p=f32,c=bf16,o=f32"):
  ...   print(mpolicy.policy_for("encoder"))
  p=f32,c=bf16,o=f32
  >>> mpolicy.policy_for("encoder") is None
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


@contextlib.contextmanager
def push_everywhere(policy: PolicyLike) -> Iterator[None]:
  """Pushes ``policy`` for every key in force on this thread (every module
  policy, every pattern), like one `push_policy` per key.

  >>> from mpolicy._src import registry
  >>> with registry.push_policy("encoder", "p=f32,c=bf16,o=f32"):
  ...   with registry.push_everywhere("full"):
  ...     print(registry.snapshot()["encoder"])
  p=f32,c=f32,o=f32
  """
  policy = _check_policy(policy)
  tokens = [_REGISTRY.push(key, policy) for key in snapshot()]
  try:
    yield
  finally:
    for token in reversed(tokens):
      _REGISTRY.pop(token)


# --- Reading the table --------------------------------------------------------


def snapshot() -> dict[Any, policy_lib.Policy]:
  """The entries in force for this thread: the global table, pushes on top.

  Returns:
    A new dict (changing it changes nothing) from table keys to policies.
    Patterns are their own keys; classes are keyed by module and qualified
    name, so read a class's entry with `lookup` rather than indexing.

  >>> from mpolicy._src import registry
  >>> with registry.push_policy("encoder", "p=f32,c=bf16,o=f32"):
  ...   print(registry.snapshot()["encoder"])
  p=f32,c=bf16,o=f32
  """
  return _REGISTRY.snapshot()


def state() -> tuple:
  """A hashable value that is equal whenever this thread's table is: a cache
  key for answers read from `snapshot`.

  >>> from mpolicy._src import registry
  >>> before = registry.state()
  >>> with registry.push_policy("encoder", "full"):
  ...   registry.state() == before
  False
  >>> registry.state() == before
  True
  """
  return _REGISTRY.state()


def lookup(table: dict[Any, policy_lib.Policy],
           key: Key) -> Optional[policy_lib.Policy]:
  """The policy ``table`` holds for exactly ``key``, or ``None``.

  Args:
    table: a `snapshot`.
    key: a name pattern or a class, as given to `set_policy`.

  Returns:
    The entry's policy; ``None`` if the key has none (no MRO walk, no
    pattern matching).

  >>> from mpolicy._src import registry
  >>> with registry.push_policy("encoder", "full"):
  ...   print(registry.lookup(registry.snapshot(), "encoder"))
  p=f32,c=f32,o=f32
  """
  return table.get(_table_key(key))


def _specificity(pattern: str) -> tuple[int, int, int]:
  """Sort key: more components, then fewer wildcards, then longer."""
  wildcards = sum(pattern.count(c) for c in _WILDCARDS)
  return (pattern.count("/") + 1, -wildcards, len(pattern))


def matching_patterns(name: str,
                      table: dict[Any, policy_lib.Policy]) -> list[str]:
  """The patterns of ``table`` that match ``name``, most specific first.

  Args:
    name: a full module name or a named-scope path, ``/``-separated.
    table: a `snapshot`.

  Returns:
    The matching patterns (`fnmatch` globs, case-sensitive), sorted by
    most ``/``-components, then fewest wildcards, then longest.

  >>> from mpolicy._src import registry
  >>> table = {"*": None, "enc*/mlp": None, "encoder/mlp": None, "dec": None}
  >>> registry.matching_patterns("encoder/mlp", table)
  ['encoder/mlp', 'enc*/mlp', '*']
  """
  found = [k for k in table
           if isinstance(k, str) and fnmatch.fnmatchcase(name, k)]
  return sorted(found, key=_specificity, reverse=True)


def region_for_scopes(names: tuple[str, ...],
                      outer: Optional[regions.Region] = None
                      ) -> Optional[regions.Region]:
  """What governs code traced under the named scopes ``names``.

  Markers written by the Haiku bridge or `full_precision()` set the region
  directly. Any other scope extends a path, and the most specific
  registered pattern that matches the path governs what is inside. The
  innermost decision wins. No pattern applies inside `full_precision()`.

  Args:
    names: the scope names, outermost first.
    outer: what governs outside all the scopes, if anything.

  Returns:
    The governing `Region` (marked ``inherited`` when a pattern decided),
    or ``None`` when nothing governs.

  >>> from mpolicy._src import registry
  >>> with registry.push_policy("encoder", "p=f32,c=bf16,o=f32"):
  ...   region = registry.region_for_scopes(("encoder", "mlp"))
  >>> print(region.policy, region.decided_by)
  p=f32,c=bf16,o=f32 pattern 'encoder'
  """
  table = snapshot()
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
      patterns = matching_patterns(scope, table)
      if patterns:
        policy_lib.require_x64(table[patterns[0]],
                               f"named scope {scope!r} (pattern "
                               f"{patterns[0]!r})")
        region = regions.Region(policy=table[patterns[0]],
                                decided_by=f"pattern {patterns[0]!r}",
                                module_name=scope, inherited=True)
  return region
