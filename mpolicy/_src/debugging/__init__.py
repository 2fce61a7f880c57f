"""The precision debugger: where a low-precision run breaks, and what fixes it.

* `program`: the computation checked (a loss and its gradients), traced
  with every op named and replayed op by op by the interpreter;
* `check`: the checker watching a replay, with the origin of every
  non-finite value carried beside it;
* `locate`: `locate_nonfinite`, the first non-finite value by module and op;
* `shadow`: `compare_to_float32`, each module's error against float32;
* `suggest`: `suggest_policy`, the few modules to run wider.
"""
