"""Python's cyclic garbage collector during compiles.

A compile allocates hundreds of thousands of short-lived objects (fake tensors, fx nodes, the min-cut's dicts,
sympy expressions), which sets off collections of the oldest generation, and each of those walks the whole heap,
a model library's included (a large part of a transformer's training-graph code generation).
Two ways around it:

- `paused()`: no collection at all while the frontend captures a frame (and the backend compiles inside it) or
  the backward compiles. Afterwards the collector runs as usual; what the compile left as garbage is found by
  its next young collection, which only scans objects made since its last run.
- `frozen()`: around code generation called on its own (the backend under torch.compile, benches): what exists
  already is frozen (gc.freeze), new objects are still collected, the frozen ones handed back afterwards. Inside
  `paused()` it does nothing.
"""
from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def paused():
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@contextlib.contextmanager
def frozen():
    if gc.get_freeze_count() or not gc.isenabled():   # (left alone when the program froze objects itself)
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
