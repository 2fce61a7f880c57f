r"""Why float16 needs loss scaling (Micikevicius et al., 2018), measured.

Trains the digits CNN (see `digits_cnn.py`) three times with the same seed:

1. float32 (policy 'full'): the reference;
2. float16 compute (`--mp_policy`, default p=f32,c=f16,o=f32), no loss scale;
3. the same with `--mp_scale_type` (Dynamic by default, from
   `--mp_scale_value`).

Every `--measure_every` steps it takes the run's current params and a fixed
probe batch and computes the gradients twice: as the run computes them
(float16 backward pass, scaled by the run's loss scale, unscaled in float32)
and with the float32 model. A gradient entry has *underflowed* when it is
nonzero in float32 but exactly zero in float16. The table reports the
fraction of nonzero float32 entries that underflowed: its mean over the
measurements, its value at the end, and each run's final loss and test
accuracy.

Nothing is rigged: the loss is the usual mean cross-entropy over the batch.
Gradients shrink as the model grows confident, and once they fall below
float16's smallest subnormal (2**-24, about 6e-8) they flush to zero. The
default batch is large (1024 of the 1437 training images), since a mean over
more examples makes each gradient smaller; with --batch_size=64 the effect
all but vanishes on this small BatchNorm CNN (about 0.02% of the entries).
The column "f32 grads < 2^-24" shows how many float32 gradient entries are
below what float16 can hold at all.

  python -m examples.loss_scaling_lesson                 # about 2 minutes
  python -m examples.loss_scaling_lesson --steps=800     # a clearer effect
"""

from __future__ import annotations

from collections.abc import Sequence
import dataclasses
from typing import Any, Callable

from absl import app
from absl import flags
import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np

import mpolicy
from examples import common
from examples import digits_cnn

FLAGS = flags.FLAGS
flags.adopt_module_key_flags(common)  # --help lists the shared flags too.

flags.DEFINE_integer("measure_every", 50,
                     "Measure gradient underflow every this many steps.")

# A large batch: the loss is a mean over it, so gradients are small, as in
# the big-batch training the paper is about. Nothing else differs.
DEFAULTS = dict(digits_cnn.DEFAULTS, batch_size=1024, steps=400,
                mp_policy="p=f32,c=f16,o=f32", mp_scale_type="Dynamic",
                compare=False)


@dataclasses.dataclass
class Underflow:
  """Underflow measurements of one run: (step, fraction) pairs."""
  steps: list[int] = dataclasses.field(default_factory=list)
  fractions: list[float] = dataclasses.field(default_factory=list)
  tiny: list[float] = dataclasses.field(default_factory=list)

  @property
  def mean(self) -> float:
    return float(np.mean(self.fractions)) if self.fractions else float("nan")

  @property
  def last(self) -> float:
    return self.fractions[-1] if self.fractions else float("nan")


F16_TINIEST = 2.0**-24  # float16's smallest subnormal.


def underflow_counts(grads_low: Any, grads_f32: Any) -> tuple[int, int, int]:
  """Counts over all gradient entries that are nonzero in float32.

  Returns:
    `(lost, tiny, total)`: entries exactly zero in `grads_low`; entries whose
    float32 magnitude is below float16's smallest subnormal (what a float16
    gradient of the same value could not hold); all nonzero entries.
  """
  lost = tiny = total = 0
  for low, ref in zip(jax.tree_util.tree_leaves(grads_low),
                      jax.tree_util.tree_leaves(grads_f32)):
    low, ref = np.asarray(low), np.asarray(ref)
    nonzero = ref != 0
    lost += int(np.sum(nonzero & (low == 0)))
    tiny += int(np.sum(nonzero & (np.abs(ref) < F16_TINIEST)))
    total += int(np.sum(nonzero))
  return lost, tiny, total


def compiled_grads(mp: common.MixedPrecision, config: digits_cnn.Config,
                   params, state, loss_scale, x, y) -> Callable[..., Any]:
  """The run's gradient computation under `mp`, compiled now.

  Policies are read at trace time, so it is traced and compiled inside this
  function's `push_policy` and can then be called anywhere.
  `fn(loss_scale, params, state, x, y)` returns `(grads_finite, grads)`,
  unscaled, in float32 (the params' dtype).
  """
  with mpolicy.push_policy(digits_cnn.DigitsCNN, mp.policy), \
       mpolicy.push_policy(hk.BatchNorm, mp.norm_policy):
    model = digits_cnn.make_model(config.channels)

    def loss_fn(params, state, x, y):
      logits, _ = model.apply(params, state, None, x, is_training=True)
      return digits_cnn.cross_entropy(logits, y)

    grad_fn = mpolicy.scaled_value_and_grad(loss_fn)

    def grads(loss_scale, params, state, x, y):
      _, finite, _, g = grad_fn(loss_scale, params, state, x, y)
      return finite, g

    return jax.jit(grads).lower(loss_scale, params, state, x, y).compile()


def run(config: digits_cnn.Config, mp: common.MixedPrecision,
        data: digits_cnn.Digits, measure_every: int
        ) -> tuple[common.RunResult, Underflow]:
  """Trains one run and measures its gradient underflow along the way."""
  probe_x = data.x_train[:config.batch_size]
  probe_y = data.y_train[:config.batch_size]
  init = digits_cnn.make_model(config.channels).init
  params, state = init(jax.random.PRNGKey(config.seed), probe_x, True)
  reference = compiled_grads(common.MixedPrecision.float32(), config, params,
                             state, mpolicy.NoOpLossScale(), probe_x, probe_y)
  measured = compiled_grads(mp, config, params, state, mp.loss_scale(),
                            probe_x, probe_y)
  underflow = Underflow()
  is_f32 = common.compute_name(mp.policy) == "f32"

  def callback(i, carry):
    step = i + 1
    if is_f32 or not (step == 1 or step % measure_every == 0
                      or step == config.steps):
      return
    params, state, _, loss_scale = carry
    finite, g_low = measured(loss_scale, params, state, probe_x, probe_y)
    if not bool(finite):
      return  # An overflow step: the run skips it; nothing to compare.
    _, g_ref = reference(mpolicy.NoOpLossScale(), params, state, probe_x,
                         probe_y)
    lost, tiny, total = underflow_counts(g_low, g_ref)
    underflow.steps.append(step)
    underflow.fractions.append(lost / max(total, 1))
    underflow.tiny.append(tiny / max(total, 1))

  result = digits_cnn.train(config, mp, data, callback=callback)
  return result, underflow


def lesson_table(rows: Sequence[tuple[common.RunResult, Underflow]]) -> str:
  header = ["run", "policy", "loss scale", "grads underflowed (mean)",
            "grads underflowed (end)", "f32 grads < 2^-24 (end)",
            "final loss", "test accuracy", "skipped steps"]
  table = []
  for r, u in rows:
    scale = r.mp.scale_type
    if scale != "NoOp":
      scale += f" (ends at {r.history.loss_scale[-1]:g})"
    pct = lambda v: "—" if np.isnan(v) else f"{100 * v:.2f}%"
    table.append([r.label, str(mpolicy.get_policy(r.mp.policy)), scale,
                  pct(u.mean), pct(u.last),
                  pct(u.tiny[-1] if u.tiny else float("nan")),
                  f"{r.metrics['final loss']:.2e}",
                  f"{100 * r.metrics['test accuracy']:.2f}%",
                  r.history.nonfinite_steps])
  return common.markdown_table(header, table)


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
  common.set_defaults(**DEFAULTS)
  config = digits_cnn.config_from_flags()
  mp = common.MixedPrecision.from_flags()
  data = digits_cnn.load_digits()
  print(f"Loss scaling lesson on the digits CNN: {config.steps} steps of "
        f"{config.batch_size}, underflow measured every {FLAGS.measure_every} "
        f"steps on a fixed batch of {config.batch_size}.")
  runs = [common.MixedPrecision.float32(mp.skip_nonfinite),
          dataclasses.replace(mp, scale_type="NoOp")]
  if mp.scale_type != "NoOp":
    runs.append(mp)
  rows = [run(config, m, data, FLAGS.measure_every) for m in runs]
  print()
  print(lesson_table(rows))
  if FLAGS.plot:
    common.plot_results([r for r, _ in rows], FLAGS.plot,
                        title="loss scaling lesson")


flags.register_validator("measure_every", lambda v: v >= 1,
                         message="--measure_every must be at least 1.")

if __name__ == "__main__":
  common.run(main, DEFAULTS)
