"""The one door to JAX internals.

* `calls`: JAX's call primitives, looked up by name.
* `internals`: name stacks, where an equation was written, jaxpr types,
  primitives matched by identity, tracing, defining primitives, devices.
* `linearize`: running a function under `jax.grad` with a linearization
  made once per signature (autodiff's internals).
* `params`: every read of a primitive's params by key, accepting each
  shape the supported JAX versions (0.10.2 to 0.12) use.
* `processes`: the `jax.distributed` client (a key-value store shared by
  the processes of a run).
* `remat`: remat policies seeing mpolicy's primitives as the JAX ones
  they stand for.
* `hijax`: JAX's next-generation constructs (``jax_scan3``,
  ``jax_remat3``, ``jax_custom_vjp3``, ``jax_custom_jvp3``), read and
  rebuilt; reached as ``jax_compat.hijax`` (its names are per construct),
  and `jaxprs_in_params`, the sub-jaxprs of any equation's params.

`internals`, `linearize`, `processes`, `remat` and `hijax` are the modules
that import JAX's private and extension modules; `private` lists each
private name they use. Supporting another JAX
version means changing this package only. Nothing in it knows about
mpolicy's policies. Every name of `calls`, `internals`, `linearize`, `params`,
`processes` and `remat` is re-exported here: the rest of mpolicy imports `jax_compat` and
nothing below it.
"""

from mpolicy._src.jax_compat.internals import *  # pylint: disable=wildcard-import
from mpolicy._src.jax_compat.calls import *  # pylint: disable=wildcard-import
from mpolicy._src.jax_compat.linearize import *  # pylint: disable=wildcard-import
from mpolicy._src.jax_compat.params import *  # pylint: disable=wildcard-import
from mpolicy._src.jax_compat.processes import *  # pylint: disable=wildcard-import
from mpolicy._src.jax_compat.remat import *  # pylint: disable=wildcard-import
from mpolicy._src.jax_compat.structure import *  # pylint: disable=wildcard-import
from mpolicy._src.jax_compat import calls as _calls
from mpolicy._src.jax_compat import internals as _internals
from mpolicy._src.jax_compat import linearize as _linearize
from mpolicy._src.jax_compat import params as _params
from mpolicy._src.jax_compat import processes as _processes
from mpolicy._src.jax_compat import remat as _remat
from mpolicy._src.jax_compat import structure as _structure
from mpolicy._src.jax_compat import hijax
from mpolicy._src.jax_compat import private
from mpolicy._src.jax_compat.hijax import jaxprs_in_params

__all__ = [*_internals.__all__, *_calls.__all__, *_linearize.__all__, *_params.__all__,
           *_processes.__all__, *_remat.__all__, *_structure.__all__, "jaxprs_in_params"]
