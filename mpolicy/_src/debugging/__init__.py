"""The precision debugger: where a low-precision run breaks, and what fixes it.

* `walk`: the checked run, a program re-run with the origin of every
  non-finite value carried beside it;
* `locate`: `locate_nonfinite`, the first non-finite value by module and op;
* `shadow`: `compare_to_float32`, each module's error against float32.
"""
