"""The transformer language model of the examples and the benchmarks.

A pre-LayerNorm decoder: token and learned position embeddings, blocks of
causal multi-head self-attention and a GELU MLP (4x), a final LayerNorm and
the vocabulary logits. Plain Haiku, no flags and no mpolicy: the examples
and the benchmarks decide the policies.

The attention modules are named `attention`, so the registry pattern
`"*/attention"` reaches all of them.

>>> import haiku as hk, jax, jax.numpy as jnp
>>> config = ModelConfig(seq_len=8, d_model=16, num_heads=2, num_layers=1)
>>> model = hk.transform(make_forward(vocab_size=11, config=config))
>>> tokens = jnp.zeros((2, 8), jnp.int32)
>>> params = model.init(jax.random.PRNGKey(0), tokens)
>>> model.apply(params, None, tokens).shape
(2, 8, 11)
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import haiku as hk
import jax
import jax.numpy as jnp


class ModelConfig(NamedTuple):
  """Sizes of the model, and whether each block runs under `hk.remat`."""
  seq_len: int = 64      # length of the position-embedding table
  d_model: int = 64
  num_heads: int = 4
  num_layers: int = 2
  remat: bool = True


class SelfAttention(hk.Module):
  """Causal multi-head self-attention."""

  def __init__(self, num_heads: int, name: str = "attention"):
    super().__init__(name=name)
    self.num_heads = num_heads

  def __call__(self, x: jax.Array) -> jax.Array:
    batch, length, width = x.shape
    head = width // self.num_heads

    def heads(name):  # [batch, length, heads, head]
      return hk.Linear(width, name=name)(x).reshape(
          batch, length, self.num_heads, head)

    q, k, v = heads("query"), heads("key"), heads("value")
    logits = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(head)
    causal = jnp.tril(jnp.ones((length, length), bool))
    logits = jnp.where(causal, logits, jnp.finfo(logits.dtype).min)
    weights = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bhts,bshd->bthd", weights, v)
    return hk.Linear(width, name="output")(out.reshape(batch, length, width))


class Block(hk.Module):
  """Pre-LayerNorm transformer block: attention, then a GELU MLP."""

  def __init__(self, num_heads: int, name: Optional[str] = None):
    super().__init__(name=name)
    self.num_heads = num_heads

  def __call__(self, x: jax.Array) -> jax.Array:
    width = x.shape[-1]
    ln = lambda n: hk.LayerNorm(-1, create_scale=True, create_offset=True,
                                name=n)
    x = x + SelfAttention(self.num_heads, name="attention")(ln("ln_1")(x))
    h = hk.Linear(4 * width, name="mlp_in")(ln("ln_2")(x))
    return x + hk.Linear(width, name="mlp_out")(jax.nn.gelu(h))


class CharTransformer(hk.Module):
  """Embeddings, `num_layers` blocks (each under `hk.remat`), logits."""

  def __init__(self, vocab_size: int, config: ModelConfig,
               name: Optional[str] = "transformer"):
    super().__init__(name=name)
    self.vocab_size = vocab_size
    self.config = config

  def __call__(self, tokens: jax.Array) -> jax.Array:
    c = self.config
    init = hk.initializers.TruncatedNormal(0.02)
    x = hk.Embed(self.vocab_size, c.d_model, w_init=init, name="embed")(tokens)
    pos = hk.get_parameter("pos_embed", [c.seq_len, c.d_model], init=init)
    x = x + pos[:tokens.shape[1]].astype(x.dtype)
    for i in range(c.num_layers):
      block = Block(c.num_heads, name=f"block_{i}")
      x = hk.remat(block)(x) if c.remat else block(x)
    x = hk.LayerNorm(-1, create_scale=True, create_offset=True,
                     name="ln_final")(x)
    return hk.Linear(self.vocab_size, name="logits")(x)


def make_forward(vocab_size: int, config: ModelConfig):
  """The model as a function of tokens, for `hk.transform` or `transform_amp`."""
  return lambda tokens: CharTransformer(vocab_size, config)(tokens)
