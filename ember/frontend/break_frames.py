"""What a graph break's entry runs and passes on: which functions a break compiles as frames of their own, how a
resume function knows the values its caller's entry rebuilt, and how breaks inside loops and try blocks resume.

A break's entry (ember.frontend.convert) runs the instruction ember could not capture and calls the rest of the
function as a resume function. The values it hands over are new objects on every call where the capture made
them: functions the frame defined (`make_function`), bound methods, a loop's iterator (`iter((...))` of the items
left). The resume function's capture knows them by their parts (`wrap_argument`, `wrap_private_iter`), so one entry
serves every call, as the original objects would. A generator called at a break runs from yield to yield through
`drive`, its entries returning steps.
"""
from __future__ import annotations

import dis
import sys
import threading
import types
import weakref
from typing import Any, Callable

import torch

from ember.frontend.capture import Capture
from ember.frontend.interpreter import instructions
from ember.frontend.policy import COMPILED_MODULE, MODULE_WRAPPERS, wrapped_module_attr
from ember.frontend.python_objects import CO_ASYNC_GENERATOR, CO_COROUTINE, CO_GENERATOR
from ember.frontend.values import BoundV, CellV, ClosureV, IterV, ObjV, TupleV, V


# Frames never compiled on their own at a break: torch's internals (as torch.compile skips them), ember itself, and
# libraries whose code ember does not capture anyway. torch.nn's modules and functional code are compiled
# (`COMPILED_TORCH`, as torch.compile inlines them): a break inside one child of an nn.Sequential or a model's
# ModuleList loop then costs a split of the container's frame, not its whole subtree run as Python. Model libraries
# (torchvision, transformers, timm) are user code.
LIBRARY_SKIP = ("torch", "ember", "numpy", "scipy", "functools", "builtins", "logging", "typing")
COMPILED_TORCH = ("torch.nn.modules.", "torch.nn.functional")


# compiled resume functions per instruction of a loop (one per iteration count left); beyond, Python runs the rest
MAX_LOOP_RESUMES = 32


TUPLE_ITER = type(iter(()))


def tuple_iter_rest(it) -> tuple:
    """The items a tuple iterator has left, without advancing it."""
    r = it.__reduce__()
    return r[1][0][r[2]:] if len(r) > 2 else ()


def wrap_private_iter(cap: Capture, value, source: str, n: int) -> V:
    """A loop's iterator made by the caller's entry for this call (`iter((...))`): its items, as an IterV the
    capture iterates (nothing else holds it, so the real one need not advance)."""
    if type(value) is not TUPLE_ITER or len(tuple_iter_rest(value)) != n:
        return cap.wrap(value, source)
    cap.guards.add(f"type({source}) is {cap.consts.ref(TUPLE_ITER)} and len(___iter_rest({source})) == {n}", 1)
    v = IterV([cap.wrap(x, f"___iter_rest({source})[{i}]") for i, x in enumerate(tuple_iter_rest(value))],
              source=source)
    cap.by_id[id(value)] = v
    cap.keepalive.append(value)
    return v


def wrap_cell(cap: Capture, cell, source: str) -> V:
    """A closure cell, its contents wrapped as an argument (a function the frame defined, held by another one)."""
    if id(cell) in cap.by_id or source in cap.by_source or type(cell) is not types.CellType:
        return cap.wrap(cell, source)
    try:
        contents = cell.cell_contents
    except ValueError:
        return cap.wrap(cell, source)
    v = CellV(None, source)
    v.contents = wrap_argument(cap, contents, f"{source}.cell_contents")
    cap._track(cell, v)
    cap.by_source[source] = v
    return v


def wrap_argument(cap: Capture, value, source: str) -> V:
    """An argument; a bound method (a `with` block's __exit__ a resume function receives) and a function an entry
    made (a closure the frame defined) are new objects on every call: they are known by their parts (function and
    object; code, globals, defaults and cells), each guarded, not by identity."""
    if id(value) in cap.by_id or source in cap.by_source:
        return cap.wrap(value, source)
    if type(value) is types.MethodType and isinstance(value.__func__, types.FunctionType):
        cap.guards.add(f"type({source}) is ___MethodType and {source}.__func__ is {cap.consts.ref(value.__func__)}",
                       0)
        v = BoundV(cap.wrap(value.__self__, f"{source}.__self__"), value.__func__, source)
    elif type(value) is types.FunctionType and value in MADE_FUNCTIONS:
        c = cap.consts.ref
        kwd = value.__kwdefaults__ or {}
        cap.guards.add(f"type({source}) is {c(types.FunctionType)} and {source}.__code__ is {c(value.__code__)} and "
                       f"{source}.__globals__ is {c(value.__globals__)} and len({source}.__defaults__ or ()) == "
                       f"{len(value.__defaults__ or ())} and tuple({source}.__kwdefaults__ or ()) == {tuple(kwd)!r}", 0)
        v = ClosureV(value.__code__, value.__globals__, value.__name__,
                     tuple(cap.wrap(d, f"{source}.__defaults__[{i}]") for i, d in enumerate(value.__defaults__ or ())),
                     {k: cap.wrap(d, f"{source}.__kwdefaults__[{k!r}]") for k, d in kwd.items()},
                     tuple(wrap_cell(cap, x, f"{source}.__closure__[{i}]")
                           for i, x in enumerate(value.__closure__ or ())),
                     value.__qualname__, source)
    else:
        return cap.wrap(value, source)
    cap.by_id[id(value)] = v
    cap.by_source[source] = v
    cap.keepalive.append(value)
    return v


def make_function(code, f_globals, defaults, kwdefaults, closure):
    fn = types.FunctionType(code, f_globals, code.co_name, defaults or None, closure or None)
    fn.__kwdefaults__ = kwdefaults or None
    fn.__qualname__ = code.co_qualname
    MADE_FUNCTIONS.add(fn)
    return fn


# functions the entries made (a compiled frame's closures, lambdas and comprehensions, new on every call): a break
# calling one compiles it through the compiler its code shares (FrameCompiler.shared_for)
MADE_FUNCTIONS: "weakref.WeakSet[types.FunctionType]" = weakref.WeakSet()


def defaults_key(f: types.FunctionType) -> tuple:
    """f's defaults, by value where they are plain constants, else by identity (the binder keeps them alive)."""
    def key(v):
        return (type(v), v) if type(v) in (int, float, str, bool, bytes, type(None)) else ("id", id(v))
    return (tuple(key(v) for v in f.__defaults__ or ()),
            tuple((k, key(v)) for k, v in sorted((f.__kwdefaults__ or {}).items())))


def module_forward(m: torch.nn.Module) -> tuple[Any, tuple]:
    """What calling module m runs, as (function, leading arguments), where that is only its forward: no hooks
    (they run through Module.__call__, in Python). Otherwise (m, ())."""
    from torch.nn.modules import module as torch_module
    if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or torch_module._global_forward_hooks \
            or torch_module._global_forward_pre_hooks or torch_module._global_backward_hooks:
        return m, ()
    fwd = m.__dict__.get("forward")
    if fwd is None:
        fwd = type(m).forward
        return (fwd, (m,)) if isinstance(fwd, types.FunctionType) else (m, ())
    if isinstance(fwd, types.MethodType) and isinstance(fwd.__func__, types.FunctionType):
        return fwd.__func__, (fwd.__self__,)   # a forward set on the instance (a patched or wrapped module)
    return (fwd, ()) if isinstance(fwd, types.FunctionType) else (m, ())


def call_with_forward(m: torch.nn.Module, args: tuple, kwargs: dict, forward: Callable):
    """m(*args, **kwargs) through the module's own call (its hooks of every kind, a subclass's __call__: FSDP2's
    all-gather before and reshard after, a library's checkpointing layer), with `forward` (the module's forward,
    compiled) standing in for m.forward during the call, as nn.Module's call reads self.forward."""
    own = m.__dict__
    had, before = "forward" in own, own.get("forward")
    own["forward"] = forward
    try:
        return m(*args, **kwargs)
    finally:
        if had:
            own["forward"] = before
        else:
            own.pop("forward", None)


# the compiled stand-in of the module each wrapper (DDP) wraps, per compile config: wrapper -> {id(cfg): CompiledModule}
_wrapped_compiled: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def call_wrapper(m: torch.nn.Module, args: tuple, kwargs: dict, cfg):
    """A library wrapper module's call (policy.PYTHON_WRAPPER_MODULES: DDP): its own forward runs as Python, with
    the module it wraps replaced for the call by a compiled stand-in sharing all its state (an ember CompiledModule,
    policy.MODULE_WRAPPERS), so the model runs compiled inside DDP's forward, its hooks and bucket state DDP's own.
    A module that already is a compiled one is called as it is."""
    attr = wrapped_module_attr(m)
    inner = m._modules[attr]
    if type(inner) in MODULE_WRAPPERS or not COMPILED_MODULE:
        return m(*args, **kwargs)
    per_cfg = _wrapped_compiled.setdefault(m, {})   # (by the config's id: the stand-in holds the config)
    stand_in = per_cfg.get(id(cfg))
    if stand_in is None or stand_in._orig_mod is not inner:
        stand_in = per_cfg[id(cfg)] = COMPILED_MODULE[0](inner, cfg)
    m._modules[attr] = stand_in
    try:
        return m(*args, **kwargs)
    finally:
        m._modules[attr] = inner


def is_library(fn: types.FunctionType) -> bool:
    mod = getattr(fn, "__module__", None) or ""
    return mod.split(".")[0] in LIBRARY_SKIP and not mod.startswith(COMPILED_TORCH)


def in_loop(code, offset: int) -> bool:
    """Whether a backward jump spans the offset: the instruction may run again in the same call."""
    insts, _index = instructions(code)
    return any(i.opcode in dis.hasjrel and i.argval is not None and i.argval <= offset < i.offset for i in insts)


def unrolled(it: IterV) -> bool:
    """Whether a loop over these items is compiled on from a break inside it, one resume function per number of
    items left: a loop over a model's modules (nn.Sequential, ModuleList, enumerate(...) of them), where each
    iteration runs other code, or a loop with at most SHORT_LOOP iterations left. A longer loop over numbers or
    data would compile a function per iteration (ember specializes on Python numbers): its rest runs as Python."""
    def has_module(v) -> bool:
        return isinstance(v, ObjV) and isinstance(v.value, torch.nn.Module) or \
            isinstance(v, TupleV) and any(has_module(x) for x in v.items)
    rest = it.remaining()
    return len(rest) <= SHORT_LOOP or all(has_module(v) for v in rest)


SHORT_LOOP = 3


class Raiser:
    """Stands for the operand of an instruction that raised in a try block: calling it, reading an attribute of it
    or its truth value raises that exception again, inside the resumed function's handlers."""
    __slots__ = ("exc",)

    def __init__(self, exc: BaseException):
        object.__setattr__(self, "exc", exc)

    def __getattribute__(self, name):
        raise object.__getattribute__(self, "exc")

    def __call__(self, *args, **kwargs):
        raise object.__getattribute__(self, "exc")

    def __bool__(self):
        raise object.__getattribute__(self, "exc")


# compiled resumes a loop may nest (each iteration's break calls the next one's resume from inside its own): past
# it, the rest of the loop runs as Python, so a long loop breaking on every iteration cannot exhaust the stack
MAX_LOOP_DEPTH = 32
_loop_state = threading.local()


# What a generator's entry returns (FrameCompiler.steps): (STEP_RETURN, value), (STEP_YIELD, value, continue with
# the value sent in -> a STEP_CALL), (STEP_CALL, resume compiler, its arguments), (STEP_PYTHON, generator).
STEP_RETURN, STEP_YIELD, STEP_CALL, STEP_PYTHON = "return", "yield", "call", "python"


def call_compiled(f, args: tuple, kwargs: dict, cfg, hint=None):
    """Run the instruction a graph break stopped at; user functions called there are compiled in turn (`hint`:
    where the break that stopped the caller sits in this call, see convert.StopHint)."""
    from ember.frontend.convert import FrameCompiler   # (convert imports this module)
    target, prefix = f, ()
    if isinstance(f, torch.nn.Module):
        if wrapped_module_attr(f) is not None:
            return call_wrapper(f, args, kwargs, cfg)
        if f._forward_hooks or f._forward_pre_hooks:   # (capture broke here for hooks that run as Python)
            forward = f.forward
            return call_with_forward(f, args, kwargs, lambda *a, **k: call_compiled(forward, a, k, cfg, hint))
        target, prefix = module_forward(f)
    elif isinstance(f, types.MethodType) and isinstance(f.__func__, types.FunctionType):
        target, prefix = f.__func__, (f.__self__,)
    if isinstance(target, types.FunctionType) and not getattr(target, "__ember_disable__", False) \
            and not is_library(target) and not target.__code__.co_flags & (CO_COROUTINE | CO_ASYNC_GENERATOR):
        steps = bool(target.__code__.co_flags & CO_GENERATOR)
        fc = FrameCompiler.shared_for(target, cfg, steps) if target in MADE_FUNCTIONS else \
            FrameCompiler.for_function(target, cfg, steps)
        call_args = fc.call_args(target, (*prefix, *args))
        if steps:   # a generator: its arguments bound now (a TypeError is raised by the call), its body run lazily
            gen = drive(fc, call_args, kwargs, fc.bind(*call_args, **kwargs))
            gen.__name__, gen.__qualname__ = target.__name__, target.__qualname__
            return gen
        if hint is None or hint.used or hint.frames[0][0] is not target.__code__:
            return fc(call_args, kwargs)
        hint.used = True
        fc.pending_hint = hint
        try:
            return fc(call_args, kwargs)
        finally:
            fc.pending_hint = None
    return f(*args, **kwargs)


def drive(fc: Callable, args: tuple, kwargs: dict, frame_args: tuple):
    """The generator a compiled generator function returns: runs its entries from yield to yield. A value thrown in
    at a yield propagates out, as from the generator's own frame: only generators whose yields sit in no try or
    with block are compiled (compilable_generator)."""
    step = fc.run_bound(frame_args, args, kwargs)
    while True:
        kind = step[0]
        if kind is STEP_YIELD:
            step = step[2]((yield step[1]))
        elif kind is STEP_CALL:
            step = step[1](step[2], {})
        elif kind is STEP_RETURN:
            return step[1]
        else:
            return (yield from step[1])


def compilable_generator(code: types.CodeType) -> bool:
    """A generator whose yields are in no try/with block and that delegates to no other (`yield from`). Python
    3.11 only: 3.12 wraps a generator's whole body in a handler (StopIteration -> RuntimeError), which the resume
    code's layout does not have yet, so generators there run as Python."""
    if sys.version_info >= (3, 12):
        return False
    insts, _index = instructions(code)
    if any(i.opname in ("SEND", "GET_YIELD_FROM_ITER") for i in insts):
        return False
    return not any(i.opname == "YIELD_VALUE" and enclosing_blocks(code, i.offset) for i in insts)


def loop_resume(compiled: Callable, plain: Callable, args: tuple):
    """Call a loop's compiled resume function (a FrameCompiler), or past MAX_LOOP_DEPTH nested ones its plain one."""
    depth = getattr(_loop_state, "depth", 0)
    if depth >= MAX_LOOP_DEPTH:
        return plain(*args)
    _loop_state.depth = depth + 1
    try:
        return compiled(args, {})
    finally:
        _loop_state.depth = depth


def enclosing_blocks(code, offset: int) -> list:
    """The try/with blocks around an offset, outermost first, as (exception-table entry, is a with block).

    CPython's table maps each range to its innermost handler only, so an outer block's range is the hull of
    all the pieces that name its handler."""
    insts, index = instructions(code)
    hulls: dict[int, list] = {}
    for e in dis._parse_exception_table(code):
        h = hulls.setdefault(e.target, [e.start, e.end, e])
        h[0], h[1] = min(h[0], e.start), max(h[1], e.end)
    out = []
    for target, (start, end, e) in hulls.items():
        if start <= offset < end:
            i = index.get(target)
            ops = [insts[j].opname for j in range(i, min(i + 2, len(insts)))] if i is not None else []
            if ops[:1] != ["PUSH_EXC_INFO"]:
                continue  # cleanup of a handler, not a block of user code
            out.append((e, ops[1:2] == ["WITH_EXCEPT_START"]))
    return sorted(out, key=lambda item: item[0].depth)
