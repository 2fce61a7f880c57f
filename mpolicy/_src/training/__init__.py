"""Training helpers for mixed precision with optax, one theme per module.

* `scaling`: `scaled_value_and_grad`, loss-scaled gradients in one call.
* `skipping`: `skip_nonfinite` and `update_if_finite`, which keep params
  and optimizer state bit for bit on a non-finite step.
* `master_weights`: a float32 master copy of half params in the state.
* `stable_dtypes`: `keep_dtypes`, state and updates that keep their dtypes.
* `attribution`: `nonfinite_flags` / `nonfinite_paths`, which leaves
  overflowed.
* `train_step`: `make_train_step`, all of the above in one step.
* `microbatches`, `accumulation`: `make_train_step(microbatches=k)`, the
  strided split and one loss-scaled step over k microbatches;
  `accumulation_check`: `check_accumulation`, which measures it in ulps.
* `state_dtypes`, `stochastic_rounding`, `half_params`: optimizer state and
  half params stored narrow, written with stochastic rounding.
"""

from mpolicy._src.training.accumulation_check import AccumulationCheck
from mpolicy._src.training.accumulation_check import check_accumulation
from mpolicy._src.training.attribution import nonfinite_flags
from mpolicy._src.training.attribution import nonfinite_paths
from mpolicy._src.training.half_params import apply_updates_stochastic
from mpolicy._src.training.half_params import stochastic_params
from mpolicy._src.training.half_params import StochasticParamsState
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
