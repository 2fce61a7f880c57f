"""mpolicy.debug: the door for seeing what ran and where precision breaks.

Every name here is also a top-level name of `mpolicy` (the same object);
this door gathers them for the reader who is debugging a run. All of them
watch the one interpreter that `amp` and `transform_amp` run on.

* What ran: `explain` (each op's dtype and the rule or policy that chose
  it, a `Report`), `explain_policy` (which registry entry governs a module,
  a `PolicyExplanation`), `fp8_stats` (float8 underflow and saturation per
  op, an `Fp8Report`).
* Where it breaks: `locate_nonfinite` (the first inf or NaN by op, module,
  dtype, line, iteration and device, a `NonFiniteReport`),
  `compare_to_float32` (each module's error against a float32 run, a
  `ShadowReport`), `suggest_policy` (the float32 islands that fix it, a
  `PolicySuggestion`).

>>> import jax.numpy as jnp, mpolicy
>>> from mpolicy import debug
>>> f = mpolicy.amp(lambda x: jnp.sum(x @ x), "p=f32,c=f16,o=f32")
>>> print(debug.locate_nonfinite(f, jnp.full((2, 2), 300.0), grad=False)
...       .primitive)
dot_general
"""

from mpolicy._src.class_lookup import explain_policy
from mpolicy._src.class_lookup import PolicyExplanation
from mpolicy._src.debugging.locate import locate_nonfinite
from mpolicy._src.debugging.locate import NonFiniteReport
from mpolicy._src.debugging.shadow import compare_to_float32
from mpolicy._src.debugging.shadow import ShadowReport
from mpolicy._src.debugging.suggest import PolicySuggestion
from mpolicy._src.debugging.suggest import suggest_policy
from mpolicy._src.explain import explain
from mpolicy._src.explain import Report
from mpolicy._src.fp8_stats import Fp8Report
from mpolicy._src.fp8_stats import fp8_stats

__all__ = (
    "Fp8Report", "NonFiniteReport", "PolicyExplanation", "PolicySuggestion",
    "Report", "ShadowReport", "compare_to_float32", "explain",
    "explain_policy", "fp8_stats", "locate_nonfinite", "suggest_policy",
)
