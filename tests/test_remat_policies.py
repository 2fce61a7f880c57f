"""Specification: remat policies save under amp what they save without it.

`jax.checkpoint_policies` decide per primitive what the backward pass
keeps. Under the op rules a matmul is ``amp_dot_general``; the policies
see it as the ``dot_general`` it stands for, so a GPT block under `amp`
or `transform_amp` keeps the same residuals as the block run in plain JAX
on bfloat16 inputs, measured with `jax.ad_checkpoint.print_saved_residuals`
(without the views, the dots policies kept no matmul output at all). With
``jax_remat3`` on, the same holds.
"""

from __future__ import annotations

import contextlib
import io
import re

import haiku as hk
import jax
from jax.ad_checkpoint import checkpoint_name, print_saved_residuals
import jax.numpy as jnp
import numpy as np
import pytest

import mpolicy

HALF = "p=f32,c=bf16,o=bf16"
T, D, H = 16, 32, 4
_BYTES = {"f32": 4, "bf16": 2}
CP = jax.checkpoint_policies
POLICIES = {
    "dots_saveable": CP.dots_saveable,
    "dots_with_no_batch_dims_saveable": CP.dots_with_no_batch_dims_saveable,
    "save_only_these_names": CP.save_only_these_names("query", "attn_out"),
    "save_anything_except_these_names":
        CP.save_anything_except_these_names("query"),
    "offload_dot_with_no_batch_dims":
        CP.offload_dot_with_no_batch_dims("device", "pinned_host"),
}
REMATS = ["classic"] + (["jax_remat3"] if "jax_remat3" in jax.config.values
                        else [])


@contextlib.contextmanager
def remat(which):
  flag = "jax_remat3"
  before = jax.config.values.get(flag)
  if before is not None:
    jax.config.update(flag, which == flag)
  try:
    yield
  finally:
    if before is not None:
      jax.config.update(flag, before)


def saved(fn, *args) -> list[tuple[str, str, str]]:
  """What the backward pass of ``fn`` keeps, arguments left out: one
  ``(dtype and shape, what, where)`` per residual, mpolicy's matmul named
  as the JAX primitive it stands for."""
  buf = io.StringIO()
  with contextlib.redirect_stdout(buf):
    print_saved_residuals(fn, *args)
  out = []
  for line in buf.getvalue().splitlines():
    m = re.match(r"\s*(\S+\[[\d,\s]*\])\s+(.*?) from (\S+)", line)
    if m and not m.group(2).startswith("the argument"):
      out.append((m.group(1), m.group(2).replace("amp_dot_general",
                                                 "dot_general"), m.group(3)))
  return sorted(out)


def nbytes(residuals) -> int:
  total = 0
  for typed, _, _ in residuals:
    dtype, dims = re.match(r"(\w+)(?:<\w+>)?\[([\d,\s]*)\]", typed).groups()
    total += _BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",")
                                          if d.strip()]))
  return total


# --- A GPT block in plain JAX ---------------------------------------------------


def block(p, x):
  q, k, v = jnp.split(x @ p["wqkv"], 3, -1)
  q = checkpoint_name(q, "query")
  q, k, v = (a.reshape(T, H, D // H).transpose(1, 0, 2) for a in (q, k, v))
  s = jnp.einsum("htd,hsd->hts", q, k) / 4.0
  a = jnp.einsum("hts,hsd->htd", jax.nn.softmax(s), v)
  x = x + checkpoint_name(a.transpose(1, 0, 2).reshape(T, D) @ p["wo"],
                          "attn_out")
  return x + jax.nn.gelu(x @ p["w1"]) @ p["w2"]


KEYS = jax.random.split(jax.random.PRNGKey(0), 5)
PARAMS = {name: jax.random.normal(k, shape) / 6 for name, k, shape in (
    ("wqkv", KEYS[0], (D, 3 * D)), ("wo", KEYS[1], (D, D)),
    ("w1", KEYS[2], (D, 4 * D)), ("w2", KEYS[3], (4 * D, D)))}
X = jax.random.normal(KEYS[4], (T, D))


def _bf16(tree):
  return jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), tree)


def _loss(policy):
  def loss(p, x):
    return jax.checkpoint(block, policy=policy)(p, x).astype(jnp.float32).sum()
  return loss


# What the block's backward keeps (bytes, arguments left out), as plain JAX
# keeps it on the bfloat16 block: the same on every JAX, except that JAX
# 0.10's remat3 keeps nothing under the offload and anything-but policies
# (its rules save only for its dots policies and names).
KEPT_BYTES = {
    "dots_saveable": 11264,  # The five matmul outputs.
    "dots_with_no_batch_dims_saveable": 8192,  # The three unbatched ones.
    "offload_dot_with_no_batch_dims": 8192,  # The same three, offloaded.
    "save_only_these_names": 2048,  # query and attn_out.
    "save_anything_except_these_names": 12288,  # Under remat3.
}
_JAX = tuple(int(p) for p in jax.__version__.split(".")[:2])


def _kept_bytes(name, which):
  if (which == "jax_remat3" and _JAX < (0, 11) and name in (
      "offload_dot_with_no_batch_dims", "save_anything_except_these_names")):
    return 0
  return KEPT_BYTES[name]


@pytest.mark.parametrize("which", REMATS)
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_amp_keeps_what_plain_jax_keeps(name, which):
  loss = _loss(POLICIES[name])
  with remat(which):
    # Plain JAX on bfloat16 parameters and inputs (as arguments: their
    # casts are no residuals), against amp on the float32 ones.
    plain = saved(loss, _bf16(PARAMS), _bf16(X))
    ours = saved(mpolicy.amp(loss, HALF), PARAMS, X)
    everything = saved(mpolicy.amp(lambda p, x: block(p, x).astype(
        jnp.float32).sum(), HALF), PARAMS, X)
  if name == "save_anything_except_these_names" and which == "classic":
    # JAX's policy saves every value: amp then keeps what it keeps without
    # a checkpoint (its own float32 statistics and all), recomputing nothing.
    assert ours == everything
    return
  assert ours == plain
  assert nbytes(ours) == _kept_bytes(name, which)
  if name.startswith("dots"):
    assert any("dot_general" in what for _, what, _ in ours)


# --- The same under transform_amp --------------------------------------------


class _Attention(hk.Module):

  def __call__(self, x):
    qkv = hk.Linear(3 * D, with_bias=False)(x)
    q, k, v = (a.reshape(T, H, D // H).transpose(1, 0, 2)
               for a in jnp.split(qkv, 3, -1))
    s = jnp.einsum("htd,hsd->hts", q, k) / 4.0
    a = jnp.einsum("hts,hsd->htd", jax.nn.softmax(s), v)
    return hk.Linear(D, with_bias=False)(a.transpose(1, 0, 2).reshape(T, D))


def _haiku_block(x):
  policy = CP.dots_with_no_batch_dims_saveable
  return hk.remat(lambda y: y + _Attention()(y), policy=policy)(x)


def test_transform_amp_keeps_what_haiku_keeps():
  mpolicy.set_policy(hk.Module, HALF)
  amp_model = mpolicy.transform_amp(_haiku_block)
  params = amp_model.init(jax.random.PRNGKey(1), X)
  plain = hk.transform(_haiku_block)
  ours = saved(lambda p, x: amp_model.apply(p, None, x).astype(
      jnp.float32).sum(), params, X)
  theirs = saved(lambda p, x: plain.apply(p, None, x).astype(
      jnp.float32).sum(), _bf16(params), _bf16(X))
  assert [(t, w) for t, w, _ in ours] == [(t, w) for t, w, _ in theirs]
  # The qkv projection's output (the block's last matmul is not needed).
  assert [(t, w) for t, w, _ in ours] == [("bf16[16,96]",
                                           "output of dot_general")]
