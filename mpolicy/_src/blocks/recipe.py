"""The NVFP4 training recipe's randomness: keys and the Hadamard rotation.

Under ``c=mxfp4`` and ``c=nvfp4`` the backward matmuls round the gradient
operand stochastically and rotate the weight-gradient matmul's operands by
a random 16 x 16 Hadamard transform (`hadamard_rotate`). Their randomness
comes from one key per matmul, `op_key`: the rules' ``seed`` option folded
with the matmul's place in the program (its count among the block matmuls
of the interpreted program, sub-jaxprs included) and, where a step count is
given (``f.at_step(step)`` of an `amp` function; `make_train_step` passes
the optimizer's count), with it, so that a step is reproducible and steps
differ; inside a loop body (a `scan`, each microbatch of
`make_train_step`) with the iteration (`iteration`), so that iterations
differ too.

>>> import jax, jax.numpy as jnp
>>> x = jax.random.normal(jax.random.PRNGKey(0), (32, 3))
>>> y = hadamard_rotate(x, 0, jax.random.PRNGKey(1))
>>> g = jax.random.normal(jax.random.PRNGKey(2), (32, 5))
>>> z = hadamard_rotate(g, 0, jax.random.PRNGKey(1))
>>> bool(jnp.allclose(y.T @ z, x.T @ g, atol=1e-4))  # H^T H = I.
True
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator, Optional

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

HADAMARD_SIZE = 16

_ITERATIONS: contextvars.ContextVar = contextvars.ContextVar(
    "mpolicy_block_iterations", default=())


def _hadamard(n: int) -> np.ndarray:
  h = np.ones((1, 1), np.float32)
  while h.shape[0] < n:
    h = np.block([[h, h], [h, -h]])
  return h / np.float32(np.sqrt(n))


@contextlib.contextmanager
def iteration(index: Any) -> Iterator[None]:
  """Folds ``index`` (a loop body's traced iteration) into the keys of the
  block matmuls traced inside, after those of the loops around it."""
  token = _ITERATIONS.set((*_ITERATIONS.get(), index))
  try:
    yield
  finally:
    _ITERATIONS.reset(token)


def current_iterations() -> tuple:
  """The iterations `iteration` set, outermost first."""
  return _ITERATIONS.get()


def op_key(seed: int, place: int, step: Optional[Any] = None,
           iterations: tuple = ()) -> jax.Array:
  """``fold_in(fold_in(PRNGKey(seed), place), step)`` (no step: two folds
  only), then each of ``iterations`` folded in: a raw ``uint32[2]`` key.

  >>> bool(jnp.all(op_key(0, 1) == op_key(0, 1)))
  True
  >>> bool(jnp.all(op_key(0, 1, 5) == op_key(0, 1, 6)))
  False
  >>> bool(jnp.all(op_key(0, 1, None, (0,)) == op_key(0, 1, None, (1,))))
  False
  """
  key = jax.random.fold_in(jax.random.PRNGKey(seed), place)
  for fold in (() if step is None else (step,)) + tuple(iterations):
    key = jax.random.fold_in(key, jnp.asarray(fold, jnp.uint32))
  return key


def hadamard_signs(key: jax.Array) -> jax.Array:
  """The random signs (16, float32 +-1) of the rotation for ``key``."""
  return jnp.where(jax.random.bernoulli(key, 0.5, (HADAMARD_SIZE,)),
                   jnp.float32(1), jnp.float32(-1))


def hadamard_rotate(x: jax.Array, axis: int, key: jax.Array) -> jax.Array:
  """``x`` (float32) with each run of 16 along ``axis`` multiplied by
  ``H diag(s)``, ``H`` the orthonormal 16 x 16 Hadamard matrix and ``s``
  `hadamard_signs`; ``axis`` is zero-padded to a multiple of 16 (the
  result keeps the padded length: the rotation spreads each run over all
  16 places). The same key on both operands of a product over ``axis``
  leaves the product unchanged (up to float32 rounding)."""
  x = jnp.moveaxis(x.astype(jnp.float32), axis, -1)
  pad = -x.shape[-1] % HADAMARD_SIZE
  if pad:
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
  runs = x.reshape(*x.shape[:-1], -1, HADAMARD_SIZE) * hadamard_signs(key)
  h = jnp.asarray(_hadamard(HADAMARD_SIZE))
  out = lax.dot_general(runs, h, (((runs.ndim - 1,), (1,)), ((), ())),
                        precision=lax.Precision.HIGHEST,
                        preferred_element_type=jnp.float32)
  out = out.reshape(x.shape)
  return jnp.moveaxis(out, -1, axis)
