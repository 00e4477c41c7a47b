"""Row kernels: a [XBLOCK, RBLOCK] tile, each program owning whole rows. Persistent when the longest inner range
fits one RBLOCK (the row lives in registers, all members share it); looped otherwise (each member loops over its
row with an [XBLOCK, RBLOCK] accumulator, reduced at the end; a max and the sum of exp(x - max) in one loop)."""
from __future__ import annotations

import sympy
import torch

from ember import config
from ember import ir
from ember.ir import Expr, symbols
from ember.codegen.schedule import X0, FusedGroup, Member
from ember.codegen.triton.heuristics import inner_index, inner_size
from ember.codegen.triton.printer import Body, compute_type, index_code, kernel_header, store_statement

REDUCE_IDENTITY = {"sum": "0", "prod": "1", "any": "0", "all": "1"}


def _identity(kind: str, dtype: torch.dtype) -> str:
    """The identity of a reduction of `kind` over values of `dtype` (what masked lanes contribute)."""
    if kind in REDUCE_IDENTITY:
        return REDUCE_IDENTITY[kind]
    big = kind in ("min", "argmin")
    if dtype.is_floating_point:
        return "float('inf')" if big else "float('-inf')"
    if dtype == torch.bool:
        return "1" if big else "0"
    info = torch.iinfo(dtype)
    return str(info.max if big else info.min)


def rows_kernel(group: FusedGroup, name: str, args: list[str], rows: int, cfg: dict, i64: bool,
                extents: dict) -> list[str]:
    """The kernel of a ROWS group (module docstring): members in order; a reduction's result is an [XBLOCK, 1]
    value later members read; a member reading what this program stored waits at a barrier unless every value
    it reads is still in a register."""
    L = kernel_header(group, name, args, ["XBLOCK", "RBLOCK"])
    ind = "    "
    pid = "tl.program_id(0).to(tl.int64)" if i64 else "tl.program_id(0)"
    L.append(f"{ind}x0 = {pid} * XBLOCK + tl.arange(0, XBLOCK)[:, None]")
    L.append(f"{ind}xmask = x0 < {_size(rows)}")
    persistent = cfg["persistent"]
    if persistent:
        L.append(f"{ind}rbase = tl.arange(0, RBLOCK)[None, :]")
        L.append(f"{ind}rflat = rbase")
    bodies: dict[int, Body] = {}
    scalars: dict = {}
    stored_here: set = set()
    # (buffer, offset) -> variable: one value per row (a batch norm's mean and rstd) this program stored, which
    # later members of any row length read from the register instead of waiting for the store
    row_values: dict = {}

    def in_registers(b: Body, body: Expr) -> bool:
        """Whether every value body reads of what this program stored is still in a register."""
        return all(x.args[0] in scalars or (x.args[0], x.args[1]) in b.stored for x in body.walk()
                   if x.op == "load" and x.args[0] in stored_here)
    run: list = []   # looped reductions of one row length not reading each other: one loop (_looped_members)
    online: dict = {}   # in `run`: a sum of exp(x - max) -> that max (one loop, _online_softmax_max)
    rflat = sympy.Symbol("rflat", integer=True, nonnegative=True)
    at_row: dict = {}   # id(member) -> (its row length, ranges, body and store offset at the row x0, rflat)
    for m in group.members:
        R = inner_size(m)
        ranges = {X0: rows, rflat: max(R, 1) if symbols.is_static(R) else R}
        subst = inner_index(m, rflat) if m.inner else {}
        at_row[id(m)] = (R, ranges, ir.substitute(m.body, subst, ranges),
                         ir.simplify_index(sympy.sympify(m.store).xreplace(subst), ranges))
    computed = {m.buf.name for m in group.members}
    hoisted = _row_loads(computed, [b for _, _, b, _ in at_row.values()], rows, scalars, ind, extents)
    L += hoisted.pop("lines")

    def flush():
        if run:
            ms = [r[0] for r in run]
            L.extend(_looped_members(ms, [r[1] for r in run], [r[2] for r in run], scalars, ind, run[0][3],
                                     run[0][4], extents, online, hoisted))
            for x in ms:
                scalars[x.buf.name] = f"{x.buf.name}_v"
                if not x.local:
                    stored_here.add(x.buf.name)
            run.clear()
            online.clear()

    for m in group.members:
        R, ranges, body, store = at_row[id(m)]
        joins = run and not persistent and m.is_reduction and R == run[0][3] and m.inner
        if joins and m.reads & {r[0].buf.name for r in run}:
            mx = _online_softmax_max(m, run, online) if config.ONLINE_SOFTMAX else None
            if mx is None:
                joins = False
            else:
                online[m.buf.name] = mx
        if run and not joins:
            flush()
        barrier_at = None
        if m.reads & stored_here:
            barrier_at = len(L)
            L.append(f"{ind}tl.debug_barrier()  # {m.buf.name} reads values this program just stored")
        if symbols.is_static(R) and R == 0:  # an empty inner range: a reduction gives its identity, a pointwise member writes nothing
            if m.is_reduction:
                ident = "0" if m.buf.kind.startswith("arg") else _identity(m.buf.kind, m.body.dtype)
                L.append(f"{ind}{m.buf.name}_v = tl.full([XBLOCK, 1], {ident}, {compute_type(m.buf.dtype)})")
                scalars[m.buf.name] = f"{m.buf.name}_v"
                if not m.local:
                    L.append(ind + store_statement(m, f"{m.buf.name}_v", index_code(sympy.sympify(m.store), {}),
                                                   "xmask", "[XBLOCK, 1]"))
                    stored_here.add(m.buf.name)
            continue
        if not m.inner:   # (R is 1)
            b = Body(scalars, "xmask", ind, ranges, extents)
            b.prefix = f"{m.buf.name}_t"    # names of its own: a later looped member must not reassign them
            b.stored.update(row_values)
            b.stored.update(hoisted)
            if barrier_at is not None and in_registers(b, body):
                del L[barrier_at]
            v = b.emit(body)
            L += b.lines
            if m.is_reduction:  # reduction over nothing: the value itself (its index, for argmax/argmin)
                if m.buf.kind.startswith("arg"):
                    v = "tl.zeros([XBLOCK, 1], tl.int64)"
                L.append(f"{ind}{m.buf.name}_v = {v}")
                v = f"{m.buf.name}_v"
                scalars[m.buf.name] = v
            if not (m.local and m.is_reduction):
                L.append(ind + store_statement(m, v, index_code(store, {}), "xmask", "[XBLOCK, 1]"))
                stored_here.add(m.buf.name)
                if not m.is_reduction and m.buf.dtype == m.body.dtype and m.buf.dtype in (torch.float32,
                                                                                            torch.float64):
                    row_values[(m.buf.name, store)] = v
                    for other in bodies.values():
                        other.stored[(m.buf.name, store)] = v
            continue
        if persistent:
            # members over the same row length share one Body: a value (a load of the row) is computed once
            if R not in bodies:
                L.append(f"{ind}rmask{R} = xmask & (rbase < {R})")
                bodies[R] = Body(scalars, f"rmask{R}", ind, ranges, extents)
                bodies[R].row_mask = "xmask"
                bodies[R].prefix = f"r{R}_"
                bodies[R].stored.update(row_values)
                bodies[R].stored.update(hoisted)
                # every load of the row this group reads but does not compute, issued before the first reduction
                # (a layer norm's weight and bias loaded after its reductions each wait a latency of their own)
                for r_len, _, later, _ in at_row.values():
                    if r_len == R:
                        for x in later.walk():
                            if _load_from_outside(x, computed, scalars):
                                bodies[R].emit(x)
                L += bodies[R].lines
            b = bodies[R]
            if barrier_at is not None and in_registers(b, body):
                del L[barrier_at]   # every value read back is still in a register: no wait for the stores
            done = len(b.lines)
            v = b.emit(body)
            L += b.lines[done:]
            if m.is_reduction:
                L += _reduce_tile(m, v, ind, f"rmask{R}", "rflat", R)
                scalars[m.buf.name] = f"{m.buf.name}_v"
                if not m.local:
                    L.append(ind + store_statement(m, f"{m.buf.name}_v", index_code(store, {}), "xmask", "[XBLOCK, 1]"))
            else:
                L.append(ind + store_statement(m, v, index_code(store, {}), f"rmask{R}", "[XBLOCK, RBLOCK]"))
                if m.buf.dtype == m.body.dtype and m.buf.dtype in (torch.float32, torch.float64):
                    b.stored[(m.buf.name, store)] = v   # a later member's load of this element: the register
        elif m.is_reduction:
            run.append((m, body, store, R, ranges))
            continue
        else:
            L += _looped_members([m], [body], [store], scalars, ind, R, ranges, extents, None, hoisted)
        if not (m.local and m.is_reduction):
            stored_here.add(m.buf.name)
    flush()
    return L


def _size(n) -> str:
    """A row count or length in a kernel: an int, or Triton over the kernel's int64 size arguments."""
    return str(int(n)) if symbols.is_static(n) else index_code(sympy.sympify(n), {})


def _acc_type(m: Member) -> str:
    """The type a reduction accumulates in (bools count as int32)."""
    d = m.body.dtype
    if d == torch.bool:
        return "tl.int32"
    return compute_type(d)


def _reduce_tile(m: Member, v: str, ind: str, mask: str, rflat: str, R: int) -> list[str]:
    """Reduce a [XBLOCK, RBLOCK] tile of values v (masked lanes -> identity) to `<buf>_v` of [XBLOCK, 1]."""
    kind, n, at = m.buf.kind, m.buf.name, _acc_type(m)
    ident = _identity(kind, m.body.dtype)
    out_t = compute_type(m.buf.dtype)
    L = [f"{ind}{n}_in = tl.where({mask}, ({v}), {ident}).to({at})"]
    if kind == "sum":
        L.append(f"{ind}{n}_v = tl.sum({n}_in, 1)[:, None].to({out_t})")
    elif kind == "prod":
        L.append(f"{ind}{n}_v = tl.reduce({n}_in, 1, _prod)[:, None].to({out_t})")
    elif kind in ("max", "min"):
        fn = "_max_nan" if kind == "max" else "_min_nan"
        if m.body.dtype.is_floating_point:
            L.append(f"{ind}{n}_v = tl.reduce({n}_in, 1, {fn})[:, None].to({out_t})")
        else:
            L.append(f"{ind}{n}_v = tl.{kind}({n}_in, 1)[:, None].to({out_t})")
    elif kind in ("any", "all"):
        L.append(f"{ind}{n}_v = (tl.{'max' if kind == 'any' else 'min'}(({n}_in != 0).to(tl.int32), 1)[:, None] != 0)")
    elif kind in ("argmax", "argmin"):
        L.append(f"{ind}{n}_i = tl.where({mask}, {rflat} + tl.zeros_like({n}_in).to(tl.int64), {2 ** 62})")
        L.append(f"{ind}_, {n}_v = tl.reduce(({n}_in, {n}_i), 1, _{kind})")
        L.append(f"{ind}{n}_v = {n}_v[:, None]")
    else:
        raise NotImplementedError(f"reduction {kind}")
    return L


def _online_softmax_max(m: Member, run: list, online: dict) -> str | None:
    """The max reduction of `run` (looped reductions pending one loop) whose result the sum reduction `m` reads
    as `sum(exp(x - max))`, x being exactly the value the max reduces (the same Expr: the same loads, pointwise
    ops between them and the max included), so both run in one loop (online softmax, `_accumulate_online`);
    None when m is not such a sum, or reads any other member of the run."""
    if m.buf.kind != "sum":
        return None
    by_name = {r[0].buf.name: r for r in run}
    read = m.reads & by_name.keys()
    if len(read) != 1:
        return None
    (name,) = read
    mx, mbody, mstore, R, ranges = by_name[name]
    if mx.buf.kind != "max" or name in online.values() or not mbody.dtype.is_floating_point or \
            mx.buf.dtype != mbody.dtype or m.inner != mx.inner:
        return None
    rflat = sympy.Symbol("rflat", integer=True, nonnegative=True)
    body = ir.substitute(m.body, inner_index(m, rflat), ranges)
    if body.op != "exp" or body.args[0].op != "sub" or body.dtype != mbody.dtype:
        return None
    x, shift = body.args[0].args
    if x is not mbody or shift.op != "load" or shift.args != (name, mstore):
        return None
    return name


def _load_from_outside(x: Expr, computed: set, scalars: dict) -> bool:
    """Whether x is a direct load of a buffer no member of the group computes (nor a scalar it holds)."""
    return x.op == "load" and x.args[0] not in computed and x.args[0] not in scalars and \
        isinstance(x.args[1], sympy.Basic) and not ir.indirect_symbols(x.args[1])


def _row_loads(computed: set, bodies: list, rows: int, scalars: dict, ind: str, extents: dict) -> dict:
    """The loads of one value per row (a batch norm's weight, bias, running statistics) that no member of the
    group computes, issued at the kernel's start: {(buffer, offset): variable, "lines": their statements}.
    Issued where first used, after a reduction's barrier, each would wait a memory latency of its own. (A graph input
    a member updates in place is read for its old value, by the thread that overwrites it: earlier is as right.)"""
    b = Body(scalars, "xmask", ind, {X0: rows}, extents)
    b.prefix = "h"
    got: dict = {}
    for body in bodies:
        for x in body.walk():
            if _load_from_outside(x, computed, scalars) and x.args[1].free_symbols <= {X0} and \
                    (x.args[0], x.args[1]) not in got:
                got[(x.args[0], x.args[1])] = b.emit(x)
    got["lines"] = b.lines
    return got


def _looped_members(ms: list, bodies: list, stores: list, scalars, ind, R, ranges, extents,
                    online: dict | None = None, hoisted: dict | None = None) -> list[str]:
    """One loop over the row in RBLOCK steps for members of the same row length that do not read each other
    (a pointwise member alone, or several reductions: values they share, e.g. a load, computed once), except
    that a sum of exp(x - max) may read its max (`online`: sum -> max, see `_online_softmax_max`): its
    accumulator is updated with the max's (`_accumulate_online`), its body is not computed."""
    online = online or {}
    sum_of = {mx: s for s, mx in online.items()}
    by_name = {m.buf.name: m for m in ms}
    L = []
    for m in ms:
        if m.is_reduction:
            n, kind, at = m.buf.name, m.buf.kind, _acc_type(m)
            L.append(f"{ind}{n}_acc = tl.full([XBLOCK, RBLOCK], {_identity(kind, m.body.dtype)}, {at})")
            if kind.startswith("arg"):
                L.append(f"{ind}{n}_acci = tl.full([XBLOCK, RBLOCK], {2 ** 62}, tl.int64)")
    L.append(f"{ind}for roff in range(0, {_size(R)}, RBLOCK):")
    ii = ind + "    "
    L.append(f"{ii}rflat = roff + tl.arange(0, RBLOCK)[None, :]")
    L.append(f"{ii}mask = xmask & (rflat < {_size(R)})")
    b = Body(scalars, "mask", ii, ranges, extents)
    b.row_mask = "xmask"
    b.stored.update(hoisted or {})
    b.prefix = f"{ms[0].buf.name}_t"   # a name reused from an earlier member would be a loop-carried variable to Triton
    after = []
    for m, body, store in zip(ms, bodies, stores):
        if m.buf.name in online:   # accumulated with its max's update, reduced right after it
            if not m.local:
                after.append(ind + store_statement(m, f"{m.buf.name}_v", index_code(store, {}), "xmask", "[XBLOCK, 1]"))
            continue
        done = len(b.lines)
        v = b.emit(body)
        L += b.lines[done:]
        if not m.is_reduction:
            L.append(ii + store_statement(m, v, index_code(store, {}), "mask", "[XBLOCK, RBLOCK]"))
            continue
        if m.buf.name in sum_of:
            upd, fin = _accumulate_online(m, by_name[sum_of[m.buf.name]], v, ii, ind)
        else:
            upd, fin = _accumulate(m, v, ii, ind)
        L += upd
        after += fin
        if not m.local:
            after.append(ind + store_statement(m, f"{m.buf.name}_v", index_code(store, {}), "xmask", "[XBLOCK, 1]"))
    return L + after


def _accumulate(m: Member, v: str, ii: str, ind: str) -> tuple[list[str], list[str]]:
    """(lines in the loop folding the tile `v` into `<buf>_acc`, lines after it reducing that to `<buf>_v`)."""
    n, kind, at = m.buf.name, m.buf.kind, _acc_type(m)
    ident = _identity(kind, m.body.dtype)
    upd_lines = [f"{ii}{n}_x = tl.where(mask, ({v}), {ident}).to({at})"]
    fl = m.body.dtype.is_floating_point
    upd = {"sum": f"{n}_acc + {n}_x", "prod": f"{n}_acc * {n}_x",
           "max": f"_max_nan({n}_acc, {n}_x)" if fl else f"tl.maximum({n}_acc, {n}_x)",
           "min": f"_min_nan({n}_acc, {n}_x)" if fl else f"tl.minimum({n}_acc, {n}_x)",
           "any": f"tl.maximum({n}_acc, ({n}_x != 0).to(tl.int32))",
           "all": f"tl.minimum({n}_acc, ({n}_x != 0).to(tl.int32))"}
    out_t = compute_type(m.buf.dtype)
    fin = []
    if kind in upd:
        upd_lines.append(f"{ii}{n}_acc = {upd[kind]}")
        fn = {"sum": None, "prod": "_prod", "max": "_max_nan" if fl else None, "min": "_min_nan" if fl else None,
              "any": None, "all": None}[kind]
        if kind == "sum":
            fin.append(f"{ind}{n}_v = tl.sum({n}_acc, 1)[:, None].to({out_t})")
        elif kind in ("any", "all"):
            fin.append(f"{ind}{n}_v = (tl.{'max' if kind == 'any' else 'min'}({n}_acc, 1)[:, None] != 0)")
        elif fn is None:
            fin.append(f"{ind}{n}_v = tl.{kind}({n}_acc, 1)[:, None].to({out_t})")
        else:
            fin.append(f"{ind}{n}_v = tl.reduce({n}_acc, 1, {fn})[:, None].to({out_t})")
    else:  # argmax / argmin
        upd_lines.append(f"{ii}{n}_xi = tl.where(mask, rflat + tl.zeros_like({n}_x).to(tl.int64), {2 ** 62})")
        upd_lines.append(f"{ii}{n}_acc, {n}_acci = _{kind}({n}_acc, {n}_acci, {n}_x, {n}_xi)")
        fin.append(f"{ind}_, {n}_v = tl.reduce(({n}_acc, {n}_acci), 1, _{kind})")
        fin.append(f"{ind}{n}_v = {n}_v[:, None]")
    return upd_lines, fin


def _accumulate_online(mx: Member, sm: Member, v: str, ii: str, ind: str) -> tuple[list[str], list[str]]:
    """`_accumulate` for a max reduction of the tile `v` (mx) and the sum of exp(v - that max) (sm) in one loop:
    each lane keeps its running max m and the sum s of exp(x - m) over the x it saw, rescaled when m grows,
    s' = s * exp(m - m') + exp(x - m'); after the loop, the row's max M and sum(s * exp(m - M)) over the lanes.
    The max is the same as `_accumulate`'s (max is exact in any order, NaN kept). The sum is eager's
    sum(exp(x - M)) but for rounding: a lane that saw only -inf (or masked) values keeps m = -inf and s = 0
    (exp(-inf - -inf) would be NaN), so it adds 0 * exp(-inf - M) = 0 to a row whose max M is finite, and
    0 * exp(-inf - -inf) = NaN to a row of only -inf, as eager's exp(-inf - -inf) does; +inf or NaN values
    make s NaN in their lane (exp(inf - inf)), hence the sum NaN, as in eager."""
    n, s, at = mx.buf.name, sm.buf.name, _acc_type(mx)
    upd = [f"{ii}{n}_x = tl.where(mask, ({v}), float('-inf')).to({at})",
           f"{ii}{n}_new = _max_nan({n}_acc, {n}_x)",
           f"{ii}{s}_acc = tl.where({n}_new == float('-inf'), 0, "
           f"{s}_acc * tl.exp({n}_acc - {n}_new) + tl.exp({n}_x - {n}_new)).to({at})",
           f"{ii}{n}_acc = {n}_new"]
    fin = [f"{ind}{n}_v = tl.reduce({n}_acc, 1, _max_nan)[:, None].to({compute_type(mx.buf.dtype)})",
           f"{ind}{s}_v = tl.sum({s}_acc * tl.exp({n}_acc - {n}_v), 1)[:, None].to({compute_type(sm.buf.dtype)})"]
    return upd, fin

