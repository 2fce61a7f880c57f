"""The variants of `bench_training.py --preset=gpu`: what each one trains with.

Each `GpuVariant` gives a context manager that fills its registry (Haiku's
for the jmp variants, mpolicy's for the mpolicy ones) while the model is
initialised and traced, a loss builder and a step builder (see below).
`GPU_VARIANTS` lists them by the key `--variants` takes.

>>> list(GPU_VARIANTS)
['f32', 'jmp', 'mpolicy', 'amp', 'f16_jmp', 'f16_mpolicy', 'fp8']
>>> GPU_VARIANTS["f16_mpolicy"].baseline
'f16_jmp'
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Optional

import haiku as hk
import jax
import jax.numpy as jnp
import jmp
import optax

import mpolicy

GPU_BF16 = "p=f32,c=bf16,o=f32"
GPU_F16 = "p=f32,c=f16,o=f32"
GPU_FP8 = "p=f32,c=f8,o=bf16"
GPU_LEARNING_RATE = 3e-4
GPU_INITIAL_LOSS_SCALE = 2.0**15



# Each variant gives a context manager that fills its registry while the
# model is initialised and traced, a loss builder `forward -> (init,
# loss_fn)` with `loss_fn(params, state, batch) -> (loss, state)`, and a step
# builder `loss_fn -> (step, optimizer, initial loss scale)` with
# `step(params, state, opt_state, loss_scale, batch) -> (params, state,
# opt_state, loss_scale, loss, grads_finite)`.


def _bn_policy(compute: str) -> str:
  # As Haiku's ImageNet example: BatchNorm computes in float32 and hands its
  # output to the next layer in the model's compute dtype.
  return f"p=f32,c=f32,o={compute}"


@contextlib.contextmanager
def _gpu_no_policy(model: GpuModel):
  del model
  yield


def _gpu_haiku_policy(policy: str, compute: str):

  @contextlib.contextmanager
  def ctx(model: GpuModel):
    hk.mixed_precision.set_policy(model.model_cls, jmp.get_policy(policy))
    if model.has_batchnorm:
      hk.mixed_precision.set_policy(hk.BatchNorm,
                                    jmp.get_policy(_bn_policy(compute)))
    try:
      yield
    finally:
      hk.mixed_precision.clear_policy(model.model_cls)
      hk.mixed_precision.clear_policy(hk.BatchNorm)

  return ctx


def _gpu_mpolicy_policy(policy: str, compute: str):

  @contextlib.contextmanager
  def ctx(model: GpuModel):
    with contextlib.ExitStack() as stack:
      stack.enter_context(mpolicy.push_policy(hk.Module, policy))
      if model.has_batchnorm:
        stack.enter_context(
            mpolicy.push_policy(hk.BatchNorm, _bn_policy(compute)))
      yield

  return ctx


def _haiku_loss(forward):
  t = hk.transform_with_state(forward)
  return t.init, lambda p, s, batch: t.apply(p, s, None, batch)


def _mpolicy_transform_loss(forward):
  t = mpolicy.transform_amp_with_state(forward)
  return t.init, lambda p, s, batch: t.apply(p, s, None, batch)


def _amp_loss(policy):

  def build(forward):
    t = hk.transform_with_state(forward)
    loss = mpolicy.amp(lambda p, s, batch: t.apply(p, s, None, batch), policy)
    return t.init, loss

  return build


def _plain_step(loss_fn):
  opt = optax.adam(GPU_LEARNING_RATE)

  def step(params, state, opt_state, loss_scale, batch):
    (loss, new_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(
        params, state, batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), new_state, opt_state,
            loss_scale, loss, jnp.array(True))

  return step, opt, None


def _jmp_dynamic_scale_step(loss_fn):
  """Float16 training as a Haiku+jmp user writes it by hand."""
  opt = optax.adam(GPU_LEARNING_RATE)

  def step(params, state, opt_state, loss_scale, batch):
    def scaled_loss(p):
      loss, new_state = loss_fn(p, state, batch)
      return loss_scale.scale(loss), (loss, new_state)

    (_, (loss, new_state)), grads = jax.value_and_grad(
        scaled_loss, has_aux=True)(params)
    grads = loss_scale.unscale(grads)
    finite = jmp.all_finite(grads)
    loss_scale = loss_scale.adjust(finite)
    updates, new_opt_state = opt.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    params, state, opt_state = jmp.select_tree(
        finite, (new_params, new_state, new_opt_state),
        (params, state, opt_state))
    return params, state, opt_state, loss_scale, loss, finite

  return step, opt, jmp.DynamicLossScale(jnp.float32(GPU_INITIAL_LOSS_SCALE))


def _mpolicy_dynamic_scale_step(loss_fn):
  """Float16 training with mpolicy's helpers."""
  opt = mpolicy.skip_nonfinite(optax.adam(GPU_LEARNING_RATE))
  grad_fn = mpolicy.scaled_value_and_grad(loss_fn, has_aux=True)

  def step(params, state, opt_state, loss_scale, batch):
    loss_scale, finite, (loss, new_state), grads = grad_fn(
        loss_scale, params, state, batch)
    updates, opt_state = opt.update(grads, opt_state, params,
                                    grads_finite=finite)
    state = mpolicy.select_tree(finite, new_state, state)
    return (optax.apply_updates(params, updates), state, opt_state,
            loss_scale, loss, finite)

  return step, opt, mpolicy.DynamicLossScale(
      jnp.float32(GPU_INITIAL_LOSS_SCALE))


@dataclasses.dataclass
class GpuVariant:
  key: str
  label: str
  policy: Callable[[GpuModel], Any]   # model -> context manager
  loss: Callable[[Callable[..., Any]], tuple[Callable, Callable]]
  step: Callable[[Callable[..., Any]], tuple[Callable, Any, Any]]
  baseline: str = "jmp"   # the hand-written counterpart for "× jmp"


GPU_VARIANTS = {
    "f32": GpuVariant("f32", "float32 (hk.transform)", _gpu_no_policy,
                      _haiku_loss, _plain_step),
    "jmp": GpuVariant("jmp", "Haiku + jmp bf16 (hand-written)",
                      _gpu_haiku_policy(GPU_BF16, "bf16"), _haiku_loss,
                      _plain_step),
    "mpolicy": GpuVariant("mpolicy", "mpolicy.transform_amp bf16",
                          _gpu_mpolicy_policy(GPU_BF16, "bf16"),
                          _mpolicy_transform_loss, _plain_step),
    "amp": GpuVariant("amp", "mpolicy.amp(apply) bf16", _gpu_no_policy,
                      _amp_loss(GPU_BF16), _plain_step),
    "f16_jmp": GpuVariant(
        "f16_jmp", "Haiku + jmp f16, DynamicLossScale by hand",
        _gpu_haiku_policy(GPU_F16, "f16"), _haiku_loss,
        _jmp_dynamic_scale_step, baseline="f16_jmp"),
    "f16_mpolicy": GpuVariant(
        "f16_mpolicy", "mpolicy f16, scaled_value_and_grad + skip_nonfinite",
        _gpu_mpolicy_policy(GPU_F16, "f16"), _mpolicy_transform_loss,
        _mpolicy_dynamic_scale_step, baseline="f16_jmp"),
    # ---- fp8 hook -------------------------------------------------------
    # mpolicy.transform_amp with compute in float8 (`c=f8`, BatchNorm as in
    # the bf16 variants). Runs only with --fp8 (or when listed in
    # --variants), and is skipped with a printed note when this mpolicy's
    # `get_policy` does not know float8 compute yet.
    "fp8": GpuVariant("fp8", "mpolicy.transform_amp fp8 (c=f8,o=bf16)",
                      _gpu_mpolicy_policy(GPU_FP8, "bf16"),
                      _mpolicy_transform_loss, _plain_step),
}
GPU_DEFAULT_VARIANTS = "f32,jmp,mpolicy,amp,f16_jmp,f16_mpolicy"


def fp8_unavailable() -> Optional[str]:
  """Why the fp8 variant cannot run here, or None if it can."""
  try:
    mpolicy.get_policy(GPU_FP8)
  except Exception as e:  # pylint: disable=broad-except
    return f"get_policy({GPU_FP8!r}) raised {type(e).__name__}: {e}"
  return None
