"""The C++ backend: an ATen graph on CPU tensors -> lowered, scheduled and printed as C++/OpenMP
(ember.codegen.cpp) -> built in the background (ember.runtime.cache) -> a host program calling its kernels
through ctypes (ember.codegen.wrapper), run by cpp_program.CompiledGraph.

compile_aten(gm, example_inputs, options) is the inner compiler ember_backend.compile_graph calls on each
ATen-level graph (forward and backward); options {"fallback": "eager"}: a graph whose generated code fails to
build runs eagerly (logged), not raising.

Symbolic graphs (docs/dynamic.md: SymInt placeholders, fake values with symbolic sizes) compile once for every
size: kernels take the size symbols as int64 arguments, the host program allocates from them. What the code
generator cannot do symbolically raises CannotLower, and the graph then runs as its ATen graph (correct at every
size), logged under EMBER_LOGS=fallbacks.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from ember.codegen import cpp, lower, schedule
from ember.errors import CannotLower
from ember.ir import symbols
from ember.backends.cpp_program import CompiledGraph, done, runner
from ember.runtime import cache
from ember.tools.logs import get_logger

fallback_log = get_logger("fallbacks")
code_log = get_logger("output_code")
SYMBOLIC = True   # compiles symbolic ATen graphs (ember_backend routes dynamic graphs only to such backends)
STATS = {"graphs": 0, "eager_graphs": 0, "kernels": 0, "externs": 0, "fallback_ops": 0}
# (any other error, a bug in ember, propagates: ember.tools.failsafe runs the captured graph eagerly, one place for
# every backend)


def compile_aten(gm: torch.fx.GraphModule, example_inputs: list, options: dict | None = None) -> Callable:
    """Compile a functional ATen-level fx graph (node.meta['val'] set) into fused C++ kernels."""
    options = options or {}
    t0 = time.perf_counter()
    bad = _dtypes(gm) - set(cpp.CTYPE)
    if bad:
        fallback_log.warning("graph runs eagerly: the C++ backend has no kernels for %s", sorted(map(str, bad)))
        STATS["eager_graphs"] += 1
        return gm.forward
    symbolic = lower.is_symbolic(gm)
    hints = {}
    try:
        with lower.lowering(symbolic):
            low, out_spec, _ = lower.lower(gm, example_inputs)
            hints = dict(symbols.HINTS)
            sched = schedule.schedule(low, row_buffers=True, mutations=gm.meta.get("ember_input_mutations"))
            sched = schedule.split_elementwise(sched, cpp.too_big_for_one_function)
            source, kernels = cpp.generate(sched)
    except CannotLower as e:
        if symbolic:
            fallback_log.warning("symbolic graph runs as its ATen graph (every size): %s", e)
            STATS["eager_graphs"] += 1
            return gm.forward
        fallback_log.warning("graph runs eagerly: %s", e)
        STATS["eager_graphs"] += 1
        return gm.forward
    STATS["graphs"] += 1
    STATS["kernels"] += len(kernels)
    STATS["externs"] += sum(isinstance(i, schedule.ExternBuffer) for i in sched.items)
    STATS["fallback_ops"] += len(low.fallbacks)
    build = cache.build_cpp(source) if kernels else None
    if code_log.isEnabledFor(10):
        code_log.debug("graph %s: %d kernels, %d extern calls, ATen fallbacks %s (lowered in %.3fs)\n%s",
                       gm.__class__.__name__, len(kernels), len(sched.items) - len(kernels), low.fallbacks or "none",
                       time.perf_counter() - t0, source[len(cpp.PRELUDE):])
    if build is None:
        build = done(None)
    compiled = CompiledGraph(gm, sched, source, kernels, build, options, hints)

    return runner(compiled, out_spec)


def _dtypes(gm) -> set:
    import torch.utils._pytree as pytree
    return {v.dtype for n in gm.graph.nodes for v in pytree.tree_leaves(n.meta.get("val"))
            if isinstance(v, torch.Tensor)}
