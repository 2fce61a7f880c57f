"""The one door to JAX internals.

* `internals`: the one module that imports JAX's private and extension
  modules; name stacks, where an equation was written, jaxpr types,
  primitives matched by identity, tracing, defining primitives, devices.
* `linearize`: running a function under `jax.grad` with a linearization
  made once per signature (autodiff's internals).
* `params`: every read of a primitive's params by key, accepting each
  shape the supported JAX versions (0.10.2 to 0.12) use.

Supporting another JAX version means changing this package only. Nothing
in it knows about policies. Every name is re-exported here: the rest of
mpolicy imports `jax_compat` and nothing below it.
"""

from mpolicy._src.jax_compat.internals import *  # pylint: disable=wildcard-import
from mpolicy._src.jax_compat.linearize import *  # pylint: disable=wildcard-import
from mpolicy._src.jax_compat.params import *  # pylint: disable=wildcard-import
from mpolicy._src.jax_compat import internals as _internals
from mpolicy._src.jax_compat import linearize as _linearize
from mpolicy._src.jax_compat import params as _params

__all__ = [*_internals.__all__, *_linearize.__all__, *_params.__all__]
