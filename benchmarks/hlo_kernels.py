"""Op counts of an optimized HLO module, for the benchmarks in this folder.

Reads the text of `jax.jit(f).lower(...).compile().as_text()` and counts, per
backend-neutral category:

  kernels      matmul/convolution kernels with their element types:
               GPU library calls (`custom-call` targets such as
               `__cublas$gemm`, `__cublas$lt$matmul`, `__cudnn$convForward`)
               and `dot` / `convolution` instructions wherever they sit (on
               CPU and in Triton / cuDNN fusion bodies on GPU, labelled with
               the fusion kind that holds them);
  converts     `convert` instructions (fusion bodies included), by dtype pair
               and by source (the `op_name` metadata JAX writes, shortened),
               and how many sit in reducer bodies (`to_apply=`);
  fusions, while loops, conditionals, custom-calls, all instructions (and
               every opcode's count), fusions that only cast or move data,
               compute instructions by result dtype.

Kernel keys read like `__cublas$gemm(bf16,bf16)->bf16` or
`dot[__triton_gemm](bf16,bf16)->f32`: operand element types, then the result's
(the first element of a tuple result, skipping the s8/u8 scratch buffer).

>>> import jax, jax.numpy as jnp
>>> text = jax.jit(jnp.dot).lower(jnp.ones((2, 3)), jnp.ones((3, 4))).compile().as_text()
>>> sum(n for k, n in hlo_stats(text).kernels.items() if "(f32,f32)->f32" in k)
1

See also: `bench_training.py --preset=gpu`, `bench_char_transformer.py`.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from typing import Any

_COMPUTATION = re.compile(
    r"^\s*(?:ENTRY\s+)?%?(?P<name>[\w.\-$]+)\s*\(.*\)\s*->.*\{\s*$")
_INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-$]+)\s*=\s*(?P<type>.+?)\s"
    r"(?P<op>[a-z][a-z0-9\-_]*)\((?P<args>.*)$")
_DTYPES = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]+m[0-9]+[a-z0-9]*)?)\[")
_ARGNAME = re.compile(r"%([\w.\-$]+)")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_CALLS = re.compile(r"calls=%?([\w.\-$]+)")
_FUSION_KIND = re.compile(r'"kind"\s*:\s*"([^"]+)"')
_OP_KIND = re.compile(r"kind=(k\w+)")
_KERNEL_TARGET = re.compile(r"cublas|cudnn|gemm|matmul|conv", re.I)
_TO_APPLY = re.compile(r"to_apply=%?([\w.\-$]+)")
_OPNAME = re.compile(r'op_name="([^"]*)"')
_TRANSFORM = re.compile(
    r"(?:jit|jvp|transpose|pjit|vmap|checkpoint|remat)\((.*)\)")
_SCRATCH = ("s8", "u8")
# Opcodes that compute nothing themselves (left out of `ops_by_dtype`).
_NON_COMPUTE = frozenset({
    "parameter", "constant", "tuple", "get-tuple-element", "bitcast", "copy",
    "fusion", "call", "custom-call"})
# A fusion whose body has a convert and only these opcodes just casts.
_LAYOUT_ONLY = frozenset({
    "parameter", "constant", "bitcast", "copy", "reshape", "transpose",
    "broadcast", "tuple", "get-tuple-element", "slice", "convert"})
NO_OP_NAME = "<no op_name: inserted by XLA>"


@dataclasses.dataclass
class HloStats:
  """Counts from one optimized HLO module (see the module docstring)."""
  instructions: int = 0
  fusions: int = 0
  while_loops: int = 0
  conditionals: int = 0
  custom_calls: int = 0
  converts: int = 0
  converts_in_reducers: int = 0
  cast_only_fusions: int = 0
  convert_pairs: collections.Counter = dataclasses.field(
      default_factory=collections.Counter)
  convert_sources: collections.Counter = dataclasses.field(
      default_factory=collections.Counter)
  kernel_sources: collections.Counter = dataclasses.field(
      default_factory=collections.Counter)
  ops_by_dtype: collections.Counter = dataclasses.field(
      default_factory=collections.Counter)
  kernels: collections.Counter = dataclasses.field(
      default_factory=collections.Counter)
  custom_call_targets: collections.Counter = dataclasses.field(
      default_factory=collections.Counter)
  opcodes: collections.Counter = dataclasses.field(
      default_factory=collections.Counter)

  def kernel_dtypes(self) -> collections.Counter:
    """Kernels by `(operand types)->result type` only, whatever runs them."""
    out = collections.Counter()
    for key, n in self.kernels.items():
      out[key[key.index("("):]] += n
    return out

  def to_dict(self) -> dict[str, Any]:
    d = {}
    for field in dataclasses.fields(self):
      v = getattr(self, field.name)
      d[field.name] = (dict(sorted(v.items()))
                       if isinstance(v, collections.Counter) else v)
    d["kernel_dtypes"] = dict(sorted(self.kernel_dtypes().items()))
    return d


def short_source(op_name: str) -> str:
  """The last three parts of an `op_name` or name stack, transforms unwrapped.

  >>> short_source("jit(step)/jvp(model)/mlp/linear_0/dot_general")
  'mlp/linear_0/dot_general'
  """
  keep = []
  for part in (p for p in op_name.split("/") if p):
    m = _TRANSFORM.fullmatch(part)
    if m:
      part = m.group(1)
      if part in ("step", "model") or not keep and part.startswith("<"):
        continue
    keep.append(part)
  return "/".join(keep[-3:]) if keep else NO_OP_NAME


def _source(line: str) -> str:
  m = _OPNAME.search(line)
  return short_source(m.group(1)) if m else NO_OP_NAME


def _result_dtype(type_str: str) -> str:
  found = _DTYPES.findall(type_str)
  if not found:
    return "?"
  for dt in found:
    if dt not in _SCRATCH:
      return dt
  return found[0]


def _operand_dtypes(args: str, types: dict[str, str]) -> list[str]:
  # Operands end at the first ")" that closes the call: "(%a, %b), attrs".
  depth, end = 0, len(args)
  for i, ch in enumerate(args):
    if ch == "(":
      depth += 1
    elif ch == ")":
      if depth == 0:
        end = i
        break
      depth -= 1
  inline = _DTYPES.findall(args[:end])
  if inline:  # Newer printers write operand types inline.
    return inline
  return [types.get(n, "?") for n in _ARGNAME.findall(args[:end])]


def hlo_stats(text: str) -> HloStats:
  """Counts kernels, converts, fusions and loops in `compiled.as_text()`.

  Args:
    text: an optimized HLO module as text.

  Returns:
    An `HloStats`.
  """
  stats = HloStats()
  fusion_kind: dict[str, str] = {}  # fused computation name -> kind
  fused: list[str] = []  # the computation each fusion instruction calls
  # First pass: which computation each fusion calls, and its kind.
  for line in text.splitlines():
    m = _INSTR.match(line)
    if m and m["op"] == "fusion":
      call = _CALLS.search(line)
      if call:
        kind = _FUSION_KIND.search(line) or _OP_KIND.search(line)
        fusion_kind[call.group(1)] = kind.group(1) if kind else "fusion"
        fused.append(call.group(1))
  types: dict[str, str] = {}
  computation = ""
  body_ops: dict[str, collections.Counter] = {}  # computation -> opcodes
  for line in text.splitlines():
    c = _COMPUTATION.match(line)
    if c:
      types, computation = {}, c["name"]
      body_ops[computation] = collections.Counter()
      continue
    m = _INSTR.match(line)
    if not m:
      continue
    op, result = m["op"], _result_dtype(m["type"])
    types[m["name"]] = result
    stats.instructions += 1
    stats.opcodes[op] += 1
    body_ops.setdefault(computation, collections.Counter())[op] += 1
    if op not in _NON_COMPUTE:
      stats.ops_by_dtype[result] += 1
    if op == "fusion":
      stats.fusions += 1
    elif op == "while":
      stats.while_loops += 1
    elif op == "conditional":
      stats.conditionals += 1
    elif op == "convert":
      stats.converts += 1
      ins = _operand_dtypes(m["args"], types)
      stats.convert_pairs[f"{ins[0] if ins else '?'}->{result}"] += 1
      stats.convert_sources[_source(line)] += 1
    elif op == "custom-call":
      stats.custom_calls += 1
      target = _TARGET.search(line)
      name = target.group(1) if target else "?"
      stats.custom_call_targets[name] += 1
      if _KERNEL_TARGET.search(name):
        ins = [t for t in _operand_dtypes(m["args"], types)
               if t not in _SCRATCH][:2]
        stats.kernels[f"{name}({','.join(ins)})->{result}"] += 1
    if op in ("dot", "convolution"):
      ins = _operand_dtypes(m["args"], types)[:2]
      where = fusion_kind.get(computation)
      label = f"{op}[{where}]" if where and where.startswith("__") else op
      stats.kernels[f"{label}({','.join(ins)})->{result}"] += 1
      stats.kernel_sources[f"{','.join(ins)}->{result} {_source(line)}"] += 1
  reducers = set(_TO_APPLY.findall(text))
  stats.converts_in_reducers = sum(
      ops["convert"] for name, ops in body_ops.items() if name in reducers)
  for name in fused:
    ops = body_ops.get(name, collections.Counter())
    if ops["convert"] and set(ops) <= _LAYOUT_ONLY:
      stats.cast_only_fusions += 1
  return stats


def format_counter(counter: collections.Counter, limit: int = 12) -> str:
  """`3× a, 1× b` for the `limit` most common entries."""
  items = counter.most_common(limit)
  more = len(counter) - len(items)
  s = ", ".join(f"{n}× {k}" for k, n in items) or "-"
  return s + (f", +{more} more" if more > 0 else "")


def temp_bytes(compiled: Any):
  """`compiled.memory_analysis().temp_size_in_bytes`, or None if unknown."""
  try:
    analysis = compiled.memory_analysis()
  except Exception:  # pylint: disable=broad-except
    return None
  if analysis is None:
    return None
  if isinstance(analysis, (list, tuple)):  # One per device on some versions.
    analysis = analysis[0] if analysis else None
  value = getattr(analysis, "temp_size_in_bytes", None)
  return int(value) if value is not None else None
