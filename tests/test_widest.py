"""Where floating dtypes meet, "widest" means what JAX promotes to."""

import jax
import jax.numpy as jnp
import numpy as np

import mpolicy
from _helpers import walk_eqns


def test_bfloat16_meeting_float16_runs_in_float32_as_in_jax():
  f = lambda a, b: a + b
  a, b = jnp.ones(3, jnp.bfloat16), jnp.ones(3, jnp.float16)
  assert f(a, b).dtype == jnp.float32
  out = mpolicy.amp(f)(a, b)
  assert out.dtype == jnp.float32
  (add,) = [e for e in walk_eqns(jax.make_jaxpr(mpolicy.amp(f))(a, b))
            if e.primitive.name == "add"]
  assert [v.aval.dtype for v in add.invars] == [jnp.float32, jnp.float32]


def test_cond_branches_in_bfloat16_and_float16_meet_in_float32():
  """Branches governed by a bf16 and an f16 region: outputs meet in f32."""

  def branch(scope):
    def run(x, w):
      with jax.named_scope(scope):
        return x @ w
    return run

  def f(p, x, w):
    return jax.lax.cond(p, branch("to_bf16"), branch("to_f16"), x, w)

  x, w = jnp.ones((2, 3)), jnp.full((3, 2), 0.5)
  with mpolicy.push_policy("to_bf16", "p=f32,c=bf16,o=bf16"), \
       mpolicy.push_policy("to_f16", "p=f32,c=f16,o=f16"):
    g = mpolicy.amp(f)
    (cond,) = [e for e in walk_eqns(jax.make_jaxpr(g)(True, x, w))
               if e.primitive.name == "cond"]
    assert cond.outvars[0].aval.dtype == jnp.float32
    for p in (True, False):
      np.testing.assert_array_equal(g(jnp.bool_(p), x, w),
                                    np.full((2, 2), 1.5, np.float32))
