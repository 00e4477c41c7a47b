"""Schedule passes for the GPU, between scheduling and printing: groups of few rows split into their parts,
wide horizontal groups chunked, private values kept in registers, results stored over dying inputs."""
from __future__ import annotations

import dataclasses

import sympy

from ember import ir
from ember.ir import ExternBuffer, Pointwise, TensorArg, symbols
from ember.codegen.schedule import FusedGroup, Schedule, lifetimes, order_elementwise, split_elementwise
from ember.codegen.triton import heuristics
from ember.codegen.triton.heuristics import FLAT, FOREACH, ROWS, group_shape, inner_size
from ember.codegen.wrapper import CONV_RESULTS, OUT_VARIANTS, buffer_layout


def registers_for_private_values(sched: Schedule) -> None:
    """Pointwise members that nothing outside their group reads (no graph output, no in-place write, no later
    kernel or library call): `local`, so `inline_locals` substitutes them into their readers and they are never
    stored (a value computed only for a gradient in the same kernel costs a write otherwise). In a group with
    reductions too, a row value its reductions and epilogue read (a masked softmax's exp(x - max), which the
    decomposition materializes as too costly to compute twice): a persistent kernel computes it once into
    registers shared by its readers, a looped one computes it again in each loop instead of storing it in the
    first and loading it in the next. Runs after the splits and chunks, which could part a value from its
    readers."""
    outputs = {o.buffer for o in sched.lowered.outputs if isinstance(o, TensorArg)}
    readers: dict[str, set] = {}
    for j, it in enumerate(sched.items):
        names = set().union(*(m.reads for m in it.members)) if isinstance(it, FusedGroup) else set(it.inputs)
        for n in names:
            readers.setdefault(n, set()).add(j)
    for j, it in enumerate(sched.items):
        if isinstance(it, FusedGroup):
            for k, m in enumerate(it.members):
                if m.local or m.dest or m.buf.name in outputs or readers.get(m.buf.name) != {j}:
                    continue
                # only where inline_locals can substitute it: every read is of the element it computes
                if all(x.inner == m.inner and all(ld.args[1] == m.store for ld in x.body.walk()
                                                  if ld.op == "load" and ld.args[0] == m.buf.name)
                       for x in it.members[k + 1:] if m.buf.name in x.reads):
                    m.local = True


def overwrite_dying_inputs(sched: Schedule) -> None:
    """A flat pointwise kernel stores its result over an input it reads for the last time, where that input is
    an intermediate of the same layout: a convolution's or product's fresh result, or a buffer an earlier kernel
    stored (not a graph input, output or a value an ATen fallback saw); the result may be an output (the
    memory is the call's own, fresh each call). The result takes over the input's memory
    (`Schedule.takes_over`; the wrapper passes the name on): the input's lines, which the kernel has just read
    into the L2 cache, are overwritten there, and a step's working set is one activation, not two. Safe where
    every element is read only by the thread that overwrites it: each load of the input in the group is at the
    member's store offset over the same loops and in the member's range (a horizontally fused kernel runs one
    range per size and block, each on programs of its own), and a range stores after all its loads."""
    items = sched.items
    last, pinned = lifetimes(sched)
    fresh: set = set()   # intermediates whose memory is theirs alone
    for it in items:
        if isinstance(it, ExternBuffer):
            if not it.fallback and (it.target in CONV_RESULTS or it.target in OUT_VARIANTS) and \
                    len(it.outputs) == 1 and it.outputs[0] is not None and it.outputs[0].name == it.name:
                fresh.add(it.name)
        else:
            fresh.update(m.buf.name for m in it.members if not m.local and not m.dest)
    taken: set = set()
    for j, it in enumerate(items):
        if not isinstance(it, FusedGroup) or group_shape(it) not in (FLAT, FOREACH):
            continue
        for m in it.members:
            b = m.buf
            if m.local or m.dest or m.body is None or not isinstance(b, Pointwise) or ir.prod(b.size) == 1:
                continue
            for r in sorted(m.reads):
                rb = sched.buffers.get(r)
                if r in taken or r not in fresh or r in pinned or last.get(r) != j or rb is None \
                        or buffer_layout(rb) != buffer_layout(b) or not symbols.same(rb.offset, 0) \
                        or not symbols.same(b.offset, 0):
                    continue
                if all(tuple(x.inner) == tuple(m.inner) and (x.block, inner_size(x)) == (m.block, inner_size(m))
                       and all(sympy.expand(e.args[1] - m.store) == 0 for e in x.body.walk()
                               if e.op == "load" and e.args[0] == r) for x in it.members if r in x.reads):
                    m.dest = r
                    sched.takes_over[b.name] = r
                    taken.add(r)
                    break


def split_few_row_groups(sched: Schedule) -> Schedule:
    """Split groups of few rows into their independent parts.

    The scheduler joins independent buffers into one group when their row counts match (horizontal fusion);
    a contiguous buffer is one row, so unrelated pointwise buffers of different sizes become one group of one
    row: one Triton program looping over every member. On a GPU the parallelism is across rows, so a group with
    fewer rows than the GPU has SMs
    is split into its connected parts (members joined by reads); each part gets the shape that suits it
    (a lone pointwise part is flat). Parts keep the order of their first members."""
    items = []
    for it in sched.items:
        if not isinstance(it, FusedGroup) or len(it.members) < 2 or symbols.hint(it.numel) >= heuristics.sm_count() \
                or group_shape(it) != ROWS:
            items.append(it)
            continue
        scalars = _leading_scalars(it)
        if scalars:    # one-element values (e.g. an optimizer's bias correction) first, in a kernel of their own,
            # so the elementwise rest is one flat kernel over all programs instead of one program's loop
            items.append(dataclasses.replace(it, members=scalars))
            it = dataclasses.replace(it, members=[m for m in it.members if m not in scalars])
            order_elementwise(it)   # one block per parameter
            if group_shape(it) != ROWS:     # flat, or one foreach kernel over the independent parts
                items.append(it)
                continue
        # graph inputs written in place: a writer and every reader of its input stay in one part, in order
        in_place = {m.dest for m in it.members if m.dest and m.dest != m.buf.name}
        part_of: dict = {}
        parts: list[list] = []
        for m in it.members:
            # reductions over the same extents reading the same buffer stay together: they share its loads
            # (batch norm's backward sums the gradient and the gradient times x-hat)
            shared = [(r, m.inner) for r in m.reads] if m.is_reduction else []
            shared += [("in place", x) for x in sorted({*m.reads, m.dest} & in_place)]
            joined = sorted({part_of[r] for r in [*m.reads, *shared] if r in part_of})
            if not joined:
                parts.append([m])
                k = len(parts) - 1
            else:
                k = joined[0]
                for j in joined[1:]:            # m connects earlier parts: merge them into the first
                    parts[k].extend(parts[j])
                    parts[j] = []
                    for key in [key for key, v in part_of.items() if v == j]:
                        part_of[key] = k
                parts[k].append(m)
            part_of[m.buf.name] = k
            for key in shared:
                part_of.setdefault(key, k)
        # one-element parts (each batch norm's num_batches_tracked + 1) share flat kernels of at most
        # MAX_BLOCKS_PER_KERNEL members, not a launch each nor one program over all (slow to compile); nothing
        # is read between parts
        order = {id(m): i for i, m in enumerate(it.members)}
        lone = [p for p in parts if p and all(not m.is_reduction and not m.inner for m in p)]
        if len(lone) > 1:
            chunks: list[list] = [[]]
            for p in lone:
                if chunks[-1] and len(chunks[-1]) + len(p) > MAX_BLOCKS_PER_KERNEL:
                    chunks.append([])
                chunks[-1] += [dataclasses.replace(m, block=0) for m in p]
            order.update((id(new), order[id(m)]) for new, m in zip((m for c in chunks for m in c),
                                                                   (m for p in lone for m in p)))
            parts = [p for p in parts if p and not any(p is q for q in lone)] + chunks
        for members in parts:
            if not members:
                continue
            part = dataclasses.replace(it, members=sorted(members, key=lambda m: order[id(m)]))
            if group_shape(part) == ROWS and not any(m.is_reduction for m in members):
                # pointwise members reading each other's stored values in other shapes (a gelu recomputed in a
                # backward) would run in one program: one flat kernel each, in order
                items += [dataclasses.replace(it, members=[m]) for m in part.members]
            else:
                items.append(part)
    return dataclasses.replace(sched, items=items)


MAX_BLOCKS_PER_KERNEL = 32   # independent blocks (an optimizer's parameters) one horizontally fused kernel takes


def chunk_wide_groups(sched: Schedule, limit: int = MAX_BLOCKS_PER_KERNEL) -> Schedule:
    """Horizontally fused groups of many independent blocks in kernels of at most `limit` blocks each.

    One kernel over hundreds of parameters takes minutes to compile; a few launches more cost microseconds."""
    def too_big(g: FusedGroup) -> bool:
        return len(g.members) > limit and group_shape(g) != ROWS and len({m.block for m in g.members}) > limit
    return split_elementwise(sched, too_big)


def split_symbolic_foreach(sched: Schedule) -> Schedule:
    """A symbolic graph's horizontally fused groups over ranges of different sizes, one group per range (a flat
    kernel each): a foreach kernel lays its ranges end to end over the program ids at numbers fixed in its
    source. Members reading each other's element or an in-place input's old value share a range (FOREACH)."""
    if not symbols.HINTS:   # a static graph
        return sched
    items = []
    for it in sched.items:
        sizes = [inner_size(m) for m in it.members] if isinstance(it, FusedGroup) else []
        if not sizes or all(symbols.is_static(n) for n in [it.numel, *sizes]) or group_shape(it) != FOREACH:
            items.append(it)
            continue
        ranges: dict = {}
        for m in it.members:
            ranges.setdefault((inner_size(m), m.block), []).append(m)
        items += [dataclasses.replace(it, members=ms) for ms in ranges.values()]
    return dataclasses.replace(sched, items=items)


def _leading_scalars(group: FusedGroup) -> list:
    """The group's one-element pointwise members when they can run before all the others: none reads another
    kind of member of the group, and the group has no reduction (whose register values members may share)."""
    if not symbols.same(group.numel, 1) or any(m.is_reduction or m.local for m in group.members):
        return []
    scalars = [m for m in group.members if not m.inner]
    if not scalars or len(scalars) == len(group.members):
        return []
    dests = {m.dest for m in group.members if m.dest}
    if any(m.dest or m.reads & dests for m in scalars):   # moved first, they would write or read out of order
        return []
    others = {m.buf.name for m in group.members if m.inner}
    return [] if any(m.reads & others for m in scalars) else scalars

