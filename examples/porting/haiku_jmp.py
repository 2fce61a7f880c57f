# Haiku + jmp -> mpolicy. Changed lines say what they were.
import haiku as hk
import jax
import jax.numpy as jnp
import optax
import mpolicy                  # new
import mpolicy as jmp           # was: import jmp

policy = jmp.get_policy("p=f32,c=bf16,o=f32")
mpolicy.set_policy(hk.Module, policy)        # was: hk.mixed_precision.set_policy(hk.nets.MLP, policy)
mpolicy.set_policy(hk.LayerNorm, "full")     # was: hk.mixed_precision.set_policy(hk.LayerNorm, ...)

def forward(x):
  x = hk.nets.MLP([32, 32])(x)
  return hk.Linear(4)(hk.LayerNorm(-1, True, True)(x))

model = mpolicy.transform_amp(forward)       # was: hk.transform(forward)
opt = optax.adam(1e-2)

def loss_fn(params, x, y):
  logits = model.apply(params, None, x)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

@jax.jit
def train_step(params, opt_state, loss_scale, x, y):
  loss, grads = jax.value_and_grad(
      lambda p: loss_scale.scale(loss_fn(p, x, y)))(params)
  grads = loss_scale.unscale(grads)
  finite = jmp.all_finite(grads)
  loss_scale = loss_scale.adjust(finite)
  updates, new_opt_state = opt.update(grads, opt_state, params)
  params, opt_state = jmp.select_tree(
      finite, (optax.apply_updates(params, updates), new_opt_state),
      (params, opt_state))
  return params, opt_state, loss_scale, loss_scale.unscale(loss)

x = jax.random.normal(jax.random.PRNGKey(1), [64, 8])
y = (x[:, 0] > 0).astype(jnp.int32) + 2 * (x[:, 1] > 0).astype(jnp.int32)
params = model.init(jax.random.PRNGKey(0), x)
opt_state = opt.init(params)
loss_scale = jmp.DynamicLossScale(jnp.float32(2 ** 15))
for _ in range(50):
  params, opt_state, loss_scale, loss = train_step(
      params, opt_state, loss_scale, x, y)
print(f"loss {float(loss):.3f}, loss scale {float(loss_scale.loss_scale)}")
assert float(loss) < 0.5
