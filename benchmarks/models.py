"""The models the benchmarks train: one definition of each.

  MLP              a ReLU `hk.nets.MLP` under one top-level module (both
                   presets of `bench_training.py`);
  CharTransformer  the examples' transformer LM (`examples/transformer_lm.py`),
                   with its `ModelConfig` (`bench_char_transformer.py`);
  GPT              the same transformer, sized by GPT-style arguments, without
                   `hk.remat`, its position table as long as its input
                   (`bench_training.py`'s transformer and `--preset=gpu` GPT).

The examples' module is loaded by its path: the repository root is not a
package, and dm-haiku installs a top-level `examples` package that would
shadow the repository's `examples/` directory. Import this module with
`benchmarks/` on `sys.path` (as the benchmark scripts do), from any working
directory.

>>> import haiku as hk, jax, jax.numpy as jnp
>>> f = hk.transform(lambda t: GPT(vocab=32, d_model=16, heads=2, layers=1)(t))
>>> tokens = jnp.zeros((2, 12), jnp.int32)
>>> params = f.init(jax.random.PRNGKey(0), tokens)
>>> params["gpt"]["pos_embed"].shape
(12, 16)
>>> params["gpt/block_0/attention/query"]["w"].shape
(16, 16)
>>> f.apply(params, None, tokens).shape
(2, 12, 32)
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType
from typing import Optional, Sequence

import haiku as hk

EXAMPLES = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def load_example(name: str) -> ModuleType:
  """Imports `examples/<name>.py` by path, once per process."""
  key = f"mpolicy_examples_{name}"
  if key not in sys.modules:
    path = os.path.join(EXAMPLES, f"{name}.py")
    if not os.path.isfile(path):
      raise ImportError(f"no {path}: the benchmarks import their models from "
                        "the repository's examples/ directory")
    spec = importlib.util.spec_from_file_location(key, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    spec.loader.exec_module(module)
  return sys.modules[key]


_transformer_lm = load_example("transformer_lm")
CharTransformer = _transformer_lm.CharTransformer
ModelConfig = _transformer_lm.ModelConfig


class MLP(hk.Module):
  """ReLU MLP: the `hidden` layers, then `classes` logits."""

  def __init__(self, hidden: Sequence[int], classes: int,
               name: Optional[str] = None):
    super().__init__(name=name)
    self.sizes = list(hidden) + [classes]

  def __call__(self, x):
    return hk.nets.MLP(self.sizes, name="mlp")(x)


class GPT(CharTransformer):
  """`CharTransformer` with GPT-style arguments and no `hk.remat`.

  Its position table has `max_len` rows, or as many as the tokens it is
  first called on have positions when `max_len` is None.
  """

  def __init__(self, vocab: int, d_model: int, heads: int, layers: int,
               name: Optional[str] = None, *, max_len: Optional[int] = None,
               remat: bool = False):
    super().__init__(vocab, ModelConfig(max_len or 0, d_model, heads, layers,
                                        remat), name=name)
    self._fixed_len = max_len is not None

  def __call__(self, tokens):
    if not self._fixed_len:
      self.config = self.config._replace(seq_len=tokens.shape[-1])
    return super().__call__(tokens)
