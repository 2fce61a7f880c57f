"""The op rules: how each first-order primitive runs under a policy.

One home per primitive family, each registering its facts (`facts`) beside
the code they describe:

* `classes`: the class rules (``lower``, ``full``, ``promote``, inputs, as
  written) and the element-wise, reduction, linear-algebra and combining
  primitives no family owns;
* `special`: casts, bit reinterpretations, writes to references,
  broadcasts and gathers of down-cast values;
* `kernels`: host callbacks and Pallas kernels, run with their traced
  dtypes (or by a dtype rule given by kernel name);
* `matmul`, `conv`: each family's ``lower`` rule, its amp primitive and
  its float8 variant (`amp_primitive`, `fp8_scaling`, `half_storage` hold
  what they share; `fp8_placement` decides where float8 runs, `fp8_mesh`
  which devices share a scale);
* `collectives`: cross-device sums in the dtype `OpRules.with_collectives`
  asks;
* `custom`: the user's rules (`OpRules.with_rule`);
* `dispatch`: `run`, which looks the rules up in order (`run_in_float32`:
  in float32, as written).

Importing this package registers every family.
"""

from mpolicy._src.rules import classes
from mpolicy._src.rules import collectives
from mpolicy._src.rules import conv
from mpolicy._src.rules import kernels
from mpolicy._src.rules import matmul
from mpolicy._src.rules import special
from mpolicy._src.rules.dispatch import run
from mpolicy._src.rules.dispatch import run_in_float32

__all__ = ["classes", "collectives", "conv", "kernels", "matmul", "special", "run",
           "run_in_float32"]
