"""mpolicy.training: the door for training with optax in mixed precision.

Every name here is also a top-level name of `mpolicy` (``mpolicy.X`` and
``mpolicy.training.X`` are the same object); this door gathers the ones a
training loop needs in one place. Importing it loads optax.

* Loss scales (jmp's API): `DynamicLossScale`, `StaticLossScale`,
  `NoOpLossScale`, `all_finite`, `select_tree`.
* One step: `make_train_step` (loss scaling, skipping non-finite steps,
  retries, gradient accumulation, reduction across devices) and its
  `TrainStepResult`; `scaled_value_and_grad` for a loop of your own.
* Steps that overflow: `skip_nonfinite` / `update_if_finite` (params and
  optimizer state kept bit for bit), `nonfinite_flags` / `nonfinite_paths`
  (which leaves overflowed).
* The optimizer's precision: `master_weights`, `with_state_dtypes`,
  `keep_dtypes`, `stochastic_round`, `stochastic_params`,
  `apply_updates_stochastic`; `check_accumulation` measures accumulation
  in ulps.

>>> import jax.numpy as jnp, optax, mpolicy
>>> from mpolicy import training
>>> step = training.make_train_step(
...     lambda p, x: jnp.mean((x @ p) ** 2), optax.sgd(0.1))
>>> params = jnp.ones((3,))
>>> scale = training.DynamicLossScale(jnp.float32(2.0 ** 15))
>>> out = step(params, optax.sgd(0.1).init(params), scale, jnp.ones((4, 3)))
>>> out.grads_finite.item(), out.params.dtype
(True, dtype('float32'))
>>> training.make_train_step is mpolicy.make_train_step
True
"""

from mpolicy._src.loss_scale import all_finite
from mpolicy._src.loss_scale import DynamicLossScale
from mpolicy._src.loss_scale import LossScale
from mpolicy._src.loss_scale import NoOpLossScale
from mpolicy._src.loss_scale import select_tree
from mpolicy._src.loss_scale import StaticLossScale
from mpolicy._src.training.accumulation_check import AccumulationCheck
from mpolicy._src.training.accumulation_check import check_accumulation
from mpolicy._src.training.attribution import nonfinite_flags
from mpolicy._src.training.attribution import nonfinite_paths
from mpolicy._src.training.half_params import apply_updates_stochastic
from mpolicy._src.training.half_params import stochastic_params
from mpolicy._src.training.half_params import StochasticParamsState
from mpolicy._src.training.low_bits import LowBitsMasterState
from mpolicy._src.training.master_weights import init_master_weights
from mpolicy._src.training.master_weights import master_weights
from mpolicy._src.training.master_weights import MasterWeightsState
from mpolicy._src.training.master_weights import params_from_master
from mpolicy._src.training.scaling import scaled_value_and_grad
from mpolicy._src.training.skipping import skip_nonfinite
from mpolicy._src.training.skipping import SkipNonFiniteState
from mpolicy._src.training.skipping import update_if_finite
from mpolicy._src.training.stable_dtypes import keep_dtypes
from mpolicy._src.training.state_dtypes import StateDtypesState
from mpolicy._src.training.state_dtypes import with_state_dtypes
from mpolicy._src.training.stochastic_rounding import stochastic_round
from mpolicy._src.training.train_step import make_train_step
from mpolicy._src.training.train_step import TrainStepResult

__all__ = (
    "AccumulationCheck", "DynamicLossScale", "LossScale", "LowBitsMasterState",
    "MasterWeightsState",
    "NoOpLossScale", "SkipNonFiniteState", "StateDtypesState",
    "StaticLossScale", "StochasticParamsState", "TrainStepResult",
    "all_finite", "apply_updates_stochastic", "check_accumulation",
    "init_master_weights", "keep_dtypes", "make_train_step", "master_weights",
    "nonfinite_flags", "nonfinite_paths", "params_from_master",
    "scaled_value_and_grad", "select_tree", "skip_nonfinite",
    "stochastic_params", "stochastic_round", "update_if_finite",
    "with_state_dtypes",
)
