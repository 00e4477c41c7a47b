"""Resume functions: new code objects that continue a function's bytecode from the middle.

At a graph break the compiled code runs the graph captured so far, performs the unsupported instruction
in plain Python, and then calls a *resume function* built here: a copy of the original code object with
a small prologue that rebuilds the interpreter state and jumps to the instruction the original would run
next.  From there on the body is the original one (same exception table, same line numbers), so it
returns, raises and has side effects exactly as the original would from that point.

Parameters of the resume code::

    __resume_at_{offset}_{name}(___stack0, ..., ___stack{n-1}, *live_locals)

``___stack{k}`` is the k-th operand-stack value from the bottom (more underscores if the name is taken,
as when resuming a resume function).  Slots listed in ``null_positions`` hold NULL (the slot below a callable pushed by LOAD_GLOBAL/PUSH_NULL/LOAD_ATTR, or the saved loop
variable of a 3.12 inlined comprehension when it was unbound) and take no argument.  A live local that
is a *cell variable* (captured by an inner function) is passed as its value: the original MAKE_CELL
wraps it in a fresh cell, as it does for an argument of the original.  Where closures made before the
break must keep sharing the cell with the resumed code, name it in ``passed_cells`` and pass the
``types.CellType`` itself: its MAKE_CELL is dropped and the parameter slot *is* the cell.  Free
variables come from the closure given to ``types.FunctionType(code, globals, name, None, closure)``:
co_freevars is unchanged.

Prologue layout (everything up to the original RESUME is kept, minus MAKE_CELL of passed cells)::

    COPY_FREE_VARS n / MAKE_CELL c    original order (3.11: COPY_FREE_VARS first; 3.12: MAKE_CELL first);
                                      a live cell variable's parameter value goes into its new cell, a
                                      dead one starts empty
    RESUME 0
    PUSH_NULL; LOAD_CONST _expect_cells; LOAD_CONST names; LOAD_FAST c...; [PRECALL n]; CALL n; POP_TOP
                                      only with passed_cells: LOAD_DEREF of a non-cell would crash
    LOAD_FAST ___stack{k}; DELETE_FAST ___stack{k}  (PUSH_NULL for a NULL slot), bottom of stack first;
                                      the parameter is cleared so it holds no extra reference
    LOAD_FAST self; STORE_FAST ___stack{k}   only for zero-argument super() (see below)
    KW_NAMES names                    only when resuming between a KW_NAMES and its CALL
    JUMP_FORWARD target               into the untouched original body

The body keeps the original instruction sequence, so CPython's specializations that assume a neighbour
(3.11 PRECALL doing the CALL, COMPARE_OP fused with the next POP_JUMP) stay valid: we only jump in.

3.11 vs 3.12 differences handled:
  - 3.11 calls need PRECALL before CALL (in our prologue); dis.stack_effect charges a call's arguments
    to PRECALL although CALL pops them, so depths at a CALL are corrected.  3.11 has
    POP_JUMP_FORWARD/BACKWARD_IF_*, 3.12 only forward conditional jumps: the bytecode library's labels
    take care of both.
  - 3.12 emits unchecked LOAD_FAST for locals the compiler proved bound from the function start; in the
    resume function only its parameters are bound at entry, so every other LOAD_FAST becomes
    LOAD_FAST_CHECK (UnboundLocalError instead of a crash if a caller forgets a live local).
  - 3.12 inlines comprehensions: LOAD_FAST_AND_CLEAR saves the outer value of the loop variable on the
    stack (NULL if it was unbound) and the exception table restores it; nothing special beyond NULLs.
  - 3.12 FOR_ITER on exhaustion skips END_FOR; dis.stack_effect models it as jumping *to* END_FOR with
    one extra value, which gives the right depth after END_FOR.  END_FOR itself never runs and is not
    offered as a resume offset.
  - KW_NAMES (3.11 and 3.12) keeps call keywords in interpreter state, not on the stack: the prologue
    re-emits it when the resume offset is between KW_NAMES and its CALL.
  - Offsets are ``dis`` offsets (CACHE entries skipped); an instruction may also be named by the
    offset of its first EXTENDED_ARG prefix.

Zero-argument ``super()`` finds the instance in local slot 0 (3.11 and 3.12's unspecialized
LOAD_SUPER_ATTR), i.e. the resume code's first parameter: functions that use it must pass their first
argument as a live local, and when a stack parameter comes first the prologue copies it there.

A generator's resume code is a generator function too: its prologue follows the generator's own
(RETURN_GENERATOR, POP_TOP, RESUME), so calling it makes a generator that rebuilds the state and continues
on its first next(); resuming after a YIELD_VALUE passes the value sent in as the top stack slot.

Known limits: coroutines are refused (their frames cannot be rebuilt by a call); in cleanup
handlers that keep ``lasti`` on the stack, a later RERAISE sets the resume frame's f_lasti to the
*original* offset, so the traceback line of that frame may be wrong; resuming inside an ``except`` body
needs the caller to run the resume function while that exception is being handled (sys.exc_info()).
"""
from __future__ import annotations

import dis
import functools
import sys
import types
from dataclasses import dataclass
from typing import Iterable, Mapping

from bytecode import Bytecode, CellVar, CompilerFlags, Instr, Label, TryBegin, TryEnd

PY312 = sys.version_info >= (3, 12)
_JUMPS = frozenset(dis.hasjrel) | frozenset(dis.hasjabs)
_NO_FALLTHROUGH = frozenset({"RETURN_VALUE", "RETURN_CONST", "RAISE_VARARGS", "RERAISE", "JUMP_FORWARD",
                             "JUMP_BACKWARD", "JUMP_BACKWARD_NO_INTERRUPT"})
_UNRESUMABLE = (CompilerFlags.COROUTINE | CompilerFlags.ASYNC_GENERATOR
                | CompilerFlags.ITERABLE_COROUTINE)


@dataclass(frozen=True)
class ResumeCode:
    code: types.CodeType          # FunctionType(code, globals, code.co_name, None, closure)(*args)
    offset: int                   # dis offset of the first original instruction it runs
    argnames: tuple[str, ...]     # its parameters in order: the non-NULL stack slots, then live_locals
    stack_depth: int              # operand stack depth at offset, NULL slots included
    null_positions: tuple[int, ...]  # stack slots (0 = bottom) holding NULL; they take no argument
    live_locals: tuple[str, ...]
    passed_cells: tuple[str, ...]  # live cell variables passed as types.CellType, not as their value
    # each offset of the resume code's body (an EXTENDED_ARG prefix's too) -> the original instruction's offset:
    # a break in a resume function resumes the original code there, so a loop's resumes are one function
    original_offsets: Mapping[int, int]


def _stack_effect(ins: dis.Instruction, jump: bool) -> int:
    if ins.opname == "PRECALL":  # 3.11: dis charges the arguments to PRECALL, but CALL pops them
        return 0
    if ins.opname == "RETURN_GENERATOR":  # the generator's first resumption finds None pushed (its POP_TOP pops it)
        return 1
    if ins.opname == "CALL" and not PY312:
        return -ins.arg - 1
    return dis.stack_effect(ins.opcode, ins.arg if ins.opcode >= dis.HAVE_ARGUMENT else None, jump=jump)


def _where(code: types.CodeType) -> str:
    return f"{code.co_qualname} ({code.co_filename}:{code.co_firstlineno})"


@functools.lru_cache(maxsize=None)
def resume_offsets(code: types.CodeType) -> Mapping[int, int]:
    """Every offset where a resume function may start, mapped to the operand stack depth there.

    A dataflow over ``dis`` instructions from the entry: fallthrough and jump edges use
    ``dis.stack_effect``; an instruction covered by an exception-table entry also flows into its handler
    with the entry's depth plus the exception (plus lasti).  Prologue, unreachable and (3.12) END_FOR
    offsets are left out.  Raises AssertionError if two paths disagree on a depth (this analysis would be
    wrong).  Cached per code object; the result is read-only."""
    if code.co_flags & _UNRESUMABLE:
        raise ValueError(f"{_where(code)}: coroutines cannot be resumed by a call")
    instrs = list(dis.get_instructions(code))
    index = {ins.offset: k for k, ins in enumerate(instrs)}
    handlers = dis.Bytecode(code).exception_entries
    depth: dict[int, int] = {}
    todo = [(0, 0)]
    while todo:
        k, d = todo.pop()
        ins = instrs[k]
        if ins.offset in depth:
            assert depth[ins.offset] == d, f"{_where(code)}: depth {depth[ins.offset]} and {d} at {ins.offset}"
            continue
        depth[ins.offset] = d
        todo += [(index[e.target], e.depth + 1 + e.lasti) for e in handlers if e.start <= ins.offset < e.end]
        if ins.opcode in _JUMPS:
            todo.append((index[ins.argval], d + _stack_effect(ins, jump=True)))
        if ins.opname not in _NO_FALLTHROUGH:
            todo.append((k + 1, d + _stack_effect(ins, jump=False)))
    body = next(k for k, ins in enumerate(instrs) if ins.opname == "RESUME") + 1
    # 3.12's END_FOR never runs (FOR_ITER jumps past it), so no state exists there to resume from
    return types.MappingProxyType({ins.offset: depth[ins.offset] for ins in instrs[body:]
                                   if ins.offset in depth and ins.opname != "END_FOR"})


def stack_depth_at(code: types.CodeType, offset: int) -> int:
    """Operand stack depth (NULL slots included) before the instruction at ``offset``."""
    depths = resume_offsets(code)
    if offset not in depths:
        raise ValueError(f"{_where(code)}: cannot resume at offset {offset}: not the offset of an "
                         f"instruction reachable after the prologue (see dis.dis)")
    return depths[offset]


def make_resume_code(code: types.CodeType, offset: int, stack_depth: int, live_locals: Iterable[str],
                     null_positions: Iterable[int] = (), passed_cells: Iterable[str] = ()) -> ResumeCode:
    """Code that continues ``code`` at ``offset`` from the given operand stack and live locals.

    See the module docstring for the parameters of the result.  Cached per arguments."""
    # code objects compare equal across files (co_filename is not compared): keep tracebacks right
    return _make_resume_code(code, code.co_filename, code.co_qualname, offset, stack_depth, tuple(live_locals),
                             tuple(sorted(set(null_positions))), tuple(passed_cells))


def clear_caches() -> None:
    resume_offsets.cache_clear()
    _make_resume_code.cache_clear()


def _expect_cells(names: tuple[str, ...], *cells: object) -> None:
    for name, cell in zip(names, cells):
        if type(cell) is not types.CellType:
            raise TypeError(f"resume function: {name!r} is in passed_cells, so pass a types.CellType, "
                            f"not a {type(cell).__name__}")


def _locate(code: types.CodeType, bc: Bytecode, offset: int) -> tuple[Instr, Instr | None]:
    """The bytecode-library Instr at dis ``offset``, and the KW_NAMES still pending there (if any)."""
    real, prefix = [], []  # real: (offsets that name the instruction, opname); EXTENDED_ARG is folded
    for ins in dis.get_instructions(code):
        if ins.opname == "EXTENDED_ARG":
            prefix.append(ins.offset)
        else:
            real.append(([*prefix, ins.offset], ins.opname))
            prefix = []
    abstract = [item for item in bc if isinstance(item, Instr)]
    assert len(abstract) == len(real), f"{_where(code)}: bytecode library and dis disagree"
    kw_names = None
    for (offsets, opname), instr in zip(real, abstract):
        # 3.12 compiles LOAD_CLOSURE to LOAD_FAST; the bytecode library names it back
        assert instr.name == opname or {instr.name, opname} == {"LOAD_CLOSURE", "LOAD_FAST"}, (opname, instr)
        if offset in offsets:
            return instr, kw_names
        kw_names = instr if instr.name == "KW_NAMES" else None if instr.name == "CALL" else kw_names
    raise AssertionError(f"{_where(code)}: offset {offset} not found")


@functools.lru_cache(maxsize=None)
def _make_resume_code(code: types.CodeType, _filename: str, _qualname: str, offset: int, stack_depth: int,
                      live_locals: tuple[str, ...], nulls: tuple[int, ...], cells: tuple[str, ...]) -> ResumeCode:
    expected = stack_depth_at(code, offset)
    if stack_depth != expected:
        raise ValueError(f"{_where(code)}: the stack depth at offset {offset} is {expected}, got {stack_depth}")
    if any(not 0 <= k < stack_depth for k in nulls):
        raise ValueError(f"{_where(code)}: NULL slots {nulls} outside a stack of depth {stack_depth}")
    if len(set(live_locals)) != len(live_locals) or any(
            n not in code.co_varnames and n not in code.co_cellvars for n in live_locals):
        raise ValueError(f"{_where(code)}: live locals must be distinct names from co_varnames or "
                         f"co_cellvars (free variables come from the closure); got {list(live_locals)}")
    if any(c not in live_locals or c not in code.co_cellvars for c in cells):
        raise ValueError(f"{_where(code)}: passed_cells {list(cells)} must be live cell variables")
    prefix = "___stack"
    while any(n.startswith(prefix) for n in code.co_varnames):  # e.g. when resuming a resume function
        prefix = "_" + prefix
    stack_names = [f"{prefix}{k}" for k in range(stack_depth)]
    argnames = tuple(n for k, n in enumerate(stack_names) if k not in nulls) + live_locals
    # Zero-argument super() reads the class from __class__ and the instance from local slot 0, which in
    # the resume code is its first parameter: that slot must hold the original's first argument.
    self_name = code.co_varnames[0] if code.co_argcount else None
    fix_slot0 = "__class__" in code.co_freevars and "super" in code.co_names and argnames[:1] != (self_name,)
    if fix_slot0 and (self_name not in live_locals or argnames[0] not in stack_names):
        raise ValueError(f"{_where(code)} uses super(): pass its first argument {self_name!r} as a live local, "
                         f"first among them when the stack is empty")

    bc = Bytecode.from_code(code, conserve_exception_block_stackdepth=True)
    target, kw_names = _locate(code, bc, offset)
    label = Label()
    loc = target.location  # the prologue reports the user's line where execution resumes

    def instr(name: str, *arg) -> Instr:
        return Instr(name, *arg, location=loc)

    prologue = []
    if cells:  # LOAD_FAST on a cell variable's slot loads the raw object: the passed cell
        prologue += [instr("PUSH_NULL"), instr("LOAD_CONST", _expect_cells), instr("LOAD_CONST", cells),
                     *[instr("LOAD_FAST", c) for c in cells]]
        n = 1 + len(cells)
        prologue += [instr("CALL", n)] if PY312 else [instr("PRECALL", n), instr("CALL", n)]
        prologue.append(instr("POP_TOP"))
    for k, name in enumerate(stack_names):
        prologue += [instr("PUSH_NULL")] if k in nulls else [instr("LOAD_FAST", name), instr("DELETE_FAST", name)]
    if fix_slot0:  # the stack parameter in slot 0 was cleared above: it becomes a second `self`
        prologue += [instr("LOAD_DEREF", CellVar(self_name)) if self_name in code.co_cellvars else
                     instr("LOAD_FAST", self_name), instr("STORE_FAST", argnames[0])]
    if kw_names is not None:
        prologue.append(instr("KW_NAMES", kw_names.arg))
    prologue.append(instr("JUMP_FORWARD", label))

    items, in_body = [], False
    for item in bc:
        if not in_body:
            assert not isinstance(item, (TryBegin, TryEnd)), f"{_where(code)}: try block before RESUME"
            if isinstance(item, Instr) and item.name == "MAKE_CELL" and item.arg.name in cells:
                continue  # the parameter is the cell
            items.append(item)
            if isinstance(item, Instr) and item.name == "RESUME":
                items += prologue
                in_body = True
            continue
        if item is target:
            items.append(label)
        if PY312 and isinstance(item, Instr) and item.name == "LOAD_FAST" and item.arg not in argnames:
            item = Instr("LOAD_FAST_CHECK", item.arg, location=item.location)
        items.append(item)

    new = Bytecode(items)
    new.first_lineno, new.filename, new.docstring = bc.first_lineno, bc.filename, bc.docstring
    new.cellvars, new.freevars = list(bc.cellvars), list(bc.freevars)
    new.name = f"__resume_at_{offset}_{code.co_name}"
    new.qualname = f"__resume_at_{offset}_{code.co_qualname}"
    new.argnames = list(argnames)
    new.argcount, new.posonlyargcount, new.kwonlyargcount = len(argnames), 0, 0
    new.flags = bc.flags & ~(CompilerFlags.VARARGS | CompilerFlags.VARKEYWORDS)
    # The original body never needs more than co_stacksize from a state it reaches; the prologue needs
    # stack_depth, or 3 + the passed cells.  The exception table keeps the original depths: recomputing
    # them would miss try blocks entered through the prologue's jump rather than from their start.
    stacksize = max(code.co_stacksize, stack_depth, 3 + len(cells))
    resumed = new.to_code(stacksize=stacksize, compute_exception_stack_depths=False)
    return ResumeCode(resumed, offset, argnames, stack_depth, nulls, live_locals, cells,
                      _original_offsets(code, resumed))


def _original_offsets(code: types.CodeType, resumed: types.CodeType) -> Mapping[int, int]:
    """The resume code's body is the original's body, instruction for instruction (EXTENDED_ARG prefixes may
    differ, LOAD_FAST may have become LOAD_FAST_CHECK): the two lists end alike, so align them from the end."""
    def named(c: types.CodeType) -> list[tuple[list[int], str]]:
        out, prefix = [], []
        for ins in dis.get_instructions(c):
            if ins.opname == "EXTENDED_ARG":
                prefix.append(ins.offset)
            else:
                out.append(([*prefix, ins.offset], ins.opname))
                prefix = []
        return out
    orig, new = named(code), named(resumed)
    body = len(orig) - next(k for k, (_o, name) in enumerate(orig) if name == "RESUME") - 1
    out = {}
    for (o_offsets, o_name), (n_offsets, n_name) in zip(orig[len(orig) - body:], new[len(new) - body:]):
        assert o_name == n_name or {o_name, n_name} in ({"LOAD_FAST", "LOAD_FAST_CHECK"},
                                                        {"LOAD_CLOSURE", "LOAD_FAST"}), (o_name, n_name)
        for n in n_offsets:
            out[n] = o_offsets[-1]
    return types.MappingProxyType(out)
