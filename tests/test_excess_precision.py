"""A float32 loss over half logits reads one rounding, excess precision or not.

XLA keeps excess precision by default: inside a fusion it reads a bfloat16
value unrounded. A cross-entropy under `amp` reads the bfloat16 logits three
times (maximum, log-sum-exp, picked logit); if the log-sum-exp reads them
unrounded and the picked logit rounded, confident examples get a negative
loss. These tests run a small Haiku classifier with confident predictions
both ways: XLA's default, and ``--xla_allow_excess_precision=false`` (set in
a subprocess, since XLA reads its flags once).
"""

import json
import os
import pathlib
import subprocess
import sys

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mpolicy

HALF = "p=f32,c=bf16,o=f32"


def _forward(x):
  h = jax.nn.relu(hk.Linear(64)(x))
  return hk.Linear(10)(h)


def per_example_losses():
  """(amp losses, float32 losses) of a confident classifier, as lists."""
  net = hk.without_apply_rng(hk.transform(_forward))

  @jax.jit  # One program for the set-up, not one compile per eager op.
  def setup():
    x = jax.random.normal(jax.random.PRNGKey(1), (128, 32))
    params = net.init(jax.random.PRNGKey(0), x)
    # Large weights and non-zero biases: logits of tens, so one bfloat16 ulp
    # of a logit is far above the float32 loss of a confident example.
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(2), len(leaves))
    params = jax.tree.unflatten(tree, [
        10 * p + 0.4 * jax.random.normal(k, p.shape)
        for p, k in zip(leaves, keys)])
    return params, x, jnp.argmax(net.apply(params, x), -1)

  params, x, labels = setup()

  def losses(params, x, labels):
    logits = net.apply(params, x).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels)

  got = jax.jit(mpolicy.amp(losses, HALF))(params, x, labels)
  want = jax.jit(losses)(params, x, labels)
  return np.asarray(got).tolist(), np.asarray(want).tolist()


def _check(got, want):
  got, want = np.asarray(got), np.asarray(want)
  assert np.isfinite(got).all()
  negative = got[got < 0]
  assert negative.size == 0, f"{negative.size} negative losses: {negative[:5]}"
  # bfloat16 logits of tens are a few tenths apart: the losses follow.
  np.testing.assert_allclose(got, want, atol=0.5)
  assert abs(got.mean() - want.mean()) < 0.05


def test_cross_entropy_of_half_logits_is_never_negative():
  _check(*per_example_losses())


@pytest.mark.ci  # A subprocess with other XLA flags, 5 s on 2 cores.
def test_same_without_excess_precision():
  env = dict(os.environ, XLA_FLAGS=" ".join(
      [os.environ.get("XLA_FLAGS", ""), "--xla_allow_excess_precision=false"]))
  env["PYTHONPATH"] = os.pathsep.join(
      [str(pathlib.Path(mpolicy.__file__).parent.parent),
       env.get("PYTHONPATH", "")])
  code = ("import json, sys; sys.path.insert(0, sys.argv[1]); "
          "import test_excess_precision as t; "
          "print(json.dumps(t.per_example_losses()))")
  out = subprocess.run(
      [sys.executable, "-c", code, str(pathlib.Path(__file__).parent)],
      env=env, capture_output=True, text=True, timeout=120, check=True)
  got, want = json.loads(out.stdout.strip().splitlines()[-1])
  _check(got, want)


def _all_eqns(jaxpr):
  """The equations of ``jaxpr`` and of every jaxpr in their params."""
  for eqn in jaxpr.eqns:
    yield eqn
    for value in eqn.params.values():
      inner = getattr(value, "jaxpr", value)  # A ClosedJaxpr or a Jaxpr.
      if hasattr(inner, "eqns"):
        yield from _all_eqns(inner)


def test_every_up_cast_of_a_half_value_pins_its_rounding():
  f = mpolicy.amp(lambda h, w: jax.nn.log_softmax(jnp.exp(h @ w) + h @ w),
                  HALF)
  eqns = list(_all_eqns(
      jax.make_jaxpr(f)(jnp.ones((4, 8)), jnp.ones((8, 3))).jaxpr))
  up_casts = [e.outvars[0] for e in eqns
              if e.primitive.name == "convert_element_type"
              and e.invars[0].aval.dtype == jnp.bfloat16
              and e.outvars[0].aval.dtype == jnp.float32]
  pinned = {e.invars[0] for e in eqns if e.primitive.name == "reduce_precision"
            and e.params["mantissa_bits"] == 7}
  # exp's input (computed in float32, stored in bf16), log_softmax's input.
  assert len(up_casts) >= 2
  assert all(v in pinned for v in up_casts), (up_casts, pinned)
