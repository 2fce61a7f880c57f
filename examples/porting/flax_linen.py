# A float32 Flax linen script -> bf16: three changed lines.
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import mpolicy                                         # new

mpolicy.set_policy(nn.Module, "p=f32,c=bf16,o=f32")    # new: every module
mpolicy.set_policy(nn.BatchNorm, "full")               # new: BatchNorm in f32

class Net(nn.Module):
  @nn.compact
  def __call__(self, x, train):
    x = nn.Dense(32)(x)
    x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
    return nn.Dense(4)(nn.relu(x))

model = Net()
apply = mpolicy.amp(model.apply)                       # was: apply = model.apply
opt = optax.adam(1e-2)

def loss_fn(params, batch_stats, x, y):
  logits, updates = apply({"params": params, "batch_stats": batch_stats},
                          x, True, mutable=["batch_stats"])
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
  return loss, updates["batch_stats"]

@jax.jit
def train_step(params, batch_stats, opt_state, x, y):
  (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(
      params, batch_stats, x, y)
  updates, opt_state = opt.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), batch_stats, opt_state, loss

x = jax.random.normal(jax.random.PRNGKey(1), [64, 8])
y = (x[:, 0] > 0).astype(jnp.int32) + 2 * (x[:, 1] > 0).astype(jnp.int32)
variables = model.init(jax.random.PRNGKey(0), x, False)
params, batch_stats = variables["params"], variables["batch_stats"]
opt_state = opt.init(params)
for _ in range(50):
  params, batch_stats, opt_state, loss = train_step(
      params, batch_stats, opt_state, x, y)
print(f"loss {float(loss):.3f}")
assert float(loss) < 0.5
assert {v.dtype for v in jax.tree_util.tree_leaves(batch_stats)} == {jnp.dtype("float32")}
