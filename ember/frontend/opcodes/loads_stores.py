"""Opcode handlers for the stack, constants, locals, closure cells, globals, attributes and imports."""
from __future__ import annotations

import builtins
import dis
import sys
import types
from typing import TYPE_CHECKING

import torch

from ember.errors import Unsupported
from ember.frontend.opcodes.registry import PY312, opcode
from ember.frontend.policy import TRUSTED_MODULE_PREFIXES
from ember.frontend.signals import PyError
from ember.frontend.values import NULL, CellV, NewObjV, NullV, ObjV, SuperV, V

if TYPE_CHECKING:
    from ember.frontend.interpreter import Frame


@opcode("NOP", "RESUME", "PRECALL", "EXTENDED_ARG", "CACHE")
def nop(frame: Frame, inst: dis.Instruction) -> None:
    pass


@opcode("POP_TOP")
def pop_top(frame: Frame, inst: dis.Instruction) -> None:
    frame.pop()


@opcode("PUSH_NULL")
def push_null(frame: Frame, inst: dis.Instruction) -> None:
    frame.push(NULL)


@opcode("COPY")
def copy(frame: Frame, inst: dis.Instruction) -> None:
    frame.push(frame.stack[-inst.arg])


@opcode("SWAP")
def swap(frame: Frame, inst: dis.Instruction) -> None:
    s = frame.stack
    s[-1], s[-inst.arg] = s[-inst.arg], s[-1]


@opcode("LOAD_CONST")
def load_const(frame: Frame, inst: dis.Instruction) -> None:
    frame.push(frame.const_v(inst.argval))


@opcode("LOAD_FAST", "LOAD_FAST_CHECK")
def load_fast(frame: Frame, inst: dis.Instruction) -> None:
    name = inst.argval
    if name not in frame.locals:
        raise Unsupported(f"local variable {name!r} referenced before assignment", frame.where())
    frame.push(frame.locals[name])


@opcode("LOAD_FAST_AND_CLEAR")
def load_fast_and_clear(frame: Frame, inst: dis.Instruction) -> None:
    frame.push(frame.locals.pop(inst.argval, NULL))


@opcode("STORE_FAST")
def store_fast(frame: Frame, inst: dis.Instruction) -> None:
    v = frame.pop()
    if isinstance(v, NullV):
        frame.locals.pop(inst.argval, None)
    else:
        frame.locals[inst.argval] = v


@opcode("DELETE_FAST")
def delete_fast(frame: Frame, inst: dis.Instruction) -> None:
    frame.locals.pop(inst.argval, None)


@opcode("MAKE_CELL")
def make_cell(frame: Frame, inst: dis.Instruction) -> None:
    name = inst.argval
    if name not in frame.cells:
        frame.cells[name] = CellV(frame.locals.pop(name, None))


@opcode("COPY_FREE_VARS")
def copy_free_vars(frame: Frame, inst: dis.Instruction) -> None:
    pass  # the frame's free cells were set up when it was created


@opcode("LOAD_CLOSURE")
def load_closure(frame: Frame, inst: dis.Instruction) -> None:
    frame.push(frame.cells[inst.argval])


@opcode("LOAD_DEREF")
def load_deref(frame: Frame, inst: dis.Instruction) -> None:
    cell = frame.cells.get(inst.argval)
    if cell is None or cell.contents is None:
        raise Unsupported(f"free variable {inst.argval!r} referenced before assignment", frame.where())
    frame.push(cell.contents)


@opcode("STORE_DEREF")
def store_deref(frame: Frame, inst: dis.Instruction) -> None:
    cell = frame.cells.setdefault(inst.argval, CellV(None))
    cell.contents = frame.pop()
    cell.mutated = True


@opcode("LOAD_GLOBAL")
def load_global(frame: Frame, inst: dis.Instruction) -> None:
    if inst.arg & 1:
        frame.push(NULL)
    frame.push(global_value(frame, inst.argval))


def global_value(frame: Frame, name: str) -> V:
    key = (id(frame.f_globals), name)
    if key in frame.cap.global_writes:
        return frame.cap.global_writes[key][1]
    if name in frame.f_globals:
        value = frame.f_globals[name]
        trusted = isinstance(value, types.ModuleType) and value.__name__.split(".")[0] in TRUSTED_MODULE_PREFIXES
        return frame.cap.wrap(value, None if trusted else f"{frame.globals_source}[{name!r}]")
    b = frame.f_globals.get("__builtins__", builtins)
    b = b if isinstance(b, dict) else vars(b)
    if name not in b:
        raise Unsupported(f"name {name!r} is not defined", frame.where())
    return ObjV(b[name])


@opcode("STORE_GLOBAL")
def store_global(frame: Frame, inst: dis.Instruction) -> None:
    frame.cap.global_writes[(id(frame.f_globals), inst.argval)] = (frame.f_globals, frame.pop())


@opcode("LOAD_ATTR")
def load_attr(frame: Frame, inst: dis.Instruction) -> None:
    obj = frame.pop()
    if PY312 and inst.arg & 1:
        frame.push(NULL)
    frame.push(frame.getattr(obj, inst.argval))


@opcode("LOAD_METHOD")
def load_method(frame: Frame, inst: dis.Instruction) -> None:
    obj = frame.pop()
    frame.push(NULL)
    frame.push(frame.getattr(obj, inst.argval))


@opcode("STORE_ATTR")
def store_attr(frame: Frame, inst: dis.Instruction) -> None:
    obj = frame.pop()
    value = frame.pop()
    frame.setattr(obj, inst.argval, value)


@opcode("DELETE_ATTR")
def delete_attr(frame: Frame, inst: dis.Instruction) -> None:
    obj = frame.pop()
    if isinstance(obj, ObjV) and not isinstance(obj.value, torch.nn.Module) and obj.source is not None:
        had_write = obj.writes.pop(inst.argval, None) is not None
        if inst.argval in getattr(obj.value, "__dict__", {}):
            obj.deleted.add(inst.argval)  # deleting what the real object has: done after the graph
        elif not had_write:
            raise PyError(AttributeError(inst.argval), frame.where())
        return
    if isinstance(obj, NewObjV) and inst.argval in obj.attrs:
        del obj.attrs[inst.argval]
        return
    raise Unsupported(f"del of attribute {inst.argval!r}", frame.where())


@opcode("LOAD_SUPER_ATTR")
def load_super_attr(frame: Frame, inst: dis.Instruction) -> None:
    self_v = frame.pop()
    cls_v = frame.pop()
    frame.pop()  # the global `super`
    sup = SuperV(cls_v.value, self_v)
    if inst.arg & 1:
        frame.push(NULL)
    frame.push(frame.getattr(sup, inst.argval))


@opcode("LOAD_ASSERTION_ERROR")
def load_assertion_error(frame: Frame, inst: dis.Instruction) -> None:
    frame.push(ObjV(AssertionError))


@opcode("IMPORT_NAME")
def import_name(frame: Frame, inst: dis.Instruction) -> None:
    fromlist = frame.const_value(frame.pop())
    level = frame.const_value(frame.pop())
    name = inst.argval
    package = frame.f_globals.get("__package__") or frame.f_globals.get("__name__")
    full = name if level == 0 else _resolve_relative(name, package, level)
    if full not in sys.modules:
        raise Unsupported(f"import of {full}, not imported yet (importing runs its code)", frame.where())
    mod = __import__(name, frame.f_globals, None, fromlist, level)
    frame.push(ObjV(mod))


@opcode("IMPORT_FROM")
def import_from(frame: Frame, inst: dis.Instruction) -> None:
    frame.push(frame.getattr(frame.stack[-1], inst.argval))


def _resolve_relative(name: str, package: str | None, level: int) -> str:
    base = (package or "").rsplit(".", level - 1)[0]
    return f"{base}.{name}" if name else base
