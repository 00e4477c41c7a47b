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

import collections
import dataclasses
import itertools
from typing import Callable

import sympy
import torch

from ember import ir
from ember.ir import Expr, ExternBuffer, Pointwise, Reduction, TensorArg, symbols
from ember.tools import collector

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
    local: bool = False  # read only inside the group, never stored: a reduction (a register) or, with
    # schedule(row_buffers=True), a pointwise row (a per-thread row buffer)
    dest: str = ""  # the buffer the store writes: buf.name, or the graph input it updates in place
    block: int = 0  # in an `elementwise` group: members of one block run in one loop (C++) / range (Triton)
    across: bool = False  # a pointwise buffer whose rows run along a middle dim (make_member(across=True))

    @property
    def target(self) -> str:
        return self.dest or self.buf.name

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

    @property
    def elementwise(self) -> bool:
        """Pointwise members that read from each other only the element the other computes in the same
        iteration (same inner loops, its store offset): e.g. an optimizer update of every parameter. Backends
        run the members of a `block` as one loop / program range that takes members' values from registers
        and loads everything before storing anything (so an in-place writer may sit before readers of its
        input's old values)."""
        if getattr(self, "_elementwise", None) is None:
            by_name = {m.buf.name: m for m in self.members}
            ok = True
            for m in self.members:
                if m.is_reduction or m.body is None:
                    ok = False
                    break
                for x in m.body.walk():
                    p = by_name.get(x.args[0]) if x.op == "load" else None
                    if p is not None and (tuple(p.inner) != tuple(m.inner) or sympy.expand(x.args[1] - p.store) != 0):
                        ok = False
            self._elementwise = ok
        return self._elementwise

    def origins(self) -> list:
        return list(dict.fromkeys(o for m in self.members for o in m.buf.origins))


@dataclasses.dataclass
class Schedule:
    items: list  # FusedGroup | ExternBuffer, in execution order
    lowered: object  # the LoweredGraph
    buffers: dict  # name -> Buffer (every buffer that exists at run time, extern outputs included)
    inplace: dict = dataclasses.field(default_factory=dict)  # buffer name -> input name its kernel writes into
    # buffer name -> the intermediate whose memory its kernel overwrites (read there for the last time;
    # triton.overwrite_dying_inputs): the wrapper hands that memory over to it
    takes_over: dict = dataclasses.field(default_factory=dict)


def reads_of(e: Expr) -> set:
    return {x.args[0] for x in e.walk() if x.op == "load"}


def _outer_index(size, x0) -> list:
    """Multi-index of the row x0 over dims `size` (row-major)."""
    strides = ir.contiguous_strides(size)
    return [ir.ModIndex(ir.FloorDiv(x0, st), s) if s != 1 else sympy.Integer(0) for s, st in zip(size, strides)]


@dataclasses.dataclass(frozen=True)
class LoopView:
    """A buffer's dims in the order its loops walk them: memory order (largest stride first). The identity for
    row-major buffers; a channels-last [N, C, H, W] buffer is walked as [N, H, W, C], C innermost, so its stores
    (and the loads of channels-last inputs) are contiguous in the inner loop."""
    size: tuple
    stride: tuple
    fn: Callable  # the buffer's fn over the loop-ordered index


def loop_view(buf) -> LoopView:
    view = getattr(buf, "_loop_view", None)
    if view is not None:
        return view
    size, stride = tuple(buf.size), tuple(buf.stride)
    view = LoopView(size, stride, buf.fn)
    static = all(isinstance(s, int) or getattr(s, "is_Integer", False) for s in (*size, *stride))
    if stride != ir.contiguous_strides(size) and (static or symbols.HINTS):
        # size-1 dims outermost (their stride is meaningless), then by decreasing stride (stable; symbolic strides
        # ordered by the example's values, the order then checked to be dense at every size)
        perm = sorted(range(len(size)), key=lambda d: (size[d] != 1, -symbols.hint(stride[d])))
        psize, pstride = tuple(size[p] for p in perm), tuple(stride[p] for p in perm)
        if perm != list(range(len(size))) and all(
                symbols.same(a, b) for a, b, n in zip(pstride, ir.contiguous_strides(psize), psize) if n != 1):
            def unperm(idx):
                out = [None] * len(perm)
                for k, p in enumerate(perm):
                    out[p] = idx[k]
                return out
            fn = (lambda idx, r: buf.fn(unperm(idx), r)) if isinstance(buf, Reduction) else \
                (lambda idx: buf.fn(unperm(idx)))
            view = LoopView(psize, pstride, fn)
    buf._loop_view = view
    return view


def _dense_rows(buf) -> bool:
    """Whether buf's elements lie in memory in its loop order with no gaps (so row x0 of a group over its
    loops is the memory range [x0 * width, (x0 + 1) * width))."""
    if buf.offset != 0:
        return False
    view = loop_view(buf) if isinstance(buf, (Pointwise, Reduction)) else LoopView(tuple(buf.size), tuple(buf.stride), None)
    return all(a == b for a, b, n in zip(view.stride, ir.contiguous_strides(view.size), view.size) if n != 1)


def make_member(buf, numel: int, across: bool = False) -> Member | None:
    """buf as a member of a group of `numel` rows, or None when its iteration space does not split so.

    across: a pointwise buffer whose rows are a middle dim of `numel` (an [N, C, H, W] batch norm output in a
    group of C rows, whose reductions over N, H, W made the statistics it reads): row x0 is the slice at
    x0 along that dim, walked as two inner loops, the dims before it and the dims after it."""
    if ir.prod(buf.size) == 0:  # nothing to compute: allocated only, in a group of no rows
        return Member(buf, (), None, 0, set()) if numel == 0 else None
    view = loop_view(buf)
    if across:
        dims = [d for d in range(1, len(view.size)) if view.size[d] == numel and symbols.gt(ir.prod(view.size[:d]), 1)]
        if isinstance(buf, Reduction) or not dims:
            return None
        d = dims[0]
        before, after = tuple(view.size[:d]), tuple(view.size[d + 1:])
        inner = (ir.prod(before),) + ((ir.prod(after),) if ir.prod(after) != 1 else ())
        ranges = {X0: numel, **{r: s for r, s in zip(rvars(len(inner)), inner)}}
        r = rvars(len(inner))
        index = [ir.simplify_index(i, ranges) for i in _outer_index(before, r[0])] + [X0] + (
            [ir.simplify_index(i, ranges) for i in _outer_index(after, r[1])] if len(r) > 1 else
            [sympy.Integer(0)] * len(after))
        body = _simplify_loads(view.fn(index), ranges)
        store = ir.simplify_index(buf.offset + sum((i * s for i, s in zip(index, view.stride)), sympy.Integer(0)),
                                  ranges)
        return Member(buf, inner, body, store, reads_of(body), across=True)
    if isinstance(buf, Reduction):
        if ir.prod(buf.size) != numel:
            return None
        outer, inner, groups = view.size, buf.rsize, None
    else:
        for groups in (merged_dims(buf), None):  # contiguous dims merged, else the buffer's own dims
            size = view.size if groups is None else tuple(ir.prod(view.size[d] for d in g) for g in groups)
            ks = [k for k in range(len(size) + 1) if ir.prod(size[:k]) == numel]
            if ks:
                outer, inner = size[:ks[-1]], size[ks[-1]:]
                break
        else:
            return None
    ranges = {X0: max(numel, 1) if symbols.is_static(numel) else numel, **{r: s for r, s in zip(rvars(len(inner)), inner)}}
    oidx = [ir.simplify_index(i, ranges) for i in _outer_index(outer, X0)]
    r = rvars(len(inner))
    if isinstance(buf, Reduction):
        body = view.fn(oidx, r)
        index = oidx
    else:
        index = oidx + r
        if groups is not None:  # unmerge: each merged index back to the buffer's dims
            full = []
            for g, i in zip(groups, index):
                full += [ir.simplify_index(j, ranges) for j in _outer_index([view.size[d] for d in g], i)]
            index = full
        body = view.fn(index)
    store = ir.simplify_index(buf.offset + sum((i * s for i, s in zip(index, view.stride)), sympy.Integer(0)), ranges)
    body = _simplify_loads(body, ranges)
    return Member(buf, tuple(inner), body, store, reads_of(body))


def merged_dims(buf: Pointwise) -> list[list[int]]:
    """Groups of adjacent dims that every access (loads, the store) walks as one contiguous range, so a
    [8, 64, 56, 56] batch-norm loops over 512 rows of 3136 elements instead of 28672 rows of 56."""
    if getattr(buf, "_merged", None) is not None:
        return buf._merged
    view = loop_view(buf)
    n = len(view.size)
    idx = [sympy.Symbol(f"m{i}", integer=True, nonnegative=True) for i in range(n)]
    idx_set = set(idx)
    nodes = view.fn(idx).walk()
    offsets = [x.args[1] for x in nodes if x.op == "load"]
    offsets.append(sum((i * st for i, st in zip(idx, view.stride)), sympy.Integer(0)))
    # with each dim's range: a reshape's div/mod that cancels within it (a group norm's [N, G, C/G*H*W] statistics
    # view read as [N, C, H, W]) is affine again, and H, W merge (rows of 1024, not of W = 32). Size-1 dims get
    # no range: merging them changes no loop but would move where rows split (a [1, C, 1, 1] buffer as 1 row)
    ranges = {i: s for i, s in zip(idx, view.size) if s != 1}
    offsets = [ir.simplify_index(off, ranges) for off in offsets]
    blocked = set()
    for x in nodes:  # index values and indirect indices must see the dims as they are
        if x.op == "index":
            blocked |= x.args[0].free_symbols
    coeffs = []  # per offset: {m_i: its coefficient (a number), or None where it is not one}
    for off in offsets:
        off = ir.expand_index(off)
        lin: dict = {}
        for t in sympy.Add.make_args(off):
            factors = sympy.Mul.make_args(t)
            if not all(f.is_Number or f.is_Symbol for f in factors):  # (plain terms c*m_i*m_j need no test)
                # (a division or clamp of sizes only, a conv's output size (s - 1) // 2 + 1, is a size)
                if not t.is_polynomial(*idx) or any(isinstance(a, (ir.FloorDiv, ir.ModIndex, sympy.Min, sympy.Max))
                                                     and a.free_symbols & idx_set for a in sympy.preorder_traversal(t)):
                    blocked |= t.free_symbols
            # what off.coeff(m) sums: the other factors of each term with m as a factor
            for k, f in enumerate(factors):
                if f in idx_set:
                    rest = sympy.Mul(*factors[:k], *factors[k + 1:])
                    have = lin.get(f, 0)
                    lin[f] = None if have is None or not _is_size(rest) else have + rest
        coeffs.append(lin)
    groups = [[0]] if n else []
    for d in range(1, n):
        a, b = idx[d - 1], idx[d]
        ok = a not in blocked and b not in blocked and all(
            lin.get(a, 0) is not None and lin.get(b, 0) is not None and lin.get(a, 0) - view.size[d] * lin.get(b, 0) == 0
            for lin in coeffs)
        if ok:
            groups[-1].append(d)
        else:
            groups.append([d])
    buf._merged = groups
    return groups


def _is_size(c) -> bool:
    """A number, or an expression of the size symbols (a symbolic stride)."""
    return c.is_number or bool(symbols.HINTS) and c.free_symbols <= symbols.HINTS.keys()


def _simplify_loads(e: Expr, ranges) -> Expr:
    def rule(x, go):
        if x.op == "load":
            return Expr("load", (x.args[0], ir.simplify_index(x.args[1], ranges)), x.dtype)
        if x.op == "index":
            return Expr("index", (ir.simplify_index(x.args[0], ranges),), x.dtype)
        return None
    return ir.rewrite(e, rule)


def _row_local(m: Member, producer: Member, numel: int) -> bool:
    """Whether every element m reads from producer's buffer was written in the same row x0."""
    buf = producer.buf
    if producer.across or not _dense_rows(buf):   # (an across member's row is not a memory range)
        return False
    width = ir.prod(producer.inner) if not producer.is_reduction else 1
    ranges = {X0: numel, **{r: s for r, s in zip(rvars(len(m.inner)), m.inner)}}
    for x in m.body.walk():
        if x.op == "load" and x.args[0] == buf.name:
            rest = ir.simplify_index(x.args[1] - X0 * width, ranges)
            if numel == 1:  # one row: x0 is 0
                rest = rest.subs(X0, 0)
            if X0 in rest.free_symbols or any(isinstance(s, ir.IndirectSymbol) for s in rest.free_symbols):
                return False
            b = ir.bounds(rest, ranges)
            if b is None or not symbols.is_nonnegative(b[0]) or not symbols.is_positive(width - b[1]):
                return False
    return True


def _outgrows_rows(g: FusedGroup, m: Member) -> bool:
    """Whether pointwise m would do far more work per row than g's reductions, in a group of too few rows to
    spread it: a Triton group runs one program per row, so m, fused, runs as serially as its rows are few
    (a loss's backward over every logit after the scalar count of targets it divides by: one program for all of
    them). m is a kernel of its own then."""
    if m.is_reduction or symbols.hint(g.numel) >= FEW_ROWS:
        return False
    widths = [symbols.hint(ir.prod(r.inner)) for r in g.members if r.is_reduction]
    inner = symbols.hint(ir.prod(m.inner))
    return bool(widths) and inner > ROW_GROWTH * max(widths) and inner > ROW_GROWTH_MIN


ROW_GROWTH, ROW_GROWTH_MIN = 4, 4096   # (a reduction's epilogue over its rows' elements: as wide as they are)
FEW_ROWS = 256   # rows enough to keep a GPU's multiprocessors busy
ACROSS_MAX_R = 4096   # longest row of an across member (Triton keeps it in registers, one program per row)

SCRATCH_BYTES = 128 * 1024  # per-thread row buffers of one group live on the stack


def _row_contiguous(m: Member) -> bool:
    return not m.across and _dense_rows(m.buf)


def _default_rows(buf) -> int:
    if ir.prod(buf.size) == 0:
        return 0
    if isinstance(buf, Reduction):
        return ir.prod(buf.size)
    full = loop_view(buf).size
    size = [ir.prod(full[d] for d in g) for g in merged_dims(buf)]
    if len(size) <= 1:
        return 1
    if symbols.hint(size[-1]) >= 16:
        return ir.prod(size[:-1])
    return ir.prod(full[:-1])


def schedule(lowered, row_buffers: bool = False, mutations: list | None = None, across: bool = False) -> Schedule:
    """Group `lowered`'s buffers into FusedGroups and extern calls. row_buffers: pointwise rows read only inside
    their group become `local` too (the backend keeps them per row: C++ uses a per-thread stack array).
    mutations: (input index, output index) pairs, the graph outputs that the caller copies back into inputs
    (ember.autograd's input mutations); those computed by a kernel are written into the input directly where
    that is safe (`Schedule.inplace`, see `_write_in_place`). across: pointwise buffers may join a group of
    reductions with their rows along a middle dim (make_member(across=True)), as its epilogue: a batch norm's
    normalization in the kernel of its statistics, its input gradient in the kernel of its sums (Triton: a
    program per channel reads its slice once; the C++ backend keeps its flat loops, which are faster there)."""
    with collector.frozen():
        return _schedule(lowered, row_buffers, mutations, across)


def _schedule(lowered, row_buffers: bool, mutations: list | None, across: bool = False) -> Schedule:
    buffers = {b.name: b for b in lowered.inputs if b is not None}
    for name, t in lowered.constants.items():
        buffers[name] = ir.InputBuffer(name, tuple(t.shape), tuple(t.stride()), t.dtype, 0)
    for b in lowered.buffers:
        buffers[b.name] = b
        for o in getattr(b, "outputs", None) or []:
            if o is not None:
                buffers[o.name] = o

    made: dict = {}  # (buffer name, rows) -> its Member or None: a buffer is tried against several groups

    def member(b, numel: int, across: bool = False) -> Member | None:
        key = (b.name, numel, across)
        if key not in made:
            made[key] = make_member(b, numel, across)
        m = made[key]
        return None if m is None else dataclasses.replace(m, reads=set(m.reads))  # a copy: groups mark members

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
            m = member(b, _default_rows(b))
            bodies[b.name] = m
            needed |= m.reads
    live = [b for b in lowered.buffers if b.name in bodies or (isinstance(b, ExternBuffer) and (
        b.side_effect or any(o is not None and o.name in needed for o in b.outputs)))]

    # A pointwise buffer read only by kernels (not by a library call, not a graph output) is placed when its
    # first reader is, from that reader's earliest group on: placed as early as its own inputs allow, it would
    # land in a group before a library call its reader waits for, and go through memory (GPT-2's backward would
    # compute the GELU's tanh in a kernel of its own, read back by the gradient kernel after the matmul).
    outputs = {o.buffer for o in lowered.outputs if isinstance(o, TensorArg)}
    order = {b.name: i for i, b in enumerate(live)}
    by_extern = set().union(*(b.inputs for b in live if isinstance(b, ExternBuffer)))
    deferred = {b.name for b in live if isinstance(b, Pointwise) and b.name not in outputs and b.name not in by_extern}

    items: list = []
    where: dict[str, int] = {}  # buffer name -> index of the item computing it
    member_of: dict[str, Member] = {}

    def place(b, start: int = -1, rows: int | None = None) -> None:
        """rows: the row count of the reader b is placed for (a deferred buffer), for a group b starts"""
        reads = bodies[b.name].reads
        waiting = sorted((r for r in reads if r in deferred and r not in where), key=order.__getitem__)
        if waiting:
            here = max((where[r] for r in reads if r in where), default=-1)
            for r in waiting:
                if r not in where:
                    place(buffers[r], max(start, here), rows or _default_rows(b))
        last = max((where[r] for r in reads if r in where), default=-1)
        placed = False
        for j in range(max(last, start, 0), len(items)):
            g = items[j]
            if not isinstance(g, FusedGroup):
                continue
            m = member(b, g.numel)
            if m is None and across and isinstance(b, Pointwise) and symbols.gt(g.numel, 1) and \
                    any(where.get(r) == j for r in bodies[b.name].reads):
                # only as an epilogue of the group's reductions, over rows as long as theirs (not a split
                # reduction's last step) and short enough to stay in registers
                m = member(b, g.numel, across=True)
                widths = {ir.prod(mm.inner) for mm in g.members if mm.is_reduction}
                if m is not None and (ir.prod(m.inner) not in widths or symbols.hint(ir.prod(m.inner)) > ACROSS_MAX_R):
                    m = None
            if m is None or (across and _outgrows_rows(g, m)):   # (C++ runs a one-row group's loops in parallel)
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
        if not placed:   # a group of its own; a flat one (one row) takes its reader's row count if b fits it
            m = member(b, rows) if rows is not None and symbols.gt(rows, 1) and _default_rows(b) == 1 else None
            numel = rows if m is not None else _default_rows(b)
            m = m or bodies[b.name]
            items.append(FusedGroup(numel, [m]))
            member_of[b.name], where[b.name] = m, len(items) - 1

    for b in live:
        if isinstance(b, ExternBuffer):
            items.append(b)
            for o in b.outputs:
                if o is not None:
                    where[o.name] = len(items) - 1
        elif b.name not in deferred:
            place(b)
    for b in live:   # (read by nothing placed: none, as every chain of readers ends at a kept buffer)
        if b.name in deferred and b.name not in where:
            place(b)

    for it in items:
        if isinstance(it, FusedGroup):
            order_elementwise(it)

    # reductions read only in their own group, at their own row, stay in registers
    readers: dict[str, set] = {}
    for j, it in enumerate(items):
        names = it.inputs if isinstance(it, ExternBuffer) else set().union(*(m.reads for m in it.members))
        for n in names:
            readers.setdefault(n, set()).add(j)
    for j, it in enumerate(items):
        if isinstance(it, FusedGroup):
            scratch = 0
            for m in it.members:
                if m.buf.name in outputs or not readers.get(m.buf.name, set()) <= {j} or m.body is None:
                    continue
                if m.is_reduction:
                    m.local = True
                elif row_buffers and symbols.gt(it.numel, 1) and _row_contiguous(m):
                    # a row read only by later members of its group: a per-thread row buffer (stays in cache)
                    # (a run-time width: kept by the example's width, in a buffer the kernel allocates per thread)
                    # (a 16-bit row is kept as float: cpp_lowp)
                    width = max(ir.itemsize(m.buf.dtype), 4 if m.buf.dtype.is_floating_point else 1)
                    size = symbols.hint(ir.prod(m.inner)) * width
                    if scratch + size <= SCRATCH_BYTES:
                        m.local, scratch = True, scratch + size
    sched = Schedule(items, lowered, buffers)
    readers = _Readers(sched)
    for ii, oi in mutations or []:
        _write_in_place(sched, ii, oi, where, member_of, readers)
    return sched


def order_elementwise(g: FusedGroup) -> None:
    """An `elementwise` group (horizontal fusion: e.g. one optimizer update per parameter) is split into
    blocks: members over the same loops that read a common buffer or each other (the updates of one
    parameter: new param, exp_avg, exp_avg_sq all read its grad). Members are ordered by inner loop sizes,
    then block, first seen first (a block keeps its members' order: producers first). C++ runs a block as
    one loop (its loads shared; a loop per block keeps the streams of one loop few), Triton runs all blocks
    of a size in one program range."""
    if len(g.members) < 2 or not g.elementwise:
        return
    parent = list(range(len(g.members)))

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i
    owner: dict = {m.buf.name: i for i, m in enumerate(g.members)}
    for i, m in enumerate(g.members):
        # buffers read element by element (a scalar every update reads, like a learning rate, joins nothing)
        streamed = {x.args[0] for x in m.body.walk() if x.op == "load" and x.args[1].free_symbols}
        for r in m.reads:
            if r in owner:  # reads another member (at the element it computes)
                parent[find(i)] = find(owner[r])
                continue
            if r not in streamed:
                continue
            j = owner.setdefault((tuple(m.inner), r), i)
            parent[find(i)] = find(j)
    first_size: dict = {}
    first_block: dict = {}
    for i, m in enumerate(g.members):
        first_size.setdefault(tuple(m.inner), len(first_size))
        m.block = first_block.setdefault(find(i), len(first_block) + 1)
    g.members.sort(key=lambda m: (first_size[tuple(m.inner)], m.block))


def split_elementwise(sched: Schedule, too_big: Callable[[FusedGroup], bool]) -> Schedule:
    """Elementwise (horizontally fused) groups cut between blocks, greedily, into groups that are not `too_big`:
    a code generator's limit on one kernel (Triton: blocks per kernel, for compile time; C++: the pointer
    arguments of one ctypes call, at most 1024)."""
    items = []
    for it in sched.items:
        if not isinstance(it, FusedGroup) or not it.elementwise or not too_big(it):
            items.append(it)
            continue
        order_elementwise(it)
        chunk: list = []
        for _, members in itertools.groupby(it.members, key=lambda m: m.block):
            members = list(members)
            if chunk and too_big(dataclasses.replace(it, members=chunk + members)):
                items.append(dataclasses.replace(it, members=chunk))
                chunk = []
            chunk = chunk + members
        if chunk:
            items.append(dataclasses.replace(it, members=chunk))
    return dataclasses.replace(sched, items=items)


def _members_by_buffer(items: list) -> tuple[dict, dict]:
    """({buffer name: index of the group computing it}, {buffer name: its member}) over the groups of items."""
    where, member_of = {}, {}
    for j, it in enumerate(items):
        if isinstance(it, FusedGroup):
            for m in it.members:
                where[m.buf.name], member_of[m.buf.name] = j, m
    return where, member_of


def lifetimes(sched: Schedule) -> tuple[dict, set]:
    """(the index of the last item reading each buffer, the buffers that never die: graph outputs and what
    ATen fallbacks saw, whose results may be views of it)."""
    last, pinned = {}, {o.buffer for o in sched.lowered.outputs if isinstance(o, TensorArg)}
    for j, it in enumerate(sched.items):
        reads = it.inputs if isinstance(it, ExternBuffer) else \
            set().union(*(m.reads for m in it.members), getattr(it, "extra_reads", ()))
        for r in reads:
            last[r] = j
        if isinstance(it, ExternBuffer) and it.fallback:
            pinned |= set(it.inputs)
    return last, pinned


class _Readers:
    """What `_write_in_place` asks of every mutation, looked up instead of walking every item each time
    (a training step has thousands of mutations over as many items): the last item reading
    each buffer and the buffers that never die (`lifetimes`), the inputs of extern calls whose results may alias
    them, and how often each buffer is a graph output."""

    def __init__(self, sched: Schedule):
        self.last, self.pinned = lifetimes(sched)
        self.aliased = {r for it in sched.items if isinstance(it, ExternBuffer) and it.aliases_input for r in it.inputs}
        self.outputs = collections.Counter(o.buffer for o in sched.lowered.outputs if isinstance(o, TensorArg))


def write_in_place(sched: Schedule, mutations: list | None) -> None:
    """`_write_in_place` again, over a schedule whose groups a backend has split: a group holding an
    optimizer's step counters (one element each, read by every update) is not `elementwise`, so its parameters
    and moments would be written to fresh buffers and copied back; split off from the counters, it is."""
    where, member_of = _members_by_buffer(sched.items)
    readers = _Readers(sched)
    for ii, oi in mutations or []:
        if _read_stored_scalar(sched, ii, oi, where, member_of):
            readers = _Readers(sched)   # some members read other buffers now
        _write_in_place(sched, ii, oi, where, member_of, readers)


def _updating_member(sched: Schedule, ii: int, oi: int, member_of: dict) -> tuple | None:
    """(graph input ii, the member computing graph output oi: the input's new value) where a group computes it."""
    low = sched.lowered
    if not (0 <= ii < len(low.inputs) and 0 <= oi < len(low.outputs)):
        return None
    inp, out = low.inputs[ii], low.outputs[oi]
    if inp is None or not isinstance(out, TensorArg) or out.buffer not in member_of:
        return None
    return inp, member_of[out.buffer]


def _stored_scalar(sched: Schedule, ii: int, oi: int, member_of: dict) -> tuple | None:
    """(graph input ii, the member storing its new value, a load of that stored value) where the stored value is
    the member's body recomputed anywhere, bit for bit: a one-element update whose value has no index in it
    (the same Expr is then the same number in any kernel) of a dtype computed as stored (float32/float64: no
    rounding at the store)."""
    found = _updating_member(sched, ii, oi, member_of)
    if found is None:
        return None
    inp, m = found
    body = m.body
    if not isinstance(m.buf, Pointwise) or m.local or body is None or body.dtype != m.buf.dtype or \
            body.dtype not in (torch.float32, torch.float64) or getattr(m.store, "free_symbols", None) or \
            any(e.op == "index" or (e.op == "load" and e.args[1].free_symbols) for e in body.walk()):
        return None
    return inp, m, Expr("load", (m.buf.name, m.store), m.buf.dtype)


def _read_stored_scalar(sched: Schedule, ii: int, oi: int, where: dict, member_of: dict) -> bool:
    """Later kernels that recompute a one-element update's new value from the input's old element read the
    stored new value instead (`_stored_scalar`). A capturable optimizer's step counter: the first kernel stores
    `step + 1`, the parameters' kernel recomputed `step + 1` inside each bias correction from the old counter,
    and that read of the old value kept the counter from being written in place (a fresh tensor and a copy
    back, each call)."""
    found = _stored_scalar(sched, ii, oi, member_of)
    if found is None:
        return False
    inp, m, stored = found
    body = m.body
    changed = False
    for it in sched.items[where[m.buf.name] + 1:]:
        if isinstance(it, FusedGroup):
            for x in it.members:
                if inp.name in x.reads and x.body is not None and any(e is body for e in x.body.walk()):
                    x.body = ir.rewrite(x.body, lambda y, go: stored if y is body else None)
                    x.reads = reads_of(x.body)
                    changed = True
    return changed


MAX_RECOMPUTED_COST = 32   # compute nodes (ir.compute_cost) of a one-element value its readers recompute
MAX_LINKING_READERS = 4    # kernels that may each recompute a one-element value that links a library


def recompute_scalars(sched: Schedule, mutations: list | None, linked: frozenset = frozenset()) -> None:
    """One-element values that later kernels can recompute exactly are computed there, not stored by one
    kernel and loaded by the next: a capturable Adam's per-parameter step size `-(lr / (1 - beta1 ** step))`
    would be a zero-dim buffer per parameter (allocated each call, host time) that the counters' kernel stores
    and the parameters' kernel loads; the parameters' kernel computes it from the stored counter instead.

    A member is recomputed by its readers (their loads of it become its body, `ir.rewrite`) and dropped, with
    its buffer, when:
    - it is a one-element Pointwise member, not `local`, not written in place, not a graph output;
    - every reader is a member of a later group (no extern call, nothing in its own group) and loads it at its
      store offset;
    - its body has no index in it and loads single elements only (the same Expr, the same number anywhere)
      and is of a dtype computed as stored (float32/float64: no rounding at the store, as `_stored_scalar`);
      it costs at most MAX_RECOMPUTED_COST (a scalar each reader's programs compute once, not per element)
      and, read by more than MAX_LINKING_READERS kernels, uses none of the `linked` ops (Triton: those printed
      as libdevice calls, which link libdevice into every kernel using one, a compile-time cost per kernel:
      Adam's bias corrections `1 - beta ** step` would be recomputed in hundreds of kernels of a one-graph
      training step);
    - everything its body loads holds at each reader what it held when the member ran: after the stored-value
      rewrite (a recomputed in-place update, `step + 1`, reads the stored counter, `_stored_scalar`), it loads
      only graph inputs and constants that no kernel writes in place (mutations not written in place are
      copied back after the graph; graphs are functional, so nothing else writes an input), and stored
      buffers of groups up to its own (a buffer is written once: by its group, or in place into the one input
      it updates, which only it writes).
    Members are visited in schedule order, so one recomputed inside another is counted in that one's cost.
    After the last in-place decision (`write_in_place`): an input it inlines a load of must stay unwritten.
    Triton only: its kernels compute a scalar once per program; a C++ loop would recompute it per element."""
    items = sched.items
    where, member_of = _members_by_buffer(items)
    stored: list = []   # (an update's value Expr, the load of its stored value, the group storing it)
    for ii, oi in mutations or []:
        found = _stored_scalar(sched, ii, oi, member_of)
        if found is not None:
            stored.append((found[1].body, found[2], where[found[1].buf.name]))
    low = sched.lowered
    unwritten = ({b.name for b in low.inputs if b is not None} | set(low.constants)) - set(sched.inplace.values())
    outputs = {o.buffer for o in low.outputs if isinstance(o, TensorArg)}
    by_extern = set().union(*(it.inputs for it in items if isinstance(it, ExternBuffer)))
    readers: dict[str, dict] = {}   # buffer name -> {id(member): (group index, member)} of the members reading it
    for j, it in enumerate(items):
        if isinstance(it, FusedGroup):
            for m in it.members:
                for r in m.reads:
                    readers.setdefault(r, {})[id(m)] = (j, m)
    dropped: set = set()
    for j, it in enumerate(items):
        if not isinstance(it, FusedGroup):
            continue
        for c in it.members:
            name = c.buf.name
            if not isinstance(c.buf, Pointwise) or ir.prod(c.buf.size) != 1 or c.local or c.dest or \
                    c.body is None or name in outputs or name in by_extern or name in sched.inplace or \
                    c.body.dtype != c.buf.dtype or c.body.dtype not in (torch.float32, torch.float64) or \
                    getattr(c.store, "free_symbols", None):
                continue
            users = list(readers.get(name, {}).values())
            if not users or any(k <= j or x.body is None or any(
                    e.op == "load" and e.args[0] == name and e.args[1] != c.store for e in x.body.walk())
                    for k, x in users):
                continue
            reread = {value: load for value, load, k in stored if k <= j}   # (Exprs hash by identity)
            body = ir.rewrite(c.body, lambda y, go: reread.get(y)) if reread else c.body
            if any(e.op == "index" and e.args[0].free_symbols or e.op == "load" and (
                    e.args[1].free_symbols or not (e.args[0] in unwritten or (
                        e.args[0] in member_of and e.args[0] not in dropped and where[e.args[0]] <= j
                        and not member_of[e.args[0]].local))) for e in body.walk()) \
                    or ir.compute_cost(body) > MAX_RECOMPUTED_COST or (
                        len({k for k, _ in users}) > MAX_LINKING_READERS and any(e.op in linked for e in body.walk())):
                continue
            bodies = [ir.rewrite(x.body, lambda y, go: body if y.op == "load" and y.args[0] == name else None)
                      for _, x in users]
            if any(name in reads_of(b) for b in bodies):   # a load inside an indirect index (rewrite keeps it)
                continue
            for (k, x), b in zip(users, bodies):
                x.body, x.reads = b, reads_of(b)
                for r in x.reads:
                    readers.setdefault(r, {})[id(x)] = (k, x)
            for r in c.reads:
                readers.get(r, {}).pop(id(c), None)
            readers.pop(name, None)
            dropped.add(name)
    if dropped:
        kept = []
        for it in items:
            if isinstance(it, FusedGroup) and any(m.buf.name in dropped for m in it.members):
                it.members = [m for m in it.members if m.buf.name not in dropped]
                if not it.members:
                    continue
            kept.append(it)
        sched.items = kept


def _same_sizes(a: tuple, b: tuple) -> bool:
    """Whether two tuples of sizes (strides, offsets) are equal at every size the guards admit."""
    return len(a) == len(b) and all(symbols.same(x, y) for x, y in zip(a, b))


def _reads_only(x, name: str, m) -> bool:
    """Whether member x reads buffer `name` only at the element member m stores, over m's loops (a row's
    epilogue reading the value its row just stored: Adam's update of a batch norm's weight reads the new
    moments its row computed in the kernel of the batch norm's backward sums)."""
    return tuple(x.inner) == tuple(m.inner) and x.body is not None and all(
        sympy.expand(e.args[1] - m.store) == 0 for e in x.body.walk() if e.op == "load" and e.args[0] == name)


def _write_in_place(sched: Schedule, ii: int, oi: int, where: dict, member_of: dict, readers: _Readers) -> None:
    """Let the kernel computing graph output `oi`, the new value of input `ii`, store into the input itself
    (no fresh buffer, no copy after the graph) when nothing can tell the difference:
    - the output is a buffer a group computes, with the input's layout, returned once and as a whole;
    - nothing reads the input's old value after that group: no later group or extern call, no graph output,
      no ATen fallback before it (its result may be a view of the input). Library calls before it may read
      it (a training step's convolutions read the weights its optimizer then updates): they run first;
    - inside the group, every member reading the input reads exactly the element being written, over the
      same loops, and runs no later than the writer or shares its block in an `elementwise` group (so each
      element is read before it is overwritten, by the same thread / program); a member reading the new
      value shares the writer's block there (it takes the value from a register), or, in a group of rows,
      runs after the writer and reads only the element written, over the same loops (`_reads_only`)."""
    found = _updating_member(sched, ii, oi, member_of)
    if found is None:
        return
    inp, m = found
    low = sched.lowered
    out = low.outputs[oi]
    b = m.buf
    layout = (*b.size, *b.stride)
    if not isinstance(b, Pointwise) or m.local or m.dest or b.dtype != inp.dtype or m.body is None \
            or not _same_sizes((*layout, b.offset), (*out.size, *out.stride, out.offset)) \
            or not _same_sizes(layout, (*inp.size, *inp.stride)) or inp.name in sched.inplace.values():
        return
    j = where[b.name]
    # (pinned: a graph output, or read by an ATen fallback, whose result may be a view of it)
    if readers.outputs[b.name] != 1 or inp.name in readers.pinned or inp.name in readers.aliased \
            or readers.last.get(inp.name, -1) > j:
        return
    group = sched.items[j]
    pos = group.members.index(m)
    for k, x in enumerate(group.members):
        if b.name in x.reads and not (group.elementwise and x.block == m.block) and not (
                not group.elementwise and k > pos and _reads_only(x, b.name, m)):
            return
        if inp.name not in x.reads:
            continue
        if (k > pos and not (group.elementwise and x.block == m.block)) or tuple(x.inner) != tuple(m.inner):
            return
        for e in x.body.walk():
            if e.op == "load" and e.args[0] == inp.name and sympy.expand(e.args[1] - m.store) != 0:
                return
    m.dest = inp.name
    sched.inplace[b.name] = inp.name
