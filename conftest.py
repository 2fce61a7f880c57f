"""Collection set-up for the whole repository (tests and doctests).

The Flax bridge imports Flax, an optional dependency: without Flax its
doctests are not collected (its tests skip themselves).
"""

import importlib.util

collect_ignore = []
if importlib.util.find_spec("flax") is None:
  collect_ignore.append("mpolicy/_src/flax_bridge.py")
