"""Plain-text tables, as the reports print them.

>>> print(text_table(("op", "dtype"), [("exp", "float32"), ("dot", "bf16")]))
op   dtype
---  -------
exp  float32
dot  bf16
"""

from __future__ import annotations

from collections.abc import Sequence


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
  """``header`` and ``rows`` in left-aligned columns, two spaces apart,
  under a rule of dashes."""
  widths = [max([len(h)] + [len(r[i]) for r in rows])
            for i, h in enumerate(header)]

  def fmt(cols):
    return "  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip()

  return "\n".join([fmt(header), fmt(["-" * w for w in widths])]
                   + [fmt(r) for r in rows])
