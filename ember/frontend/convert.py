"""From a captured frame to a cached entry: guards -> graph call -> side effects -> rebuilt outputs.

`FrameCompiler` owns the cache of one function (several entries, each with its own guards). On a miss it
captures the function on the call's real arguments (ember.frontend.interpreter), hands the graph to the
backend, and generates a Python function for the entry:

    def ___entry(<the function's arguments>):
        if not <guards>: return ___MISS
        ___o = ___graph(<graph inputs, by source>)
        <values to keep, then side effects: attribute/list/dict/global/cell writes, as Python would do them>
        return <the original return structure>                  # whole function captured
        -- or, at a graph break --
        <the instruction ember could not capture, run in Python>
        return ___resume(<stack>, <live locals>)                # rest of the function, compiled on its own

A break happens where the interpreter raised Unsupported: capture restarts and stops just before that
instruction of the root frame, so the state there is exact.
"""
from __future__ import annotations

import dataclasses
import functools
import keyword
import linecache
import math
import sys
import types
import warnings
import weakref
from typing import Any, Callable

import torch
import torch.fx

from ember import config
from ember.autograd.backward import with_freed_history
from ember.frontend.dead_code import eliminate_dead_code
from ember.errors import BackendCompilerFailed, GraphBreakError, Unsupported
from ember.frontend.guards import CHECKER_FUNCTIONS, DICT_GET, share_paths
from ember.frontend.break_frames import (
    MAX_LOOP_RESUMES, STEP_CALL, STEP_PYTHON, STEP_RETURN, STEP_YIELD, Raiser, call_compiled,
    compilable_generator, defaults_key, enclosing_blocks, in_loop, loop_resume, make_function, tuple_iter_rest,
    unrolled, wrap_argument, wrap_cell, wrap_private_iter,
)
from ember.frontend.binding import arg_names, make_binder, trampoline
from ember.frontend.capture import Capture, ConstTable
from ember.frontend.dynamic_dims import DimPolicy
from ember.frontend.symbolic import log_dynamic
from ember.frontend.interpreter import Frame, instructions, where
from ember.frontend.modes import autocast_state, close_autocast, restore_autocast
from ember.frontend.policy import COMPILE_ANSWERED, EAGER_ANSWERS, add_program, program_in
from ember.frontend.python_objects import is_namedtuple_cls
from ember.frontend.recompile_reasons import failed_check, with_sizes
from ember.frontend.signals import StopCapture
from ember.frontend.values import AutocastExit as _AutocastExit, GradExit as _GradExit
from ember.frontend.values import noop_exit as _noop_exit
from ember.frontend.values import (
    AutocastExitV, BoundV, CellV, ClosureV, ConstV, DictV, GradModeCtxV, GradModeExitV, IterV, ListV, NewObjV, NoOpCtxV,
    NullV, ObjV, PartialV, PyFloatV, SetV, SuperV, TensorV, TupleV, V,
)
from ember.tools import collector, failsafe
from ember.tools.logs import enabled, get_logger

MISS = object()
NULL = object()  # stands for CPython's NULL on a rebuilt stack
log_graph, log_guards = get_logger("graph"), get_logger("guards")
log_recompiles, log_breaks = get_logger("recompiles"), get_logger("graph_breaks")
CO_GENERATOR, CO_COROUTINE, CO_ASYNC_GENERATOR, CO_ITERABLE_COROUTINE = 0x20, 0x80, 0x200, 0x100

# explain() listens here: one list of events per active recording.
RECORDERS: list[list] = []
STATS = {"captures": 0}   # captures run by this process (tests of ember.load_cache count them)


def _emit(kind: str, **info) -> None:
    for rec in RECORDERS:
        rec.append((kind, info))


class Entry:
    def __init__(self, fn: Callable, guards: list[str], check: Callable, description: str):
        self.fn, self.guards, self.check, self.description = fn, guards, check, description


@dataclasses.dataclass
class StopHint:
    """Where a graph break sits inside the functions a root frame's break instruction calls.

    A break found in an inlined call stops the root frame just before that call; the entry then runs the call
    through `call_compiled`, which compiles the callee, whose capture would interpret the callee again only to
    meet the same break and restart (GPT-2's loss, behind three wrapper functions: four interpretations of the
    whole model before the one that makes the graph). The hint carries the break's instruction in each inlined
    frame (`frames`, outermost first), its reason and guards, so the callee's capture stops there at once, as
    its own rediscovery would have (a stop is valid at any instruction, so a stale hint costs at most a break
    that was not needed). Used once: by the first capture of `frames[0]`'s code that the entry's call starts."""
    frames: list            # (code, offset, earlier visits to the offset) per inlined frame, outermost first
    reason: str
    where: str              # the Unsupported's own location ("" when it gave none)
    holds_while: tuple      # guards under which the break stands (Unsupported.holds_while)
    used: bool = False

    def __repr__(self) -> str:   # (shown in the entry's source as a constant)
        return f"StopHint({self.frames[0][0].co_qualname}@{self.frames[0][1]}: {self.reason[:40]})"


class FrameCompiler:
    """The compiled form of one function: a binder for its arguments and a list of guarded entries."""

    _by_function: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()
    _by_code: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()   # shared compilers
    _all: "weakref.WeakSet[FrameCompiler]" = weakref.WeakSet()
    # ember.load_cache's: (compiler) -> whether it installed saved entries of its code (frontend/saved.py)
    restore: Callable[["FrameCompiler"], bool] | None = None

    def __init__(self, fn: types.FunctionType, cfg, name: str | None = None, shared: bool = False,
                 steps: bool = False):
        self.fn = fn
        # a generator's, called by break_frames.drive: each entry returns the next step (STEP_*), not a value
        self.steps = steps
        # shared by the functions of one code object (functions an entry makes anew on every call): each call passes
        # its function's closure first (`___clo`), which the capture reads and guards like an argument
        self.shared = shared
        self.code = fn.__code__
        self.cfg = cfg
        self.name = name or fn.__qualname__
        self.entries: list[Entry] = []
        self.disabled = bool(self.code.co_flags & (CO_GENERATOR | CO_COROUTINE | CO_ASYNC_GENERATOR)) and not steps
        self.warned = False
        self.resumes: dict[tuple, FrameCompiler] = {}
        self.pending_hint: StopHint | None = None   # set by call_compiled for the call it makes
        # a resume function's: the compiler of the code it continues and its offsets there (see resume_compiler)
        self.origin: tuple[FrameCompiler, Any] | None = None
        # a resume function's parameters that receive an iterator its caller's entry made (`iter((...))` of a
        # loop's remaining items, private to the call): name -> how many items it holds
        self.private_iters: dict[str, int] = {}
        self.frame_state: dict[str, tuple] = {}   # sizes its captures saw, by source (dynamic_dims.DimPolicy)
        self.restore_asked = False   # whether its first miss asked FrameCompiler.restore for saved entries
        self.argnames = arg_names(self.code)
        self.bind = make_binder(fn, self.argnames, shared)
        # a call passing exactly the positional parameters needs no binder: its argument tuple is the frame's
        self.n_positional = self.code.co_argcount + shared if len(self.argnames) == self.code.co_argcount else -1
        # the entry's parameters: the argument names, or stand-ins where a name is no identifier (pytest's
        # `@py_assert1` locals reach resume functions)
        self.params = [n if n.isidentifier() and not keyword.iskeyword(n) else f"___arg{i}"
                       for i, n in enumerate(self.argnames)]
        self.entry_params = ["___clo", *self.params] if shared else self.params
        FrameCompiler._all.add(self)

    @classmethod
    def for_callable(cls, f: Callable, cfg) -> Callable:
        """The call path for any callable: a function, a bound method, or a callable object."""
        if isinstance(f, types.MethodType) and isinstance(f.__func__, types.FunctionType):
            inner = cls.for_function(f.__func__, cfg)
            obj = f.__self__
            return lambda args, kwargs: inner((obj, *args), kwargs)
        if isinstance(f, types.FunctionType):
            return cls.for_function(f, cfg)
        tramp = trampoline(f)
        return cls(tramp, cfg, name=getattr(f, "__qualname__", type(f).__name__))

    @classmethod
    def for_function(cls, f: types.FunctionType, cfg, steps: bool = False) -> "FrameCompiler":
        per_fn = cls._by_function.setdefault(f, {})
        fc = per_fn.get((id(cfg), steps))
        if fc is None or fc.cfg is not cfg:  # an id can be reused once a Config is gone
            fc = per_fn[(id(cfg), steps)] = cls(f, cfg, steps=steps)
        return fc

    @classmethod
    def shared_for(cls, f: types.FunctionType, cfg, steps: bool = False) -> "FrameCompiler":
        """The compiler of every function of f's code, globals and defaults: a function a compiled frame defines
        (a closure, a lambda, a comprehension) is a new object on every call, and compiling each anew would
        recompile on every call (torch.compile keys its cache by code object likewise)."""
        per_code = cls._by_code.setdefault(f.__code__, {})
        key = (id(f.__globals__), defaults_key(f), id(cfg), steps)
        fc = per_code.get(key)
        if fc is None or fc.cfg is not cfg or fc.fn.__globals__ is not f.__globals__:
            fc = per_code[key] = cls(f, cfg, shared=True, steps=steps)
        return fc

    def call_args(self, f: types.FunctionType, args: tuple) -> tuple:
        """The arguments of a call of f through this compiler (f's closure first where it is shared)."""
        return (f.__closure__, *args) if self.shared else args

    # -- the hot path ------------------------------------------------------------------------------------
    def __call__(self, args: tuple, kwargs: dict):
        frame_args = args if len(args) == self.n_positional and not kwargs else self.bind(*args, **kwargs)
        # (run_bound's body, inlined: one Python call less on every compiled call)
        for e in self.entries:
            r = e.fn(*frame_args)
            if r is not MISS:
                return r
        if self.disabled:
            return self.run_python(args, kwargs)
        return self.compile_and_run(args, kwargs, frame_args)

    def run_bound(self, frame_args: tuple, args: tuple, kwargs: dict):
        """__call__ on arguments already bound (a generator's, bound when it was called)."""
        for e in self.entries:
            r = e.fn(*frame_args)
            if r is not MISS:
                return r
        if self.disabled:
            return self.run_python(args, kwargs)
        return self.compile_and_run(args, kwargs, frame_args)

    def run_python(self, args: tuple, kwargs: dict):
        fn = self.fn
        if self.shared:
            fn, args = make_function(self.code, fn.__globals__, fn.__defaults__, fn.__kwdefaults__, args[0]), args[1:]
        return (STEP_PYTHON, fn(*args, **kwargs)) if self.steps else fn(*args, **kwargs)

    # -- misses ------------------------------------------------------------------------------------------
    def compile_and_run(self, args, kwargs, frame_args):
        if FrameCompiler.restore is not None and not self.restore_asked:
            self.restore_asked = True
            if FrameCompiler.restore(self):   # entries ember.load_cache read for this code: no capture if one fits
                for e in self.entries:
                    r = e.fn(*frame_args)
                    if r is not MISS:
                        return r
        if self.entries:
            reason = self.failed_guard(frame_args)
            log_recompiles.debug("recompiling %s (%s): guard failed: %s", self.name, _code_where(self.code), reason)
            _emit("recompile", name=self.name, reason=reason)
            if len(self.entries) >= config.RECOMPILE_LIMIT:
                self.disabled = True
                if not self.warned:
                    self.warned = True
                    warnings.warn(f"ember: {self.name} ({_code_where(self.code)}) was recompiled "
                                  f"{config.RECOMPILE_LIMIT} times; the guard that kept failing: {reason}. "
                                  f"It runs uncompiled from now on.", stacklevel=4)
                return self.run_python(args, kwargs)
        entry = self.capture_without_gc(frame_args) if config.COMPILE_WITHOUT_GC else self.capture(frame_args)
        # newest first (as torch.compile's cache): the latest capture fits the state calls are in now. An
        # optimizer's first step breaks (its state is created) and makes an entry that every later step would
        # otherwise evaluate and miss before reaching the steady-state one.
        self.entries.insert(0, entry)
        r = entry.fn(*frame_args)
        if r is MISS:  # the capture itself changed what the guards read: run as Python this time
            log_guards.debug("fresh entry of %s missed its own guards; running uncompiled", self.name)
            return self.run_python(args, kwargs)
        return r

    def failed_guard(self, frame_args) -> str:
        entry = self.entries[0]   # the newest
        for g in entry.guards:
            try:
                if not entry.check(g, frame_args):
                    return with_sizes(entry, failed_check(entry, g, frame_args), frame_args)
            except Exception as e:
                return f"{g} (raised {type(e).__name__})"
        return "(none)"

    def sizes_changed(self, frame_args) -> bool:
        """Whether a tensor or int that earlier captures saw has another size now (automatic dynamic will then
        make it symbolic, so the capture needs a ShapeEnv; a recompile for any other reason does not)."""
        if self.cfg.dynamic is not None or not self.entries:
            return False
        entry = self.entries[0]
        for key, seen in list(self.frame_state.items()):
            source = key[1] if type(key) is tuple else key
            try:
                now = entry.check(source, frame_args)
            except Exception:   # (a source of an older entry's constants, or no longer there)
                continue
            if isinstance(now, torch.Tensor) and type(seen) is tuple and tuple(now.shape) != seen or \
                    type(now) is int and type(seen) is int and now != seen:
                return True
        return False

    def capture_without_gc(self, frame_args: tuple) -> Entry:
        """capture (and the backend's compile inside it) with Python's cyclic garbage collector paused
        (ember.tools.collector says why)."""
        with collector.paused():
            return self.capture(frame_args)

    def capture(self, frame_args: tuple) -> Entry:
        STATS["captures"] += 1
        stop_at: dict[int, tuple[str, int]] = {}   # offset -> (reason, the visit to stop at: 0 = first)
        break_guards: list[str] = []
        hints: dict[int, StopHint] = {}   # per stop offset: where the break sits in the calls made there
        prev_grad = torch.is_grad_enabled()
        prev_autocast = autocast_state()
        consts = ConstTable()  # shared by the attempts: break_guards name its constants
        hint, self.pending_hint = self.pending_hint, None
        if hint is not None and hint.frames[0][0] is self.code and not self.cfg.fullgraph:
            _code, offset, skip = hint.frames[0]
            where_ = hint.where or where(self.code, offset)
            stop_at[offset] = (f"{hint.reason} ({where_})", skip)
            break_guards += hint.holds_while
            if len(hint.frames) > 1:
                hints[offset] = StopHint(hint.frames[1:], hint.reason, hint.where, hint.holds_while)
            log_breaks.debug("graph break in %s at %s: %s", self.name, where_, hint.reason)
            _emit("break", name=self.name, reason=hint.reason, where=where_)
        if self.steps:   # a generator's capture ends at its next yield (EntryCodegen.yield_step)
            if not compilable_generator(self.code):
                return self.fallback_entry(Capture(consts), "a yield inside a try or with block, or yield from")
            insts, _index = instructions(self.code)
            stop_at.update({i.offset: ("yield", 0) for i in insts if i.opname == "YIELD_VALUE"})
        # loss.backward() joins the graph for ember's own backends (ember.autograd.backward); a custom backend
        # gets the graph break torch.compile makes there
        backward_in_graph = self.cfg.backend_name in BACKWARD_IN_GRAPH_BACKENDS
        symbolic = True   # (False after a symbolic capture failed inside ember: captured again static)
        changed = self.sizes_changed(frame_args)
        found_before = dict(stop_at), list(break_guards), dict(hints)
        for _attempt in range(64):
            cap = Capture(consts, DimPolicy(self.cfg.dynamic, self.frame_state, changed) if symbolic else None)
            cap.eager_answers = program_in(EAGER_ANSWERS, self.cfg)
            cap.backward_in_graph = backward_in_graph
            cap.transient = tuple(break_guards)
            for g in break_guards:
                cap.guards.add(g, 1)
            local_vars = {}
            try:
                for name, param, value in zip(self.argnames, self.params,
                                              frame_args[1:] if self.shared else frame_args):
                    n = self.private_iters.get(name)
                    local_vars[name] = wrap_private_iter(cap, value, param, n) if n is not None else \
                        wrap_argument(cap, value, param)
            except Unsupported as u:   # an argument ember does not capture (a __torch_function__ subclass)
                if self.cfg.fullgraph:
                    raise GraphBreakError(_break_message(u.reason, where(self.code, 0))) from None
                return self.fallback_entry(cap, u.reason)
            cells = {}
            clo = (frame_args[0] if self.shared else self.fn.__closure__) or ()
            clo_source = "___clo" if self.shared else consts.ref(clo)
            for i, fv in enumerate(self.code.co_freevars):
                cells[fv] = wrap_cell(cap, clo[i], f"{clo_source}[{i}]")
            frame = Frame(cap, self.code, self.fn.__globals__, local_vars, cells, stop_at=stop_at)
            try:
                try:
                    result = frame.run()
                except StopCapture as stop:
                    try:
                        return self.make_entry(cap, frame_args, stop=stop, hint=hints.get(stop.inst.offset))
                    except Unsupported as u:   # (not a break where the frame stood: the entry's own limit)
                        raise _EntryFailed(u.reason) from u
                try:
                    return self.make_entry(cap, frame_args, result=result)
                except Unsupported as u:
                    raise _EntryFailed(u.reason) from u
            except _GradAfterBackward:
                backward_in_graph = False
            except Unsupported as u:
                if u.raises and not cap.eager_answers and (cap.compile_answered or
                                                           program_in(COMPILE_ANSWERED, self.cfg)):
                    self.answer_as_eager(u)   # then capture again from the breaks known before this path
                    stop_at, break_guards, hints = dict(found_before[0]), list(found_before[1]), dict(found_before[2])
                    continue
                inst = frame.current
                if inst is None or inst.offset in stop_at and stop_at[inst.offset][1] < frame.visits[inst.offset]:
                    return self.fallback_entry(cap, u.reason)
                where_ = u.where or where(self.code, inst.offset)
                if self.cfg.fullgraph:
                    raise GraphBreakError(_break_message(u.reason, where_)) from None
                stop_at[inst.offset] = (f"{u.reason} ({where_})", frame.visits[inst.offset] - 1)
                break_guards += u.holds_while
                if getattr(u, "inlined_at", None):
                    hints[inst.offset] = StopHint(u.inlined_at, u.reason, u.where, tuple(u.holds_while))
                log_breaks.debug("graph break in %s at %s: %s", self.name, where_, u.reason)
                _emit("break", name=self.name, reason=u.reason, where=where_)
            except Exception as e:
                if cap.symbols is None or not cap.symbols.any or isinstance(e, GraphBreakError):
                    if isinstance(e, _EntryFailed):
                        return self.fallback_entry(Capture(ConstTable()), e.reason)
                    raise
                # symbolic sizes met something ember does not handle yet: never wrong, capture again static
                log_dynamic.debug("%s (%s): symbolic capture failed (%s: %s); captured again with static sizes",
                                  self.name, _code_where(self.code), type(e).__name__, str(e)[:300])
                symbolic = False
            finally:
                if cap.compile_answered:
                    add_program(COMPILE_ANSWERED, self.cfg)
                torch._C._set_grad_enabled(prev_grad)
                if autocast_state() != prev_autocast:   # a capture stopped inside an autocast block
                    restore_autocast(prev_autocast)
        return self.fallback_entry(Capture(ConstTable()), "too many graph breaks")

    def answer_as_eager(self, u: Unsupported) -> None:
        """An op that raises (u) on a path taken for a compile-only answer (policy.EAGER_ANSWERS): every capture of
        the program answers as eager from now on; its entries are dropped (the next call captures them again)."""
        add_program(EAGER_ANSWERS, self.cfg)
        for fc in [fc for fc in FrameCompiler._all if fc.cfg is self.cfg]:
            fc.entries = []
        log_breaks.debug("%s: %s (%s) on a path taken for torch.compile's answer to is_compiling(); the program "
                         "answers as eager from now on", self.name, u.reason, u.where or _code_where(self.code))

    def fallback_entry(self, cap: Capture, reason: str) -> Entry:
        """Run the whole function as Python when these guards hold."""
        log_breaks.debug("%s runs uncompiled: %s", self.name, reason)
        _emit("fallback", name=self.name, reason=reason)
        gen = EntryCodegen(self, cap)
        call = f"{gen.function_expr(self)}({', '.join(self.argnames_call())})"
        gen.lines.append(f"return (___STEP_PYTHON, {call})" if self.steps else f"return {call}")
        return gen.finish(f"uncompiled ({reason})")

    def argnames_call(self) -> list[str]:
        out = []
        code = self.code
        n = code.co_argcount + code.co_kwonlyargcount
        for i, name in enumerate(self.params):
            if i < code.co_argcount:
                out.append(name)
            elif i < n:
                out.append(f"{name}={name}")
            elif code.co_flags & 0x04 and i == n:
                out.append(f"*{name}")
            else:
                out.append(f"**{name}")
        return out

    # -- building an entry --------------------------------------------------------------------------------
    def make_entry(self, cap: Capture, frame_args, result: V | None = None, stop: StopCapture | None = None,
                   hint: StopHint | None = None):
        gen = EntryCodegen(self, cap)
        gen.hint = hint
        try:
            if stop is None:
                live = [result]
            else:
                live = list(stop.frame.stack) + list(stop.frame.locals.values()) + \
                    [c.contents for c in stop.frame.cells.values() if c.contents is not None]
            gen.call_graph(live)
            if stop is None:
                out = gen.expr(result)
                gen.side_effects()
                gen.lines.append(f"return (___STEP_RETURN, {out})" if self.steps else f"return {out}")
            else:
                gen.resume(stop)
        except Unsupported as u:
            return self.fallback_entry(cap, u.reason)
        return gen.finish("graph" if stop is None else f"graph, then break at {stop.reason}")

    def resume_compiler(self, offset: int, stack_depth: int, names: tuple, nulls: tuple, compiled: bool,
                        iters: tuple = ()):
        """The function that continues this code at `offset` (compiled, or plain Python). A resume function's own
        breaks continue the original code (`origin`): a break inside a loop resumes at the same instruction on
        every iteration, one compiler per number of items left in the loop's iterators (`iters`: (argument
        position, items) of each iterator the entry rebuilds), so iterations do not recompile one another's entry."""
        if self.origin is not None:
            fc, offsets = self.origin
            return fc.resume_compiler(offsets[offset], stack_depth, names, nulls, compiled, iters)
        if compiled and iters and sum(k[0] == offset for k in self.resumes) >= MAX_LOOP_RESUMES:
            compiled = False   # a long Python loop breaking on every iteration: its rest runs as Python
        key = (offset, stack_depth, names, nulls, compiled, iters if compiled else ())
        if key not in self.resumes:
            from ember.frontend.bytecode_gen import make_resume_code
            rc = make_resume_code(self.code, offset, stack_depth, list(names), tuple(nulls))
            fn = types.FunctionType(rc.code, self.fn.__globals__, rc.code.co_name, None, self.fn.__closure__)
            if compiled:
                fc = FrameCompiler(fn, self.cfg, name=f"{self.name} (resumed at {offset})", shared=self.shared,
                                   steps=self.steps)
                fc.origin = (self, rc.original_offsets)
                fc.private_iters = {rc.argnames[i]: n for i, n in iters}
                self.resumes[key] = fc
            else:
                self.resumes[key] = fn
        return self.resumes[key]


class EntryCodegen:
    """Writes one entry function's Python source."""

    def __init__(self, fc: FrameCompiler, cap: Capture):
        self.fc, self.cap = fc, cap
        self.consts = cap.consts
        self.lines: list[str] = []
        self.namespace: dict[str, Any] = base_namespace(fc.cfg)
        self.memo: dict[int, str] = {}
        self.outputs: dict[int, int] = {}  # id(TensorV) -> index in the graph's outputs
        self.freed: set[int] = set()       # id(TensorV) of outputs an in-graph backward went through
        self.hint: StopHint | None = None   # for the call at the break (FrameCompiler.capture)
        self.ntmp = 0

    def function_expr(self, f) -> str:
        """A function to call in the entry: a shared compiler's, or a plain resume function of one, made with
        this call's closure."""
        code, f = (f.code, f.fn) if isinstance(f, FrameCompiler) else (f.__code__, f)
        if not self.fc.shared:
            return self.consts.ref(f)
        return f"___make_function({self.consts.ref(code)}, {self.consts.ref(f.__globals__)}, (), {{}}, ___clo)"

    def tmp(self, value: str | None = None) -> str:
        self.ntmp += 1
        self.lines += [f"___t{self.ntmp} = {value}"] if value is not None else []   # (a statement assigning it)
        return f"___t{self.ntmp}"

    # -- the graph --------------------------------------------------------------------------------------
    def call_graph(self, live: list[V]) -> None:
        cap = self.cap
        needed: list[TensorV | PyFloatV] = []
        seen = set()

        def visit(v, depth=0):
            if depth > 50 or id(v) in seen:
                return
            seen.add(id(v))
            if isinstance(v, TensorV):
                if v.source is None:
                    needed.append(v)
            elif isinstance(v, PyFloatV):
                needed.append(v)
            elif isinstance(v, (ListV, TupleV, SetV, IterV)):
                for x in (v.items if not isinstance(v, IterV) else v.remaining()):
                    visit(x, depth + 1)
            elif isinstance(v, DictV):
                for x in v.items.values():
                    visit(x, depth + 1)
            elif isinstance(v, NewObjV):
                for x in v.attrs.values():
                    visit(x, depth + 1)
            elif isinstance(v, ObjV):
                for x in v.writes.values():
                    visit(x, depth + 1)
            elif isinstance(v, CellV):
                if v.contents is not None:
                    visit(v.contents, depth + 1)
            elif isinstance(v, ClosureV):
                for x in (*v.defaults, *v.kwdefaults.values(), *v.closure):
                    visit(x, depth + 1)
            elif isinstance(v, BoundV):
                visit(v.self_v, depth + 1)

        for v in live:
            visit(v)
        for v in cap.mutables:
            visit(v)
        for _g, v in cap.global_writes.values():
            visit(v)
        for _t, v in cap.grad_writes.values():
            visit(v)
        real_ops = [n for n in cap.graph.nodes if n.op in ("call_function", "call_method", "call_module")
                    and n.target is not torch._C._set_grad_enabled]
        if not real_ops and not needed:
            if cap.grad_enabled != torch.is_grad_enabled():
                self.lines.append(f"___torch._C._set_grad_enabled({cap.grad_enabled})")
            return
        out_nodes = [v.node for v in needed]
        with_grad = [k for k, v in enumerate(needed) if v.fake.requires_grad]
        if cap.backward_node is not None and with_grad:
            # values with autograd history outlive a graph that ran its backward: the loss and what it was
            # computed from leave as tensors whose history is freed, as in eager; any other needs the graph break
            # at the backward, where eager autograd keeps its history
            from ember.autograd.partition import ancestors   # (here: partition imports the frontend's meta)
            freed = ancestors([cap.backward_node.args[0]])
            if any(needed[k].node not in freed for k in with_grad):
                raise _GradAfterBackward()
            for k in with_grad:
                self.freed.add(id(needed[k]))
                out_nodes[k] = cap.graph.call_method("detach", (needed[k].node,))
                out_nodes[k].meta["val"] = needed[k].fake.detach()
            self.namespace["___with_freed_history"] = with_freed_history
        for i, v in enumerate(needed):
            self.outputs[id(v)] = i
        close_autocast(cap)
        cap.graph.output(tuple(out_nodes))
        dead_ops = eliminate_dead_code(cap.graph)
        for inp in list(cap.inputs):  # inputs the graph ended up not using (still guarded) are not passed
            if not inp.node.users and not isinstance(inp.real, int):
                cap.graph.erase_node(inp.node)
                cap.inputs.remove(inp)
        if cap.symbols is not None:   # a symbol's int input stays while a tensor input's size has it
            cap.symbols.drop_unused()
        real_ops = [n for n in cap.graph.nodes if n.op in ("call_function", "call_method", "call_module")
                    and n.target is not torch._C._set_grad_enabled]
        root = torch.nn.Module()
        for n in cap.graph.nodes:
            if n.op == "get_attr":
                root.register_buffer(n.target, n.meta["tensor"], persistent=False)
        gm = torch.fx.GraphModule(root, cap.graph, class_name="GraphModule")
        gm.meta["ember_where"] = _code_where(self.fc.code)
        gm.meta["ember_dead_ops"] = dead_ops   # captured, then dropped as dead (explain's dead_op_count)
        gm.meta["ember_guarded"] = True   # called only with inputs matching example_inputs' metadata, grad mode
        example_inputs = [inp.real for inp in cap.inputs]
        if enabled("graph"):
            log_graph.debug("graph of %s (%s):\n%s", self.fc.name, _code_where(self.fc.code), gm.print_readable(False))
        _emit("graph", name=self.fc.name, gm=gm, ops=len(real_ops))
        cfg = self.fc.cfg
        try:
            if cap.transient:
                # its entry holds only until the program changes what broke the graph (an optimizer's state,
                # made at the first step): this graph runs once, uncompiled, instead of compiled for one call
                log_breaks.debug("graph of %s runs uncompiled: it is captured only until %s", self.fc.name,
                                 " and ".join(cap.transient))
                compiled = gm.forward
            else:
                # (ember's own backends fall back to eager from a crash; EMBER_CHECK=1 wraps the first calls)
                compiled = failsafe.compile_graph(cfg, gm, example_inputs)
        except Exception as e:
            raise BackendCompilerFailed(cfg.backend_name, e, _code_where(self.fc.code)) from e
        if not callable(compiled):
            raise BackendCompilerFailed(cfg.backend_name, TypeError(f"backend returned {type(compiled).__name__}, "
                                                                    f"not a callable"), _code_where(self.fc.code))
        self.namespace["___graph"] = compiled
        self.lines.append(f"___o = ___graph({', '.join(inp.source for inp in cap.inputs)})")

    # -- rebuilding values ------------------------------------------------------------------------------
    def expr(self, v: V) -> str:
        key = id(v)
        if key in self.memo:
            return self.memo[key]
        e = self._expr(v)
        if isinstance(v, (ListV, DictV, SetV, NewObjV, ClosureV, CellV, IterV)) and not e.isidentifier():
            t = self.tmp()
            self.lines.append(f"{t} = {e}")
            e = t
        self.memo[key] = e
        return e

    def _expr(self, v: V) -> str:
        c = self.consts.ref
        if isinstance(v, TensorV):
            if v.source is not None:
                return v.source
            if id(v) in self.freed:      # (once: the same tensor wherever it is used)
                t = self.tmp()
                self.lines.append(f"{t} = ___with_freed_history(___o[{self.outputs[id(v)]}])")
                return t
            return f"___o[{self.outputs[id(v)]}]"
        if isinstance(v, PyFloatV):  # a float64 0-d graph output: .item() is the Python float, exactly
            return f"___o[{self.outputs[id(v)]}].item()"
        if isinstance(v, ConstV):
            x = v.value
            if isinstance(x, torch.SymInt):   # an int computed from sizes: the same expression over this call's
                return f"({self.cap.symbols.python(x)})"
            if x is None or type(x) in (bool, int, str, bytes) or (type(x) is float and x == x and
                                                                   x not in (float("inf"), float("-inf"))):
                return repr(x)
            return c(x)
        if isinstance(v, ObjV):
            if v.source is not None:
                return v.source
            return c(v.value)
        if isinstance(v, ListV):
            if v.source is not None:
                return v.source
            return "[" + ", ".join(self.expr(x) for x in v.items) + "]"
        if isinstance(v, TupleV):
            items = ", ".join(self.expr(x) for x in v.items)
            if v.cls is tuple:
                return f"({items},)" if v.items else "()"
            if is_namedtuple_cls(v.cls):
                return f"{c(v.cls)}({items})"
            return f"{c(v.cls)}(({items},))"
        if isinstance(v, DictV):
            if v.source is not None:
                return v.source
            body = "{" + ", ".join(f"{self.key(k)}: {self.expr(x)}" for k, x in v.items.items()) + "}"
            if v.cls is dict:
                return body
            return f"{c(v.cls)}(**{body})" if dataclasses.is_dataclass(v.cls) else f"{c(v.cls)}({body})"
        if isinstance(v, SetV):
            if v.source is not None:
                return v.source
            return "{" + ", ".join(self.expr(x) for x in v.items) + "}" if v.items else "set()"
        if isinstance(v, NewObjV) and issubclass(v.cls, BaseException):
            args = v.attrs.get("args")
            return f"{c(v.cls)}(*{self.expr(args) if args is not None else '()'})"
        if isinstance(v, NewObjV):
            t = self.tmp()
            self.memo[id(v)] = t
            self.lines.append(f"{t} = ___new_object({c(v.cls)})")
            for k, x in v.attrs.items():
                self.lines.append(f"{t}.__dict__[{k!r}] = {self.expr(x)}")
            return t
        if isinstance(v, CellV):
            if v.source is not None:
                return v.source
            t = self.tmp()
            self.memo[id(v)] = t
            self.lines.append(f"{t} = ___make_cell()")
            if v.contents is not None:
                self.lines.append(f"{t}.cell_contents = {self.expr(v.contents)}")
            return t
        if isinstance(v, ClosureV):
            if v.source is not None:   # the function the call received (its parts can change only through it)
                return v.source
            defaults = "(" + "".join(self.expr(x) + ", " for x in v.defaults) + ")"
            kwd = "{" + ", ".join(f"{k!r}: {self.expr(x)}" for k, x in v.kwdefaults.items()) + "}"
            closure = "(" + "".join(self.expr(x) + ", " for x in v.closure) + ")"
            return f"___make_function({c(v.code)}, {c(v.globals)}, {defaults}, {kwd}, {closure})"
        if isinstance(v, IterV):
            return "iter((" + "".join(self.expr(x) + ", " for x in v.remaining()) + "))"
        if isinstance(v, BoundV):
            if isinstance(v.func, str):
                return f"{self.expr(v.self_v)}.{v.func}"
            return f"___MethodType({c(v.func)}, {self.expr(v.self_v)})"
        if isinstance(v, GradModeExitV):
            return f"___grad_exit({v.prev})"
        if isinstance(v, AutocastExitV):   # (a statement: the block entered before the break's instruction runs)
            return v.source or self.tmp(f"{c(_AutocastExit)}({', '.join(c(a) for a in v.node.args)})")
        if isinstance(v, GradModeCtxV):
            return f"___torch.set_grad_enabled({v.enabled})" if v.prev is not None else \
                f"___torch.{'enable_grad' if v.enabled else 'no_grad'}()"
        if isinstance(v, NoOpCtxV):  # entered during capture as nothing: its __exit__ does nothing either
            if v.exit:
                return c(_noop_exit)
            return f"{c(v.cls)}(*{c(v.args[0])}, **{c(v.args[1])})"
        if isinstance(v, SuperV):
            return f"super({c(v.cls)}, {self.expr(v.obj)})"
        if isinstance(v, NullV):
            return "___NULL"
        if isinstance(v, PartialV):
            kw = "".join(f", {k}={self.expr(x)}" for k, x in v.kwargs.items())
            return f"{c(functools.partial)}({self.expr(v.func)}{''.join(', ' + self.expr(x) for x in v.args)}{kw})"
        raise Unsupported(f"cannot rebuild a {type(v).__name__} in Python")

    def key(self, k) -> str:
        return self.consts.key(k)

    # -- side effects -----------------------------------------------------------------------------------
    def side_effects(self) -> None:
        """Write back mutations of things that existed before the call, in Python's terms."""
        writes: list[tuple[str, str]] = []  # (target statement format, value expr), values computed first
        for v in self.cap.mutables:
            if isinstance(v, ObjV):
                for name, x in v.writes.items():
                    writes.append((f"setattr({v.source}, {name!r}, {{}})", self.expr(x)))
                for name in v.deleted:
                    if name not in v.writes:
                        writes.append((f"delattr({v.source}, {name!r})", "None"))
            elif isinstance(v, ListV) and v.mutated:
                writes.append((f"{v.source}[:] = {{}}", "[" + ", ".join(self.expr(x) for x in v.items) + "]"))
            elif isinstance(v, DictV) and v.mutated:
                body = "{" + ", ".join(f"{self.key(k)}: {self.expr(x)}" for k, x in v.items.items()) + "}"
                writes.append((f"{v.source}.clear(); {v.source}.update({{}})", body))
            elif isinstance(v, SetV) and v.mutated:
                writes.append((f"{v.source}.clear(); {v.source}.update({{}})",
                               "[" + ", ".join(self.expr(x) for x in v.items) + "]"))
            elif isinstance(v, CellV) and v.mutated and v.contents is not None:
                writes.append((f"{v.source}.cell_contents = {{}}", self.expr(v.contents)))
        for (_gid, name), (g, x) in self.cap.global_writes.items():
            writes.append((f"{self.consts.ref(g)}[{name!r}] = {{}}", self.expr(x)))
        for t, g in self.cap.grad_writes.values():
            writes.append((f"{t.source}.grad = {{}}", self.expr(g)))
        temps = []
        for _target, value in writes:
            t = self.tmp()
            self.lines.append(f"{t} = {value}")
            temps.append(t)
        for (target, _value), t in zip(writes, temps):
            self.lines.append(target.format(t) if "{}" in target else target)

    # -- graph breaks -----------------------------------------------------------------------------------
    def resume(self, stop: StopCapture) -> None:
        """The break's instruction run in Python, then the rest of the function as a compiled resume function.

        Inside a try or with block, an exception from the instruction resumes the function uncompiled at that
        instruction with the failing operand replaced by a `Raiser` of the exception: Python raises it again
        there and the function's own handlers run. Inside a loop, each iteration's break resumes the same
        instruction (FrameCompiler.resume_compiler), nested at most MAX_LOOP_DEPTH calls deep at run time."""
        frame, inst = stop.frame, stop.inst
        stack_vs = list(frame.stack)
        stack = [self.expr(v) for v in stack_vs]
        names = tuple(frame.locals)
        local_vs = [frame.locals[n] for n in names]
        cell_names = tuple(n for n, c in frame.cells.items() if n in frame.code.co_cellvars and c.contents is not None)
        local_vs += [frame.cells[n].contents for n in cell_names]
        local_exprs = [self.expr(v) for v in local_vs]
        names = names + cell_names
        self.side_effects()
        insts, index = instructions(frame.code)
        looping = in_loop(frame.code, inst.offset)
        covering = enclosing_blocks(frame.code, inst.offset)
        grad_withs = [frame.stack[e.depth - 1] for e, is_with in covering if is_with and 0 < e.depth <= len(frame.stack)
                      and isinstance(frame.stack[e.depth - 1], GradModeExitV)]
        in_try = len(grad_withs) != len(covering)  # a block whose handler is not only a grad-mode restore
        restore = f"___torch._C._set_grad_enabled({grad_withs[0].prev})" if grad_withs and not in_try else None

        def go(offset: int, st: list[str], vs: list, compiled: bool = True) -> str:
            keep = [i for i, e in enumerate(st) if e != "___NULL"]
            nst = tuple(i for i, e in enumerate(st) if e == "___NULL")
            args = ", ".join([st[i] for i in keep] + local_exprs)
            arg_vs = [vs[i] for i in keep] + local_vs
            iters = tuple((i, len(v.remaining())) for i, v in enumerate(arg_vs) if isinstance(v, IterV))
            plain = self.function_expr(self.fc.resume_compiler(offset, len(st), names, nst, False))
            steps = self.fc.steps
            uncompiled = f"return (___STEP_PYTHON, {plain}({args}))" if steps else f"return {plain}({args})"
            if not compiled or not all(unrolled(v) for v in arg_vs if isinstance(v, IterV)):
                return uncompiled
            rc = self.fc.resume_compiler(offset, len(st), names, nst, True, iters)
            if not isinstance(rc, FrameCompiler):
                return uncompiled
            if rc.shared:
                args = f"___clo, {args}" if args else "___clo"
            packed = f"({args}{',' if args else ''})"
            if steps:   # (break_frames.drive calls it: no nesting, in a loop or not)
                return f"return (___STEP_CALL, {self.consts.ref(rc)}, {packed})"
            if looping:
                return f"return ___loop_resume({self.consts.ref(rc)}, {plain}, {packed})"
            return f"return {self.consts.ref(rc)}({packed}, {{}})"

        def at_instruction(st: list[str]) -> str:
            """Resume uncompiled at the instruction itself (3.11: at the PRECALL/KW_NAMES that set up a CALL)."""
            i = index[inst.offset]
            while i > 0 and insts[i - 1].opname in ("PRECALL", "KW_NAMES") and op == "CALL":
                i -= 1
            return go(insts[i].offset, st, stack_vs, compiled=False)

        def run(line: str, operand: int) -> None:
            """The instruction's work in Python; in a try block, its exception re-raised by the function's code
            (stack slot `operand` holds what raises it)."""
            if not in_try:
                self.guarded_call(line, restore)
                return
            self.lines += ["___exc = None", "try:", "    " + line, "except BaseException as ___e:", "    ___exc = ___e",
                           "if ___exc is not None:"]
            st = list(stack)
            st[operand] = "___raiser(___exc)"
            self.lines.append("    " + at_instruction(st))

        op = inst.opname
        if op == "YIELD_VALUE" and self.fc.steps:
            # a generator's capture ends at its next yield: the value, and how to go on with the value sent in
            # (the resume function's arguments are read now, as the generator's frame would hold them)
            frozen = []
            for e in [*stack[:-1], *local_exprs]:
                t = e if e == "___NULL" else self.tmp()
                if t != e:
                    self.lines.append(f"{t} = {e}")
                frozen.append(t)
            local_exprs[:] = frozen[len(stack) - 1:]
            self.lines.append(f"___yielded = {stack[-1]}")
            ret = go(insts[index[inst.offset] + 1].offset, frozen[:len(stack) - 1] + ["___sent"],
                     stack_vs[:-1] + [None])
            self.lines.append(f"return (___STEP_YIELD, ___yielded, lambda ___sent: {ret[len('return '):]})")
            return
        if op not in ("CALL", "CALL_FUNCTION_EX", "LOAD_ATTR", "LOAD_METHOD", "POP_JUMP_IF_TRUE", "POP_JUMP_IF_FALSE",
                      "POP_JUMP_FORWARD_IF_TRUE", "POP_JUMP_FORWARD_IF_FALSE",
                      "POP_JUMP_BACKWARD_IF_TRUE", "POP_JUMP_BACKWARD_IF_FALSE"):
            # Run the rest of the function as Python from this instruction (its handlers included).
            self.lines.append(at_instruction(stack))
            return
        nxt = insts[index[inst.offset] + 1].offset
        hint = f", {self.consts.ref(self.hint)}" if self.hint is not None else ""
        if op == "CALL":
            n = inst.arg
            kw = frame.kw_names
            base = len(stack) - n - 2
            a, b, args = stack[base], stack[base + 1], stack[base + 2:]
            if a == "___NULL":
                fn, pos, callee = b, args, base + 1
            else:
                fn, pos, callee = a, [b] + args, base
            npos = len(pos) - len(kw)
            call = (f"___r = __call_compiled({fn}, ({''.join(e + ', ' for e in pos[:npos])}), "
                    f"{{{', '.join(f'{k!r}: {e}' for k, e in zip(kw, pos[npos:]))}}}, ___cfg{hint})")
            run(call, callee)
            self.lines.append(go(nxt, stack[:base] + ["___r"], stack_vs[:base] + [None]))
        elif op in ("LOAD_ATTR", "LOAD_METHOD"):
            # an attribute whose getter ember cannot capture (a property that logs, say): read in Python, the
            # rest compiled. A method load (3.11 LOAD_METHOD, 3.12 LOAD_ATTR with the low bit) leaves
            # NULL and the bound attribute, which the CALL after it calls alike
            method = op == "LOAD_METHOD" or (sys.version_info >= (3, 12) and inst.arg & 1)
            run(f"___r = getattr({stack[-1]}, {inst.argval!r})", len(stack) - 1)
            self.lines.append(go(nxt, stack[:-1] + (["___NULL", "___r"] if method else ["___r"]),
                                 stack_vs[:-1] + ([None, None] if method else [None])))
        elif op == "CALL_FUNCTION_EX":
            has_kw = inst.arg & 1
            kwargs = stack[-1] if has_kw else "{}"
            args = stack[-1 - has_kw]
            fn = stack[-2 - has_kw]
            base = len(stack) - 2 - has_kw
            if base > 0 and stack[base - 1] == "___NULL":
                base -= 1
            run(f"___r = __call_compiled({fn}, tuple({args}), dict({kwargs}), ___cfg{hint})", len(stack) - 2 - has_kw)
            self.lines.append(go(nxt, stack[:base] + ["___r"], stack_vs[:base] + [None]))
        else:
            when = op.endswith("TRUE")
            cond = stack[-1]
            if restore or in_try:
                run(f"___c = bool({cond})", len(stack) - 1)
                cond = "___c"
            self.lines.append(f"if bool({cond}) is {when}:")
            self.lines.append("    " + go(inst.argval, stack[:-1], stack_vs[:-1]))
            self.lines.append(go(nxt, stack[:-1], stack_vs[:-1]))

    def guarded_call(self, line: str, restore: str | None) -> None:
        """The break's instruction; inside `with torch.no_grad()` an exception leaves the grad mode restored."""
        if restore is None:
            self.lines.append(line)
            return
        self.lines += ["try:", "    " + line, "except BaseException:", "    " + restore, "    raise"]

    # -- the function -----------------------------------------------------------------------------------
    def finish(self, description: str) -> Entry:
        fc = self.fc
        if self.cap.symbols is not None:   # (after the tensor guards that make reading the sizes safe)
            for g in self.cap.symbols.guards():
                self.cap.guards.add(g, 3)
        guards = self.cap.guards.exprs()
        condition = self.cap.guards.condition()
        checker = self.cap.guards.checker
        if checker is not None:   # (its dict_get: dict.get without Tensor.__hash__ calls)
            self.namespace.update({name: getattr(checker, f) for name, f in CHECKER_FUNCTIONS.items()})
        self.namespace.update(self.consts.objs)
        params = ", ".join(fc.entry_params)
        lines = list(self.lines)
        first = lines[:1] if lines and lines[0].startswith("___o = ___graph(") else []
        cond, first = share_paths(condition, first)
        lines[:len(first)] = first
        src = [f"def ___entry({params}):",
               "    try:",
               f"        ___ok = {cond}",
               "    except Exception:",
               "        return ___MISS",
               "    if not ___ok:",
               "        return ___MISS"]
        src += ["    " + line for line in lines]
        text = "\n".join(src) + "\n"
        if enabled("guards"):
            log_guards.debug("entry for %s (%s):\n%s", fc.name, _code_where(fc.code), text)
        entry = make_entry_function(fc, text, self.namespace, guards, description)
        _emit("entry", name=fc.name, guards=guards)
        entry.graph_inputs = [i.source for i in self.cap.inputs]
        return entry


def base_namespace(cfg) -> dict:
    """The names every entry's code may use besides its own constants."""
    return {"___MISS": MISS, DICT_GET: dict.get, "___torch": torch, "___math": math, "___NULL": NULL, "___new_object": _new_object,
            "___make_cell": _make_cell, "___grad_exit": _GradExit, "__call_compiled": call_compiled, "___cfg": cfg,
            "___MethodType": types.MethodType, "___make_function": make_function, "___iter_rest": tuple_iter_rest,
            "___raiser": Raiser, "___loop_resume": loop_resume, "___STEP_RETURN": STEP_RETURN,
            "___STEP_YIELD": STEP_YIELD, "___STEP_CALL": STEP_CALL, "___STEP_PYTHON": STEP_PYTHON}


def make_entry_function(fc: FrameCompiler, text: str, namespace: dict, guards: list[str], description: str) -> Entry:
    """The entry whose source is `text` (a function ___entry over fc's entry parameters), run in `namespace`."""
    filename = f"<ember entry of {fc.name}>"
    code = compile(text, filename, "exec")
    ns = dict(namespace)
    exec(code, ns)
    if isinstance(ns.get("___graph"), failsafe.FirstCalls):   # it leaves the entry after its first calls
        ns["___graph"].slots.append(ns)
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    ns_for_check = dict(ns)

    def check(g: str, frame_args) -> bool:
        return eval(g, ns_for_check, dict(zip(fc.entry_params, frame_args)))

    entry = Entry(ns["___entry"], guards, check, description)
    entry.source = text
    return entry


# ---------------------------------------------------------------------------------------------------------
# Helpers the generated code calls.

def _new_object(cls):
    return cls.__new__(cls) if cls.__new__ is not object.__new__ else object.__new__(cls)


def _make_cell():
    return types.CellType()


BACKWARD_IN_GRAPH_BACKENDS = ("ember", "aot_eager", "eager")


class _EntryFailed(Exception):
    """The entry of a finished capture could not be made (a symbolic size it cannot say in Python)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class _GradAfterBackward(Exception):
    """A capture with `loss.backward()` in its graph returns or keeps a value that requires grad."""


def _code_where(code) -> str:
    return f"{code.co_filename}:{code.co_firstlineno}"


def _break_message(reason: str, where_: str) -> str:
    filename, _, line = where_.rpartition(":")
    src = linecache.getline(filename, int(line)).strip() if line.isdigit() else ""
    return (f"graph break with fullgraph=True: {reason}\n  at {where_}\n    {src}\n"
            f"Remove fullgraph=True to let ember split the graph here, or change this line.")


def reset_caches() -> None:
    for fc in list(FrameCompiler._all):
        fc.entries.clear()
        fc.resumes.clear()
        fc.frame_state.clear()
        fc.disabled = bool(fc.code.co_flags & (CO_GENERATOR | CO_COROUTINE | CO_ASYNC_GENERATOR)) and not fc.steps
        fc.warned = False
        fc.restore_asked = False
    FrameCompiler._by_function = weakref.WeakKeyDictionary()
    FrameCompiler._by_code = weakref.WeakKeyDictionary()
    # decoded bytecode and resume code too: a capture after reset() pays what a fresh process pays
    # (bench/frontend.py's cold capture times rely on it)
    from ember.frontend import bytecode_gen, interpreter
    interpreter.clear_caches()
    bytecode_gen.clear_caches()
