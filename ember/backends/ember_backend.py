"""The "ember" backend: autograd (ember.autograd) -> decompositions -> loop IR -> fused C++/OpenMP kernels.

compile_graph(gm, example_inputs, options=None) is the backend; compile_aten is the inner compiler that the
autograd layer calls on each ATen-level graph (forward and backward). options (ember.compile(options=...)):
  {"fallback": "eager"}  a graph whose generated code fails to build runs eagerly (logged) instead of raising
(the frontend does not pass options to backends yet: ember.compile(options=...) will reach here once it does.)
"""
from __future__ import annotations

import ctypes
import time
from typing import Callable

import torch

from ember.codegen import cpp, lower, schedule, wrapper
from ember.runtime import cache
from ember.tools.logs import get_logger

fallback_log = get_logger("fallbacks")
code_log = get_logger("output_code")
STATS = {"graphs": 0, "eager_graphs": 0, "kernels": 0, "externs": 0, "fallback_ops": 0}


def compile_graph(gm: torch.fx.GraphModule, example_inputs: list, options: dict | None = None) -> Callable:
    """The backend entry point (torch.compile's custom-backend contract)."""
    options = options or {}
    inner = lambda g, ex: compile_aten(g, ex, options)  # noqa: E731
    try:
        from ember.autograd import aot_module
    except ImportError:
        aot_module = None
    if aot_module is not None:
        return aot_module(gm, example_inputs, fw_compiler=inner, bw_compiler=inner)
    if _is_aten(gm):
        return inner(gm, example_inputs)
    fallback_log.debug("graph runs eagerly: torch-level graph and ember.autograd (the ATen tracer) is not available")
    STATS["eager_graphs"] += 1
    return gm.forward


def _is_aten(gm: torch.fx.GraphModule) -> bool:
    import operator
    return all(n.op != "call_function" or isinstance(n.target, torch._ops.OpOverload) or n.target is operator.getitem
               for n in gm.graph.nodes) and not any(n.op in ("call_module", "call_method") for n in gm.graph.nodes)


class CompiledGraph:
    """A compiled ATen graph; the C++ build runs in the background until the first call needs it."""

    def __init__(self, gm, sched, source, kernels, build, options):
        self.gm, self.sched, self.source, self.kernels = gm, sched, source, kernels
        self.build, self.options = build, options
        self.call = None
        self.err = (ctypes.c_int64 * 1)()

    def _load(self):
        try:
            path = self.build.result()
        except cache.BuildError:
            if self.options.get("fallback") == "eager":
                fallback_log.warning("C++ build failed; graph runs eagerly (options={'fallback': 'eager'})",
                                     exc_info=True)
                self.call = lambda args: self.gm(*args)
                return
            raise
        lib = ctypes.CDLL(str(path)) if path is not None else None
        fns = {}
        for name, args, _ in self.kernels:
            f = getattr(lib, name)
            f.argtypes = [ctypes.c_void_p] * (len(args) + 1)
            f.restype = None
            fns[name] = f
        errp = ctypes.addressof(self.err)
        err = self.err

        def kernel_call(group):
            _, args, checks = next(k for k in self.kernels if k[0] == group.name)
            ptrs = ", ".join(f"{a}.data_ptr()" for a in args)
            check = "; _check_err()" if checks else ""
            return f"{group.name}({ptrs}{', ' if ptrs else ''}_errp){check}"

        def check_err():
            if err[0]:
                err[0] = 0
                raise IndexError("ember: index out of range in a gather/indexing operation of the compiled graph")

        self.lib = lib
        self.call = wrapper.python_wrapper(self.sched, kernel_call, {
            **fns, "_errp": errp, "_check_err": check_err, "_fallback": lambda args: self.gm(*args)})
        if code_log.isEnabledFor(10):
            code_log.debug("host program:\n%s", self.call.source)

    def __call__(self, *args):
        if self.call is None:
            self._load()
        return self.call(list(args))


def compile_aten(gm: torch.fx.GraphModule, example_inputs: list, options: dict | None = None) -> Callable:
    """Compile a functional ATen-level fx graph (node.meta['val'] set) into fused C++ kernels."""
    options = options or {}
    t0 = time.perf_counter()
    try:
        low, out_spec, _ = lower.lower(gm, example_inputs)
        sched = schedule.schedule(low)
        source, kernels = cpp.generate(sched)
    except lower.Unsupported as e:
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
        build = _done(None)
    compiled = CompiledGraph(gm, sched, source, kernels, build, options)

    import torch.utils._pytree as pytree

    def run(*args):
        return pytree.tree_unflatten(compiled(*args), out_spec)
    run.compiled = compiled
    return run


def _done(v):
    import concurrent.futures
    f = concurrent.futures.Future()
    f.set_result(v)
    return f
