"""A symbolic interpreter of CPython 3.11/3.12 bytecode that records torch operations into a torch.fx.Graph.

It runs a function's instructions on tracked values (ember.frontend.values) instead of real ones. Python-level
values are known at capture time (they come from the first call's arguments), so Python control flow is
followed, and every assumption made about them becomes a guard. Tensors are fake: each tensor operation adds a
node to the graph and is run on fake tensors only for its result's shape and dtype.

One `Frame` interprets one code object; calls to user functions are inlined as child frames sharing the
`Capture` (graph, guards, wrapped inputs). Whatever cannot be recorded raises `Unsupported`; the caller
(ember.frontend.convert) turns that into a graph break at the root frame's current instruction.
The rest of the package gives the frame its meaning, one job per file: capture.py (the graph and its inputs),
python_semantics.py, operators.py, items.py, attributes.py, calls.py, methods.py, builtin_functions.py,
py_float.py, modes.py, backward_in_graph.py; policy.py says which calls are recorded or evaluated.
"""
from __future__ import annotations

import bisect
import builtins
import dis
import operator
import sys
import types

import torch

from ember import config
from ember.errors import Unsupported
from ember.frontend.attributes import Attributes
from ember.frontend.backward_in_graph import BackwardInGraph
from ember.frontend.builtin_functions import classes_of
from ember.frontend.calls import Calls
from ember.frontend.capture import Capture
from ember.frontend.items import Items
from ember.frontend.methods import Methods
from ember.frontend.modes import GlobalModes
from ember.frontend.operators import Operators
from ember.frontend.policy import TRUSTED_MODULE_PREFIXES
from ember.frontend.py_float import PyFloats
from ember.frontend.python_objects import CO_GENERATOR, CO_VARARGS, CO_VARKEYWORDS
from ember.frontend.python_semantics import PythonSemantics
from ember.frontend.signals import PyError, Return, StopCapture
from ember.frontend.values import (
    NULL, AutocastCtxV, BoundV, CellV, ClosureV, ConstV, DictV, GradModeCtxV, GradModeExitV, IterV, ListV, NewObjV,
    NoOpCtxV, NullV, ObjV, SetV, SuperV, TensorV, TupleV, V,
)

PY312 = sys.version_info >= (3, 12)
BINARY_OPS = {  # BINARY_OP arg -> (operator function, in place?)
    0: (operator.add, False), 1: (operator.and_, False), 2: (operator.floordiv, False), 3: (operator.lshift, False),
    4: (operator.matmul, False), 5: (operator.mul, False), 6: (operator.mod, False), 7: (operator.or_, False),
    8: (operator.pow, False), 9: (operator.rshift, False), 10: (operator.sub, False), 11: (operator.truediv, False),
    12: (operator.xor, False), 13: (operator.iadd, True), 14: (operator.iand, True), 15: (operator.ifloordiv, True),
    16: (operator.ilshift, True), 17: (operator.imatmul, True), 18: (operator.imul, True), 19: (operator.imod, True),
    20: (operator.ior, True), 21: (operator.ipow, True), 22: (operator.irshift, True), 23: (operator.isub, True),
    24: (operator.itruediv, True), 25: (operator.ixor, True),
}
COMPARE_OPS = {"<": operator.lt, "<=": operator.le, "==": operator.eq, "!=": operator.ne, ">": operator.gt,
               ">=": operator.ge}


def where(code: types.CodeType, offset: int) -> str:
    """file:line of an instruction (every recorded op carries one: walking co_lines per op was a tenth of
    GPT-2's capture, so each code's line starts are listed once)"""
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


def instructions(code: types.CodeType):
    if code not in _INSTRUCTIONS:
        insts = list(dis.get_instructions(code))
        _INSTRUCTIONS[code] = (insts, {inst.offset: i for i, inst in enumerate(insts)})
    return _INSTRUCTIONS[code]


class Frame(PythonSemantics, Operators, PyFloats, Items, Attributes, BackwardInGraph, Calls, Methods,
            GlobalModes):
    """Interprets one code object over tracked values."""

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
        self.stop_at = stop_at or {}
        self.globals_source = globals_source if globals_source is not None else cap.consts.ref(f_globals)
        self.yields: list[V] | None = [] if code.co_flags & CO_GENERATOR else None
        self.exc_info: list[V] = []
        self.current: dis.Instruction | None = None

    def where(self) -> str:
        return where(self.code, self.current.offset if self.current else 0)

    # -- main loop ----------------------------------------------------------------------------------------
    def run(self) -> V:
        try:
            while True:
                inst = self.insts[self.ip]
                self.current = inst
                if self.parent is None and inst.offset in self.stop_at:
                    raise StopCapture(self, inst, self.stop_at[inst.offset])
                self.ip += 1
                handler = getattr(self, inst.opname, None)
                if handler is None:
                    raise Unsupported(f"bytecode {inst.opname} is not supported", self.where())
                try:
                    handler(inst)
                except PyError as e:
                    if not self.catch(inst, e):
                        raise
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

    def PUSH_EXC_INFO(self, inst):
        exc = self.pop()
        self.push(self.exc_info[-1] if self.exc_info else ConstV(None))
        self.exc_info.append(exc)
        self.push(exc)

    def POP_EXCEPT(self, inst):
        self.pop()
        if self.exc_info:
            self.exc_info.pop()

    def CHECK_EXC_MATCH(self, inst):
        typ = self.pop()
        exc = self.stack[-1]
        self.push(ConstV(isinstance(exc.value, classes_of(typ))))

    def RERAISE(self, inst):
        exc = self.pop()
        raise PyError(exc.value, self.where())

    def WITH_EXCEPT_START(self, inst):
        exc = self.stack[-1]
        exit_fn = self.stack[-4]
        e = exc.value
        self.push(self.call(exit_fn, [ObjV(type(e)), exc, ConstV(None)], {}))

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

    # -- loads and stores ----------------------------------------------------------------------------
    def NOP(self, inst): pass
    RESUME = NOP
    PRECALL = NOP
    EXTENDED_ARG = NOP
    CACHE = NOP

    def POP_TOP(self, inst):
        self.pop()

    def PUSH_NULL(self, inst):
        self.push(NULL)

    def COPY(self, inst):
        self.push(self.stack[-inst.arg])

    def SWAP(self, inst):
        s = self.stack
        s[-1], s[-inst.arg] = s[-inst.arg], s[-1]

    def LOAD_CONST(self, inst):
        self.push(self.const_v(inst.argval))

    def RETURN_CONST(self, inst):
        raise Return(self.const_v(inst.argval))

    def LOAD_FAST(self, inst):
        name = inst.argval
        if name not in self.locals:
            raise Unsupported(f"local variable {name!r} referenced before assignment", self.where())
        self.push(self.locals[name])

    LOAD_FAST_CHECK = LOAD_FAST

    def LOAD_FAST_AND_CLEAR(self, inst):
        self.push(self.locals.pop(inst.argval, NULL))

    def STORE_FAST(self, inst):
        v = self.pop()
        if isinstance(v, NullV):
            self.locals.pop(inst.argval, None)
        else:
            self.locals[inst.argval] = v

    def DELETE_FAST(self, inst):
        self.locals.pop(inst.argval, None)

    def MAKE_CELL(self, inst):
        name = inst.argval
        if name not in self.cells:
            self.cells[name] = CellV(self.locals.pop(name, None))

    def COPY_FREE_VARS(self, inst):
        pass  # the frame's free cells were set up when it was created

    def LOAD_CLOSURE(self, inst):
        self.push(self.cells[inst.argval])

    def LOAD_DEREF(self, inst):
        cell = self.cells.get(inst.argval)
        if cell is None or cell.contents is None:
            raise Unsupported(f"free variable {inst.argval!r} referenced before assignment", self.where())
        self.push(cell.contents)

    def STORE_DEREF(self, inst):
        cell = self.cells.setdefault(inst.argval, CellV(None))
        cell.contents = self.pop()
        cell.mutated = True

    def LOAD_GLOBAL(self, inst):
        if inst.arg & 1:
            self.push(NULL)
        self.push(self.load_global(inst.argval))

    def load_global(self, name: str) -> V:
        key = (id(self.f_globals), name)
        if key in self.cap.global_writes:
            return self.cap.global_writes[key][1]
        if name in self.f_globals:
            value = self.f_globals[name]
            trusted = isinstance(value, types.ModuleType) and value.__name__.split(".")[0] in TRUSTED_MODULE_PREFIXES
            return self.cap.wrap(value, None if trusted else f"{self.globals_source}[{name!r}]")
        b = self.f_globals.get("__builtins__", builtins)
        b = b if isinstance(b, dict) else vars(b)
        if name not in b:
            raise Unsupported(f"name {name!r} is not defined", self.where())
        return ObjV(b[name])

    def STORE_GLOBAL(self, inst):
        self.cap.global_writes[(id(self.f_globals), inst.argval)] = (self.f_globals, self.pop())

    def LOAD_ATTR(self, inst):
        obj = self.pop()
        if PY312 and inst.arg & 1:
            self.push(NULL)
        self.push(self.getattr(obj, inst.argval))

    def LOAD_METHOD(self, inst):
        obj = self.pop()
        self.push(NULL)
        self.push(self.getattr(obj, inst.argval))

    def STORE_ATTR(self, inst):
        obj = self.pop()
        value = self.pop()
        self.setattr(obj, inst.argval, value)

    def DELETE_ATTR(self, inst):
        obj = self.pop()
        if isinstance(obj, ObjV) and not isinstance(obj.value, torch.nn.Module) and obj.source is not None:
            had_write = obj.writes.pop(inst.argval, None) is not None
            if inst.argval in getattr(obj.value, "__dict__", {}):
                obj.deleted.add(inst.argval)  # deleting what the real object has: done after the graph
            elif not had_write:
                raise PyError(AttributeError(inst.argval), self.where())
            return
        if isinstance(obj, NewObjV) and inst.argval in obj.attrs:
            del obj.attrs[inst.argval]
            return
        raise Unsupported(f"del of attribute {inst.argval!r}", self.where())

    def LOAD_SUPER_ATTR(self, inst):
        self_v = self.pop()
        cls_v = self.pop()
        self.pop()  # the global `super`
        sup = SuperV(cls_v.value, self_v)
        if inst.arg & 1:
            self.push(NULL)
        self.push(self.getattr(sup, inst.argval))

    def LOAD_ASSERTION_ERROR(self, inst):
        self.push(ObjV(AssertionError))

    # -- building containers ---------------------------------------------------------------------------
    def BUILD_TUPLE(self, inst):
        self.push(TupleV(self.popn(inst.arg)))

    def BUILD_LIST(self, inst):
        self.push(ListV(self.popn(inst.arg)))

    def BUILD_SET(self, inst):
        items = self.popn(inst.arg)
        s = SetV([])
        for x in items:
            self.set_add(s, x)
        self.push(s)

    def BUILD_MAP(self, inst):
        flat = self.popn(2 * inst.arg)
        self.push(DictV({self.key(flat[i]): flat[i + 1] for i in range(0, len(flat), 2)}))

    def BUILD_CONST_KEY_MAP(self, inst):
        keys = self.pop()
        values = self.popn(inst.arg)
        self.push(DictV({self.key(k): v for k, v in zip(keys.items, values)}))

    def BUILD_STRING(self, inst):
        parts = self.popn(inst.arg)
        self.push(ConstV("".join(self.const_value(p) for p in parts)))

    def BUILD_SLICE(self, inst):
        parts = self.popn(inst.arg)
        self.push(ConstV(slice(*[self.const_value(p) for p in parts])))

    def LIST_APPEND(self, inst):
        v = self.pop()
        self.list_mutate(self.stack[-inst.arg]).items.append(v)

    def LIST_EXTEND(self, inst):
        v = self.pop()
        self.list_mutate(self.stack[-inst.arg]).items.extend(self.iterate(v))

    def SET_ADD(self, inst):
        v = self.pop()
        self.set_add(self.stack[-inst.arg], v)

    def SET_UPDATE(self, inst):
        v = self.pop()
        for x in self.iterate(v):
            self.set_add(self.stack[-inst.arg], x)

    def MAP_ADD(self, inst):
        value = self.pop()
        key = self.pop()
        self.dict_mutate(self.stack[-inst.arg]).items[self.key(key)] = value

    def DICT_UPDATE(self, inst):
        other = self.pop()
        d = self.dict_mutate(self.stack[-inst.arg])
        d.items.update(self.as_dict(other))

    def DICT_MERGE(self, inst):
        other = self.as_dict(self.pop())
        d = self.dict_mutate(self.stack[-inst.arg])
        for k in other:
            if k in d.items:
                raise Unsupported(f"duplicate keyword argument {k!r}", self.where())
        d.items.update(other)

    def LIST_TO_TUPLE(self, inst):
        self.push(TupleV(list(self.pop().items)))

    def CALL_INTRINSIC_1(self, inst):
        if inst.argrepr == "INTRINSIC_LIST_TO_TUPLE":
            return self.LIST_TO_TUPLE(inst)
        if inst.argrepr == "INTRINSIC_UNARY_POSITIVE":
            return self.push(self.unary(operator.pos, self.pop()))
        raise Unsupported(f"{inst.argrepr} is not supported", self.where())

    def UNPACK_SEQUENCE(self, inst):
        items = self.iterate(self.pop())
        if len(items) != inst.arg:
            raise Unsupported("unpacking a sequence of the wrong length", self.where())
        for x in reversed(items):
            self.push(x)

    def UNPACK_EX(self, inst):
        items = self.iterate(self.pop())
        before, after = inst.arg & 0xFF, inst.arg >> 8
        if len(items) < before + after:
            raise Unsupported("unpacking a sequence of the wrong length", self.where())
        rest = items[before:len(items) - after]
        out = items[:before] + [ListV(rest)] + items[len(items) - after:]
        for x in reversed(out):
            self.push(x)

    # -- operators ---------------------------------------------------------------------------------------
    def BINARY_OP(self, inst):
        b = self.pop()
        a = self.pop()
        fn, inplace = BINARY_OPS[inst.arg]
        self.push(self.binary(fn, a, b, inplace))

    def UNARY_NEGATIVE(self, inst):
        self.push(self.unary(operator.neg, self.pop()))

    def UNARY_INVERT(self, inst):
        self.push(self.unary(operator.invert, self.pop()))

    def UNARY_POSITIVE(self, inst):
        self.push(self.unary(operator.pos, self.pop()))

    def UNARY_NOT(self, inst):
        v = self.pop()
        if isinstance(v, TensorV):
            raise Unsupported("`not` of a tensor needs its value", self.where())
        self.push(ConstV(not self.truth(v)))

    def COMPARE_OP(self, inst):
        b = self.pop()
        a = self.pop()
        op = inst.argval if not PY312 else inst.argrepr.split()[0] if inst.argrepr else inst.argval
        self.push(self.binary(COMPARE_OPS[op.strip()], a, b, False))

    def IS_OP(self, inst):
        b = self.pop()
        a = self.pop()
        same = self.is_same(a, b)
        self.push(ConstV(same != bool(inst.arg)))

    def CONTAINS_OP(self, inst):
        container = self.pop()
        item = self.pop()
        self.push(ConstV(self.contains(container, item) != bool(inst.arg)))

    def BINARY_SUBSCR(self, inst):
        idx = self.pop()
        obj = self.pop()
        self.push(self.getitem(obj, idx))

    def BINARY_SLICE(self, inst):
        end = self.pop()
        start = self.pop()
        obj = self.pop()
        self.push(self.getitem(obj, ConstV(slice(self.const_value(start), self.const_value(end)))))

    def STORE_SUBSCR(self, inst):
        idx = self.pop()
        obj = self.pop()
        value = self.pop()
        self.setitem(obj, idx, value)

    def STORE_SLICE(self, inst):
        end = self.pop()
        start = self.pop()
        obj = self.pop()
        value = self.pop()
        self.setitem(obj, ConstV(slice(self.const_value(start), self.const_value(end))), value)

    def DELETE_SUBSCR(self, inst):
        idx = self.pop()
        obj = self.pop()
        if isinstance(obj, DictV):
            self.dict_mutate(obj).items.pop(self.key(idx))
        elif isinstance(obj, ListV):
            items = self.list_mutate(obj).items
            del items[self.const_value(idx)]
        else:
            raise Unsupported(f"del on {type(obj).__name__}", self.where())

    def FORMAT_VALUE(self, inst):
        spec = self.const_value(self.pop()) if (inst.arg & 0x04) == 0x04 else ""
        v = self.pop()
        value = self.const_value(v)
        conv = inst.arg & 0x03
        value = {0: value, 1: str(value), 2: repr(value), 3: ascii(value)}[conv]
        self.push(ConstV(format(value, spec)))

    # -- control flow -----------------------------------------------------------------------------------
    def JUMP_FORWARD(self, inst):
        self.jump(inst)

    JUMP_BACKWARD = JUMP_FORWARD
    JUMP_BACKWARD_NO_INTERRUPT = JUMP_FORWARD
    JUMP_ABSOLUTE = JUMP_FORWARD
    JUMP = JUMP_FORWARD

    def _pop_jump(self, inst, when: bool):
        v = self.pop()
        if isinstance(v, TensorV):
            self.push(v)  # restore: the break happens before this instruction
            raise Unsupported("data-dependent control flow: a branch on a tensor's value", self.where())
        if self.truth(v) == when:
            self.jump(inst)

    def POP_JUMP_IF_TRUE(self, inst):
        self._pop_jump(inst, True)

    def POP_JUMP_IF_FALSE(self, inst):
        self._pop_jump(inst, False)

    POP_JUMP_FORWARD_IF_TRUE = POP_JUMP_BACKWARD_IF_TRUE = POP_JUMP_IF_TRUE
    POP_JUMP_FORWARD_IF_FALSE = POP_JUMP_BACKWARD_IF_FALSE = POP_JUMP_IF_FALSE

    def POP_JUMP_IF_NONE(self, inst):
        v = self.pop()
        if self.is_none(v):
            self.jump(inst)

    def POP_JUMP_IF_NOT_NONE(self, inst):
        v = self.pop()
        if not self.is_none(v):
            self.jump(inst)

    POP_JUMP_FORWARD_IF_NONE = POP_JUMP_BACKWARD_IF_NONE = POP_JUMP_IF_NONE
    POP_JUMP_FORWARD_IF_NOT_NONE = POP_JUMP_BACKWARD_IF_NOT_NONE = POP_JUMP_IF_NOT_NONE

    def JUMP_IF_TRUE_OR_POP(self, inst):
        v = self.stack[-1]
        if isinstance(v, TensorV):
            raise Unsupported("data-dependent control flow: `or` on a tensor's value", self.where())
        if self.truth(v):
            self.jump(inst)
        else:
            self.pop()

    def JUMP_IF_FALSE_OR_POP(self, inst):
        v = self.stack[-1]
        if isinstance(v, TensorV):
            raise Unsupported("data-dependent control flow: `and` on a tensor's value", self.where())
        if not self.truth(v):
            self.jump(inst)
        else:
            self.pop()

    def GET_ITER(self, inst):
        v = self.pop()
        self.push(v if isinstance(v, IterV) else IterV(self.iterate(v)))

    def FOR_ITER(self, inst):
        it = self.stack[-1]
        if not isinstance(it, IterV):
            raise Unsupported("iteration over an object ember cannot see into", self.where())
        if it.pos < len(it.items):
            self.push(it.items[it.pos])
            it.pos += 1
        else:
            self.pop()
            self.jump(inst)
            if PY312:  # 3.12 jumps past the END_FOR that follows the target
                self.ip += 1

    def END_FOR(self, inst):
        self.pop()
        self.pop()

    def RETURN_VALUE(self, inst):
        raise Return(self.pop())

    def RETURN_GENERATOR(self, inst):
        self.push(ConstV(None))

    def YIELD_VALUE(self, inst):
        if self.yields is None:
            raise Unsupported("yield outside a generator", self.where())
        self.yields.append(self.pop())
        self.push(ConstV(None))  # the value sent in by next()

    def SEND(self, inst):
        self.pop()  # the value sent in: always None for generators consumed by iteration
        it = self.stack[-1]
        if not isinstance(it, IterV):
            raise Unsupported("yield from a non-iterable", self.where())
        if it.pos < len(it.items):
            self.push(it.items[it.pos])
            it.pos += 1
            return
        if not PY312:
            self.pop()
        self.push(ConstV(None))
        self.jump(inst)

    def END_SEND(self, inst):
        v = self.pop()
        self.pop()
        self.push(v)

    def GET_YIELD_FROM_ITER(self, inst):
        v = self.pop()
        self.push(v if isinstance(v, IterV) else IterV(self.iterate(v)))

    def RAISE_VARARGS(self, inst):
        if inst.arg == 0:
            if not self.exc_info:
                raise Unsupported("bare raise outside an except block", self.where())
            raise PyError(self.exc_info[-1].value, self.where())
        if inst.arg == 2:
            self.pop()  # the cause: kept by Python when the exception escapes (it is re-raised for real)
        v = self.pop()
        raise PyError(self.real_exception(v), self.where())

    def real_exception(self, v: V) -> BaseException:
        if isinstance(v, ObjV) and isinstance(v.value, type) and issubclass(v.value, BaseException):
            return v.value()
        if isinstance(v, ObjV) and isinstance(v.value, BaseException):
            return v.value
        if isinstance(v, NewObjV) and issubclass(v.cls, BaseException):
            args = v.attrs.get("args")
            try:
                return v.cls(*[self.const_value(a) for a in args.items]) if args else v.cls()
            except Unsupported:
                return v.cls("<value known at run time>")
        raise Unsupported(f"raise of {self.type_name(v)}", self.where())

    # -- with blocks --------------------------------------------------------------------------------------
    def BEFORE_WITH(self, inst):
        ctx = self.pop()
        if isinstance(ctx, GradModeCtxV):
            prev = self.cap.grad_enabled if ctx.prev is None else ctx.prev
            self.set_grad(ctx.enabled)
            self.push(GradModeExitV(prev))
            self.push(ConstV(None))
            return
        if isinstance(ctx, AutocastCtxV):
            self.push(self.enter_autocast(ctx))
            self.push(ConstV(None))
            return
        if isinstance(ctx, NoOpCtxV):
            self.push(NoOpCtxV(ctx.cls, ctx.args, exit=True))  # its __exit__: calling it does nothing (see call)
            self.push(ctx)  # record_function.__enter__ returns self
            return
        enter = self.getattr(ctx, "__enter__")
        exit_ = self.getattr(ctx, "__exit__")
        if not isinstance(enter, BoundV) or not isinstance(exit_, BoundV):
            raise Unsupported(f"context manager {type(ctx).__name__} is not supported", self.where())
        self.push(exit_)
        self.push(self.call(enter, [], {}))

    # -- functions ----------------------------------------------------------------------------------------
    def KW_NAMES(self, inst):
        self.kw_names = self.code.co_consts[inst.arg]

    def CALL(self, inst):
        n = inst.arg
        args = self.popn(n)
        kw = self.kw_names
        self.kw_names = ()
        b = self.pop()
        a = self.pop()
        if isinstance(a, NullV):
            fn = b
        else:
            fn, args = a, [b] + args
        kwargs = {}
        if kw:
            kwargs = dict(zip(kw, args[len(args) - len(kw):]))
            args = args[:len(args) - len(kw)]
        self.push(self.call(fn, args, kwargs))

    def CALL_FUNCTION_EX(self, inst):
        kwargs = self.as_dict(self.pop()) if inst.arg & 1 else {}
        args = self.iterate(self.pop())
        fn = self.pop()
        if self.stack and isinstance(self.stack[-1], NullV):
            self.pop()
        self.push(self.call(fn, list(args), dict(kwargs)))

    def MAKE_FUNCTION(self, inst):
        if PY312 or sys.version_info >= (3, 11):
            code = self.pop().value
        flags = inst.arg
        closure = tuple(self.pop().items) if flags & 0x08 else ()
        if flags & 0x04:
            self.pop()  # annotations
        kwdefaults = self.as_dict(self.pop()) if flags & 0x02 else {}
        defaults = tuple(self.pop().items) if flags & 0x01 else ()
        self.push(ClosureV(code, self.f_globals, code.co_name, defaults, kwdefaults, closure, code.co_qualname))

    def IMPORT_NAME(self, inst):
        fromlist = self.const_value(self.pop())
        level = self.const_value(self.pop())
        name = inst.argval
        package = self.f_globals.get("__package__") or self.f_globals.get("__name__")
        full = name if level == 0 else _resolve_relative(name, package, level)
        if full not in sys.modules:
            raise Unsupported(f"import of {full}, not imported yet (importing runs its code)", self.where())
        mod = __import__(name, self.f_globals, None, fromlist, level)
        self.push(ObjV(mod))

    def IMPORT_FROM(self, inst):
        self.push(self.getattr(self.stack[-1], inst.argval))

    def LOAD_BUILD_CLASS(self, inst):
        raise Unsupported("class definition inside a compiled function", self.where())

    def inline(self, code, f_globals, defaults, kwdefaults, closure, args, kwargs, name) -> V:
        if self.depth >= config.MAX_INLINE_DEPTH:
            raise Unsupported(f"call depth over {config.MAX_INLINE_DEPTH} (recursion) in {name}", self.where())
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
            u.inlined_at = None if inner is None or child.current is None else [(code, child.current.offset), *inner]
            raise
        if child.yields is not None:
            return IterV(child.yields)
        return result


def _resolve_relative(name: str, package: str | None, level: int) -> str:
    base = (package or "").rsplit(".", level - 1)[0]
    return f"{base}.{name}" if name else base


def bind_arguments(code, defaults, kwdefaults, args, kwargs, name, where_) -> dict[str, V]:
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
