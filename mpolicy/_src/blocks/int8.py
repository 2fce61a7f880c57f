"""Int8 matmuls: symmetric dynamic quantization, exact int32 accumulation.

Each operand of a matmul is quantized along its contracting dimensions:
one scale per index of its other (free and batch) dimensions, so the
weight gets one per output channel and the activation one per row,

    s = amax * float32(1/127)   (1 where amax is 0)
    q = clip(round_half_even(x / s), -127, 127)   as int8,

computed in float32 from the operand as given. The int8 x int8 product is
summed exactly in int32 and rescaled, ``(float32(acc) * s_row) * s_col``,
``s_row`` the activation's scale and ``s_col`` the weight's. A row or
channel holding a non-finite value gets a NaN scale, so its outputs are
NaN, never a clipped number.

`dot_general` is differentiable: its backward pass is straight-through,
the gradients of the unquantized matmul, computed by a function the caller
gives (the rules give the bfloat16 matmul's).

>>> import jax.numpy as jnp
>>> q, s = quantize(jnp.array([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0]]), (1,))
>>> q.tolist(), s.ravel().tolist()
([[64, -127, 32], [0, 0, 0]], [0.015748031437397003, 1.0])
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Optional

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

NAME = "int8"
QMAX = 127
_INV_QMAX = np.float32(1 / QMAX)


def quantize(x, contracting: tuple[int, ...]):
  """``x`` as int8 and its float32 scales (module doc).

  Args:
    x: a floating array (read in float32).
    contracting: the axes summed over by the matmul; the amax runs over
      them.

  Returns:
    ``(q, s)``: ``q`` int8 of ``x``'s shape, ``s`` float32 with ``x``'s
    rank, size 1 along ``contracting`` (``x ~= q * s``); NaN where the
    values it scales hold a non-finite one.
  """
  x = x.astype(jnp.float32)
  amax = jnp.max(jnp.abs(x), axis=tuple(contracting), keepdims=True)
  s = jnp.where(amax == 0, np.float32(1), amax * _INV_QMAX)
  s = jnp.where(jnp.isfinite(amax), s, np.float32(np.nan))
  q = jnp.clip(jnp.round(x / s), -QMAX, QMAX).astype(jnp.int8)
  return q, s


def _free(ndim: int, contracting, batch) -> list[int]:
  return [d for d in range(ndim) if d not in contracting and d not in batch]


def _to_result(s, contracting, batch, before: int, after: int):
  """An operand's scales laid out along the result ``batch + free`` dims,
  with ``before``/``after`` size-1 axes for the other operand's free dims
  (before: the right operand's scales sit after the left's free dims)."""
  keep = [*batch, *_free(s.ndim, contracting, batch)]
  s = lax.transpose(s, [*keep, *contracting]).reshape(
      [s.shape[d] for d in keep])
  nb = len(batch)
  return s.reshape(s.shape[:nb] + (1,) * before + s.shape[nb:] + (1,) * after)


def matmul(lhs, rhs, dimension_numbers, out_dtype, *, weight: str = "rhs",
           lhs_given=None, rhs_given=None):
  """The int8 forward product of ``lhs`` and ``rhs`` (module doc).

  Args:
    lhs, rhs: the operands (floating); either may be ``None`` where its
      ``(q, s)`` is given.
    dimension_numbers: as for `jax.lax.dot_general`.
    out_dtype: the result's dtype.
    weight: ``"lhs"`` or ``"rhs"``: the operand whose scale is applied
      last (``s_col``).
    lhs_given, rhs_given: an operand's `quantize` result, used instead of
      quantizing it (a weight stored in int8).

  Returns:
    ``dot_general``'s result in ``out_dtype``.
  """
  (lc, rc), (lb, rb) = dimension_numbers
  ql, sl = quantize(lhs, lc) if lhs_given is None else lhs_given
  qr, sr = quantize(rhs, rc) if rhs_given is None else rhs_given
  acc = lax.dot_general(ql, qr, dimension_numbers,
                        preferred_element_type=jnp.int32)
  nlf = len(_free(ql.ndim, lc, lb))
  nrf = len(_free(qr.ndim, rc, rb))
  s_lhs = _to_result(sl, lc, lb, 0, nrf)
  s_rhs = _to_result(sr, rc, rb, nlf, 0)
  s_row, s_col = (s_rhs, s_lhs) if weight == "lhs" else (s_lhs, s_rhs)
  return ((acc.astype(jnp.float32) * s_row) * s_col).astype(out_dtype)


class Int8Config(NamedTuple):
  """What `dot_general` needs besides its operands (static)."""
  dimension_numbers: Any
  out_dtype: Any
  weight: str
  backward: Callable[..., Any]  # ``(lhs, rhs) -> result``: its vjp is used.


def _fwd(lhs, rhs, config: Int8Config):
  out = matmul(lhs, rhs, config.dimension_numbers, config.out_dtype,
               weight=config.weight)
  return out, (lhs, rhs)


def _bwd(config: Int8Config, residuals, g):
  _, vjp = jax.vjp(config.backward, *residuals)
  return vjp(g.astype(config.out_dtype))


_straight_through = jax.custom_vjp(
    lambda lhs, rhs, config: _fwd(lhs, rhs, config)[0], nondiff_argnums=(2,))
_straight_through.defvjp(_fwd, _bwd)


def dot_general(lhs, rhs, dimension_numbers, *, out_dtype=jnp.bfloat16,
                weight: str = "rhs",
                backward: Optional[Callable[..., Any]] = None):
  """`jax.lax.dot_general` in int8 (module doc), straight-through backward.

  >>> import jax, jax.numpy as jnp
  >>> x = jax.random.normal(jax.random.PRNGKey(0), (8, 64))
  >>> w = jax.random.normal(jax.random.PRNGKey(1), (64, 16))
  >>> y = dot_general(x, w, (((1,), (0,)), ((), ())))
  >>> y.dtype, bool(jnp.linalg.norm(y - x @ w) / jnp.linalg.norm(x @ w) < 0.02)
  (dtype(bfloat16), True)

  Args:
    lhs, rhs: floating operands (float32 parameters as they are).
    dimension_numbers: as for `jax.lax.dot_general`.
    out_dtype: the result's dtype.
    weight: the weight operand, ``"lhs"`` or ``"rhs"`` (see `matmul`).
    backward: ``(lhs, rhs) -> result`` whose gradients are the backward
      pass's; ``None``: the float32 product.
  """
  if weight not in ("lhs", "rhs"):
    raise ValueError(f"int8.dot_general(weight={weight!r}): must be 'lhs' "
                     "or 'rhs', the operand quantized per output channel")
  out_dtype = np.dtype(out_dtype)
  if backward is None:
    backward = functools.partial(_float32_dot, dimension_numbers, out_dtype)
  config = Int8Config(dimension_numbers, out_dtype, weight, backward)
  return _straight_through(lhs, rhs, config)


def _float32_dot(dimension_numbers, out_dtype, lhs, rhs):
  return lax.dot_general(lhs.astype(jnp.float32), rhs.astype(jnp.float32),
                         dimension_numbers,
                         preferred_element_type=jnp.float32).astype(out_dtype)
