"""A compiled C++ graph at run time: its kernels' library loaded through ctypes, its host program, the call.

cpp_backend.compile_aten makes one from a graph it lowered (the host program printed from the schedule); a saved
program (ember.load_cache, ember.export) makes one from its saved form (`CompiledGraph.ember_saved`: the ATen
graph, the host program's source and namespace, the built library), without importing the code generator.
"""
from __future__ import annotations

import concurrent.futures
import ctypes
from typing import Callable

from ember.codegen import wrapper
from ember.ir import symbols
from ember.runtime import artifacts, cache, heap
from ember.tools.logs import get_logger

fallback_log = get_logger("fallbacks")
code_log = get_logger("output_code")


class CompiledGraph:
    """A compiled ATen graph; the C++ build runs in the background until the first call needs it."""

    def __init__(self, gm, sched, source, kernels, build, options, hints=None):
        self.gm, self.sched, self.source, self.kernels = gm, sched, source, kernels
        self.build, self.options = build, options
        self.hints = hints or {}   # symbolic graph: the example's sizes, for the host program's choices
        self.call = None
        self.err = (ctypes.c_int64 * 1)()
        self.saved_program = None   # (host program source, namespace) of a loaded graph

    def _load(self):
        heap.keep_freed_memory()
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
        sizes = {str(s) for s in self.hints}
        for name, args, _ in self.kernels:
            f = getattr(lib, name)
            f.argtypes = [ctypes.c_void_p] * (len(args) + 1)
            f.restype = None
            fns[name] = f
        err = self.err

        def kernel_call(group):
            _, args, checks = next(k for k in self.kernels if k[0] == group.name)
            ptrs = ", ".join(a if a in sizes else f"{a}.data_ptr()" for a in args)
            check = "; _check_err()" if checks else ""
            return f"{group.name}({ptrs}{', ' if ptrs else ''}_errp){check}"

        def check_err():
            if err[0]:
                err[0] = 0
                raise IndexError("ember: index out of range in a gather/indexing operation of the compiled graph")

        self.lib = lib
        bound = {**fns, "_errp": ctypes.addressof(self.err), "_check_err": check_err,
                 "_fallback": lambda args: self.gm(*args)}
        if self.saved_program is not None:   # (ember.load_cache: the host program as it was saved)
            self.call = wrapper.restored_wrapper(*self.saved_program, bound)
            return
        from ember.codegen import lower   # (here: a loaded program never lowers, nor imports the code generator)
        with lower.LOWERING_LOCK:   # (symbols.HINTS is the lowering's state)
            symbols.HINTS.clear()
            symbols.HINTS.update(self.hints)
            try:
                self.call = wrapper.python_wrapper(self.sched, kernel_call, bound,
                    check_inputs=not self.gm.meta.get("ember_guarded", False), persistent=True,
                    consumed_outputs=frozenset(self.gm.meta.get("ember_consumed_outputs", ())))
            finally:
                symbols.HINTS.clear()
        if code_log.isEnabledFor(10):
            code_log.debug("host program:\n%s", self.call.source)

    def ember_saved(self) -> tuple:
        """The saved form (ember.runtime.artifacts): the ATen graph, the host program's source and namespace
        and the built library; loaded, it runs with no lowering and no build."""
        if self.call is None:
            self._load()
        path = self.build.result()
        program = getattr(self.call, "source", None)
        if program is None:   # (the build failed: the graph runs eagerly)
            return (eager_graph, (self.gm,))
        return (restored_graph, (self.gm, wrapper.saved_namespace(self.call, self.kernels), program, self.kernels,
                                  None if path is None else artifacts.Shipped(path), self.options, self.hints))

    def __call__(self, *args):
        if self.call is None:
            self._load()
        return self.call(list(args))


def runner(compiled: CompiledGraph, out_spec) -> Callable:
    unflatten = wrapper.fast_unflatten(out_spec)

    def run(*args):
        return unflatten(compiled(*args))
    run.compiled = compiled
    run.ember_saved = lambda: (runner, (compiled, out_spec))
    return run


def restored_graph(gm, namespace: dict, program: str, kernels: list, library, options: dict,
                    hints: dict) -> CompiledGraph:
    """A CompiledGraph as ember_saved wrote it: its library loaded from the cache directory, its host program
    run from the saved source."""
    compiled = CompiledGraph(gm, None, None, kernels, done(library), options, hints)
    compiled.saved_program = (program, namespace)
    return compiled


def eager_graph(gm):
    return gm.forward


def done(v) -> concurrent.futures.Future:
    """A future already holding v."""
    f = concurrent.futures.Future()
    f.set_result(v)
    return f
