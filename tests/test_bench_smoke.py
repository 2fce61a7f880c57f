"""Smoke tests of the benchmarks: the GPU preset at its smallest sizes on CPU,
the char-transformer benchmark, and the HLO kernel counter they share."""

import importlib.util
import json
import os
import re
import subprocess
import sys

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mpolicy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")


def _load(name):
  """Imports benchmarks/<name>.py (benchmarks/ is not a package)."""
  key = f"_bench_{name}"
  if key not in sys.modules:
    spec = importlib.util.spec_from_file_location(
        key, os.path.join(BENCH, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module  # dataclasses look their module up here.
    spec.loader.exec_module(module)
  return sys.modules[key]


def _run(script, *args, timeout=600):
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep +
             os.environ.get("PYTHONPATH", ""), JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, os.path.join(BENCH, script), *args],
                        capture_output=True, text=True, env=env,
                        timeout=timeout, cwd=ROOT)


# An optimized XLA:GPU module as `compiled.as_text()` prints it: a cuBLAS
# gemm with its scratch buffer, a cuBLASLt fp8 matmul, a Triton gemm fusion
# and a cuDNN convolution.
GPU_HLO = """\
%gemm_fusion_dot.1_computation (p0: bf16[8,16], p1: bf16[16,4]) -> f32[8,4] {
  %p0 = bf16[8,16]{1,0} parameter(0)
  %p1 = bf16[16,4]{1,0} parameter(1)
  ROOT %dot.3 = f32[8,4]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main.9 (a: bf16[128,64], b: bf16[64,256], c: bf16[8,16], d: bf16[16,4], x: f8e4m3fn[16,32], y: f8e5m2[16,32], im: bf16[2,8,8,4], k: bf16[3,3,4,4]) -> bf16[128,256] {
  %a = bf16[128,64]{1,0} parameter(0)
  %b = bf16[64,256]{1,0} parameter(1)
  %c = bf16[8,16]{1,0} parameter(2)
  %d = bf16[16,4]{1,0} parameter(3)
  %x = f8e4m3fn[16,32]{1,0} parameter(4)
  %y = f8e5m2[16,32]{1,0} parameter(5)
  %im = bf16[2,8,8,4]{3,2,1,0} parameter(6)
  %k = bf16[3,3,4,4]{3,2,1,0} parameter(7)
  %s = f32[] constant(1)
  %cublas-gemm.1 = (bf16[128,256]{1,0}, s8[4194304]{0}) custom-call(%a, %b), custom_call_target="__cublas$gemm", backend_config={"operation_queue_id":"0","gemm_backend_config":{"alpha_real":1}}
  %cublas-gemm.2 = (f32[16,16]{1,0}, s8[33554432]{0}) custom-call(%x, %y, %s, %s), custom_call_target="__cublas$lt$matmul$f8"
  %gemm_fusion_dot.1 = f32[8,4]{1,0} fusion(%c, %d), kind=kCustom, calls=%gemm_fusion_dot.1_computation, backend_config={"operation_queue_id":"0","fusion_backend_config":{"kind":"__triton_gemm"}}
  %cudnn-conv.1 = (bf16[2,8,8,4]{3,2,1,0}, u8[0]{0}) custom-call(%im, %k), window={size=3x3 pad=1_1x1_1}, dim_labels=b01f_01io->b01f, custom_call_target="__cudnn$convForward"
  %cvt = f32[128,64]{1,0} convert(%a)
  ROOT %gte = bf16[128,256]{1,0} get-tuple-element(%cublas-gemm.1), index=0
}
"""


def test_hlo_stats_reads_gpu_library_calls_and_fusions():
  hlo = _load("hlo_kernels")
  stats = hlo.hlo_stats(GPU_HLO)
  assert dict(stats.kernels) == {
      "__cublas$gemm(bf16,bf16)->bf16": 1,
      "__cublas$lt$matmul$f8(f8e4m3fn,f8e5m2)->f32": 1,
      "dot[__triton_gemm](bf16,bf16)->f32": 1,
      "__cudnn$convForward(bf16,bf16)->bf16": 1,
  }
  assert dict(stats.kernel_dtypes()) == {
      "(bf16,bf16)->bf16": 2, "(f8e4m3fn,f8e5m2)->f32": 1,
      "(bf16,bf16)->f32": 1}
  assert stats.custom_calls == 3 and stats.fusions == 1
  assert dict(stats.convert_pairs) == {"bf16->f32": 1}
  json.dumps(stats.to_dict())  # Plain data for --json.


# An optimized XLA:CPU module: a cast-only fusion, a reduce whose reducer
# body converts, a dot with JAX's op_name metadata and a convert without.
CPU_HLO = """\
%fused_cast (p0: f32[4,8]) -> bf16[8,4] {
  %p0 = f32[4,8]{1,0} parameter(0)
  %t = f32[8,4]{1,0} transpose(%p0), dimensions={1,0}
  ROOT %c = bf16[8,4]{1,0} convert(%t), metadata={op_name="jit(step)/jvp(model)/mlp/linear_0/convert_element_type"}
}

%add_bf16 (a: bf16[], b: bf16[]) -> bf16[] {
  %a = bf16[] parameter(0)
  %b = bf16[] parameter(1)
  %a32 = f32[] convert(%a)
  %b32 = f32[] convert(%b)
  %s = f32[] add(%a32, %b32)
  ROOT %r = bf16[] convert(%s)
}

ENTRY %main (x: f32[4,8], w: bf16[4,4]) -> bf16[] {
  %x = f32[4,8]{1,0} parameter(0)
  %w = bf16[4,4]{1,0} parameter(1)
  %f = bf16[8,4]{1,0} fusion(%x), kind=kLoop, calls=%fused_cast
  %d = bf16[8,4]{1,0} dot(%f, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/transpose(jvp(model))/mlp/linear_0/dot_general"}
  %z = bf16[] constant(0)
  ROOT %sum = bf16[] reduce(%d, %z), dimensions={0,1}, to_apply=%add_bf16
}
"""


def test_hlo_stats_sources_reducers_and_cast_only_fusions():
  hlo = _load("hlo_kernels")
  stats = hlo.hlo_stats(CPU_HLO)
  assert stats.cast_only_fusions == 1
  assert stats.converts == 4 and stats.converts_in_reducers == 3
  assert dict(stats.convert_pairs) == {"f32->bf16": 2, "bf16->f32": 2}
  assert stats.convert_sources == {
      "mlp/linear_0/convert_element_type": 1, hlo.NO_OP_NAME: 3}
  assert dict(stats.kernels) == {"dot(bf16,bf16)->bf16": 1}
  assert dict(stats.kernel_sources) == {
      "bf16,bf16->bf16 mlp/linear_0/dot_general": 1}
  # Compute ops by result dtype: two converts, the dot and the reduce.
  assert stats.ops_by_dtype["bf16"] == 4 and stats.ops_by_dtype["f32"] == 4
  assert hlo.short_source("jit(step)/jvp(model)/a/b/c/d") == "b/c/d"


def test_benchmark_files_are_small_and_define_no_models_of_their_own():
  files = sorted(f for f in os.listdir(BENCH) if f.endswith(".py"))
  lines = {f: len(open(os.path.join(BENCH, f)).read().splitlines())
           for f in files}
  assert max(lines.values()) <= 600, lines
  for name in files:
    text = open(os.path.join(BENCH, name)).read()
    if name != "models.py":
      assert not re.search(r"^class \w+\(hk\.Module\)", text, re.M), name
    if name != "hlo_kernels.py":  # The one HLO reader: no regexes elsewhere.
      assert not re.search(r"^import re$", text, re.M), name
  models = _load("models")
  example = models.load_example("transformer_lm")
  assert models.CharTransformer is example.CharTransformer
  assert issubclass(models.GPT, example.CharTransformer)
  bench = _load("bench_training")
  # The GPU preset's GPT under its old name and arguments.
  f = hk.transform(lambda t: bench.GpuGPT(64, 16, 2, 1, name="model")(t))
  params = jax.eval_shape(f.init, jax.random.PRNGKey(0),
                          jnp.zeros((2, 24), jnp.int32))
  assert params["model"]["pos_embed"].shape == (24, 16)
  assert params["model/logits"]["w"].shape == (16, 64)


def test_benchmarks_import_their_models_from_any_directory(tmp_path):
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  for script in ("bench_training.py", "bench_char_transformer.py"):
    proc = subprocess.run([sys.executable, os.path.join(BENCH, script),
                           "--help"], capture_output=True, text=True,
                          env=env, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage:" in proc.stdout


def test_hlo_stats_on_a_compiled_cpu_module():
  hlo = _load("hlo_kernels")

  def f(x, w):
    y = jnp.dot(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16),
                preferred_element_type=jnp.float32)
    return jnp.tanh(y) @ w

  compiled = jax.jit(f).lower(jnp.ones((4, 8)), jnp.ones((8, 8))).compile()
  stats = hlo.hlo_stats(compiled.as_text())
  assert stats.kernel_dtypes() == {"(bf16,bf16)->f32": 1, "(f32,f32)->f32": 1}
  assert stats.convert_pairs["f32->bf16"] == 2
  assert stats.while_loops == 0
  # XLA:CPU reports its scratch memory (the bf16 and f32 intermediates),
  # on every JAX end; an object without a memory analysis gives None.
  temp = hlo.temp_bytes(compiled)
  assert isinstance(temp, int) and temp >= 4 * 8 * (4 + 2), temp
  assert hlo.temp_bytes(object()) is None


def test_gpu_preset_rejects_bad_flags_by_name():
  bench = _load("bench_training")
  for argv, words in [(["--scale=0"], "--scale must be a positive integer"),
                      (["--variants=f32,bogus"], "unknown variant 'bogus'"),
                      (["--models=vgg"], "unknown model 'vgg'")]:
    with pytest.raises(SystemExit) as e:
      bench.main(["--preset=gpu"] + argv)
    assert e.value.code == 2, argv
  proc = _run("bench_training.py", "--preset=gpu", "--variants=bogus")
  assert proc.returncode == 2
  assert "unknown variant 'bogus'" in proc.stderr
  assert "fp8" in proc.stderr  # The message lists the valid variants.


@pytest.mark.slow
def test_gpu_preset_smallest_scale_runs_every_variant(tmp_path):
  out = tmp_path / "gpu.json"
  proc = _run("bench_training.py", "--preset=gpu", "--models=mlp",
              "--scale=512", "--steps=1", "--warmup=0", "--fp8",
              f"--json={out}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  data = json.loads(out.read_text())
  assert data["header"]["platform"] == "cpu" and "flags" in data["header"]["cpu"]
  variants = data["models"]["mlp"]["variants"]
  try:
    mpolicy.get_policy("p=f32,c=f8,o=bf16")
    fp8 = True
  except ValueError:
    fp8 = False
  expected = ["f32", "jmp", "mpolicy", "amp", "f16_jmp", "f16_mpolicy"]
  assert list(variants) == expected + (["fp8"] if fp8 else [])
  if not fp8:
    assert any("fp8 variant skipped" in n for n in data["notes"])
    assert "fp8 variant skipped" in proc.stdout
  for key, r in variants.items():
    assert r["status"] == "ok", (key, r["status"])
    assert len(r["step_ms"]) == 1 and r["median_step_ms"] > 0
    assert isinstance(r["temp_bytes"], int) and r["temp_bytes"] > 0, key
    assert r["final_loss"] > 0
  dtypes = {k: set(r["hlo"]["kernel_dtypes"]) for k, r in variants.items()}
  # 4 layers: 4 forward matmuls, 3 input gradients, 4 weight gradients.
  for key in variants:
    assert sum(variants[key]["hlo"]["kernel_dtypes"].values()) == 11, key
  assert dtypes["f32"] == {"(f32,f32)->f32"}
  assert variants["f32"]["hlo"]["convert_pairs"].get("f32->bf16", 0) == 0
  for key in ("jmp", "mpolicy", "amp"):
    assert variants[key]["hlo"]["convert_pairs"]["f32->bf16"] > 0, key
  for key in ("mpolicy", "amp"):
    # 7 of the 11 matmuls multiply bf16 by bf16 into float32, on both JAX
    # ends (the hand-written jmp's bf16 dots XLA:CPU 0.10 runs in float32:
    # only its casts are certain).
    assert variants[key]["hlo"]["kernel_dtypes"] == {
        "(bf16,bf16)->f32": 7, "(f32,f32)->f32": 4}, key
  for key in ("f16_jmp", "f16_mpolicy"):
    assert variants[key]["final_loss_scale"] in (2.0**15, 2.0**14)
    assert variants[key]["hlo"]["convert_pairs"]["f32->f16"] > 0
  assert variants["f32"]["final_loss_scale"] is None
  assert "| Haiku + jmp bf16 (hand-written) |" in proc.stdout


@pytest.mark.slow
def test_gpu_preset_all_models_at_small_scale(tmp_path):
  out = tmp_path / "gpu.json"
  proc = _run("bench_training.py", "--preset=gpu", "--scale=64",
              "--steps=1", "--warmup=0", f"--json={out}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  data = json.loads(out.read_text())
  assert list(data["models"]) == ["mlp", "gpt", "resnet50"]
  for name, m in data["models"].items():
    for key, r in m["variants"].items():
      assert r["status"] == "ok", (name, key, r["status"])
  resnet = data["models"]["resnet50"]["variants"]
  assert any(k.startswith("convolution") for k in resnet["f32"]["hlo"]["kernels"])


@pytest.mark.slow
def test_char_transformer_benchmark_smoke(tmp_path):
  out = tmp_path / "char.json"
  proc = _run("bench_char_transformer.py", "--scale=16", "--steps=3",
              "--device_steps=1", "--runs=f16_static_skip,bf16",
              "--hlo_stats", f"--json={out}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  results = {r["run"]: r for r in json.loads(out.read_text())["results"]}
  assert list(results) == ["f16_static_skip", "bf16"]
  for r in results.values():
    assert r["status"] == "ok"
    assert r["loop_steps_per_s"] > 0 and r["device_steps_per_s"] > 0
    assert len(r["losses"]) == 3
  assert results["f16_static_skip"]["final_loss_scale"] == 1024.0
  assert results["f16_static_skip"]["hlo"]["convert_pairs"]["f32->f16"] > 0
  assert results["bf16"]["hlo"]["convert_pairs"]["f32->bf16"] > 0
  assert "| f16_static_skip |" in proc.stdout


@pytest.mark.slow
def test_trace_benchmark_reports_every_column_and_ratios_to_jmp():
  proc = _run("bench_trace.py", "--layers=1,2", "--repeats=1", "--d_model=32",
              "--heads=2", "--seq=8", "--batch=2", "--vocab=64",
              "--variants=jmp,transform_amp,amp(apply)")
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = proc.stdout
  assert "### 1 layers" in out and "### 2 layers" in out, out
  rows = [line.split("|")[1:-1] for line in out.splitlines()
          if line.startswith("| jmp |") or line.startswith("| transform_amp |")
          or line.startswith("| amp(apply) |")]
  table_rows = [r for r in rows if len(r) == 11]  # the per-depth tables
  assert len(table_rows) == 6, out
  for row in table_rows:
    trace_cpu, lower_cpu = float(row[1]), float(row[2])
    assert trace_cpu > 0 and lower_cpu > 0, row
    eqns, binds, hlo = (int(row[i]) for i in (7, 8, 9))
    assert eqns > 0 and binds >= eqns and hlo > 0, row
  jmp_rows = [r for r in table_rows if r[0].strip() == "jmp"]
  # CPU and wall ratios to jmp, taken within each repeat.
  assert all(r[3].strip() == r[4].strip() == "1.00" for r in jmp_rows), jmp_rows
  assert "eager calls" in out and "per added layer" in out, out
  assert "loadavg at the end" in out, out


@pytest.mark.ci  # 8 simulated devices in a subprocess: 10 s on 2 cores.
def test_collectives_benchmark_prints_both_sums_and_their_ratio():
  proc = _run("bench_collectives.py", "--reps", "1", "--calls", "1",
              "--batch", "16", "--features", "64", "--out", "32")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "8 simulated devices" in proc.stdout and "jax " in proc.stdout
  assert re.search(r"\| bf16 sum \| [0-9.]+ ms", proc.stdout)
  assert re.search(r"\| f32 sum \| [0-9.]+ ms", proc.stdout)
  assert re.search(r"\| f32 / bf16 \| [0-9.]+x", proc.stdout)


def _table(out: str, title: str) -> list[list[str]]:
  """The body rows of the markdown table under the ``### title`` line."""
  lines = out.split(f"### {title}", 1)[1].splitlines()
  end = next((i for i, l in enumerate(lines[1:]) if l.startswith("###")),
             len(lines))
  rows = [l for l in lines[1:end + 1] if l.startswith("|")]
  return [[c.strip() for c in r.strip("|").split("|")] for r in rows[2:]]


def _ratio(cell: str) -> float:
  """``0.27x (0.25-0.31)`` or ``0.284x`` -> the leading ratio."""
  value = float(cell.split("x", 1)[0])
  assert 0 < value < float("inf"), cell
  return value


@pytest.mark.slow  # Trains six tiny models and exports three: ~2 min on 2 cores.
def test_int8_benchmark_prints_every_table_with_positive_ratios():
  proc = _run("bench_int8.py", "--seeds=0", "--digits_steps=5",
              "--char_steps=2", "--d_model=16", "--seq_len=16", "--hidden=16",
              "--mlp=32", "--mlp_batch=8", "--repeats=2", "--calls=1",
              "--matmul_n=32")
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = proc.stdout
  assert out.startswith("jax ") and "CPU " in out and "load average" in out
  fidelity = _table(out, "Fidelity")
  assert [r[:2] for r in fidelity] == [
      [m, v] for m in ("digits CNN", "char transformer")
      for v in ("float32", "bf16", "int8 QAT", "PTQ (float32 → int8)")]
  for model, _, metric, mean, *_ in fidelity:
    low, high = (0, 1) if metric == "test accuracy" else (0, 10)
    assert low <= float(mean) <= high, (model, mean)
  sizes = _table(out, "Serving artifact bytes")
  assert [r[0].split(" (")[0] for r in sizes] == [
      "digits CNN", "char transformer", "MLP 784-32-10"]
  for row in sizes:
    f32_params, int8_params = (int(row[i].replace(",", "")) for i in (2, 4))
    assert 0 < int8_params < f32_params, row
    assert _ratio(row[5]) > 0 and row[6] in ("met", "missed")
  serve = _table(out, "Serving CPU time per batch")
  assert len(serve) == 4 and serve[-1][0] == "raw matmul 32^3 (reference)"
  for row in serve:
    _ratio(row[3])
    assert "(s8,s8)->s32" in row[5], row  # Every int8 program has int8 dots.
  steps = _table(out, "Training step CPU time")
  assert [r[0] for r in steps] == ["char transformer", "MLP"]
  assert all(_ratio(r[3]) and r[4] in ("met", "missed") for r in steps)


def test_int8_benchmark_rejects_unknown_parts_by_name():
  proc = _run("bench_int8.py", "--parts=bytes,speed", timeout=120)
  assert proc.returncode != 0
  assert "--parts must be a comma-separated subset of" in proc.stderr


def test_fidelity_counts_matmul_flops_of_dots_and_convolutions():
  fidelity = _load("fidelity")

  def f(x, w, k):
    y = jax.lax.conv_general_dilated(x, k, (1, 1), "SAME",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return jnp.sum(jax.jit(jnp.dot)(y.reshape(2, -1), w))

  x, k = jnp.ones((2, 4, 4, 3)), jnp.ones((3, 3, 3, 5))
  w = jnp.ones((80, 7))
  # conv: 2 * (2*4*4*5 outputs) * (3*3*3 taps); dot (in a jit): 2 * 2*80 * 7.
  assert fidelity.matmul_flops(jax.make_jaxpr(f)(x, w, k).jaxpr) == [
      2 * 160 * 27, 2 * 160 * 7]
  amped = mpolicy.amp(f, "p=f32,c=bf16,o=f32")
  shares = fidelity.flop_shares(
      "bf16", lambda p, s, x: amped(x, *p), lambda p, s, x: f(x, *p),
      (w, k), (w, k), {}, x)
  assert shares == (1.0, 1.0)
  # Under mxfp8 the convolution stays in bfloat16: low, not the format.
  amped = mpolicy.amp(f, "p=f32,c=mxfp8,o=f32",
                      rules=mpolicy.DEFAULT_RULES.with_fp8(min_size=0))
  low, own = fidelity.flop_shares(
      "mxfp8", lambda p, s, x: amped(x, *p), lambda p, s, x: f(x, *p),
      (w, k), (w, k), {}, x)
  assert low == 1.0 and own == pytest.approx(7 / 34)


def test_fidelity_script_runs_and_writes_its_csv_table_and_plot(tmp_path):
  out, png = tmp_path / "runs.csv", tmp_path / "runs.png"
  proc = _run("fidelity.py", "--models=co2_mlp", "--formats=f32,bf16",
              "--seeds=0,1", "--steps=3", f"--csv={out}", f"--plot={png}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = out.read_text().splitlines()
  assert lines[0] == "model,format,seed,steps,metric,value"
  cells = [l for l in proc.stdout.splitlines() if l.startswith("CELL ")]
  assert len(cells) == len(lines) - 1 == 2 * 2 * 5, proc.stdout
  assert "CELL co2_mlp bf16 1 low_flops=100" in proc.stdout
  assert "CELL co2_mlp f32 0 low_flops=0" in proc.stdout
  assert re.search(r"\| co2_mlp \| bf16 \| test_mse \| [0-9.]+ \| [0-9.]+ \| "
                   r"[-+][0-9.]+ \| (yes|no) \| 100\.0 \| 100\.0 \| 0 \| 2 \|", proc.stdout)
  assert png.read_bytes()[:4] == b"\x89PNG"
  again = _run("fidelity.py", f"--from_csv={out}")
  assert again.returncode == 0, again.stderr[-3000:]
  assert "| co2_mlp | bf16 | test_mse |" in again.stdout
  assert "co2_mlp: mxfp8" not in again.stdout  # No mxfp8 run to compare.


@pytest.mark.slow  # Every format on the CO2 MLP: 40 s of CPU (benchmark smoke).
def test_fidelity_script_runs_every_format_this_mpolicy_has(tmp_path):
  fidelity = _load("fidelity")
  png = tmp_path / "all.png"
  proc = _run("fidelity.py", "--models=co2_mlp", "--seeds=0", "--steps=2",
              f"--plot={png}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  formats = fidelity.available()
  assert {"f32", "f16", "mxfp8", "nvfp4", "adam8"} <= set(formats)
  for fmt in formats:
    assert f"| co2_mlp | {fmt} | test_mse | " in proc.stdout, fmt
  assert re.search(r"CELL co2_mlp f16 0 islands=\d", proc.stdout)
  assert png.read_bytes()[:4] == b"\x89PNG"


def test_fidelity_script_rejects_bad_flags_and_a_missing_int8(capsys):
  fidelity = _load("fidelity")
  for argv, words in [(["--models=vgg"], "--models must be a comma-separated"),
                      (["--formats=f32,fp4"], "--formats must be"),
                      (["--steps=0"], "--steps must be at least 1")]:
    assert fidelity.main(["fidelity.py"] + argv) == 2, argv
    assert words in capsys.readouterr().err, argv
  try:
    mpolicy.get_policy("c=int8")
  except ValueError:
    assert fidelity.main(["fidelity.py", "--formats=int8"]) == 2
    assert "this mpolicy has no int8" in capsys.readouterr().err
    assert "int8" not in fidelity.available()
  else:
    assert "int8" in fidelity.available()


@pytest.mark.slow
def test_fidelity_page_and_csv_reproduce(tmp_path):
  """Two runs of docs/fidelity.csv, rerun at its steps, give its values
  again, and the page's table holds the CSV's means."""
  fidelity = _load("fidelity")
  docs = os.path.join(ROOT, "docs")
  results, _, _, _, (steps,) = fidelity.read_csv(
      [os.path.join(docs, "fidelity.csv")])
  out = tmp_path / "again.csv"
  proc = _run("fidelity.py", "--models=co2_mlp", "--formats=f32,mxfp8",
              "--seeds=0", f"--steps={steps}", f"--csv={out}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  again, *_ = fidelity.read_csv([out])
  for key, metrics in again.items():
    for name in ("test_mse", "low_flops", "format_flops", "skipped"):
      assert metrics[name] == pytest.approx(results[key][name], rel=0.02,
                                            abs=1e-6), (key, name)
  page = open(os.path.join(docs, "fidelity.md")).read()
  seeds = sorted({s for (_, _, s) in results})
  for model, fmt in [("co2_mlp", "f32"), ("char_transformer", "mxfp8")]:
    metric = "test_mse" if model == "co2_mlp" else "test_loss"
    mean = np.mean([results[(model, fmt, s)][metric] for s in seeds])
    assert f"| {model} | {fmt} | {metric} | {mean:.4f} |" in page, (model, fmt)
  assert f"--steps={steps}" in page
