"""A symbolic interpreter of CPython 3.11/3.12 bytecode that records torch operations into a torch.fx.Graph.

It runs a function's instructions on tracked values (ember.frontend.values) instead of real ones. Python-level
values are known at capture time (they come from the first call's arguments), so Python control flow is
followed, and every assumption made about them becomes a guard. Tensors are fake: each tensor operation adds a
node to the graph and is run on fake tensors only for its result's shape and dtype.

One `Frame` interprets one code object; calls to user functions are inlined as child frames sharing the
`Capture` (graph, guards, wrapped inputs). Whatever cannot be recorded raises `Unsupported`; the caller
(ember.frontend.convert) turns that into a graph break at the root frame's current instruction.

This file is the frame loop: the frame's state and value stack, the dispatch of each instruction to its handler
in ember.frontend.opcodes, the exception table, and the inlining of calls. What values mean lives in the mixin
classes Frame is made of, one job per file (python_semantics, operators, items, attributes, calls, methods,
py_float, modes, backward_in_graph); capture.py records torch calls; policy.py says which calls are recorded.
"""
from __future__ import annotations

import bisect
import dis
import types

from ember import config
from ember.errors import Unsupported
from ember.frontend.attributes import Attributes
from ember.frontend.backward_in_graph import BackwardInGraph
from ember.frontend.calls import Calls
from ember.frontend.capture import Capture
from ember.frontend.items import Items
from ember.frontend.methods import Methods
from ember.frontend.modes import GlobalModes
from ember.frontend.opcodes.registry import OPCODES   # (importing the opcodes package registers every handler)
from ember.frontend.operators import Operators
from ember.frontend.py_float import PyFloats
from ember.frontend.python_objects import CO_GENERATOR, CO_VARARGS, CO_VARKEYWORDS
from ember.frontend.python_semantics import PythonSemantics
from ember.frontend.signals import PyError, Return, StopCapture
from ember.frontend.values import CellV, ConstV, DictV, IterV, ObjV, TupleV, V


def where(code: types.CodeType, offset: int) -> str:
    """file:line of an instruction (every recorded op carries one, so each code's line starts are listed once
    rather than co_lines walked per op: docs/evidence.md)"""
    starts = _LINE_STARTS.get(code)
    if starts is None:
        starts = _LINE_STARTS[code] = ([], [])
        for start, _end, lineno in code.co_lines():
            if lineno is not None:
                starts[0].append(start)
                starts[1].append(lineno)
    i = bisect.bisect_right(starts[0], offset)
    return f"{code.co_filename}:{starts[1][i - 1] if i else None}"


_INSTRUCTIONS: dict[types.CodeType, tuple[list, dict]] = {}
_LINE_STARTS: dict[types.CodeType, tuple[list, list]] = {}
_EXCEPTION_TABLES: dict[types.CodeType, list] = {}


def clear_caches() -> None:
    _INSTRUCTIONS.clear()
    _EXCEPTION_TABLES.clear()
    _LINE_STARTS.clear()


def exception_table(code: types.CodeType) -> list:
    if code not in _EXCEPTION_TABLES:
        _EXCEPTION_TABLES[code] = list(dis._parse_exception_table(code))
    return _EXCEPTION_TABLES[code]


def instructions(code: types.CodeType) -> tuple[list[dis.Instruction], dict[int, int]]:
    if code not in _INSTRUCTIONS:
        insts = list(dis.get_instructions(code))
        _INSTRUCTIONS[code] = (insts, {inst.offset: i for i, inst in enumerate(insts)})
    return _INSTRUCTIONS[code]


class Frame(PythonSemantics, Operators, PyFloats, Items, Attributes, BackwardInGraph, Calls, Methods,
            GlobalModes):
    """Interprets one code object over tracked values. The opcode handlers (ember.frontend.opcodes) act on it
    through its stack methods and the value semantics of its mixin bases."""

    def __init__(self, cap: Capture, code: types.CodeType, f_globals: dict, local_vars: dict[str, V],
                 cells: dict[str, CellV], parent: Frame | None = None, stop_at: dict | None = None,
                 start_offset: int = 0, globals_source: str | None = None):
        self.cap, self.code, self.f_globals = cap, code, f_globals
        self.locals = local_vars
        self.cells = cells
        self.parent = parent
        self.depth = 0 if parent is None else parent.depth + 1
        self.stack: list[V] = []
        self.insts, self.index = instructions(code)
        self.ip = self.index[start_offset]
        self.kw_names: tuple = ()
        self.stop_at = stop_at or {}   # offset -> (reason, earlier visits to let pass): where the capture stops
        self.visits: dict[int, int] = {}   # offset -> times reached (a loop's break is at one iteration, not all)
        self.globals_source = globals_source if globals_source is not None else cap.consts.ref(f_globals)
        self.yields: list[V] | None = [] if code.co_flags & CO_GENERATOR else None
        self.exc_info: list[V] = []
        self.current: dis.Instruction | None = None

    def where(self) -> str:
        return where(self.code, self.current.offset if self.current else 0)

    # -- main loop ----------------------------------------------------------------------------------------
    def run(self) -> V:
        symbols = self.cap.symbols
        try:
            while True:
                inst = self.insts[self.ip]
                self.current = inst
                seen = self.visits.get(inst.offset, 0)
                if self.parent is None and inst.offset in self.stop_at:
                    reason, skip = self.stop_at[inst.offset]
                    if seen >= skip:
                        raise StopCapture(self, inst, reason)
                self.visits[inst.offset] = seen + 1
                self.ip += 1
                handler = OPCODES.get(inst.opname)
                if handler is None:
                    raise Unsupported(f"bytecode {inst.opname} is not supported", self.where())
                try:
                    handler(self, inst)
                except PyError as e:
                    if not self.catch(inst, e):
                        raise
                if symbols is not None and len(symbols.shape_env.guards) != symbols.n_guards:
                    symbols.note_guards(self.where())   # a decision on a symbolic size, at the user's line
        except Return as r:
            return r.value

    def catch(self, inst, e: PyError) -> bool:
        """Jump to the handler the exception table names for this instruction, as CPython does."""
        for entry in exception_table(self.code):
            if entry.start <= inst.offset < entry.end:
                del self.stack[entry.depth:]
                if entry.lasti:
                    self.push(ConstV(inst.offset))
                self.push(ObjV(e.exc))
                self.ip = self.index[entry.target]
                return True
        return False

    def push(self, v: V):
        self.stack.append(v)

    def pop(self) -> V:
        return self.stack.pop()

    def popn(self, n: int) -> list[V]:
        if n == 0:
            return []
        out = self.stack[-n:]
        del self.stack[-n:]
        return out

    def jump(self, inst):
        self.ip = self.index[inst.argval]

    def inline(self, code, f_globals, defaults, kwdefaults, closure, args, kwargs, name) -> V:
        if self.depth >= config.MAX_INLINE_DEPTH:
            raise Unsupported(f"call depth over {config.MAX_INLINE_DEPTH} (recursion) in {name}", self.where())
        if code.co_flags & CO_GENERATOR and _receives_sent_values(code):
            # inlined, a generator runs to its end at the call, every yield answered None: one whose yields
            # take values (`x = yield ...`, for send()) must run as a generator of its own
            raise Unsupported(f"generator {name} receives values sent to it", self.where())
        local_vars = bind_arguments(code, defaults, kwdefaults, args, kwargs, name, self.where())
        cells = {}
        for i, fv in enumerate(code.co_freevars):
            c = closure[i] if i < len(closure) else None
            if c is None or not isinstance(c, CellV):
                raise Unsupported(f"closure of {name} is not trackable", self.where())
            cells[fv] = c
        child = Frame(self.cap, code, f_globals, local_vars, cells, parent=self,
                      globals_source=None if f_globals is not self.f_globals else self.globals_source)
        try:
            result = child.run()
        except Unsupported as u:
            # where the break sits in each inlined frame, outermost first: the callee compiled at the root's
            # break instruction starts with its stop there (convert.StopHint) instead of rediscovering it
            inner = getattr(u, "inlined_at", ())
            u.inlined_at = None if inner is None or child.current is None else \
                [(code, child.current.offset, child.visits[child.current.offset] - 1), *inner]
            raise
        if child.yields is not None:
            return IterV(child.yields)
        return result


def _receives_sent_values(code: types.CodeType) -> bool:
    """Whether a yield's result is used (a YIELD_VALUE's RESUME followed by anything but POP_TOP)."""
    insts, _index = instructions(code)
    return any(a.opname == "YIELD_VALUE" and b.opname == "RESUME" and
               c.opname not in ("POP_TOP", "JUMP_BACKWARD_NO_INTERRUPT")   # (the latter: a `yield from` loop)
               for a, b, c in zip(insts, insts[1:], insts[2:]))


def bind_arguments(code: types.CodeType, defaults: tuple, kwdefaults: dict, args: list[V], kwargs: dict[str, V],
                   name: str, where_: str) -> dict[str, V]:
    """CPython's argument binding, over tracked values."""
    nargs = code.co_argcount
    nkwonly = code.co_kwonlyargcount
    names = code.co_varnames
    posonly = code.co_posonlyargcount
    out: dict[str, V] = {}
    positional = names[:nargs]
    for i, v in enumerate(args[:nargs]):
        out[positional[i]] = v
    extra = args[nargs:]
    idx = nargs + nkwonly
    varargs_name = varkw_name = None
    if code.co_flags & CO_VARARGS:
        varargs_name = names[idx]
        idx += 1
    if code.co_flags & CO_VARKEYWORDS:
        varkw_name = names[idx]
    if extra and varargs_name is None:
        raise Unsupported(f"{name}() takes {nargs} positional arguments but {len(args)} were given", where_)
    if varargs_name is not None:
        out[varargs_name] = TupleV(list(extra))
    rest = {}
    kwonly = names[nargs:nargs + nkwonly]
    for k, v in kwargs.items():
        if k in positional[posonly:] or k in kwonly:
            if k in out:
                raise Unsupported(f"{name}() got multiple values for argument {k!r}", where_)
            out[k] = v
        elif varkw_name is not None:
            rest[k] = v
        else:
            raise Unsupported(f"{name}() got an unexpected keyword argument {k!r}", where_)
    if varkw_name is not None:
        out[varkw_name] = DictV(rest)
    first_default = nargs - len(defaults)
    for i, pname in enumerate(positional):
        if pname not in out:
            if i >= first_default:
                out[pname] = defaults[i - first_default]
            else:
                raise Unsupported(f"{name}() missing required argument {pname!r}", where_)
    for k in kwonly:
        if k not in out:
            if k in kwdefaults:
                out[k] = kwdefaults[k]
            else:
                raise Unsupported(f"{name}() missing required keyword-only argument {k!r}", where_)
    return out
