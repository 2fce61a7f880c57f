"""`suggest_policy`: the few modules to run in float32 (islands), measured.

Every candidate is measured, not guessed: with the policy on every module
and the islands found so far, the loss and its gradients run op by op
(`program.run`), checked for non-finite values and observed module by
module, and are compared with the float32 shadow (`shadow.float32_run`,
run once). The search:

1. While something is not finite, the module of the first non-finite value
   (`locate.first_nonfinite`) becomes an island.
2. While the loss or the gradients are further than the tolerance from
   float32, the modules that add the most error of their own (the error of
   their outputs less that of what they read, from the last run's
   `shadow` rows) per share of the matmul FLOPs they would take out of half
   become islands: 1, then 2, 4, ... at a time, re-ranked after each run.
   A norm that adds as much error as a projection goes first: it costs
   almost nothing in float32.
3. With evaluations left, each island the second step added is dropped in
   turn, least useful first, where the rest stays within the tolerance.

Before them, where a dynamic loss scale's gradients overflow with the
policy as given, the scales it backs off to by itself are tried (the
smallest first, then halving the range): where one is finite, the scale
alone overflowed, and the search goes on at the largest finite one.

An island is a module's own ops: its child modules keep the policy unless
they are islands too (the pattern ``"path"`` gets the island policy, and
the full name of each child module the policy), so a float32 attention
keeps its projections in half.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
import contextlib
import dataclasses
import sys
from typing import Any, Optional

import jax.numpy as jnp
import numpy as np

from mpolicy._src import dtypes
from mpolicy._src import loss_scale as loss_scale_lib
from mpolicy._src import policy as policy_lib
from mpolicy._src import regions
from mpolicy._src import registry
from mpolicy._src.debugging import flops
from mpolicy._src.debugging import locate
from mpolicy._src.debugging import program as program_lib
from mpolicy._src.debugging import shadow


@dataclasses.dataclass(frozen=True)
class Measured:
  """One configuration's loss and gradients against float32.

  Attributes:
    islands: the module paths in the island policy.
    finite: whether the loss and every gradient are finite.
    value_error: the loss's relative error (inf where not finite).
    grad_error: the gradients' relative error, as one vector.
    half_flops: the fraction of matmul FLOPs (forward and backward) that
      multiply in a dtype narrower than float32.
    first_nonfinite: where the first non-finite value appeared, if any.
  """
  islands: tuple[str, ...]
  finite: bool
  value_error: float
  grad_error: float
  half_flops: float
  first_nonfinite: Optional[locate.NonFiniteReport] = None

  def within(self, tolerance: float) -> bool:
    return (self.finite and self.value_error <= tolerance
            and self.grad_error <= tolerance)

  def text(self) -> str:
    half = (f"; {100 * self.half_flops:.1f}% of matmul FLOPs in half"
            if np.isfinite(self.half_flops) else "")
    if not self.finite:
      first = self.first_nonfinite
      where = (f": the first at {first.primitive} ({first.direction}), "
               f"module {first.path!r}" if first is not None and first.path
               else "")
      return f"not finite{where}{half}"
    return (f"loss rel error {self.value_error:.2e}, gradients rel error "
            f"{self.grad_error:.2e}{half}")


def _roots() -> tuple[type, ...]:
  """The base module classes of the frameworks loaded (hk.Module,
  nn.Module): their entry is the default for every module."""
  found = []
  for name in ("haiku", "flax.linen"):
    base = getattr(sys.modules.get(name), "Module", None)
    if isinstance(base, type):
      found.append(base)
  return tuple(found)


def _used(roots, found) -> tuple[type, ...]:
  """Those of ``roots`` whose default governed a module call in ``found``
  (the sites of a run without islands)."""
  decided = " | ".join({site.region.decided_by for site in found
                        if site.region is not None})
  return tuple(r for r in roots
               if f"default {registry.key_name(r)}" in decided)


def children(path: str, modules) -> tuple[str, ...]:
  """The modules of ``modules`` directly inside module ``path``.

  ``modules`` maps each module path to the scope names its call runs
  under (or is a set of paths, nested by name alone). A module is inside
  another when its path extends the other's (``"a/b"`` in ``"a"``) or its
  call runs inside the other's: a Flax root module is named by its class
  (``"Model"``) while its children keep Flax's names (``"Dense_0"``).

  >>> children("a", {"a", "a/b", "a/b/c", "a/d", "ab"})
  ('a/b', 'a/d')
  >>> children("Model", {"Model": ("Model",), "Dense_0": ("Model", "Dense_0")})
  ('Dense_0',)
  """
  scopes = modules if isinstance(modules, dict) else {}

  def within(inner: str, outer: str) -> bool:
    if inner == outer:
      return False
    if inner.startswith(outer + "/"):
      return True
    a, b = scopes.get(outer), scopes.get(inner)
    return a is not None and b is not None and 0 < len(a) < len(b) and (
        b[:len(a)] == a)

  inside = [m for m in modules if within(m, path)]
  return tuple(sorted(m for m in inside
                      if not any(within(m, o) for o in inside)))


def module_scopes(found) -> dict[str, tuple[str, ...]]:
  """Each module path among sites ``found`` -> the scope names its call
  runs under (the shortest of its ops')."""
  out: dict[str, tuple[str, ...]] = {}
  for site in found:
    if site.path:
      names = regions.plain_scope_names(site.names)
      if site.path not in out or len(names) < len(out[site.path]):
        out[site.path] = names
  return out


def _entries(policy, island, roots, islands, kept) -> list[tuple[Any, Any]]:
  """The registry entries, ``(key, policy)``, of a configuration: the
  policy as every framework's default, each island's pattern, and the
  children of islands that keep the policy."""
  return ([(root, policy) for root in roots]
          + [(locate.pattern_of(p), island) for p in islands]
          + [(locate.pattern_of(p), policy) for p in kept
             if p not in islands])


@contextlib.contextmanager
def _configured(policy, island, roots, islands, kept) -> Iterator[None]:
  """The registry with ``policy`` on every module and ``island`` on the
  own ops of each of ``islands`` (their children ``kept`` in ``policy``)."""
  with contextlib.ExitStack() as stack:
    stack.enter_context(registry.push_everywhere(policy))
    for key, value in _entries(policy, island, roots, islands, kept):
      stack.enter_context(registry.push_policy(key, value))
    yield


@dataclasses.dataclass(frozen=True)
class PolicySuggestion:
  """What `suggest_policy` found.

  Attributes:
    policy: the policy on every module.
    island_policy: the policy of the islands (``island_dtype`` computes).
    float32_paths: the module paths to run in the island policy (their own
      ops; empty when none is needed).
    reasons: why each path was chosen, in the same order.
    before: the policy on every module, measured.
    after: with the islands, measured.
    tolerance: the relative error allowed for the loss and the gradients.
    evals: how many times the function ran (the float32 shadow included).
    max_evals: the budget.
    roots: the module classes whose default is the policy (``hk.Module``,
      ``nn.Module``).
    kept: the child modules of islands that keep the policy.
    backed_off: ``(given, reached)`` where the dynamic loss scale given
      overflowed alone: the largest scale it backs off to at which the
      policy is finite, where `after` was measured; else ``None``.
  """
  policy: policy_lib.Policy
  island_policy: policy_lib.Policy
  float32_paths: tuple[str, ...]
  reasons: tuple[str, ...]
  before: Measured
  after: Measured
  tolerance: float
  evals: int
  max_evals: int
  roots: tuple[type, ...] = ()
  kept: tuple[str, ...] = ()
  backed_off: Optional[tuple[float, float]] = None

  @property
  def ok(self) -> bool:
    """Whether the suggestion is finite and within the tolerance."""
    return self.after.within(self.tolerance)

  def apply(self) -> contextlib.AbstractContextManager:
    """A context manager: inside, the registry holds `policy` for every
    module (every entry in force, and the default of each framework's
    module class) and `island_policy` for the islands' own ops; on exit it
    is as it was."""
    return _configured(self.policy, self.island_policy, self.roots,
                       self.float32_paths, self.kept)

  def set_policy_lines(self) -> str:
    """The suggestion as ``set_policy`` lines to paste into a script: what
    `apply` holds, from an empty registry."""
    why = dict(zip(self.float32_paths, self.reasons))
    lines = ["mpolicy.clear_policies()"]
    for key, value in _entries(self.policy, self.island_policy, self.roots,
                               self.float32_paths, self.kept):
      name = registry.key_name(key) if isinstance(key, type) else repr(key)
      reason = why.get(key) if isinstance(key, str) else None
      lines.append(f"mpolicy.set_policy({name}, \"{value}\")"
                   + (f"  # {reason}" if reason and value == self.island_policy
                      else ""))
    return "\n".join(lines)

  def __str__(self) -> str:
    head = (f"suggest_policy: {self.policy} on every module, islands "
            f"{self.island_policy}; tolerance {self.tolerance:g}; "
            f"{self.evals} of {self.max_evals} evaluations.")
    out = [head, f"before: {self.before.text()}"]
    if not self.float32_paths and self.before.within(self.tolerance):
      out.append("No island needed: the policy is within the tolerance "
                 "everywhere.")
      return "\n".join(out)
    n = len(self.float32_paths)
    if self.backed_off is not None:
      given, reached = (_scale_text(v) for v in self.backed_off)
      island = np.dtype(self.island_policy.compute_dtype).name
      out.append(
          f"The loss scale {given} alone overflows: at {reached}, which the "
          "dynamic loss scale backs off to by itself, "
          + (f"no module needs {island}." if not n and self.ok else
             "the search went on (measured there)."))
    out.append(f"after ({n} island{'' if n == 1 else 's'}): "
               f"{self.after.text()}")
    if not self.ok:
      out.append("Not within the tolerance: more evaluations, a larger "
                 "tolerance or a wider island dtype may be needed.")
    if self.float32_paths:
      width = max(len(p) for p in self.float32_paths)
      out.append("islands:")
      out += [f"  {p.ljust(width)}  {why}"
              for p, why in zip(self.float32_paths, self.reasons)]
    return "\n".join(out)


def _scale_text(scale: float) -> str:
  """``"2**15"`` for a power of two, else the number."""
  exponent = np.log2(scale) if scale > 0 else 0.5
  return f"2**{int(exponent)}" if exponent == int(exponent) else f"{scale:g}"


def _backed_off_scales(loss_scale) -> list[float]:
  """The scales a `DynamicLossScale` backs off to, one overflow after
  another, down to its floor (or 1, below which it would shrink the
  gradients); empty for any other loss scale."""
  if not isinstance(loss_scale, loss_scale_lib.DynamicLossScale):
    return []
  given = np.asarray(loss_scale.loss_scale)
  if given.size != 1:
    return []
  scale, factor = float(given), float(loss_scale.factor)
  floor = max(float(loss_scale.min_loss_scale), min(1.0, scale))
  out: list[float] = []
  while scale > floor and len(out) < 128:
    scale = max(scale / factor, floor)
    out.append(scale)
  return out


# An island's cost is the share of matmul FLOPs its own ops make, plus
# this floor: a module without matmuls (a norm, a softmax) is cheap, not
# free, so the error it adds still has to count.
_FLOOR = 0.01


def _why(row, share: float) -> str:
  """Why a module was chosen: the error it adds, in which pass, and the
  share of matmul FLOPs its own ops make."""
  passes = (("forward", row.rel_error, row.input_rel_error),
            ("backward", row.backward_rel_error, row.backward_input_rel_error))
  name, out, inp = max(
      passes, key=lambda p: -1.0 if p[1] is None else p[1] - (p[2] or 0.0))
  return (f"adds {out - (inp or 0.0):.1e} relative error in the {name} pass "
          f"({inp or 0.0:.1e} in what it is handed, {out:.1e} in what it "
          f"hands on); {100 * share:.1f}% of matmul FLOPs")


class _Search:
  """The measured runs of one search, counted against the budget."""

  def __init__(self, call, policy, island, roots, max_evals: int,
               loss_scale: Any = None):
    self.call, self.policy, self.island = call, policy, island
    self.loss_scale = loss_scale
    self.roots, self.max_evals = roots, max_evals
    self.evals = 0
    self.reference: Optional[program_lib.Run] = None
    # Module path -> the scope names of its call (of a first run).
    self.modules: dict[str, tuple[str, ...]] = {}

  def kept(self, islands) -> tuple[str, ...]:
    """The child modules of ``islands`` that keep the policy."""
    return tuple(sorted({c for p in islands
                         for c in children(p, self.modules)}))

  @property
  def left(self) -> int:
    return self.max_evals - self.evals

  def float32(self) -> None:
    self.evals += 1
    self.reference = shadow.float32_run(self.call, True, self.loss_scale)

  def measure(self, islands) -> tuple[Measured, program_lib.Run]:
    self.evals += 1
    islands = tuple(islands)
    with _configured(self.policy, self.island, self.roots, islands,
                     self.kept(islands)):
      run = program_lib.run(
          self.call, self.call.program(True, self.loss_scale, True),
          observer=shadow.Outputs)
    if not self.modules:
      self.modules = module_scopes(run.sites)
    finite = program_lib.all_finite(run.outs)
    want = self.reference.outs  # type: ignore[union-attr]  # Run first.
    value = (shadow.Error.of(run.outs[:1], want[:1]) if finite else None)
    grads = (shadow.Error.of(run.outs[1:], want[1:]) if finite else None)
    first = (None if finite else
             locate.first_nonfinite(self.call, run, True,
                                    self.loss_scale)[0])  # type: ignore[index]  # Not finite.
    inf = float("inf")
    return Measured(
        islands, finite, value.rel_error if value else inf,
        grads.rel_error if grads else (0.0 if finite else inf),
        flops.half_fraction(run.checker.flops), first), run

  def back_off(self) -> Optional[tuple[float, Measured, Any]]:
    """Where the dynamic loss scale overflows with no island: the largest
    scale it backs off to at which the policy is finite, measured with no
    island (``(scale, measured, run)``; the search then uses it), or
    ``None`` where even its floor is not finite."""
    scales = _backed_off_scales(self.loss_scale)
    given = self.loss_scale
    found = None
    lo, hi = 0, len(scales) - 1  # The answer is in scales[lo:hi + 1].
    while scales and self.left > 0 and (found is None or lo < found[0]):
      i = hi if found is None else (lo + found[0]) // 2
      self.loss_scale = loss_scale_lib.StaticLossScale(scales[i])
      measured, run = self.measure(())
      if measured.finite:
        found = (i, measured, run)
      elif found is None:
        break  # Not the scale alone: its floor overflows too.
      else:
        lo = i + 1
    if found is None:
      self.loss_scale = given
      return None
    i, measured, run = found
    self.loss_scale = loss_scale_lib.StaticLossScale(scales[i])
    return scales[i], measured, run

  def ranked(self, run, islands) -> list[tuple[str, str]]:
    """Modules not yet islands, by the error they add per share of the
    matmul FLOPs they would take out of half, largest first.

    Returns:
      ``(path, why)`` pairs.
    """
    report = shadow.report_of(self.call, run, self.reference, True)  # type: ignore[arg-type]  # Run first.
    own = flops.by_module(run.checker.flops, run.sites)
    total = sum(own.values()) or 1
    found = []
    for row in report.rows:
      if not row.path or row.path in islands:
        continue
      added = row.added()
      if added > 0:  # inf: it makes a non-finite value of finite ones.
        share = own.get(row.path, 0) / total
        found.append((added / (share + _FLOOR), row.path, _why(row, share)))
    return [(path, why) for _, path, why in
            sorted(found, key=lambda t: -t[0])]


def _check(policy, tolerance, max_evals, island_dtype) -> tuple:
  if policy is None:
    raise TypeError("suggest_policy: pass the policy to put on every module, "
                    "e.g. policy='p=f32,c=bf16,o=f32'.")
  policy = policy_lib.get_policy(policy)
  if (isinstance(tolerance, bool) or not isinstance(tolerance, (int, float))
      or not tolerance > 0 or not np.isfinite(tolerance)):
    raise ValueError(f"suggest_policy: tolerance must be a positive number "
                     f"(a relative error, e.g. 0.05); got {tolerance!r}.")
  if isinstance(max_evals, bool) or not isinstance(max_evals, int) or (
      max_evals < 2):
    raise ValueError(f"suggest_policy: max_evals must be an int of at least 2 "
                     f"(the float32 shadow and the policy as given); got "
                     f"{max_evals!r}.")
  try:
    island_dtype = np.dtype(island_dtype)
  except TypeError:
    island_dtype = None
  if island_dtype is None or not dtypes.is_float(island_dtype):
    raise TypeError(f"suggest_policy: island_dtype must be a floating dtype "
                    f"such as jnp.float32 or jnp.bfloat16; got "
                    f"{island_dtype!r}.")
  island = policy_lib.Policy(policy.param_dtype, island_dtype,
                             policy.output_dtype)
  return policy, island


def suggest_policy(fn: Callable[..., Any], *args: Any, policy: Any = None,
                   tolerance: float = 0.05, max_evals: int = 16,
                   island_dtype: Any = jnp.float32,
                   loss_scale: Any = None) -> PolicySuggestion:
  """Finds a few module paths to run in ``island_dtype`` so that ``fn``
  matches float32.

  With ``policy`` on every module, it measures ``fn``'s loss and its
  gradients (with respect to the first argument) against float32, and
  adds islands, modules whose own ops run in ``island_dtype``, until both
  are finite and each within ``tolerance`` (norm-wise relative error):
  first the module of the first non-finite value, while there is one;
  then the modules that add the most error of their own, as
  `compare_to_float32` measures them. It calls ``fn`` at most ``max_evals``
  times (the float32 shadow once, then once per candidate), and with
  evaluations left drops the islands the rest does without.

  >>> import jax, jax.numpy as jnp, mpolicy
  >>> def loss(w, x):
  ...   with jax.named_scope("big"):
  ...     h = x @ w  # 4 x 300 x 300 = 360000: no float16 holds it.
  ...   with jax.named_scope("small"):
  ...     return jnp.mean(h * 1e-5)
  >>> f = mpolicy.amp(loss, "p=f32,c=f16,o=f32")
  >>> s = suggest_policy(f, jnp.full((4, 4), 300.0), jnp.full((2, 4), 300.0),
  ...                    policy="p=f32,c=f16,o=f32")
  >>> s.float32_paths, s.before.finite, s.ok
  (('big',), False, True)
  >>> with s.apply():
  ...   print(mpolicy.policy_for("big"))
  p=f32,c=f32,o=f32

  Args:
    fn: the loss function, as you call it (its model under `amp` or built
      with `transform_amp`).
    *args: its arguments.
    policy: the policy to put on every module (a `Policy` or spec string).
    tolerance: the relative error allowed for the loss and, as one vector,
      the gradients.
    max_evals: how many times ``fn`` may run, at least 2.
    island_dtype: the dtype the islands compute in (under ``c=f8``,
      ``jnp.bfloat16`` may be enough).
    loss_scale: ``None``, a number or an mpolicy loss scale: gradients are
      measured as a training step computes them, of the loss times its
      scale, divided by it after. A `DynamicLossScale` that alone
      overflows is backed off as training would back it off, to the
      largest scale at which the policy is finite, and the search goes on
      there (`PolicySuggestion.backed_off`).

  Returns:
    A `PolicySuggestion`: ``float32_paths``, ``apply()``, ``str()`` and
    ``set_policy_lines()``.

  See also: `compare_to_float32`, `locate_nonfinite`, `set_policy`.
  """
  policy, island = _check(policy, tolerance, max_evals, island_dtype)
  loss_scale = program_lib.check_loss_scale(loss_scale, "suggest_policy")
  call = program_lib.Call(fn, args, "suggest_policy")
  search = _Search(call, policy, island, _roots(), max_evals, loss_scale)
  search.float32()
  before, run = search.measure(())
  search.roots = _used(search.roots, run.sites)
  islands: list[str] = []
  reasons: dict[str, str] = {}
  now, best = before, before
  backed_off = None
  if not before.finite:
    backed = search.back_off()
    if backed is not None:
      scale, now, run = backed
      backed_off = (float(np.asarray(loss_scale.loss_scale)), scale)
  # 1. The first non-finite value's module, while there is one.
  while not now.finite and search.left > 0:
    first = now.first_nonfinite
    if first is None or not first.path or first.path in islands:
      break
    islands.append(first.path)
    reasons[first.path] = (f"its {first.primitive} made the first non-finite "
                           f"value ({first.direction} pass, "
                           f"{first.dtype or '?'})")
    now, run = search.measure(islands)
  # 2. The modules that add the most error, more at a time.
  found = len(islands)
  k = 1
  while now.finite and not now.within(tolerance) and search.left > 0:
    ranked = search.ranked(run, islands)
    if not ranked:
      break
    for path, why in ranked[:k]:
      islands.append(path)
      reasons[path] = why
    now, run = search.measure(islands)
    k *= 2
  if now.within(tolerance):
    best = now
    # 3. Drop what the rest does without, least useful first.
    for i in range(len(islands) - 1, found - 1, -1):
      if search.left <= 0:
        break
      trial = islands[:i] + islands[i + 1:]
      measured, _ = search.measure(trial)
      if measured.within(tolerance):
        del islands[i]
        best = measured
  elif now.finite or not before.finite:
    best = now
  return PolicySuggestion(policy, island, best.islands,
                          tuple(reasons[p] for p in best.islands), before,
                          best, float(tolerance), search.evals, max_evals,
                          search.roots, search.kept(best.islands), backed_off)
