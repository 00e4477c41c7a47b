"""Opcode handlers for unary, binary and comparison operators, identity and membership tests, and subscripts."""
from __future__ import annotations

import dis
import operator
from typing import TYPE_CHECKING

from ember.errors import Unsupported
from ember.frontend.opcodes.registry import PY312, opcode
from ember.frontend.values import ConstV, DictV, ListV, TensorV

if TYPE_CHECKING:
    from ember.frontend.interpreter import Frame

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


@opcode("BINARY_OP")
def binary_op(frame: Frame, inst: dis.Instruction) -> None:
    b = frame.pop()
    a = frame.pop()
    fn, inplace = BINARY_OPS[inst.arg]
    frame.push(frame.binary(fn, a, b, inplace))


@opcode("UNARY_NEGATIVE")
def unary_negative(frame: Frame, inst: dis.Instruction) -> None:
    frame.push(frame.unary(operator.neg, frame.pop()))


@opcode("UNARY_INVERT")
def unary_invert(frame: Frame, inst: dis.Instruction) -> None:
    frame.push(frame.unary(operator.invert, frame.pop()))


@opcode("UNARY_POSITIVE")
def unary_positive(frame: Frame, inst: dis.Instruction) -> None:
    frame.push(frame.unary(operator.pos, frame.pop()))


@opcode("UNARY_NOT")
def unary_not(frame: Frame, inst: dis.Instruction) -> None:
    v = frame.pop()
    if isinstance(v, TensorV):
        raise Unsupported("`not` of a tensor needs its value", frame.where())
    frame.push(ConstV(not frame.truth(v)))


@opcode("COMPARE_OP")
def compare_op(frame: Frame, inst: dis.Instruction) -> None:
    b = frame.pop()
    a = frame.pop()
    op = inst.argval if not PY312 else inst.argrepr.split()[0] if inst.argrepr else inst.argval
    frame.push(frame.binary(COMPARE_OPS[op.strip()], a, b, False))


@opcode("IS_OP")
def is_op(frame: Frame, inst: dis.Instruction) -> None:
    b = frame.pop()
    a = frame.pop()
    same = frame.is_same(a, b)
    frame.push(ConstV(same != bool(inst.arg)))


@opcode("CONTAINS_OP")
def contains_op(frame: Frame, inst: dis.Instruction) -> None:
    container = frame.pop()
    item = frame.pop()
    frame.push(ConstV(frame.contains(container, item) != bool(inst.arg)))


@opcode("BINARY_SUBSCR")
def binary_subscr(frame: Frame, inst: dis.Instruction) -> None:
    idx = frame.pop()
    obj = frame.pop()
    frame.push(frame.getitem(obj, idx))


@opcode("BINARY_SLICE")
def binary_slice(frame: Frame, inst: dis.Instruction) -> None:
    end = frame.pop()
    start = frame.pop()
    obj = frame.pop()
    frame.push(frame.getitem(obj, ConstV(slice(frame.const_value(start, symbolic=True),
                                               frame.const_value(end, symbolic=True)))))   # as BUILD_SLICE


@opcode("STORE_SUBSCR")
def store_subscr(frame: Frame, inst: dis.Instruction) -> None:
    idx = frame.pop()
    obj = frame.pop()
    value = frame.pop()
    frame.setitem(obj, idx, value)


@opcode("STORE_SLICE")
def store_slice(frame: Frame, inst: dis.Instruction) -> None:
    end = frame.pop()
    start = frame.pop()
    obj = frame.pop()
    value = frame.pop()
    frame.setitem(obj, ConstV(slice(frame.const_value(start, symbolic=True), frame.const_value(end, symbolic=True))),
                  value)


@opcode("DELETE_SUBSCR")
def delete_subscr(frame: Frame, inst: dis.Instruction) -> None:
    idx = frame.pop()
    obj = frame.pop()
    if isinstance(obj, DictV):
        frame.dict_mutate(obj).items.pop(frame.key(idx))
    elif isinstance(obj, ListV):
        items = frame.list_mutate(obj).items
        del items[frame.const_value(idx)]
    else:
        raise Unsupported(f"del on {type(obj).__name__}", frame.where())
