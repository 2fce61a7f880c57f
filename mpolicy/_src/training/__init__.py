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

The package imports none of them: `scaling`, `attribution` and
`stochastic_rounding` need only JAX, the others optax, which is loaded only
when one of their names is used (see ``mpolicy/__init__.py``).
"""
