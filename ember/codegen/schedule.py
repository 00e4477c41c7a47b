"""Scheduling: which buffers share a loop nest, which stay in registers, and in what order things run.

Vertical fusion of pointwise chains already happened during lowering (loaders compose); the scheduler fuses
loop nests. A FusedGroup is one parallel loop over `numel` rows (x0); each member runs its own inner loops
(r0, r1, ...) inside a row, in order:

    for x0 in range(numel):            # OpenMP-parallel (C++) / the program id (Triton)
        member 1: reduction over r     # e.g. max of a softmax row   -> a scalar kept in a register
        member 2: reduction over r     # sum of exp(x - max)         -> a scalar
        member 3: pointwise over r     # exp(x - max) / sum          -> stored

A buffer joins a group with the same row count when everything it reads from the group was produced for
the same row (checked on the index arithmetic), so a whole layer_norm or softmax is one loop nest; a
buffer that reads nothing from a group with its row count joins it anyway (horizontal fusion, e.g. all the
parameters of an optimizer step). A reduction result read only inside its group never reaches memory.
Extern calls are scheduled between groups, and dead buffers are dropped.
"""
from __future__ import annotations

import dataclasses

import sympy

from ember.codegen import ir
from ember.codegen.ir import Buffer, Expr, ExternBuffer, Pointwise, Reduction, TensorArg

X0 = sympy.Symbol("x0", integer=True, nonnegative=True)


def rvars(n: int) -> list:
    return [sympy.Symbol(f"r{i}", integer=True, nonnegative=True) for i in range(n)]


@dataclasses.dataclass(eq=False)
class Member:
    """One buffer computed inside a FusedGroup: its value `body` at row x0 and inner index `rvars`."""
    buf: Pointwise | Reduction
    inner: tuple  # sizes of the inner loops (reduction ranges, or the trailing dims of a pointwise buffer)
    body: Expr  # the value (reductions: the value reduced) in terms of x0 and r0.. (loads of group buffers kept)
    store: object  # offset written for this row (pointwise: in x0, r*; reduction: in x0)
    reads: set
    local: bool = False  # a reduction read only inside the group: kept in a register, never stored

    @property
    def is_reduction(self) -> bool:
        return isinstance(self.buf, Reduction)


@dataclasses.dataclass(eq=False)
class FusedGroup:
    numel: int
    members: list

    @property
    def name(self):
        return "kernel_" + "_".join(m.buf.name for m in self.members[:4])

    def origins(self) -> list:
        return list(dict.fromkeys(o for m in self.members for o in m.buf.origins))


@dataclasses.dataclass
class Schedule:
    items: list  # FusedGroup | ExternBuffer, in execution order
    lowered: object  # the LoweredGraph
    buffers: dict  # name -> Buffer (every buffer that exists at run time, extern outputs included)


def reads_of(e: Expr) -> set:
    return {x.args[0] for x in e.walk() if x.op == "load"}


def _outer_index(size, x0) -> list:
    """Multi-index of the row x0 over dims `size` (row-major)."""
    strides = ir.contiguous_strides(size)
    return [ir.ModIndex(ir.FloorDiv(x0, st), s) if s != 1 else sympy.Integer(0) for s, st in zip(size, strides)]


def make_member(buf, numel: int) -> Member | None:
    """buf as a member of a group of `numel` rows, or None when its iteration space does not split so."""
    if ir.prod(buf.size) == 0:  # nothing to compute: allocated only, in a group of no rows
        return Member(buf, (), None, 0, set()) if numel == 0 else None
    if isinstance(buf, Reduction):
        if ir.prod(buf.size) != numel:
            return None
        outer, inner = buf.size, buf.rsize
    else:
        for k in range(len(buf.size) + 1):
            if ir.prod(buf.size[:k]) == numel:
                outer, inner = buf.size[:k], buf.size[k:]
                break
        else:
            return None
    ranges = {X0: max(numel, 1), **{r: s for r, s in zip(rvars(len(inner)), inner)}}
    oidx = [ir.simplify_index(i, ranges) for i in _outer_index(outer, X0)]
    r = rvars(len(inner))
    if isinstance(buf, Reduction):
        body = buf.fn(oidx, r)
        store = ir.simplify_index(buf.offset + sum((i * s for i, s in zip(oidx, buf.stride)), sympy.Integer(0)), ranges)
    else:
        body = buf.fn(oidx + r)
        store = ir.simplify_index(buf.offset + sum((i * s for i, s in zip(oidx + r, buf.stride)), sympy.Integer(0)), ranges)
    body = _simplify_loads(body, ranges)
    return Member(buf, tuple(inner), body, store, reads_of(body))


def _simplify_loads(e: Expr, ranges) -> Expr:
    memo = {}

    def go(x):
        if not isinstance(x, Expr):
            return x
        if id(x) in memo:
            return memo[id(x)]
        if x.op == "load":
            y = Expr("load", (x.args[0], ir.simplify_index(x.args[1], ranges)), x.dtype)
        elif x.op == "index":
            y = Expr("index", (ir.simplify_index(x.args[0], ranges),), x.dtype)
        else:
            y = Expr(x.op, tuple(go(a) for a in x.args), x.dtype)
        memo[id(x)] = y
        return y
    return go(e)


def _row_local(m: Member, producer: Member, numel: int) -> bool:
    """Whether every element m reads from producer's buffer was written in the same row x0."""
    buf = producer.buf
    if tuple(buf.stride) != ir.contiguous_strides(buf.size) or buf.offset != 0:
        return False
    width = ir.prod(producer.inner) if not producer.is_reduction else 1
    ranges = {X0: numel, **{r: s for r, s in zip(rvars(len(m.inner)), m.inner)}}
    for x in m.body.walk():
        if x.op == "load" and x.args[0] == buf.name:
            rest = ir.simplify_index(x.args[1] - X0 * width, ranges)
            if X0 in rest.free_symbols or any(isinstance(s, ir.IndirectSymbol) for s in rest.free_symbols):
                return False
            b = ir.bounds(rest, ranges)
            if b is None or b[0] < 0 or b[1] >= width:
                return False
    return True


def _default_rows(buf) -> int:
    if ir.prod(buf.size) == 0:
        return 0
    if isinstance(buf, Reduction):
        return ir.prod(buf.size)
    return ir.prod(buf.size[:-1]) if len(buf.size) > 1 else 1


def schedule(lowered) -> Schedule:
    buffers = {b.name: b for b in lowered.inputs}
    for b in lowered.buffers:
        buffers[b.name] = b
        for o in getattr(b, "outputs", None) or []:
            if o is not None:
                buffers[o.name] = o

    # dead-code elimination, from the outputs back
    needed = {o.buffer for o in lowered.outputs if isinstance(o, TensorArg)}
    bodies = {}
    for b in reversed(lowered.buffers):
        outs = [b.name] + [o.name for o in (getattr(b, "outputs", None) or []) if o is not None]
        if not any(n in needed for n in outs) and not getattr(b, "side_effect", False):
            continue
        if isinstance(b, ExternBuffer):
            needed |= set(b.inputs)
        else:
            m = make_member(b, _default_rows(b))
            bodies[b.name] = m
            needed |= m.reads
    live = [b for b in lowered.buffers if b.name in bodies or (isinstance(b, ExternBuffer) and (
        b.side_effect or any(o is not None and o.name in needed for o in b.outputs)))]

    items: list = []
    where: dict[str, int] = {}  # buffer name -> index of the item computing it
    member_of: dict[str, Member] = {}
    for b in live:
        if isinstance(b, ExternBuffer):
            items.append(b)
            for o in b.outputs:
                if o is not None:
                    where[o.name] = len(items) - 1
            continue
        reads = bodies[b.name].reads
        last = max((where[r] for r in reads if r in where), default=-1)
        placed = False
        for j in range(max(last, 0), len(items)):
            g = items[j]
            if not isinstance(g, FusedGroup):
                continue
            m = make_member(b, g.numel)
            if m is None:
                continue
            inside = [member_of[r] for r in m.reads if r in where and where[r] == j]
            if j == last or inside:
                if not all(_row_local(m, p, g.numel) for p in inside):
                    continue
            elif j < last:
                continue
            g.members.append(m)
            member_of[b.name], where[b.name] = m, j
            placed = True
            break
        if not placed:
            m = bodies[b.name]
            items.append(FusedGroup(_default_rows(b), [m]))
            member_of[b.name], where[b.name] = m, len(items) - 1

    # reductions read only in their own group, at their own row, stay in registers
    readers: dict[str, set] = {}
    for j, it in enumerate(items):
        names = it.inputs if isinstance(it, ExternBuffer) else set().union(*(m.reads for m in it.members))
        for n in names:
            readers.setdefault(n, set()).add(j)
    outputs = {o.buffer for o in lowered.outputs if isinstance(o, TensorArg)}
    for j, it in enumerate(items):
        if isinstance(it, FusedGroup):
            for m in it.members:
                if m.is_reduction and m.buf.name not in outputs and readers.get(m.buf.name, set()) <= {j}:
                    m.local = True
    return Schedule(items, lowered, buffers)
