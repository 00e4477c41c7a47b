"""Opcode handlers that build containers, strings and slices, extend or update them, and unpack sequences."""
from __future__ import annotations

import dis
import operator
from typing import TYPE_CHECKING

from ember.errors import Unsupported
from ember.frontend.opcodes.registry import opcode
from ember.frontend.values import ConstV, DictV, ListV, SetV, TupleV

if TYPE_CHECKING:
    from ember.frontend.interpreter import Frame


@opcode("BUILD_TUPLE")
def build_tuple(frame: Frame, inst: dis.Instruction) -> None:
    frame.push(TupleV(frame.popn(inst.arg)))


@opcode("BUILD_LIST")
def build_list(frame: Frame, inst: dis.Instruction) -> None:
    frame.push(ListV(frame.popn(inst.arg)))


@opcode("BUILD_SET")
def build_set(frame: Frame, inst: dis.Instruction) -> None:
    items = frame.popn(inst.arg)
    s = SetV([])
    for x in items:
        frame.set_add(s, x)
    frame.push(s)


@opcode("BUILD_MAP")
def build_map(frame: Frame, inst: dis.Instruction) -> None:
    flat = frame.popn(2 * inst.arg)
    frame.push(DictV({frame.key(flat[i]): flat[i + 1] for i in range(0, len(flat), 2)}))


@opcode("BUILD_CONST_KEY_MAP")
def build_const_key_map(frame: Frame, inst: dis.Instruction) -> None:
    keys = frame.pop()
    values = frame.popn(inst.arg)
    frame.push(DictV({frame.key(k): v for k, v in zip(keys.items, values)}))


@opcode("BUILD_STRING")
def build_string(frame: Frame, inst: dis.Instruction) -> None:
    parts = frame.popn(inst.arg)
    frame.push(ConstV("".join(frame.const_value(p) for p in parts)))


@opcode("BUILD_SLICE")
def build_slice(frame: Frame, inst: dis.Instruction) -> None:
    parts = frame.popn(inst.arg)
    frame.push(ConstV(slice(*[frame.const_value(p, symbolic=True) for p in parts])))   # (x[:n]: n stays symbolic)


@opcode("FORMAT_VALUE")
def format_value(frame: Frame, inst: dis.Instruction) -> None:
    spec = frame.const_value(frame.pop()) if (inst.arg & 0x04) == 0x04 else ""
    v = frame.pop()
    value = frame.const_value(v)
    conv = inst.arg & 0x03
    value = {0: value, 1: str(value), 2: repr(value), 3: ascii(value)}[conv]
    frame.push(ConstV(format(value, spec)))


@opcode("LIST_APPEND")
def list_append(frame: Frame, inst: dis.Instruction) -> None:
    v = frame.pop()
    frame.list_mutate(frame.stack[-inst.arg]).items.append(v)


@opcode("LIST_EXTEND")
def list_extend(frame: Frame, inst: dis.Instruction) -> None:
    v = frame.pop()
    frame.list_mutate(frame.stack[-inst.arg]).items.extend(frame.iterate(v))


@opcode("SET_ADD")
def set_add(frame: Frame, inst: dis.Instruction) -> None:
    v = frame.pop()
    frame.set_add(frame.stack[-inst.arg], v)


@opcode("SET_UPDATE")
def set_update(frame: Frame, inst: dis.Instruction) -> None:
    v = frame.pop()
    for x in frame.iterate(v):
        frame.set_add(frame.stack[-inst.arg], x)


@opcode("MAP_ADD")
def map_add(frame: Frame, inst: dis.Instruction) -> None:
    value = frame.pop()
    key = frame.pop()
    frame.dict_mutate(frame.stack[-inst.arg]).items[frame.key(key)] = value


@opcode("DICT_UPDATE")
def dict_update(frame: Frame, inst: dis.Instruction) -> None:
    other = frame.pop()
    d = frame.dict_mutate(frame.stack[-inst.arg])
    d.items.update(frame.as_dict(other))


@opcode("DICT_MERGE")
def dict_merge(frame: Frame, inst: dis.Instruction) -> None:
    other = frame.as_dict(frame.pop())
    d = frame.dict_mutate(frame.stack[-inst.arg])
    for k in other:
        if k in d.items:
            raise Unsupported(f"duplicate keyword argument {k!r}", frame.where())
    d.items.update(other)


@opcode("LIST_TO_TUPLE")
def list_to_tuple(frame: Frame, inst: dis.Instruction) -> None:
    frame.push(TupleV(list(frame.pop().items)))


@opcode("CALL_INTRINSIC_1")
def call_intrinsic_1(frame: Frame, inst: dis.Instruction) -> None:
    if inst.argrepr == "INTRINSIC_LIST_TO_TUPLE":
        return list_to_tuple(frame, inst)
    if inst.argrepr == "INTRINSIC_UNARY_POSITIVE":
        return frame.push(frame.unary(operator.pos, frame.pop()))
    raise Unsupported(f"{inst.argrepr} is not supported", frame.where())


@opcode("UNPACK_SEQUENCE")
def unpack_sequence(frame: Frame, inst: dis.Instruction) -> None:
    items = frame.iterate(frame.pop())
    if len(items) != inst.arg:
        raise Unsupported("unpacking a sequence of the wrong length", frame.where())
    for x in reversed(items):
        frame.push(x)


@opcode("UNPACK_EX")
def unpack_ex(frame: Frame, inst: dis.Instruction) -> None:
    items = frame.iterate(frame.pop())
    before, after = inst.arg & 0xFF, inst.arg >> 8
    if len(items) < before + after:
        raise Unsupported("unpacking a sequence of the wrong length", frame.where())
    rest = items[before:len(items) - after]
    out = items[:before] + [ListV(rest)] + items[len(items) - after:]
    for x in reversed(out):
        frame.push(x)
