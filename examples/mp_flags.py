"""The flags every example takes, and the loss scale they name.

The mixed-precision flags keep the names of Haiku's ImageNet example:
`--mp_policy`, `--mp_scale_type`, `--mp_scale_value` (and, in the Haiku
examples, `--mp_bn_policy`, see `define_bn_policy`). Bad values stop the
example at start-up with absl's `FATAL Flags parsing error: ...`.

The examples import this module as a sibling (`import mp_flags`): run them
as files, `python examples/digits_cnn.py`, from any directory.
"""

from __future__ import annotations

import math
import os

from absl import app
from absl import flags
from absl import logging
import jax.numpy as jnp

import mpolicy

FLAGS = flags.FLAGS
SCALE_TYPES = ("NoOp", "Static", "Dynamic")

flags.DEFINE_string(
    "mp_policy", "p=f32,c=bf16,o=f32",
    "Mixed precision policy of the model, in jmp's grammar "
    "(e.g. 'p=f32,c=bf16,o=f32', 'p=f32,c=f16,o=f32', 'full').")
flags.DEFINE_enum(
    "mp_scale_type", "NoOp", list(SCALE_TYPES),
    "Loss scale: NoOp (none; fine for bfloat16), Static (fixed "
    "--mp_scale_value) or Dynamic (starts at --mp_scale_value, halves on "
    "overflow, doubles after 2000 finite steps; use it with float16).")
flags.DEFINE_float("mp_scale_value", 2.0**15,
                   "The Static loss scale, or the initial Dynamic one.")
flags.DEFINE_integer("steps", 500, "Number of training steps.")
flags.DEFINE_integer("batch_size", 64, "Training batch size.")
flags.DEFINE_integer("seed", 0, "Random seed (initialisation, batch order).")
flags.DEFINE_float("learning_rate", 1e-3, "Adam learning rate.")
flags.DEFINE_integer("log_every", 100,
                     "Print progress every this many steps (0: never).")
flags.DEFINE_bool(
    "compare", False,
    "Also train a float32 baseline (policy 'full', no loss scale) with the "
    "same seed and batches, and print a table of both runs.")
flags.DEFINE_string("plot", None,
                    "Write a PNG of the loss curves and loss scales here "
                    "(missing folders are created).")


def check_policy_spec(spec: str) -> bool:
  """Flag validator: a spec `mpolicy.get_policy` accepts (or empty)."""
  if not spec:
    return True
  try:
    mpolicy.get_policy(spec)
  except (TypeError, ValueError) as e:
    raise flags.ValidationError(str(e)) from e
  return True


def check_plot_path(path: str | None) -> bool:
  """Flag validator: ``path`` names a file whose folder exists or can be
  created (checked at start-up, so a bad path does not fail after training).
  """
  if not path:
    return True
  if os.path.isdir(path):
    raise flags.ValidationError(
        f"--plot={path} is a folder; give a file name such as "
        f"{os.path.join(path, 'losses.png')}")
  folder = os.path.dirname(os.path.abspath(path))
  existing = folder
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing) or not os.access(existing, os.W_OK):
    raise flags.ValidationError(
        f"--plot={path}: cannot write into {folder} ({existing} is not a "
        f"writable folder); give a path in a folder you can write to")
  return True


def define_bn_policy() -> None:
  """Defines `--mp_bn_policy` (once), for examples with normalisation layers."""
  if "mp_bn_policy" not in FLAGS:
    flags.DEFINE_string(
        "mp_bn_policy", "full",
        "Policy of the normalisation layers (hk.BatchNorm, hk.LayerNorm); "
        "they are most stable in float32.")
    flags.register_validator("mp_bn_policy", check_policy_spec)


flags.register_validator("mp_policy", check_policy_spec)
flags.register_validator("plot", check_plot_path)
flags.register_validator(
    "mp_scale_value", lambda v: v > 0 and math.isfinite(v),
    message="--mp_scale_value must be a positive finite number.")
for _name in ("steps", "batch_size"):
  flags.register_validator(_name, lambda v: v >= 1,
                           message=f"--{_name} must be at least 1.")


def make_loss_scale(scale_type: str, value: float) -> mpolicy.LossScale:
  """The loss scale `--mp_scale_type` names, starting at `value`."""
  if scale_type == "NoOp":
    return mpolicy.NoOpLossScale()
  if scale_type == "Static":
    return mpolicy.StaticLossScale(float(value))
  if scale_type == "Dynamic":
    return mpolicy.DynamicLossScale(jnp.float32(value))
  raise ValueError(f"scale_type must be one of {', '.join(SCALE_TYPES)}; "
                   f"got {scale_type!r}.")


def loss_scale() -> mpolicy.LossScale:
  """A fresh loss scale from `--mp_scale_type` and `--mp_scale_value`."""
  return make_loss_scale(FLAGS.mp_scale_type, FLAGS.mp_scale_value)


def run(main, **defaults) -> None:
  """`app.run(main)` with this example's defaults for the shared flags.

  Values given on the command line win. JAX's start-up INFO lines are
  hidden unless `--verbosity` is given.
  """
  for name, value in defaults.items():
    FLAGS.set_default(name, value)

  def quiet_main(argv):
    if len(argv) > 1:
      raise app.UsageError(f"Unexpected arguments: {' '.join(argv[1:])}")
    if not FLAGS["verbosity"].present:
      logging.set_verbosity(logging.WARNING)
    main()

  app.run(quiet_main)
