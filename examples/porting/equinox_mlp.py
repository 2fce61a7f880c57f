# A float32 Equinox script -> bf16. Equinox has no method hook, so a layer
# gets its own policy through a named scope and a name pattern.
import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import mpolicy                                         # new

mpolicy.set_policy("head", "full")                     # new: the head in f32

class Net(eqx.Module):
  hidden: eqx.nn.MLP
  head: eqx.nn.Linear

  def __init__(self, key):
    k1, k2 = jax.random.split(key)
    self.hidden = eqx.nn.MLP(8, 32, 32, 1, key=k1)
    self.head = eqx.nn.Linear(32, 4, key=k2)

  def __call__(self, x):
    x = self.hidden(x)
    with jax.named_scope("head"):                      # new
      return self.head(x)

forward = mpolicy.amp(lambda model, x: jax.vmap(model)(x),   # was: no amp
                      "p=f32,c=bf16,o=f32")
opt = optax.adam(1e-2)

def loss_fn(model, x, y):
  logits = forward(model, x)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

@eqx.filter_jit
def train_step(model, opt_state, x, y):
  loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
  updates, opt_state = opt.update(grads, opt_state, model)
  return eqx.apply_updates(model, updates), opt_state, loss

x = jax.random.normal(jax.random.PRNGKey(1), [64, 8])
y = (x[:, 0] > 0).astype(jnp.int32) + 2 * (x[:, 1] > 0).astype(jnp.int32)
model = Net(jax.random.PRNGKey(0))
opt_state = opt.init(eqx.filter(model, eqx.is_inexact_array))
for _ in range(50):
  model, opt_state, loss = train_step(model, opt_state, x, y)
print(f"loss {float(loss):.3f}")
assert float(loss) < 0.5
