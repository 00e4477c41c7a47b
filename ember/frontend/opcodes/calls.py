"""Opcode handlers for calls (with keyword names and *args/**kwargs) and for making functions."""
from __future__ import annotations

import dis
import sys
from typing import TYPE_CHECKING

from ember.errors import Unsupported
from ember.frontend.opcodes.registry import PY312, opcode
from ember.frontend.values import ClosureV, NullV

if TYPE_CHECKING:
    from ember.frontend.interpreter import Frame


@opcode("KW_NAMES")
def kw_names(frame: Frame, inst: dis.Instruction) -> None:
    frame.kw_names = frame.code.co_consts[inst.arg]


@opcode("CALL")
def call(frame: Frame, inst: dis.Instruction) -> None:
    n = inst.arg
    args = frame.popn(n)
    kw = frame.kw_names
    frame.kw_names = ()
    b = frame.pop()
    a = frame.pop()
    if isinstance(a, NullV):
        fn = b
    else:
        fn, args = a, [b] + args
    kwargs = {}
    if kw:
        kwargs = dict(zip(kw, args[len(args) - len(kw):]))
        args = args[:len(args) - len(kw)]
    frame.push(frame.call(fn, args, kwargs))


@opcode("CALL_FUNCTION_EX")
def call_function_ex(frame: Frame, inst: dis.Instruction) -> None:
    kwargs = frame.as_dict(frame.pop()) if inst.arg & 1 else {}
    args = frame.iterate(frame.pop())
    fn = frame.pop()
    if frame.stack and isinstance(frame.stack[-1], NullV):
        frame.pop()
    frame.push(frame.call(fn, list(args), dict(kwargs)))


@opcode("MAKE_FUNCTION")
def make_function(frame: Frame, inst: dis.Instruction) -> None:
    if PY312 or sys.version_info >= (3, 11):
        code = frame.pop().value
    flags = inst.arg
    closure = tuple(frame.pop().items) if flags & 0x08 else ()
    if flags & 0x04:
        frame.pop()  # annotations
    kwdefaults = frame.as_dict(frame.pop()) if flags & 0x02 else {}
    defaults = tuple(frame.pop().items) if flags & 0x01 else ()
    frame.push(ClosureV(code, frame.f_globals, code.co_name, defaults, kwdefaults, closure, code.co_qualname))


@opcode("LOAD_BUILD_CLASS")
def load_build_class(frame: Frame, inst: dis.Instruction) -> None:
    raise Unsupported("class definition inside a compiled function", frame.where())
