"""One @triton.jit kernel per fused group: kernel_source picks its shape and launch configuration and prints
the flat and foreach (horizontally fused) kernels here, the row kernels in row_kernels.py; generate prints a
schedule's kernels as one module, identical kernels once."""
from __future__ import annotations

import dataclasses
import hashlib
import math
import re

import sympy

from ember import config
from ember import ir
from ember.ir import Buffer, Expr, FloorDiv, ModIndex, symbols
from ember.codegen.printer import kernel_args
from ember.codegen.schedule import X0, FusedGroup, Member, Schedule
from ember.codegen.triton import heuristics
from ember.codegen.triton.heuristics import FLAT, FOREACH, ROWS, column_config, group_shape, inner_index, \
    inner_size, is_columnwise, launch_config, reduction_share
from ember.codegen.triton.printer import PRELUDE, Body, compute_type, index_code, kernel_header, store_statement
from ember.codegen.triton.row_kernels import rows_kernel
from ember.tools import collector

FOREACH_SHARED_MAX = 32     # ranges (parameters) at most that share one printed body (a where-chain of pointers)


def in_registers(m: Member) -> bool:
    """A local reduction lives in registers: no pointer argument. A local pointwise member that could not be
    inlined is stored (to a scratch buffer, see `inline_locals`)."""
    return m.local and m.is_reduction


def inline_locals(group: FusedGroup) -> tuple[FusedGroup, list[str]]:
    """Members that only later members of the group read (schedule's `local` rows): substituted into their
    readers when every read is of the same element the member computes (a tile already holds it), else
    kept as scratch buffers. Returns the group to print and the scratch buffer names."""
    members, scratch = list(group.members), []
    for k in range(len(members)):
        m = members[k]   # (the locals before it are substituted into its body already)
        if not m.local or m.is_reduction:
            continue
        readers = [j for j in range(k + 1, len(members)) if m.buf.name in members[j].reads]
        same = all(members[j].inner == m.inner and
                   all(x.args[1] == m.store for x in members[j].body.walk()
                       if x.op == "load" and x.args[0] == m.buf.name) for j in readers)
        if not same:
            scratch.append(m.buf.name)
            continue
        for j in readers:
            body = _replace_loads(members[j].body, m.buf.name, m.body)
            members[j] = dataclasses.replace(members[j], body=body,
                                             reads=(members[j].reads - {m.buf.name}) | m.reads)
        members[k] = None
    return FusedGroup(group.numel, [m for m in members if m is not None]), scratch


def _replace_loads(e: Expr, name: str, value: Expr) -> Expr:
    """e with every load of buffer `name` replaced by `value`."""
    return ir.rewrite(e, lambda x, go: value if x.op == "load" and x.args[0] == name else None)


def kernel_source(group: FusedGroup, sched: Schedule, name: str, fixup: bool = False) \
        -> tuple[str, list[str], dict, int | str]:
    """(source of one @triton.jit kernel, argument names, launch config, number of programs). With `fixup`, a
    flat kernel computing float32 sin or cos may come as a flagged pair (_flagged_sincos): its config's "fixup"
    is then the second kernel's number of programs.

    Symbolic sizes (docs/dynamic.md): the kernel takes the size symbols its code uses as int64 arguments after
    the pointers (in the argument names), the number of programs is Python over them (the host program's
    locals), and the block sizes are chosen at the example's sizes (symbols.hint): masks make any block right.
    A row whose length is symbolic is looped over (a persistent tile holds the example's length only)."""
    group, _ = inline_locals(group)
    args, writes = kernel_args(group, in_registers)
    shape = group_shape(group)
    rows = _at_least_one(group.numel)
    rmax = max((inner_size(m) for m in group.members), key=symbols.hint)
    symbolic = not all(symbols.is_static(n) for n in [rows, *(inner_size(m) for m in group.members)])
    expensive = sum(e.op in ir.EXPENSIVE for m in group.members if m.body is not None for e in m.body.walk()) \
        if shape == FLAT else 0
    hint_rows, hint_r = symbols.hint(rows), symbols.hint(rmax)
    if symbolic and shape == FLAT:
        # blocks for the range of sizes, not the example's alone: launch_config's smaller blocks for few programs
        # help only small sizes (quick at any block), and cost large ones half their speed
        hint_rows = max(hint_rows, -(-heuristics.FLAT_FULL_BLOCKS_FROM // max(hint_r, 1)))
    cfg = column_config(hint_rows, hint_r, reduction_share(group)) if shape == ROWS and hint_r > 1 and is_columnwise(group) else \
        launch_config(shape, hint_rows, hint_r, expensive, reduction_share(group))
    if cfg.get("persistent") and not all(symbols.is_static(inner_size(m)) for m in group.members):
        cfg = {**cfg, "persistent": False}   # (one pass over the row at the example's length and below)
    extents = {a: storage_extent(sched.buffers[a]) for a in args}
    # int64 indices where an offset may pass 2**31 - 1 (at some size, where a size is symbolic)
    i64 = symbolic or any(not symbols.is_static(e) for e in extents.values()) or \
        max([rows * rmax] + [ir.prod(sched.buffers[a].size) + abs(int(sched.buffers[a].offset or 0))
                             for a in args if sched.buffers[a].size]) >= 2 ** 31 - 1
    if shape == FLAT:
        split = None if symbolic else transposed_split(group.members, rows, rmax)
        flagged = split is None and fixup and not symbolic and _flagged_sincos(group, rows * rmax)
        if flagged:
            cfg = {**cfg, "BLOCK": max(cfg["BLOCK"], 1024), "fixup": 4 * heuristics.sm_count()}
        if split is not None:
            cfg = dict(TILE_META)
            src = _tiled_kernel(group, name, args, rows, rmax, i64, extents, split)
            grid = math.ceil(rows * rmax // split / cfg["YBLOCK"]) * math.ceil(split / cfg["XBLOCK"])
        else:
            src = _flat_kernel(group, name, args, rows, rmax, i64, extents, cfg["BLOCK"], flagged)
            grid = _programs(rows * rmax, cfg["BLOCK"])
    elif shape == FOREACH:
        if symbolic:
            raise NotImplementedError("a horizontally fused kernel over ranges of symbolic sizes")
        src, grid = _foreach_kernel(group, name, args, rows, cfg["BLOCK"], i64, extents)
    else:
        src = rows_kernel(group, name, args, rows, cfg, i64, extents)
        grid = _programs(rows, cfg["XBLOCK"])
    sizes = size_arguments(src)
    if sizes:
        src = _with_size_parameters(src, args, sizes)
    return src, args + sizes, cfg, grid


def _at_least_one(n):
    """A group's row count as the kernels take it: at least 1 (a symbolic count is >= 2)."""
    return max(int(n), 1) if symbols.is_static(n) else n


def _programs(total, block: int) -> int | str:
    """ceil(total / block): an int, or Python over the size symbols for a symbolic total."""
    if symbols.is_static(total):
        return math.ceil(int(total) / block)
    return symbols.python_code(FloorDiv(total + (block - 1), block))


def size_arguments(src: list[str]) -> list[str]:
    """The size symbols (symbols.HINTS) a printed kernel's code uses, sorted: its int64 arguments."""
    if not symbols.HINTS:   # a static graph
        return []
    names = sorted((str(s) for s in symbols.HINTS), key=len, reverse=True)
    used = set(re.findall(rf"\b(?:{'|'.join(map(re.escape, names))})\b", "\n".join(src[3:])))
    return [n for n in sorted(names) if n in used]


def _with_size_parameters(src: list[str], args: list[str], sizes: list[str]) -> list[str]:
    """The kernel's `def` line with the size parameters after the pointers: int64 at every value (ember's launcher
    passes them as it passes pointers) and not specialized by Triton (on a value 1 or divisibility by 16), so one
    compiled kernel serves every size; a size times a constant (s0 * 768) still tells Triton that constant's
    divisibility, which masks and row starts vectorize by."""
    params = ", ".join(f"{s}: tl.int64" for s in sizes)
    head = src[2]
    at = head.index("(") + 1 + len(", ".join(args))
    head = head[:at] + (", " if args else "") + params + head[at:]
    jit = f"@triton.jit(do_not_specialize=[{', '.join(repr(s) for s in sizes)}])"
    return src[:1] + [jit, head] + src[3:]


def storage_extent(buf: Buffer):
    """Elements of a buffer's storage its own layout can address (what a load may touch): an int, or a sympy
    expression over the size symbols."""
    if any(symbols.is_static(s) and int(s) == 0 for s in buf.size):
        return 0
    if all(symbols.is_static(x) for x in (*buf.size, *buf.stride, buf.offset or 0)):
        return int(buf.offset or 0) + sum((int(n) - 1) * int(st) for n, st in zip(buf.size, buf.stride)) + 1
    return sympy.sympify(buf.offset or 0) + sum((n - 1) * st for n, st in zip(buf.size, buf.stride)) + 1


def is_empty(group: FusedGroup) -> bool:
    """Nothing to compute: no rows, or only pointwise members over empty inner ranges."""
    def zero(n) -> bool:
        return symbols.is_static(n) and int(n) == 0
    return zero(group.numel) or all(not m.is_reduction and zero(inner_size(m)) for m in group.members)


def _flagged_sincos(group: FusedGroup, elements: int) -> bool:
    """Whether a flat kernel of `elements` (FLAGGED_MIN or more) computes float32 sin or cos and may run twice
    over the same inputs. _sincos's test for an argument past the fast path, a block-wide max, is a large
    share of a sin/cos-bound kernel's time; a flagged kernel skips it and raises a flag instead, and a second
    kernel, which returns at once unless the flag is up, redoes the whole range with _sincos (a launch of a
    few microseconds). Not where the kernel stores over memory it reads
    (an in-place update, or a result taking over a dying input): running it again would read its own results."""
    if not config.OWN_SINCOS or elements < FLAGGED_MIN or any(m.dest for m in group.members):
        return False
    stored = {m.buf.name for m in group.members if not m.local}
    if any(r in stored for m in group.members for r in m.reads):
        return False
    return any(e.op in ("sin", "cos") and compute_type(e.args[0].dtype) == "tl.float32"
               for m in group.members if m.body is not None for e in m.body.walk())


# elements from which a flat kernel is flagged: below, the fixup's launch costs more than the block test it saves
FLAGGED_MIN = 1 << 22
# a fixup kernel's: one element a thread, so libdevice's sin and cos are inlined once, not once per element a
# thread holds (faster to compile)
FIXUP_META = {"BLOCK": 128, "num_warps": 4}


def _flat_kernel(group, name, args, rows, rsize, i64, extents, block: int, flagged: bool = False) -> list[str]:
    """One program a block of the flat range; `flagged`: the flagged pair of _flagged_sincos: the kernel, its sin
    and cos from _sincos_flagged, and KERNEL_fixup, the range in a loop over its blocks of FIXUP_META's size,
    with _sincos's sin and cos (libdevice's in blocks holding a large argument: the values of the others stay
    the same bits), which lowers the flag when all its programs have run."""
    pid = "tl.program_id(0).to(tl.int64)" if i64 else "tl.program_id(0)"
    if not flagged:
        return kernel_header(group, name, args, ["BLOCK"]) + flat_range(group.members, pid, rows, rsize, extents,
                                                                         "    ", block=block)
    L = kernel_header(group, name, args + ["sincos_flag"], ["BLOCK"])
    L += flat_range(group.members, pid, rows, rsize, extents, "    ", block=block,
                    sincos_call="_sincos_flagged({}, sincos_flag)")
    L += ["", ""] + kernel_header(group, f"{name}_fixup", args + ["sincos_flag"], ["BLOCK"])[1:]
    fix_block = FIXUP_META["BLOCK"]
    # (an int64 start makes the loop's variable int64: Triton promotes it to the widest of start, end and step)
    L += ["    if tl.load(sincos_flag) != 0:",
          f"        for pid in range({pid}, {math.ceil(rows * rsize / fix_block)}, tl.num_programs(0)):"]
    L += flat_range(group.members, "pid", rows, rsize, extents, " " * 12, block=fix_block)
    L += ["        if tl.atomic_add(sincos_flag + 1, 1) == tl.num_programs(0) - 1:   # every program has read it",
          "            tl.store(sincos_flag, 0)",
          "            tl.store(sincos_flag + 1, 0)"]
    return L


XINDEX = sympy.Symbol("xindex", integer=True, nonnegative=True)
YINDEX = sympy.Symbol("yindex", integer=True, nonnegative=True)


def flat_bodies(members: list[Member], rows: int, rsize: int) -> list[tuple[Member, Expr, object]]:
    """(member, its value, its store offset) over the flat index `xindex` of rows x rsize: row and inner indices
    as div/mod of it, simplified back; an elementwise group's members reading each other's element take the
    value, not a load."""
    i = XINDEX
    ranges = {i: rows * rsize}
    out = []
    values: dict = {}  # member name -> its value Expr: an elementwise group's members read each other's element
    for m in members:
        many = not symbols.is_static(rows) or int(rows) > 1
        subst = {X0: FloorDiv(i, rsize) if many else sympy.Integer(0)}
        subst.update(inner_index(m, ModIndex(i, rsize) if many else i))
        mbody = m.body
        for name in m.reads & values.keys():
            mbody = _replace_loads(mbody, name, values[name])
        values[m.buf.name] = mbody
        out.append((m, ir.substitute(mbody, subst, ranges),
                    ir.simplify_index(sympy.sympify(m.store).xreplace(subst), ranges)))
    return out


def flat_range(members: list[Member], pid: str, rows: int, rsize: int, extents: dict, ind: str, prefix: str = "t",
               block: int | None = None, sincos_call: str | None = None) -> list[str]:
    """Members over rows x rsize as one flat range, program `pid` taking BLOCK elements of it. When `block`
    (BLOCK's value) divides the range, every lane is in it: a mask of constants, which Triton folds away (no
    compare, no predicated loads and stores: the pointwise chain is bound by its arithmetic)."""
    total = rows * rsize
    full = block is not None and _multiple_of(total, block)
    L = [f"{ind}xindex = {pid} * BLOCK + tl.arange(0, BLOCK)",
         f"{ind}xmask = tl.full([BLOCK], True, tl.int1)" if full else
         f"{ind}xmask = xindex < {index_code(sympy.sympify(total), {})}"]
    b = Body({}, "xmask", ind, {XINDEX: total}, extents)  # one body: members share their loads (CSE)
    b.prefix = prefix
    if sincos_call:
        b.sincos_call = sincos_call
    stores = []
    for m, body, store in flat_bodies(members, rows, rsize):
        v = b.emit(body)
        stores.append(ind + store_statement(m, v, index_code(store, {}), "xmask", "[BLOCK]"))
    # stores last: every load comes first (an input updated in place is read before it is written)
    return L + b.lines + stores


# A flat kernel whose loads run along another dim of the range than its stores (a transposed copy) takes
# [YBLOCK, XBLOCK] tiles: rows of the tile are contiguous for the stores, columns for those loads, and Triton
# gives each access the layout its addresses are contiguous in (a shuffle through shared memory between them),
# so both are whole 128-byte lines. A flat block's transposed loads each touch a sector for 4 bytes.
TILE_META = {"YBLOCK": 32, "XBLOCK": 32, "num_warps": 4}
TILE_MIN = 16   # each side of the split range at least this long (a narrower one gains no whole lines)


def transposed_split(members: list[Member], rows: int, rsize: int) -> int | None:
    """B: a flat range of static size split as [total / B, B] (flat index = y * B + x) so that every store and
    some load that is not contiguous along the flat index are contiguous along y (they advance by one element
    when the flat index advances by B), B a divisor of the range taken from the loads' div/mod; None where
    no load runs across the stores (the plain flat kernel is already contiguous)."""
    total = rows * rsize
    # (not where a store overwrites memory the kernel reads, in place: the flat kernel's one layout keeps each
    # element's load and store in one thread)
    if not symbols.is_static(total) or int(total) < TILE_MIN * TILE_MIN or any(m.dest for m in members):
        return None
    total = int(total)
    i = XINDEX

    def at(f, k: int) -> int | None:
        try:
            return int(f.xreplace({i: sympy.Integer(k)}))
        except (TypeError, ValueError):
            return None

    def step(f, k: int) -> int | None:
        a, b = at(f, 0), at(f, k)
        return None if a is None or b is None else b - a
    bodies = flat_bodies(members, rows, rsize)
    stores = [sympy.sympify(s) for _, _, s in bodies]
    if any(step(s, 1) != 1 for s in stores):
        return None
    across, candidates = [], set()
    for _, body, _ in bodies:
        for x in body.walk():
            if x.op != "load" or ir.indirect_symbols(x.args[1]):
                continue
            off = sympy.sympify(x.args[1])
            if step(off, 1) in (0, 1, None):   # a broadcast value, or contiguous with the stores
                continue
            across.append(off)
            candidates |= {int(d.args[1]) for d in off.atoms(FloorDiv, ModIndex) if d.args[1].is_Integer}
    for B in sorted(candidates):
        if TILE_MIN <= B <= total // TILE_MIN and total % B == 0 and any(step(off, B) == 1 for off in across):
            return B
    return None


def _tiled_kernel(group, name, args, rows, rsize, i64, extents, split: int) -> list[str]:
    """The flat range of `group` as [total / split, split] tiles of TILE_META's size (transposed_split): program
    pid takes tile (pid % ny, pid // ny), consecutive programs going down y (along the transposed loads).
    `yindex` and `xindex` are both full [YBLOCK, XBLOCK] tensors, so any load's pointer has the tile's shape."""
    total = int(rows * rsize)
    ny, nx = total // split, split
    by, bx = TILE_META["YBLOCK"], TILE_META["XBLOCK"]
    ind = "    "
    pid = "tl.program_id(0).to(tl.int64)" if i64 else "tl.program_id(0)"
    tiles_y = math.ceil(ny / by)
    itype = "tl.int64" if i64 else "tl.int32"
    L = kernel_header(group, name, args, ["YBLOCK", "XBLOCK"])
    L += [f"{ind}pid = {pid}",
          f"{ind}zero = tl.zeros([YBLOCK, XBLOCK], {itype})",
          f"{ind}yindex = (pid % {tiles_y}) * YBLOCK + tl.arange(0, YBLOCK)[:, None] + zero",
          f"{ind}xindex = (pid // {tiles_y}) * XBLOCK + tl.arange(0, XBLOCK)[None, :] + zero"]
    if ny % by == 0 and nx % bx == 0:
        L.append(f"{ind}xmask = tl.full([YBLOCK, XBLOCK], True, tl.int1)")
    else:
        L.append(f"{ind}xmask = (yindex < {ny}) & (xindex < {nx})")
    ranges = {YINDEX: ny, XINDEX: nx}
    flat = {XINDEX: YINDEX * split + XINDEX}
    b = Body({}, "xmask", ind, ranges, extents)  # one body: members share their loads (CSE)
    b.prefix = "t"
    stores = []
    for m, body, store in flat_bodies(group.members, rows, rsize):
        v = b.emit(ir.substitute(body, flat, ranges))
        store = ir.simplify_index(sympy.sympify(store).xreplace(flat), ranges)
        stores.append(ind + store_statement(m, v, index_code(store, {}), "xmask", "[YBLOCK, XBLOCK]"))
    return L + b.lines + stores


def _multiple_of(total, block: int) -> bool:
    """Whether `block` divides `total` at every size (a symbolic total: its integer coefficient, s0 * 768)."""
    if symbols.is_static(total):
        return int(total) % block == 0
    c, _ = sympy.expand(total).as_coeff_Mul()
    return c.is_Integer and int(c) % block == 0


def _foreach_kernel(group, name, args, rows, block: int, i64, extents) -> tuple[list[str], int]:
    """Pointwise members of several sizes or blocks (schedule's `Member.block`: one parameter's updates): one
    flat range per (size, block), one after the other over the program ids, so a program touches the few
    tensors of one block (not every parameter's). Readers of an in-place input's old value and members
    reading each other's element share the writer's block, hence its range."""
    by_size: dict = {}
    for m in group.members:
        by_size.setdefault((inner_size(m), m.block), []).append(m)
    # ranges whose code is the same but for the pointers (an optimizer's parameters of one shape) are printed
    # once: the program picks its range's pointers (Triton compiles one body instead of one per parameter)
    same_code: dict = {}
    # a pointer: an argument, or an argument plus a constant in a one-element load (the host-scalar pack's i-th
    # value, `tl.load(p3 + 5)`)
    names = "|".join(sorted(map(re.escape, args), key=len, reverse=True))
    word = re.compile(rf"(?<=tl\.load\()(?:{names}) \+ \d+(?=\))|\b(?:{names})\b")
    for (rsize, blk), members in by_size.items():
        n = math.ceil(rows * rsize / block)
        if n == 0:
            continue
        lines = flat_range(members, "lpid", rows, rsize, extents, "        ", prefix="s_", block=block)
        pointers: list = []

        def numbered(m: re.Match) -> str:   # q<i>: the range's i-th pointer, in order of first use
            if m[0] not in pointers:
                pointers.append(m[0])
            return f"q{pointers.index(m[0])}"
        code = word.sub(numbered, "\n".join(lines))
        same_code.setdefault((n, code), []).append(pointers)
    L = kernel_header(group, name, args, ["BLOCK"])
    L.append("    pid = tl.program_id(0).to(tl.int64)" if i64 else "    pid = tl.program_id(0)")
    start = 0
    for k, ((n, code), ranges) in enumerate(same_code.items()):
        for part in range(0, len(ranges), FOREACH_SHARED_MAX):
            share = ranges[part:part + FOREACH_SHARED_MAX]
            end = start + n * len(share)
            # one flat `if` per range, not an elif chain: hundreds of parameters would nest hundreds of scf.ifs
            L.append(f"    if pid < {end}:" if start == 0 else f"    if (pid >= {start}) & (pid < {end}):")
            if len(share) == 1:   # its own pointers, by name
                L.append(f"        lpid = pid - {start}" if start else "        lpid = pid")
                body = re.sub(r"\bq(\d+)\b", lambda m: share[0][int(m[1])], code)
            else:
                rel = f"(pid - {start})" if start else "pid"
                L.append(f"        seg = {rel} // {n}" if n > 1 else f"        seg = {rel}")
                L.append(f"        lpid = {rel} - seg * {n}" if n > 1 else "        lpid = 0")
                for i in range(len(share[0])):
                    chain = share[0][i]
                    if any(ptrs[i] != chain for ptrs in share):
                        for j, ptrs in enumerate(share[1:], 1):
                            chain = f"tl.where(seg == {j}, {ptrs[i]}, {chain})"
                    L.append(f"        q{i} = {chain}")
                body = code
            L.append(re.sub(r"\bs_(?=\d)", f"s{k}_", body))
            start = end
    return L, start


# ------------------------------------------------------------------------------------------------- modules
def generate(sched: Schedule) -> tuple[str, list]:
    """The Python module of a schedule's kernels, and per group (kernel name, args, config, grid)."""
    with collector.frozen():
        return _generate(sched)


def _generate(sched: Schedule) -> tuple[str, list]:
    parts, kernels, seen = [PRELUDE], [], set()
    for it in sched.items:
        if getattr(it, "template", None) is not None:     # mm_template.TemplateGroup (max-autotune)
            src, args, (m_, n_) = it.template
            bm, bn, bk, warps, stages = it.config
            cfg = {"BM": bm, "BN": bn, "BK": bk, "num_warps": warps, "num_stages": stages}
            grid = math.ceil(m_ / bm) * math.ceil(n_ / bn)
            name, text = canonical(src, args + [m.buf.name for m in it.members])
            if name not in seen:
                seen.add(name)
                parts.append(text)
            kernels.append((it, name, args, cfg, grid))
        elif isinstance(it, FusedGroup) and not is_empty(it):
            src, args, cfg, grid = kernel_source(it, sched, "KERNEL", fixup=True)
            name, text = canonical(src, args + [m.buf.name for m in it.members])
            if name not in seen:   # identical kernels (repeated layers) are compiled once
                seen.add(name)
                parts.append(text)
            kernels.append((it, name, args, cfg, grid))
    return "\n\n\n".join(parts) + "\n", kernels


def canonical(src: list[str], buffers: list[str]) -> tuple[str, str]:
    """Kernel text with buffers renamed p0, p1... in argument order, named by the hash of that text."""
    comment, body = src[0], "\n".join(src[1:])
    new = {n: f"p{j}" for j, n in enumerate(dict.fromkeys(buffers))}
    if new:   # one pass over the text (a pass per buffer is quadratic in a wide kernel's size)
        names = "|".join(map(re.escape, sorted(new, key=len, reverse=True)))
        body = re.sub(rf"\b({names})(?=\b|_)", lambda m: new[m.group(1)], body)
    name = "k_" + hashlib.sha256(body.encode()).hexdigest()[:16]
    return name, comment + "\n" + body.replace("def KERNEL(", f"def {name}(").replace("def KERNEL_", f"def {name}_")

