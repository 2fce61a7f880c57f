"""`locate_nonfinite`: the first non-finite value, by module and op.

The computation (the loss, and with ``grad`` its loss-scaled gradients) is
traced with the interpreter naming every op of the user's code (`sites`),
then replayed op by op by the interpreter under a checker (`check`),
which carries the origin of every non-finite value. The earliest origin of a non-finite
loss (else of a non-finite gradient) is the answer: the op it comes from,
the module that op runs in and the dtype it ran in, where the user wrote
it, the loop iteration and the device. Last, the computation runs again
with that module (or that op, outside modules) in float32, which says
whether float32 there would fix it.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import re
from typing import Any, Optional

import jax
import numpy as np

from mpolicy._src import interpreter
from mpolicy._src import jax_compat
from mpolicy._src import registry
from mpolicy._src import sites
from mpolicy._src.debugging import program as program_lib
from mpolicy._src.debugging import check


@dataclasses.dataclass(frozen=True)
class NonFiniteReport:
  """Where the first non-finite value appeared (see `locate_nonfinite`).

  Attributes:
    primitive: the op of the user's code it came from (``"dot_general"``,
      ``"log"``, ...); in the backward direction, the forward op whose
      derivative went non-finite; ``"input"`` for an argument that already
      held a non-finite value.
    path: the module that op runs in (the Haiku or Flax linen module's full
      name, else its named-scope path; ``""`` outside modules); for an
      input, the argument's path (``"0/linear/w"``: argument 0's
      ``["linear"]["w"]``).
    direction: ``"forward"`` or ``"backward"``.
    dtype: the dtype the op ran in (as `explain` says); an input's dtype.
    source: the user's ``file:line`` that made the op (``""`` if unknown).
    iteration: the iteration of the `scan` or `while_loop` it ran in (a
      backward scan's counted as its forward's), else ``None``.
    device: the device index inside `shard_map`, else ``None``.
    fixed_by_float32: whether running that module (that op, outside
      modules) in float32 makes the whole computation finite.
    op: the primitive of the program that first produced the non-finite
      value (an op rule's cast to ``float16``, the ``div`` of a derivative).
    loss_scale: the scale the backward pass started from (``None``:
      none).
    outputs: which results were not finite (``"loss"``,
      ``"gradient of linear/w"``: of the first argument's ``["linear"]["w"]``).
  """
  primitive: str
  path: str
  direction: str
  dtype: str
  source: str
  iteration: Optional[int]
  device: Optional[int]
  fixed_by_float32: bool
  op: str = ""
  outputs: tuple[str, ...] = ()
  loss_scale: Optional[float] = None

  def __str__(self) -> str:
    where = f"module {self.path!r}" if self.path else "outside any module"
    if self.primitive == "input":
      first = (f"The argument {self.path} ({self.dtype}) already holds a "
               "non-finite value")
    elif self.direction == "backward":
      first = (f"The first non-finite value appeared in the backward pass, "
               f"in the derivative of {self.primitive} ({self.op}), "
               f"{where}")
    else:
      op = self.primitive if self.op in ("", self.primitive) else (
          f"{self.primitive} ({self.op})")
      first = (f"The first non-finite value appeared in the forward pass, "
               f"at {op}, {where}")
    details = []
    if self.primitive != "input" and self.dtype:
      details.append(f"which ran in {self.dtype}")
    if self.source:
      details.append(f"written at {self.source}")
    if self.iteration is not None:
      details.append(f"in iteration {self.iteration} of its loop")
    if self.device is not None:
      details.append(f"on device {self.device} of its shard_map")
    text = first + (", " + ", ".join(details) if details else "") + "."
    if self.outputs:
      text += f" It made {_outputs_text(self.outputs)} non-finite."
    if self.primitive == "input":
      return text + " Check the data or the parameters passed in."
    what = "that module" if self.path else "that op"
    text += (f" Running {what} in float32 makes every value finite."
             if self.fixed_by_float32 else
             f" Running {what} in float32 does not make every value finite.")
    if (self.direction == "backward" and not self.fixed_by_float32
        and self.loss_scale not in (None, 1.0)):
      text += (f" The backward pass starts from the loss times "
               f"{self.loss_scale:.4g}: a smaller loss scale may be enough.")
    return text


def _outputs_text(outputs: tuple[str, ...]) -> str:
  """``"the loss and the gradients of a, b, c and 4 more"``."""
  grads = [o[len("gradient of "):] if o != "gradient" else "the argument"
           for o in outputs if o.startswith("gradient")]
  parts = ["the loss"] if "loss" in outputs else []
  if grads:
    more = f" and {len(grads) - 3} more" if len(grads) > 3 else ""
    parts.append(f"the gradient{'s' if len(grads) > 1 else ''} of "
                 f"{', '.join(grads[:3])}{more}")
  return " and ".join(parts)


def pattern_of(path: str) -> str:
  """A registry pattern matching exactly ``path`` (wildcards escaped)."""
  return re.sub(r"([*?[])", r"[\1]", path)


def island(path: str, policy) -> list:
  """The `push_policy` blocks that put ``policy`` on module ``path`` and
  everything inside it."""
  pattern = pattern_of(path)
  return [registry.push_policy(pattern, policy),
          registry.push_policy(pattern + "/*", policy)]


def _finite_with(program: Callable[..., list], arrays, path: str,
                 site: Optional[int]) -> bool:
  """Whether ``program`` is finite with ``path`` (or ``site``) in float32."""
  import contextlib  # pylint: disable=g-import-not-at-top
  with contextlib.ExitStack() as stack:
    if path:
      for block in island(path, "full"):
        stack.enter_context(block)
    else:
      stack.enter_context(sites.tagging(in_float32={site}))
    closed = jax.make_jaxpr(program)(*arrays)
  return program_lib.all_finite(interpreter.replay(closed, arrays))


def _cotangent_of(found: list, index: int) -> int:
  """The site whose result's cotangent a cast's derivative casts.

  The derivative of a cast (one an op rule or a module policy made, or one
  inside ``jnp.mean``) casts the cotangent of its operand: when that
  overflows a half dtype, the op that made the operand is the one whose
  derivative went non-finite.
  """
  site = found[index]
  while (site.primitive == jax_compat.convert_element_type_p.name
         and site.producers and site.producers[0] is not None):
    index = site.producers[0]
    site = found[index]
  return index


def locate_nonfinite(fn: Callable[..., Any], *args: Any, grad: bool = True,
                     loss_scale: Any = None) -> Optional[NonFiniteReport]:
  """Finds the first non-finite value of ``fn``'s loss or its gradients.

  ``fn`` returns a scalar loss; wrap the model in `amp` or build it with
  `transform_amp` (that is how ops know their module and dtype). It runs
  once forward and, with ``grad``, backward (the gradient with respect to
  the first argument of the loss times ``loss_scale``'s scale, as a
  training step computes it), with every value's finiteness checked, in
  one compiled program. If the loss and the gradients are finite it
  returns ``None``. Otherwise it reports the earliest non-finite value
  that reaches them (a value the program masks, such as a ``-inf``
  attention mask, is not one): the op, its module and dtype, the source
  line, the `scan`/`while_loop` iteration and `shard_map` device, and
  whether float32 in that module (or op) fixes it, which costs one more run.
  Steps that do not call it pay nothing.

  >>> import jax, jax.numpy as jnp, mpolicy
  >>> def loss(w, x):
  ...   with jax.named_scope("head"):
  ...     return jnp.mean(x @ w)
  >>> f = mpolicy.amp(loss, "p=f32,c=f16,o=f32")
  >>> report = locate_nonfinite(f, jnp.full((2, 2), 300.0),
  ...                           jnp.full((1, 2), 300.0))
  >>> report.primitive, report.path, report.direction, report.dtype
  ('dot_general', 'head', 'forward', 'float16')
  >>> report.iteration, report.device, report.fixed_by_float32
  (None, None, True)
  >>> locate_nonfinite(f, jnp.ones((2, 2)), jnp.ones((1, 2))) is None
  True

  Args:
    fn: the loss function, as you call it.
    *args: its arguments (the gradients are taken with respect to the
      first).
    grad: also check the backward pass.
    loss_scale: ``None``, a number or an mpolicy loss scale: the backward
      pass starts from the loss times its scale.

  Returns:
    A `NonFiniteReport`, or ``None`` if every value reaching the loss and
    the gradients is finite.

  See also: `compare_to_float32`, `make_train_step` (``attribute_overflow``
  names the parameters), `explain`.
  """
  loss_scale = program_lib.check_loss_scale(loss_scale, "locate_nonfinite")
  call = program_lib.Call(fn, args, "locate_nonfinite")
  program = call.program(grad, loss_scale)
  found = first_nonfinite(call, program_lib.run(call, program), grad,
                          loss_scale)
  if found is None:
    return None
  report, site = found
  if site is None:
    return report
  return dataclasses.replace(report, fixed_by_float32=_finite_with(
      program, call.arrays, report.path, site))


def first_nonfinite(call: program_lib.Call, run: program_lib.Run, grad: bool,
                    loss_scale: Any = None
                    ) -> Optional[tuple[NonFiniteReport, Optional[int]]]:
  """Where ``run``'s first non-finite value reaching its results began.

  Returns:
    ``None`` if the results are finite; else the report (its
    ``fixed_by_float32`` not yet known: ``False``) and the index of the op
    it names among ``run.sites`` (``None`` for an input or an unnamed op).
  """
  scale = (None if loss_scale is None
           else float(np.asarray(loss_scale.loss_scale)))
  outs, checker = run.outs, run.checker
  bad = [i for i, o in enumerate(outs) if not program_lib.all_finite([o])]
  if not bad:
    return None
  names = call.output_names(grad)
  found_origins = check.origins(checker, run.out_ids)
  chosen = [found_origins[i] for i in ([0] if 0 in bad else bad)
            if found_origins[i] is not None]
  outputs = tuple(names[i] for i in bad)
  if not chosen:  # Nothing but the output itself: an unchecked op.
    return NonFiniteReport("unknown", "", "forward", "", "", None, None,
                           False, outputs=outputs), None
  entry = min(chosen, key=lambda o: o.order).entry  # type: ignore[union-attr]  # Nones left out.
  event = checker.events[entry.event]
  if event.primitive == "input":
    x = call.arrays[call.paths.index(event.where)]
    return NonFiniteReport("input", event.where, "forward",
                           program_lib.leaf_dtype_name(x), "", None, None,
                           False, op="input", outputs=outputs), None
  index = event.site
  direction = "backward" if grad and 0 not in bad and event.backward else (
      "forward")
  if direction == "backward" and index is not None:
    index = _cotangent_of(run.sites, index)
  site = run.sites[index] if index is not None else None
  return NonFiniteReport(
      primitive=site.primitive if site is not None else event.primitive,
      path=site.path if site is not None else "", direction=direction,
      dtype=(site.ran_in if site is not None else ""),
      source=site.source if site is not None else "",
      iteration=entry.iteration, device=entry.device,
      fixed_by_float32=False, op=event.primitive, outputs=outputs,
      loss_scale=scale), index
