"""The small Flax NNX model the NNX tests share: a Linear, a BatchNorm
(statistics to write) and a Dropout (an RNG count to advance)."""

import jax
import pytest

nnx = pytest.importorskip("flax.nnx")

POLICY = "p=f32,c=bf16,o=f32"


class Net(nnx.Module):

  def __init__(self, rngs):
    self.linear = nnx.Linear(3, 4, rngs=rngs)
    self.norm = nnx.BatchNorm(4, rngs=rngs)
    self.drop = nnx.Dropout(0.5, rngs=rngs)

  def __call__(self, x, train=True):
    h = self.norm(self.linear(x), use_running_average=not train)
    return self.drop(h, deterministic=not train)


def _x():
  return jax.random.normal(jax.random.PRNGKey(0), (16, 3)) + 5.
