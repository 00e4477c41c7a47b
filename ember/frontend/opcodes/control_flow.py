"""Opcode handlers for jumps, loops, returns, generators, with blocks and exceptions."""
from __future__ import annotations

import dis
from typing import TYPE_CHECKING

from ember.errors import Unsupported
from ember.frontend.builtin_functions import classes_of
from ember.frontend.opcodes.registry import PY312, opcode
from ember.frontend.signals import PyError, Return
from ember.frontend.values import (
    AutocastCtxV, BoundV, ConstV, GradModeCtxV, GradModeExitV, IterV, NewObjV, NoOpCtxV, ObjV, TensorV, V,
)

if TYPE_CHECKING:
    from ember.frontend.interpreter import Frame


@opcode("JUMP_FORWARD", "JUMP_BACKWARD", "JUMP_BACKWARD_NO_INTERRUPT", "JUMP")
def jump_unconditional(frame: Frame, inst: dis.Instruction) -> None:
    frame.jump(inst)


def _pop_jump(frame: Frame, inst: dis.Instruction, when: bool):
    v = frame.pop()
    if isinstance(v, TensorV):
        frame.push(v)  # restore: the break happens before this instruction
        raise Unsupported("data-dependent control flow: a branch on a tensor's value", frame.where())
    if frame.truth(v) == when:
        frame.jump(inst)


@opcode("POP_JUMP_IF_TRUE", "POP_JUMP_FORWARD_IF_TRUE", "POP_JUMP_BACKWARD_IF_TRUE")
def pop_jump_if_true(frame: Frame, inst: dis.Instruction) -> None:
    _pop_jump(frame, inst, True)


@opcode("POP_JUMP_IF_FALSE", "POP_JUMP_FORWARD_IF_FALSE", "POP_JUMP_BACKWARD_IF_FALSE")
def pop_jump_if_false(frame: Frame, inst: dis.Instruction) -> None:
    _pop_jump(frame, inst, False)


@opcode("POP_JUMP_IF_NONE", "POP_JUMP_FORWARD_IF_NONE", "POP_JUMP_BACKWARD_IF_NONE")
def pop_jump_if_none(frame: Frame, inst: dis.Instruction) -> None:
    v = frame.pop()
    if frame.is_none(v):
        frame.jump(inst)


@opcode("POP_JUMP_IF_NOT_NONE", "POP_JUMP_FORWARD_IF_NOT_NONE", "POP_JUMP_BACKWARD_IF_NOT_NONE")
def pop_jump_if_not_none(frame: Frame, inst: dis.Instruction) -> None:
    v = frame.pop()
    if not frame.is_none(v):
        frame.jump(inst)


@opcode("JUMP_IF_TRUE_OR_POP")
def jump_if_true_or_pop(frame: Frame, inst: dis.Instruction) -> None:
    v = frame.stack[-1]
    if isinstance(v, TensorV):
        raise Unsupported("data-dependent control flow: `or` on a tensor's value", frame.where())
    if frame.truth(v):
        frame.jump(inst)
    else:
        frame.pop()


@opcode("JUMP_IF_FALSE_OR_POP")
def jump_if_false_or_pop(frame: Frame, inst: dis.Instruction) -> None:
    v = frame.stack[-1]
    if isinstance(v, TensorV):
        raise Unsupported("data-dependent control flow: `and` on a tensor's value", frame.where())
    if not frame.truth(v):
        frame.jump(inst)
    else:
        frame.pop()


@opcode("GET_ITER", "GET_YIELD_FROM_ITER")
def get_iter(frame: Frame, inst: dis.Instruction) -> None:
    v = frame.pop()
    frame.push(v if isinstance(v, IterV) and not v.view else IterV(frame.iterate(v)))


@opcode("FOR_ITER")
def for_iter(frame: Frame, inst: dis.Instruction) -> None:
    it = frame.stack[-1]
    if not isinstance(it, IterV):
        raise Unsupported("iteration over an object ember cannot see into", frame.where())
    if it.pos < len(it.items):
        frame.push(it.items[it.pos])
        it.pos += 1
    else:
        frame.pop()
        frame.jump(inst)
        if PY312:  # 3.12 jumps past the END_FOR that follows the target
            frame.ip += 1


@opcode("END_FOR")
def end_for(frame: Frame, inst: dis.Instruction) -> None:
    frame.pop()
    frame.pop()


@opcode("RETURN_VALUE")
def return_value(frame: Frame, inst: dis.Instruction) -> None:
    raise Return(frame.pop())


@opcode("RETURN_CONST")
def return_const(frame: Frame, inst: dis.Instruction) -> None:
    raise Return(frame.const_v(inst.argval))


@opcode("RETURN_GENERATOR")
def return_generator(frame: Frame, inst: dis.Instruction) -> None:
    frame.push(ConstV(None))


@opcode("YIELD_VALUE")
def yield_value(frame: Frame, inst: dis.Instruction) -> None:
    if frame.yields is None:
        raise Unsupported("yield outside a generator", frame.where())
    frame.yields.append(frame.pop())
    frame.push(ConstV(None))  # the value sent in by next()


@opcode("SEND")
def send(frame: Frame, inst: dis.Instruction) -> None:
    frame.pop()  # the value sent in: always None for generators consumed by iteration
    it = frame.stack[-1]
    if not isinstance(it, IterV):
        raise Unsupported("yield from a non-iterable", frame.where())
    if it.pos < len(it.items):
        frame.push(it.items[it.pos])
        it.pos += 1
        return
    if not PY312:
        frame.pop()
    frame.push(ConstV(None))
    frame.jump(inst)


@opcode("END_SEND")
def end_send(frame: Frame, inst: dis.Instruction) -> None:
    v = frame.pop()
    frame.pop()
    frame.push(v)


@opcode("BEFORE_WITH")
def before_with(frame: Frame, inst: dis.Instruction) -> None:
    ctx = frame.pop()
    if isinstance(ctx, GradModeCtxV):
        prev = frame.cap.grad_enabled if ctx.prev is None else ctx.prev
        frame.set_grad(ctx.enabled)
        frame.push(GradModeExitV(prev))
        frame.push(ConstV(None))
        return
    if isinstance(ctx, AutocastCtxV):
        frame.push(frame.enter_autocast(ctx))
        frame.push(ConstV(None))
        return
    if isinstance(ctx, NoOpCtxV):
        frame.push(NoOpCtxV(ctx.cls, ctx.args, exit=True))  # its __exit__: calling it does nothing (see call)
        frame.push(ctx)  # record_function.__enter__ returns self
        return
    enter = frame.getattr(ctx, "__enter__")
    exit_ = frame.getattr(ctx, "__exit__")
    if not isinstance(enter, BoundV) or not isinstance(exit_, BoundV):
        raise Unsupported(f"context manager {type(ctx).__name__} is not supported", frame.where())
    frame.push(exit_)
    frame.push(frame.call(enter, [], {}))


@opcode("WITH_EXCEPT_START")
def with_except_start(frame: Frame, inst: dis.Instruction) -> None:
    exc = frame.stack[-1]
    exit_fn = frame.stack[-4]
    e = exc.value
    frame.push(frame.call(exit_fn, [ObjV(type(e)), exc, ConstV(None)], {}))


@opcode("PUSH_EXC_INFO")
def push_exc_info(frame: Frame, inst: dis.Instruction) -> None:
    exc = frame.pop()
    frame.push(frame.exc_info[-1] if frame.exc_info else ConstV(None))
    frame.exc_info.append(exc)
    frame.push(exc)


@opcode("POP_EXCEPT")
def pop_except(frame: Frame, inst: dis.Instruction) -> None:
    frame.pop()
    if frame.exc_info:
        frame.exc_info.pop()


@opcode("CHECK_EXC_MATCH")
def check_exc_match(frame: Frame, inst: dis.Instruction) -> None:
    typ = frame.pop()
    exc = frame.stack[-1]
    frame.push(ConstV(isinstance(exc.value, classes_of(typ))))


@opcode("RERAISE")
def reraise(frame: Frame, inst: dis.Instruction) -> None:
    exc = frame.pop()
    raise PyError(exc.value, frame.where())


@opcode("RAISE_VARARGS")
def raise_varargs(frame: Frame, inst: dis.Instruction) -> None:
    if inst.arg == 0:
        if not frame.exc_info:
            raise Unsupported("bare raise outside an except block", frame.where())
        raise PyError(frame.exc_info[-1].value, frame.where())
    if inst.arg == 2:
        frame.pop()  # the cause: kept by Python when the exception escapes (it is re-raised for real)
    v = frame.pop()
    raise PyError(real_exception(frame, v), frame.where())


def real_exception(frame: Frame, v: V) -> BaseException:
    if isinstance(v, ObjV) and isinstance(v.value, type) and issubclass(v.value, BaseException):
        return v.value()
    if isinstance(v, ObjV) and isinstance(v.value, BaseException):
        return v.value
    if isinstance(v, NewObjV) and issubclass(v.cls, BaseException):
        args = v.attrs.get("args")
        try:
            return v.cls(*[frame.const_value(a) for a in args.items]) if args else v.cls()
        except Unsupported:
            return v.cls("<value known at run time>")
    raise Unsupported(f"raise of {frame.type_name(v)}", frame.where())
