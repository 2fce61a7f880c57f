"""mpolicy: mixed precision for JAX and Haiku.

Policies and loss scales (API-compatible with jmp), one registry of policies
by module class or name pattern, `transform_amp` for Haiku, an op-level
interpreter (`amp`) that runs each primitive in the dtype its rule gives it,
and optax training helpers.

First day: `get_policy` (a `Policy` from jmp's grammar,
``"p=f32,c=bf16,o=f32"``), `set_policy` (by module class or name pattern),
`transform_amp` (Haiku) or `amp` (any JAX function), `make_train_step`
with a `DynamicLossScale`, and `explain` to see what ran in which dtype.

The rest is behind three doors, each a theme (the flat names stay too):
``mpolicy.training`` (loss scales, steps, the optimizer's precision),
``mpolicy.debug`` (explain, locate_nonfinite, compare_to_float32,
suggest_policy, fp8_stats) and ``mpolicy.checkpoint`` (orbax checkpoints
checked against the policy). A door is imported on first use, as an
attribute or with ``from mpolicy import training``.

>>> import jax.numpy as jnp, mpolicy
>>> f = mpolicy.amp(lambda x, w: x @ w, "p=f32,c=bf16,o=f32")
>>> f(jnp.ones((2, 3)), jnp.ones((3, 4))).dtype
dtype('float32')
"""

import importlib as _importlib
from importlib import util as _importlib_util
import typing as _typing

from mpolicy._src.policy import cast_to_full
from mpolicy._src.policy import cast_to_half
from mpolicy._src.policy import get_policy
from mpolicy._src.policy import half_dtype
from mpolicy._src.policy import Policy

from mpolicy._src.loss_scale import all_finite
from mpolicy._src.loss_scale import DynamicLossScale
from mpolicy._src.loss_scale import LossScale
from mpolicy._src.loss_scale import NoOpLossScale
from mpolicy._src.loss_scale import select_tree
from mpolicy._src.loss_scale import StaticLossScale

from mpolicy._src.registry import clear_policies
from mpolicy._src.registry import clear_policy
from mpolicy._src.registry import policy_for
from mpolicy._src.registry import push_policy
from mpolicy._src.registry import set_policy

from mpolicy._src.class_lookup import explain_policy
from mpolicy._src.class_lookup import PolicyExplanation
from mpolicy._src.module_calls import current_policy

from mpolicy._src.op_rules import DEFAULT_RULES
from mpolicy._src.op_rules import OpRules

from mpolicy._src.amp import amp
from mpolicy._src.amp import full_precision
from mpolicy._src.int8_export import export_quantized
from mpolicy._src.higher_order import UnsupportedPrimitiveError

from mpolicy._src.explain import explain
from mpolicy._src.explain import Report
from mpolicy._src.fp8_stats import Fp8Report
from mpolicy._src.fp8_stats import fp8_stats

from mpolicy._src.debugging.locate import locate_nonfinite
from mpolicy._src.debugging.locate import NonFiniteReport
from mpolicy._src.debugging.shadow import compare_to_float32
from mpolicy._src.debugging.shadow import ShadowReport
from mpolicy._src.debugging.suggest import PolicySuggestion
from mpolicy._src.debugging.suggest import suggest_policy

from mpolicy._src.training.scaling import scaled_value_and_grad
from mpolicy._src.training.attribution import nonfinite_flags
from mpolicy._src.training.attribution import nonfinite_paths
from mpolicy._src.training.stochastic_rounding import stochastic_round

from mpolicy._src.blocks.quantize import BlockQuantized
from mpolicy._src.blocks.quantize import dequantize_blocks
from mpolicy._src.blocks.quantize import fake_quantize
from mpolicy._src.blocks.quantize import quantize_blocks

# The names below need a package beyond JAX and numpy. Each is imported on
# first use (see `__getattr__`), so `import mpolicy` loads none of those
# packages; type checkers and IDEs read the imports here.
if _typing.TYPE_CHECKING:
  from mpolicy._src.haiku_bridge import HaikuPolicyWarning
  from mpolicy._src.haiku_bridge import transform_amp
  from mpolicy._src.haiku_bridge import transform_amp_with_state
  from mpolicy._src.haiku_bridge import with_policies

  from mpolicy._src.training.skipping import skip_nonfinite
  from mpolicy._src.training.skipping import SkipNonFiniteState
  from mpolicy._src.training.skipping import update_if_finite
  from mpolicy._src.training.master_weights import init_master_weights
  from mpolicy._src.training.master_weights import master_weights
  from mpolicy._src.training.master_weights import MasterWeightsState
  from mpolicy._src.training.low_bits import LowBitsMasterState
  from mpolicy._src.training.master_weights import params_from_master
  from mpolicy._src.training.stable_dtypes import keep_dtypes
  from mpolicy._src.training.train_step import make_train_step
  from mpolicy._src.training.train_step import TrainStepResult
  from mpolicy._src.training.accumulation_check import AccumulationCheck
  from mpolicy._src.training.accumulation_check import check_accumulation
  from mpolicy._src.training.state_dtypes import StateDtypesState
  from mpolicy._src.training.state_dtypes import with_state_dtypes
  from mpolicy._src.training.half_params import apply_updates_stochastic
  from mpolicy._src.training.half_params import stochastic_params
  from mpolicy._src.training.half_params import StochasticParamsState

  from mpolicy._src.checkpoint import restore_checkpoint
  from mpolicy._src.checkpoint import save_checkpoint
  from mpolicy._src.checkpoint import CheckpointManager

# The package each lazy module needs (its import name, and what to install).
_HAIKU = ("haiku", "dm-haiku")
_OPTAX = ("optax", "optax")
_ORBAX = ("orbax.checkpoint", "orbax-checkpoint")

# Lazy name -> (the module that defines it, the package it needs).
_LAZY = {
    "HaikuPolicyWarning": ("mpolicy._src.haiku_bridge", _HAIKU),
    "transform_amp": ("mpolicy._src.haiku_bridge", _HAIKU),
    "transform_amp_with_state": ("mpolicy._src.haiku_bridge", _HAIKU),
    "with_policies": ("mpolicy._src.haiku_bridge", _HAIKU),
    "skip_nonfinite": ("mpolicy._src.training.skipping", _OPTAX),
    "SkipNonFiniteState": ("mpolicy._src.training.skipping", _OPTAX),
    "update_if_finite": ("mpolicy._src.training.skipping", _OPTAX),
    "init_master_weights": ("mpolicy._src.training.master_weights", _OPTAX),
    "master_weights": ("mpolicy._src.training.master_weights", _OPTAX),
    "MasterWeightsState": ("mpolicy._src.training.master_weights", _OPTAX),
    "LowBitsMasterState": ("mpolicy._src.training.low_bits", _OPTAX),
    "params_from_master": ("mpolicy._src.training.master_weights", _OPTAX),
    "keep_dtypes": ("mpolicy._src.training.stable_dtypes", _OPTAX),
    "make_train_step": ("mpolicy._src.training.train_step", _OPTAX),
    "TrainStepResult": ("mpolicy._src.training.train_step", _OPTAX),
    "AccumulationCheck": ("mpolicy._src.training.accumulation_check", _OPTAX),
    "check_accumulation": ("mpolicy._src.training.accumulation_check", _OPTAX),
    "StateDtypesState": ("mpolicy._src.training.state_dtypes", _OPTAX),
    "with_state_dtypes": ("mpolicy._src.training.state_dtypes", _OPTAX),
    "apply_updates_stochastic": ("mpolicy._src.training.half_params", _OPTAX),
    "stochastic_params": ("mpolicy._src.training.half_params", _OPTAX),
    "StochasticParamsState": ("mpolicy._src.training.half_params", _OPTAX),
    "restore_checkpoint": ("mpolicy._src.checkpoint", _ORBAX),
    "save_checkpoint": ("mpolicy._src.checkpoint", _ORBAX),
    "CheckpointManager": ("mpolicy._src.checkpoint", _ORBAX),
}

# The doors: subpackages, imported on first attribute access.
_DOORS = {"training": _OPTAX, "debug": None, "checkpoint": _ORBAX}

__version__ = "0.1.0"

__all__ = (
    "AccumulationCheck",
    "BlockQuantized",
    "CheckpointManager",
    "DEFAULT_RULES",
    "DynamicLossScale",
    "HaikuPolicyWarning",
    "LossScale",
    "LowBitsMasterState",
    "MasterWeightsState",
    "NoOpLossScale",
    "NonFiniteReport",
    "OpRules",
    "Policy",
    "PolicyExplanation",
    "PolicySuggestion",
    "Report",
    "ShadowReport",
    "SkipNonFiniteState",
    "StateDtypesState",
    "StaticLossScale",
    "StochasticParamsState",
    "TrainStepResult",
    "UnsupportedPrimitiveError",
    "all_finite",
    "amp",
    "apply_updates_stochastic",
    "cast_to_full",
    "cast_to_half",
    "check_accumulation",
    "clear_policies",
    "clear_policy",
    "compare_to_float32",
    "current_policy",
    "dequantize_blocks",
    "explain",
    "explain_policy",
    "export_quantized",
    "fake_quantize",
    "Fp8Report",
    "fp8_stats",
    "full_precision",
    "get_policy",
    "half_dtype",
    "init_master_weights",
    "keep_dtypes",
    "locate_nonfinite",
    "make_train_step",
    "master_weights",
    "nonfinite_flags",
    "nonfinite_paths",
    "params_from_master",
    "policy_for",
    "push_policy",
    "quantize_blocks",
    "restore_checkpoint",
    "save_checkpoint",
    "scaled_value_and_grad",
    "select_tree",
    "set_policy",
    "skip_nonfinite",
    "stochastic_params",
    "stochastic_round",
    "suggest_policy",
    "transform_amp",
    "transform_amp_with_state",
    "update_if_finite",
    "with_state_dtypes",
    "with_policies",
)

_REMOVED = {
    "tree_to_arrays": "checkpoints are orbax directories: save with "
                      "mpolicy.save_checkpoint (or orbax directly)",
    "arrays_to_tree": "checkpoints are orbax directories: restore with "
                      "mpolicy.restore_checkpoint (or orbax directly)",
}


def _needs(name: str, package: tuple[str, str]) -> None:
  """Raises an `ImportError` naming what to install if ``package`` is
  missing; finds it without importing it."""
  import_name, install = package
  try:
    found = _importlib_util.find_spec(import_name) is not None
  except ImportError:  # A missing parent package, or an import blocked.
    found = False
  if not found:
    raise ImportError(
        f"mpolicy.{name} needs {import_name}, which is not installed: "
        f"pip install {install}")


def __getattr__(name):
  if name in _LAZY:
    module, package = _LAZY[name]
    _needs(name, package)
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value  # Later reads do not come here.
    return value
  if name in _DOORS:
    if _DOORS[name]:
      _needs(name, _DOORS[name])
    return _importlib.import_module(f"mpolicy.{name}")  # Sets the attribute.
  if name in _REMOVED:
    raise AttributeError(f"mpolicy.{name} was removed: {_REMOVED[name]}.")
  raise AttributeError(f"module 'mpolicy' has no attribute {name!r}")


def __dir__():
  return sorted(set(globals()) | set(_LAZY) | set(_DOORS))
