# A float32 Haiku script -> bf16: two changed lines, no loss scaling.
import haiku as hk
import jax
import jax.numpy as jnp
import optax
import mpolicy                                               # new

mpolicy.set_policy(hk.Module, "p=f32,c=bf16,o=f32")          # new

def forward(x):
  return hk.nets.MLP([32, 32, 4])(x)

model = mpolicy.transform_amp(forward)   # was: hk.transform(forward)
opt = optax.adam(1e-2)

def loss_fn(params, x, y):
  logits = model.apply(params, None, x)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

@jax.jit
def train_step(params, opt_state, x, y):
  loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
  updates, opt_state = opt.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss

x = jax.random.normal(jax.random.PRNGKey(1), [64, 8])
y = (x[:, 0] > 0).astype(jnp.int32) + 2 * (x[:, 1] > 0).astype(jnp.int32)
params = model.init(jax.random.PRNGKey(0), x)
opt_state = opt.init(params)
for _ in range(50):
  params, opt_state, loss = train_step(params, opt_state, x, y)
print(f"loss {float(loss):.3f}")
assert float(loss) < 0.5
assert {p.dtype for p in jax.tree_util.tree_leaves(params)} == {jnp.dtype("float32")}
