"""A checkpoint's metadata, and the template checked against it.

`meta` names the format, each leaf's dtype and shape, which leaves were
host values, each leaf's checksum (`digests`), and the settings of every
loss scale in the tree (a `DynamicLossScale`'s `period`, `factor` and
`min_loss_scale`, a `StaticLossScale`'s scale), which pytree flattening
would drop. A template must match it: every mismatch is listed at once.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from mpolicy._src import loss_scale as loss_scale_lib
from mpolicy._src.checkpoint import leaves as leaves_lib

FORMAT, VERSION = "mpolicy.checkpoint", 3
_READS = (2, 3)  # Version 2 had no checksums.
_SETTINGS = {
    loss_scale_lib.DynamicLossScale: ("period", "factor", "min_loss_scale"),
    loss_scale_lib.StaticLossScale: ("loss_scale",),
}


def settings(tree: Any) -> dict[str, dict[str, Any]]:
  """`{keystr: {"type": name, setting: value}}` for each loss scale."""
  is_ls = lambda x: type(x) in _SETTINGS
  out = {}
  for path, node in jax.tree_util.tree_flatten_with_path(tree,
                                                          is_leaf=is_ls)[0]:
    if is_ls(node):
      out[jax.tree_util.keystr(path)] = dict(
          type=type(node).__name__, **{name: np.asarray(getattr(
              node, name)).item() for name in _SETTINGS[type(node)]})
  return out


def build(tree: Any, flat: dict, described: dict) -> dict:
  kinds = {k: leaves_lib.host_kind(v) for k, v in flat.items()}
  return {"format": FORMAT, "version": VERSION, "leaves": described,
          "host_values": {k: v for k, v in kinds.items() if v},
          "loss_scales": settings(tree)}


def _loss_scale_problems(want_all: dict, have_all: dict) -> list[str]:
  problems = []
  for key, want in want_all.items():
    have = have_all.get(key)
    for name in sorted(set(want) | set(have or {})) if have else ():
      if want.get(name) != have.get(name):
        problems.append(
            f"{key or 'the root'}: the checkpoint's {have['type']} has {name}="
            f"{have.get(name)!r}, the template's {want['type']} has {name}="
            f"{want.get(name)!r} (build the template with the saved "
            "settings; change them after restoring if you mean to)")
  return problems


def check(meta: Any, path: str, template: Any, flat: dict, described: dict,
          what: str) -> None:
  """Raises a `ValueError` unless `meta` is an mpolicy checkpoint's that
  `template` (flattened to `flat`, `described`) matches."""
  if (not isinstance(meta, dict) or meta.get("format") != FORMAT
      or meta.get("version") not in _READS):
    raise ValueError(
        f"{what}: {path} is not an mpolicy checkpoint of format {FORMAT!r} "
        f"version {VERSION} (its metadata is {meta!r:.300}).")
  saved, kinds = meta["leaves"], meta.get("host_values", {})
  missing = [k for k in described if k not in saved]
  extra = [k for k in saved if k not in described]
  problems = (["missing from the checkpoint: " + ", ".join(missing)] * bool(
      missing) + ["in the checkpoint but not in the template: "
                  + ", ".join(extra)] * bool(extra))
  for key, (dtype, shape) in described.items():
    if key not in saved or tuple(saved[key]) == (dtype, shape):
      continue
    s_dtype, s_shape = saved[key]
    if (key in kinds and s_shape == shape
        and isinstance(flat[key], jax.ShapeDtypeStruct)
        and not leaves_lib.abstract_mismatch(s_dtype, flat[key])):
      continue  # jax.eval_shape gave a 64-bit host value JAX's own dtype.
    problems.append(f"{key}: checkpoint has {s_dtype}{s_shape}, template "
                    f"wants {dtype}{shape}")
  problems += _loss_scale_problems(settings(template), meta["loss_scales"])
  if problems:
    raise ValueError("The checkpoint does not match the template: "
                     + "; ".join(problems) + ".")
