"""The one door to JAX internals.

* `internals`: JAX's private and extension modules for tracing: name
  stacks, where an equation was written, jaxpr types,
  primitives matched by identity, tracing, defining primitives, devices.
* `params`: every read of a primitive's params by key, accepting each
  shape the supported JAX versions (0.10.2 to 0.12) use.
* `processes`: the `jax.distributed` client (a key-value store shared by
  the processes of a run).

Supporting another JAX version means changing this package only. Nothing
in it knows about policies. Every name is re-exported here: the rest of
mpolicy imports `jax_compat` and nothing below it.
"""

from mpolicy._src.jax_compat.internals import *  # pylint: disable=wildcard-import
from mpolicy._src.jax_compat.params import *  # pylint: disable=wildcard-import
from mpolicy._src.jax_compat.processes import *  # pylint: disable=wildcard-import
from mpolicy._src.jax_compat import internals as _internals
from mpolicy._src.jax_compat import params as _params
from mpolicy._src.jax_compat import processes as _processes

__all__ = [*_internals.__all__, *_params.__all__, *_processes.__all__]
