"""How much of mpolicy a traced call touches, and how big its packages are.

Prints, for the mpolicy that `import mpolicy` finds (set PYTHONPATH to
compare two checkouts):

- code lines (all lines of the .py files) per package of `mpolicy/_src`:
  debugging, training, checkpoint, rules, blocks, and the total of `mpolicy/`;
- the distinct mpolicy files whose functions run while `jax.make_jaxpr`
  traces (1) the `apply` of a `transform_amp`'d 2-layer Haiku MLP and
  (2) one `make_train_step` step (adam, dynamic loss scale) on it. The
  first trace of each is counted, after a warm-up of an unrelated program,
  so that first-import work is not counted; `sys.setprofile` sees every
  Python call.

  PYTHONPATH=$PWD python benchmarks/trace_footprint.py
"""

import collections
import pathlib
import sys
import time

import haiku as hk
import jax
import jax.numpy as jnp
import optax

import mpolicy

ROOT = pathlib.Path(mpolicy.__file__).parent
PACKAGES = ("debugging", "training", "checkpoint", "rules", "blocks")


def lines_per_package() -> dict[str, int]:
  count = lambda files: sum(len(p.read_text().splitlines()) for p in files)
  out = {name: count((ROOT / "_src" / name).rglob("*.py"))
         for name in PACKAGES}
  out["total"] = count(ROOT.rglob("*.py"))
  return out


def files_touched(fn) -> tuple[list[str], float]:
  """The mpolicy files whose code runs in `fn()`, and its seconds."""
  seen = collections.Counter()
  root = str(ROOT)

  def profile(frame, event, arg):
    del arg
    if event == "call" and frame.f_code.co_filename.startswith(root):
      seen[frame.f_code.co_filename] += 1

  start = time.perf_counter()
  sys.setprofile(profile)
  try:
    fn()
  finally:
    sys.setprofile(None)
  seconds = time.perf_counter() - start
  return sorted(str(pathlib.Path(f).relative_to(ROOT.parent)) for f in seen), (
      seconds)


def main():
  def forward(x):
    return hk.nets.MLP([64, 10])(x)

  mpolicy.set_policy(hk.Module, "p=f32,c=bf16,o=f32")
  model = mpolicy.transform_amp(forward)
  x = jnp.ones((8, 32))
  params = model.init(jax.random.key(0), x)
  jax.make_jaxpr(mpolicy.amp(jnp.tanh))(x)  # Warm-up: imports, caches.

  def loss_fn(p, x):
    return jnp.mean(model.apply(p, None, x) ** 2)

  tx = optax.adam(1e-3)
  step = mpolicy.make_train_step(loss_fn, tx)
  scale = mpolicy.DynamicLossScale(2. ** 15)
  runs = {
      "module call": lambda: jax.make_jaxpr(model.apply)(params, None, x),
      "training step": lambda: jax.make_jaxpr(step)(params, tx.init(params),
                                                    scale, x),
  }
  print(f"mpolicy {ROOT}; jax {jax.__version__}; python "
        f"{sys.version.split()[0]}")
  print("lines:", lines_per_package())
  for name, run in runs.items():
    files, seconds = files_touched(run)
    print(f"{name}: {len(files)} mpolicy files, traced in {seconds:.2f} s "
          "(under the profiler)")
    print("  " + " ".join(files))


if __name__ == "__main__":
  main()
