"""A checkpoint's metadata (format, each leaf's dtype and shape, which were
host values, each leaf's checksum, and the loss scales' settings, which
pytree flattening drops) and the template checked against it."""

from typing import Any

import jax
import numpy as np

from mpolicy._src import loss_scale as loss_scale_lib
from mpolicy._src.checkpoint import leaves as leaves_lib

FORMAT, VERSION = "mpolicy.checkpoint", 3  # Version 2 had no checksums.
_SETTINGS = {
    loss_scale_lib.DynamicLossScale: ("period", "factor", "min_loss_scale"),
    loss_scale_lib.StaticLossScale: ("loss_scale",),
}


def settings(tree: Any) -> dict[str, dict[str, Any]]:
  """`{keystr: {"type": name, setting: value}}` for each loss scale."""
  is_ls = lambda x: type(x) in _SETTINGS
  nodes = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_ls)[0]
  return {jax.tree_util.keystr(path): dict(type=type(node).__name__, **{
      name: np.asarray(getattr(node, name)).item()
      for name in _SETTINGS[type(node)]})
          for path, node in nodes if is_ls(node)}


def build(tree: Any, flat: dict, described: dict) -> dict:
  kinds = {k: leaves_lib.host_kind(v) for k, v in flat.items()}
  return {"format": FORMAT, "version": VERSION, "leaves": described,
          "host_values": {k: v for k, v in kinds.items() if v},
          "loss_scales": settings(tree)}


def _differences(meta: dict, template: Any, flat: dict, described: dict):
  saved, kinds = meta["leaves"], meta.get("host_values", {})
  missing = [k for k in described if k not in saved]
  extra = [k for k in saved if k not in described]
  yield from ["missing from the checkpoint: " + ", ".join(missing)] * bool(
      missing)
  yield from ["in the checkpoint but not in the template: "
              + ", ".join(extra)] * bool(extra)
  for key, (dtype, shape) in described.items():
    s_dtype, s_shape = saved.get(key, (dtype, shape))
    if (s_dtype, s_shape) != (dtype, shape) and not (
        key in kinds and s_shape == shape
        and isinstance(flat[key], jax.ShapeDtypeStruct)
        and not leaves_lib.abstract_mismatch(s_dtype, flat[key])):
      # (Above: jax.eval_shape gave a 64-bit host value JAX's own dtype.)
      yield (f"{key}: checkpoint has {s_dtype}{s_shape}, template wants "
             f"{dtype}{shape}")
  for key, want in settings(template).items():
    have = meta["loss_scales"].get(key) or want
    for name in sorted(set(want) | set(have)):
      if want.get(name) != have.get(name):
        yield (f"{key or 'the root'}: the checkpoint's {have['type']} has "
               f"{name}={have.get(name)!r}, the template's {want['type']} has "
               f"{name}={want.get(name)!r} (build the template with the "
               "saved settings; change them after restoring if you mean to)")


def check(meta: Any, path: str, template: Any, flat: dict, described: dict,
          what: str) -> None:
  """Raises a `ValueError` unless `meta` is an mpolicy checkpoint's that
  `template` (flattened to `flat` and `described`) matches."""
  if (not isinstance(meta, dict) or meta.get("format") != FORMAT
      or meta.get("version") not in (2, VERSION)):
    raise ValueError(
        f"{what}: {path} is not an mpolicy checkpoint of format {FORMAT!r} "
        f"version {VERSION} (its metadata is {meta!r:.300}).")
  problems = list(_differences(meta, template, flat, described))
  if problems:
    raise ValueError("The checkpoint does not match the template: "
                     + "; ".join(problems) + ".")
