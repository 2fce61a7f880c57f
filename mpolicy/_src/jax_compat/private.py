"""Every private JAX name mpolicy uses, and which JAX versions define it.

The modules of `jax_compat` import JAX's private modules (and nothing else
of mpolicy does); ``PRIVATE_NAMES`` lists, per private module, the names
read from it, each with the JAX versions that define it: ``(first, stop)``,
the first version where it must exist and the first where it need not,
None for an open end. `missing_private_names` says which of those the installed
JAX lacks, so a JAX that moves one fails a test that names it, not a user's
program. docs/compatibility.md gives each module's use and the public
replacement it waits for.

>>> missing_private_names()
[]
>>> "jax._src.core" in PRIVATE_NAMES
True
"""

from __future__ import annotations

import importlib
import re

import jax

_ALL = (None, None)
# Names only one end of the supported range defines (the code reads them
# where present). Checked on JAX 0.10 and 0.12 only: 0.11 may have either.
_OLD_ONLY = (None, (0, 11, 0))
_NEW_ONLY = ((0, 12, 0), None)

PRIVATE_NAMES: dict[str, dict[str, tuple]] = {
    "jax._src.core": {
        "extend_axis_env_nd": _ALL,  # Binding a shard_map body's axes.
        "mem_kind_to_space": _ALL,  # A remat rule's offloading.
        "positional_effects": _ALL,  # A rebuilt scan3 loop's effects.
    },
    "jax._src.config": {"_check_vma": _ALL},
    "jax._src.source_info_util": {
        "Scope": _ALL, "Transform": _ALL, "is_user_filename": _ALL,
        "user_frame": _ALL,
    },
    "jax._src.interpreters.ad": {
        "LinearizeTrace": _ALL, "LinearizeTracer": _ALL, "Zero": _ALL,
        "linearize_jaxpr": _ALL, "primitive_linearizations": _ALL,
    },
    "jax._src.interpreters.partial_eval": {
        "convert_constvars_jaxpr": _ALL,  # Public from JAX 0.12 on.
        "ensure_enum": _ALL, "SaveableType": _ALL, "Offloadable": _ALL,
    },
    "jax._src.interpreters.remat": {
        "rules": _ALL, "reduce_precision": _ALL, "remat_subtrace": _NEW_ONLY,
    },
    "jax._src.ad_checkpoint": {
        "primal_left_tangent_right": _ALL, "DotsSaveable": _OLD_ONLY,
        "RematTraced": _ALL, "CheckpointName": _ALL,
        "CheckpointNameFwd": _NEW_ONLY,
    },
    "jax._src.hijax": {
        "call_hi_primitive_p": _ALL, "CustomVJPTraced": _ALL,
        "CustomJVPTraced": _NEW_ONLY, "_custom_jvp_rule": _NEW_ONLY,
    },
    "jax._src.lax.control_flow.loops": {"Scan3": _ALL},
    "jax._src.lax.lax": {"_dot_general_batch_dim_nums": _ALL},
    "jax._src.util": {"cache": _ALL},
    "jax._src.pallas.pallas_call": {"pallas_call_p": _ALL},
    "jax._src.distributed": {"global_state": _ALL},
}
"""Private module -> {name read from it: (first, stop) JAX versions that
must define it}."""


def installed_jax() -> tuple[int, ...]:
  """The installed JAX's version, ``(major, minor, patch)``."""
  return tuple(int(p) for p in re.findall(r"\d+", jax.__version__)[:3])


def _expected(versions: tuple) -> bool:
  first, stop = versions
  here = installed_jax()
  return (first is None or here >= first) and (stop is None or here < stop)


def private_name_report() -> list[tuple[str, bool, bool]]:
  """``(module.name, expected on this JAX, present)`` for every name."""
  report = []
  for module_name, names in PRIVATE_NAMES.items():
    try:
      module = importlib.import_module(module_name)
    except ImportError:
      module = None
    for name, versions in names.items():
      report.append((f"{module_name}.{name}", _expected(versions),
                     module is not None and hasattr(module, name)))
  return report


def missing_private_names() -> list[str]:
  """The private names the installed JAX should define and does not."""
  return [name for name, expected, present in private_name_report()
          if expected and not present]
