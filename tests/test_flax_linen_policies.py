"""Class and pattern policies for Flax linen modules under `amp`."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpolicy

nn = pytest.importorskip("flax.linen")

HALF = "p=f32,c=bf16,o=f32"


class Net(nn.Module):
  """Dense -> BatchNorm -> relu -> Dense(name="head")."""

  @nn.compact
  def __call__(self, x, train=True):
    x = nn.Dense(16)(x)
    x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
    return nn.Dense(3, name="head")(jax.nn.relu(x))


def _setup():
  model, x = Net(), jnp.linspace(-1, 1, 20, dtype=jnp.float32).reshape(4, 5)
  variables = model.init(jax.random.PRNGKey(0), x)
  fn = mpolicy.amp(lambda v, x: model.apply(v, x, mutable=["batch_stats"]))
  return fn, variables, x


def _dot_dtypes(fn, *args):
  """The dtype every matmul in ``fn``'s jaxpr multiplies in, in order.

  A plain ``dot_general`` multiplies in its operands' dtype; the op rules'
  ``amp_dot_general`` in its ``compute_dtype``.
  """
  jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
  found = []
  for e in jaxpr.eqns:
    if str(e.primitive) == "amp_dot_general":
      found.append(str(np.dtype(e.params["compute_dtype"])))
    elif str(e.primitive) == "dot_general":
      found.append("/".join(sorted({str(v.aval.dtype) for v in e.invars})))
  return found


def test_a_dense_class_policy_runs_its_matmul_and_output_in_half():
  fn, variables, x = _setup()
  assert _dot_dtypes(fn, variables, x) == ["float32"] * 2
  mpolicy.set_policy(nn.Dense, "p=f32,c=bf16,o=bf16")
  assert _dot_dtypes(fn, variables, x) == ["bfloat16"] * 2
  # o=bf16: the head's output is cast to bfloat16, and amp (given no
  # policy of its own) returns it as the function made it.
  out, _ = fn(variables, x)
  ref, _ = Net().apply(variables, x, mutable=["batch_stats"])
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(out, ref, atol=0.1)
  assert not np.array_equal(out, ref)  # ...but it did compute in bf16.


def test_batchnorm_full_changes_what_runs_and_explain_shows_it():
  fn, variables, x = _setup()
  mpolicy.set_policy(nn.Module, HALF)
  half_rows = [r for r in mpolicy.explain(fn, variables, x).rows
               if r.module_class == "nn.BatchNorm"]
  # Under the default half policy BatchNorm hands bf16 on (dtype=bf16).
  assert any(r.ran_in == "bfloat16" for r in half_rows)
  mpolicy.set_policy(nn.BatchNorm, "full")
  report = mpolicy.explain(fn, variables, x)
  full_rows = [r for r in report.rows if r.module_class == "nn.BatchNorm"]
  assert full_rows and all(r.ran_in == "float32" for r in full_rows)
  # The Dense layers around it still multiply in bf16.
  dense = [r for r in report.rows
           if r.module_class == "nn.Dense" and r.primitive.endswith("dot_general")]
  assert [r.ran_in for r in dense] == ["bfloat16", "bfloat16"]
  assert all("default nn.Module" in r.decided_by for r in dense)


def test_a_pattern_on_the_linen_path_outranks_the_class():
  fn, variables, x = _setup()
  mpolicy.set_policy(nn.Dense, HALF)
  mpolicy.set_policy("head", "full")
  assert _dot_dtypes(fn, variables, x) == ["bfloat16", "float32"]


def test_state_is_stored_in_the_param_dtype():

  class Stateful(nn.Module):

    @nn.compact
    def __call__(self, x):
      seen = self.variable("stats", "last", jnp.zeros, x.shape, jnp.float32)
      seen.value = x * 2  # x arrives in the compute dtype.
      return x

  model, x = Stateful(), jnp.ones([2, 3])
  variables = model.init(jax.random.PRNGKey(0), x)
  fn = mpolicy.amp(lambda v, x: model.apply(v, x, mutable=["stats"]))
  mpolicy.set_policy(Stateful, "p=f32,c=bf16,o=bf16")
  out, state = fn(variables, x)
  assert state["stats"]["last"].dtype == jnp.float32
  assert out.dtype == jnp.bfloat16
  # BatchNorm's statistics keep float32 under a half policy too.
  net_fn, net_vars, net_x = _setup()
  mpolicy.set_policy(nn.Module, HALF)
  _, stats = net_fn(net_vars, net_x)
  leaves = jax.tree_util.tree_leaves(stats)
  assert leaves and all(v.dtype == jnp.float32 for v in leaves)


def test_init_under_amp_creates_params_in_the_param_dtype():
  mpolicy.set_policy(nn.Dense, "p=bf16,c=bf16,o=f32")
  model = nn.Dense(4)
  params = mpolicy.amp(model.init)(jax.random.PRNGKey(0), jnp.ones([1, 3]))
  dtypes = {str(v.dtype) for v in jax.tree_util.tree_leaves(params)}
  assert dtypes == {"bfloat16"}


def test_fields_are_restored_and_non_float_dtype_fields_left_alone():
  seen = []

  class Probe(nn.Module):
    dtype: object = jnp.int32  # Not a floating dtype: not the policy's.

    @nn.compact
    def __call__(self, x):
      seen.append(self.dtype)
      return nn.Dense(2, dtype=jnp.float16)(x)

  model, x = Probe(), jnp.ones([1, 3])
  variables = model.init(jax.random.PRNGKey(0), x)
  mpolicy.set_policy(nn.Module, "p=f32,c=bf16,o=f32")
  dots = _dot_dtypes(mpolicy.amp(model.apply), variables, x)
  assert seen[-1] == jnp.int32
  # The policy's compute dtype replaces the Dense's own float16.
  assert dots == ["bfloat16"]
  assert model.dtype == jnp.int32


def test_full_precision_blocks_and_no_policy_leave_linen_alone():
  fn, variables, x = _setup()
  mpolicy.set_policy(nn.Module, HALF)

  def guarded(v, x):
    with mpolicy.full_precision():
      return Net().apply(v, x, mutable=["batch_stats"])

  assert _dot_dtypes(mpolicy.amp(guarded), variables, x) == ["float32"] * 2
  mpolicy.clear_policies()
  assert _dot_dtypes(fn, variables, x) == ["float32"] * 2
  out, _ = fn(variables, x)
  ref, _ = Net().apply(variables, x, mutable=["batch_stats"])
  assert out.dtype == jnp.float32
  np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)


def test_set_policy_rejects_other_classes_naming_what_it_takes():
  with pytest.raises(TypeError, match="Flax linen module class"):
    mpolicy.set_policy(dict, HALF)


def test_mpolicy_runs_without_flax_and_loads_no_bridge():
  # `sys.modules["flax"] = None` makes every `import flax` fail, as if
  # Flax were not installed (Haiku then puts in its own stand-in).
  code = (
      "import sys\n"
      "sys.modules['flax'] = None\n"
      "import jax.numpy as jnp, mpolicy\n"
      "mpolicy.amp(lambda x: x @ x, 'p=f32,c=bf16,o=f32')(jnp.ones((2, 2)))\n"
      "print('mpolicy._src.flax_bridge' in sys.modules)\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                       text=True, timeout=120, check=True)
  assert out.stdout.strip() == "False"


def test_an_nnx_layer_gets_its_policy_from_a_named_scope_pattern():
  # NNX has no method hook: the README's way is a named scope and a pattern.
  nnx = pytest.importorskip("flax.nnx")

  class Model(nnx.Module):

    def __init__(self, rngs):
      self.body = nnx.Linear(4, 8, rngs=rngs)
      self.head = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
      x = self.body(x)
      with jax.named_scope("head"):
        return self.head(x)

  graphdef, params = nnx.split(Model(nnx.Rngs(0)), nnx.Param)
  fn = mpolicy.amp(lambda p, x: nnx.merge(graphdef, p)(x), HALF)
  mpolicy.set_policy("head", "full")
  report = mpolicy.explain(fn, params, jnp.ones([3, 4]))
  assert [(r.scope, r.ran_in) for r in report.rows
          if r.primitive.endswith("dot_general")] == [("", "bfloat16"),
                                                      ("head", "float32")]


def test_explain_policy_names_the_linen_entry_and_default():
  mpolicy.set_policy(nn.Module, HALF)
  mpolicy.set_policy(nn.BatchNorm, "full")
  assert str(mpolicy.explain_policy(nn.BatchNorm)) == (
      "nn.BatchNorm: p=f32,c=f32,o=f32 from class nn.BatchNorm (rule 2: "
      "nearest class in the MRO).\n  also matched: nn.Module")
  dense = mpolicy.explain_policy("encoder/Dense_0", nn.Dense)
  assert (dense.rule, dense.key) == (4, nn.Module)
  assert str(dense.policy) == HALF
