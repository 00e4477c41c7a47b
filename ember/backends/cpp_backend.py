"""The C++ backend: an ATen graph on CPU tensors -> lowered, scheduled and printed as C++/OpenMP
(ember.codegen.cpp) -> built in the background (ember.runtime.cache) -> a host program calling its kernels
through ctypes (ember.codegen.wrapper).

compile_aten(gm, example_inputs, options) is the inner compiler ember_backend.compile_graph calls on each
ATen-level graph (forward and backward); options {"fallback": "eager"}: a graph whose generated code fails to
build runs eagerly (logged), not raising.

Symbolic graphs (docs/dynamic.md: SymInt placeholders, fake values with symbolic sizes) compile once for every
size: kernels take the size symbols as int64 arguments, the host program allocates from them. What the code
generator cannot do symbolically raises CannotLower, and the graph then runs as its ATen graph (correct at every
size), logged under EMBER_LOGS=fallbacks.
"""
from __future__ import annotations

import ctypes
import time
from typing import Callable

import torch

from ember.codegen import cpp, lower, schedule, wrapper
from ember.errors import CannotLower
from ember.ir import symbols
from ember.runtime import artifacts, cache
from ember.tools.logs import get_logger

fallback_log = get_logger("fallbacks")
code_log = get_logger("output_code")
SYMBOLIC = True   # compiles symbolic ATen graphs (ember_backend routes dynamic graphs only to such backends)
STATS = {"graphs": 0, "eager_graphs": 0, "kernels": 0, "externs": 0, "fallback_ops": 0, "internal_errors": 0}


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
            return (_eager_graph, (self.gm,))
        return (_restored_graph, (self.gm, wrapper.saved_namespace(self.call, self.kernels), program, self.kernels,
                                  None if path is None else artifacts.Shipped(path), self.options, self.hints))

    def __call__(self, *args):
        if self.call is None:
            self._load()
        return self.call(list(args))


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
        with lower.LOWERING_LOCK:
            try:
                low, out_spec, _ = lower.lower(gm, example_inputs)
                hints = dict(symbols.HINTS)
                # (symbolic: no input written in place, whose overlap test needs fixed extents)
                sched = schedule.schedule(low, row_buffers=True,
                                          mutations=None if symbolic else gm.meta.get("ember_input_mutations"))
                sched = schedule.split_elementwise(sched, cpp.too_big_for_one_function)
                source, kernels = cpp.generate(sched)
            except (TypeError, NotImplementedError) as e:
                if not symbolic:
                    raise
                # a size decision the code generator takes on numbers only (a comparison of symbolic sizes)
                raise CannotLower(f"no symbolic code for it ({type(e).__name__}: {e})") from e
            finally:
                symbols.HINTS.clear()
    except CannotLower as e:
        if symbolic:
            fallback_log.warning("symbolic graph runs as its ATen graph (every size): %s", e)
            STATS["eager_graphs"] += 1
            return gm.forward
        fallback_log.warning("graph runs eagerly: %s", e)
        STATS["eager_graphs"] += 1
        return gm.forward
    except Exception as e:  # a bug in ember must not break the user's program: run eagerly, loudly
        fallback_log.warning("graph runs eagerly: ember internal error %s: %s", type(e).__name__, e, exc_info=True)
        STATS["eager_graphs"] += 1
        STATS["internal_errors"] += 1
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
    compiled = CompiledGraph(gm, sched, source, kernels, build, options, hints)

    return _runner(compiled, out_spec)


def _runner(compiled: CompiledGraph, out_spec) -> Callable:
    unflatten = wrapper.fast_unflatten(out_spec)

    def run(*args):
        return unflatten(compiled(*args))
    run.compiled = compiled
    run.ember_saved = lambda: (_runner, (compiled, out_spec))
    return run


def _restored_graph(gm, namespace: dict, program: str, kernels: list, library, options: dict,
                    hints: dict) -> CompiledGraph:
    """A CompiledGraph as ember_saved wrote it: its library loaded from the cache directory, its host program
    run from the saved source."""
    compiled = CompiledGraph(gm, None, None, kernels, _done(library), options, hints)
    compiled.saved_program = (program, namespace)
    return compiled


def _eager_graph(gm):
    return gm.forward


def _dtypes(gm) -> set:
    import torch.utils._pytree as pytree
    return {v.dtype for n in gm.graph.nodes for v in pytree.tree_leaves(n.meta.get("val"))
            if isinstance(v, torch.Tensor)}


def _done(v):
    import concurrent.futures
    f = concurrent.futures.Future()
    f.set_result(v)
    return f
