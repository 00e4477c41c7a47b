"""ember's primitive set. Every ATen op ember compiles is written (ember.decomp.table) in terms of these.

  pointwise   POINTWISE ops by name (+ where, cast, constants, iota): compose loaders, nothing is computed
  reduce      sum / prod / max / min / argmax / argmin / any / all over some dims: a Reduction buffer
  views       permute, expand, reshape, slice, select, unsqueeze, squeeze, flip, as_strided, cat, pad:
              index arithmetic on the loader (no copy)
  gather      index with an integer tensor (gather, index.Tensor, embedding): an indirect index
  rng         rand / randn from a counter-based hash of (seed, element index): Philox-like, not eager's stream
  extern      library calls (mm, addmm, bmm, convolution, SDPA) and kept ATen ops: ember.codegen.lower

A primitive takes and returns TensorBoxes (ember.ir); python numbers are allowed where a tensor is.
Semantics of each pointwise op are C's/IEEE's on the operands' common dtype (callers cast first), except
where PyTorch differs (float floordiv and remainder round toward -inf as eager does; on integers they are C's
and only used on non-negative indices; comparisons return bool).
"""
from __future__ import annotations

from typing import Sequence

import sympy
import torch

from ember import config, ir
from ember.ir import Expr, FloorDiv, IndirectSymbol, ModIndex, TensorBox, symbols

# name -> arity. The meaning of each name is fixed here; backends map names to their language.
POINTWISE = {
    **{n: 1 for n in ("neg", "abs", "exp", "exp2", "log", "log2", "log10", "sqrt", "rsqrt", "sin", "cos", "tan",
                      "asin", "acos", "atan", "sinh", "cosh", "tanh", "asinh", "acosh", "atanh", "sigmoid",
                      "erf", "erfc", "log1p", "expm1", "floor", "ceil", "round", "trunc", "sign", "reciprocal",
                      "logical_not", "bitwise_not", "isnan", "isinf", "isfinite", "lgamma", "relu", "frac",
                      "signbit")},
    **{n: 2 for n in ("add", "sub", "mul", "truediv", "floordiv", "remainder", "fmod", "pow", "maximum",
                      "minimum", "fmax", "fmin", "eq", "ne", "lt", "le", "gt", "ge", "logical_and",
                      "logical_or", "logical_xor", "bitwise_and", "bitwise_or", "bitwise_xor", "atan2",
                      "copysign", "lshift", "rshift", "hypot", "nextafter")},
    "where": 3,
}
COMPARISONS = {"eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_xor", "logical_not",
               "isnan", "isinf", "isfinite", "signbit"}
REDUCTIONS = ("sum", "prod", "max", "min", "argmax", "argmin", "any", "all")

Like = TensorBox | int | float | bool


# ------------------------------------------------------------------------------------------------ pointwise
def const(value, dtype: torch.dtype, size: Sequence = ()) -> TensorBox:
    if isinstance(value, sympy.Basic) and not value.is_Number:   # a symbolic size (a mean's count): a run-time value
        e = Expr("index", (value,), torch.int64)
        e = e if dtype == torch.int64 else Expr("cast", (e,), dtype)
        return TensorBox(size, dtype, lambda idx: e)
    if dtype == torch.bool:
        value = bool(value)
    elif not dtype.is_floating_point:
        value = int(value)
    else:
        value = float(value)
    e = Expr("const", (value,), dtype)
    return TensorBox(size, dtype, lambda idx: e)


def size_value(n) -> Expr:
    """A size as an int64 value in a kernel: a constant, or the index value of a symbolic size."""
    return Expr("const", (int(n),), torch.int64) if symbols.is_static(n) else Expr("index", (n,), torch.int64)


def iota(size: Sequence, dim: int, dtype: torch.dtype = torch.int64, start=0, step=1) -> TensorBox:
    """Tensor whose value at `index` is start + step * index[dim]."""
    return TensorBox(size, dtype, lambda idx: Expr("index", (start + step * idx[dim],), dtype))


def to_box(x: Like, dtype: torch.dtype) -> TensorBox:
    return x if isinstance(x, TensorBox) else const(x, dtype)


def broadcast_shapes(*sizes) -> tuple:
    n = max((len(s) for s in sizes), default=0)
    out = []
    for d in range(n):
        dims = [s[len(s) - n + d] for s in sizes if len(s) - n + d >= 0]
        big = [x for x in dims if x != 1]
        out.append(big[0] if big else sympy.Integer(1))
    return tuple(out)


# In a channels-last CPU graph (channels the innermost loop of every 4-D kernel), a per-channel value computed
# on the fly (not stored) and read broadcast over the pixels, BROADCAST_STORE_FACTOR or more times its own
# elements, at a cost of BROADCAST_STORE_COST compute nodes or more (ir.compute_cost: one exp or division), is
# stored first: it varies along the innermost loop, so the compiler cannot hoist it, and its reader would
# recompute it at every pixel (a squeeze-excite gate's sigmoid, a folded batch norm's shift
# `beta - mean * gamma / sqrt(var + eps)`), where one small buffer computes it once per value. (Elsewhere a
# value broadcast along the inner dims, a layer norm's 1 / std per row, is hoisted out of the inner loop.)
BROADCAST_STORE_FACTOR = 8
BROADCAST_STORE_COST = 2


def _stored_if_costly(x: TensorBox, size: tuple) -> TensorBox:
    g = ir.GRAPH
    if not config.STORE_BROADCASTS or g is None or getattr(g, "target", None) != "cpu" \
            or not getattr(g, "channels_last", False) or x.strided is not None or x.ndim != 4 or len(size) != 4 \
            or not all(symbols.is_static(n) for n in (*x.size, *size)) or x.size[1] != size[1] or size[1] == 1:
        return x
    if ir.prod(size) < BROADCAST_STORE_FACTOR * ir.prod(x.size) or x.cost() < BROADCAST_STORE_COST:
        return x
    return g.realize(x)


def _broadcast_loader(x: TensorBox, size: tuple):
    if x.size == size:
        return x.loader
    x = _stored_if_costly(x, size)
    k = len(size) - x.ndim
    keep = [x.size[d] != 1 or size[d + k] == 1 for d in range(x.ndim)]
    return lambda idx: x.loader([idx[d + k] if keep[d] else sympy.Integer(0) for d in range(x.ndim)])


def cast(x: Like, dtype: torch.dtype) -> TensorBox:
    if not isinstance(x, TensorBox):
        return const(x, dtype)
    if x.dtype == dtype:
        return x
    return TensorBox(x.size, dtype, lambda idx: _cast_expr(x.loader(idx), dtype), origin=x.origin)


def _cast_expr(e: Expr, dtype: torch.dtype) -> Expr:
    if e.dtype == dtype:
        return e
    if e.op == "const":
        return const(e.args[0], dtype).loader(())
    return Expr("cast", (e,), dtype)


def pointwise(op: str, *xs: Like, dtype: torch.dtype | None = None) -> TensorBox:
    """op applied elementwise with broadcasting. Operands are cast to `dtype` (default: the first tensor's)."""
    assert POINTWISE[op] == len(xs), op
    boxes = [x for x in xs if isinstance(x, TensorBox)]
    dtype = dtype or boxes[0].dtype
    xs = [cast(to_box(x, dtype), dtype) for x in xs]
    size = broadcast_shapes(*[x.size for x in xs])
    loaders = [_broadcast_loader(x, size) for x in xs]
    out_dtype = torch.bool if op in COMPARISONS else dtype
    return TensorBox(size, out_dtype, lambda idx: Expr(op, tuple(ld(idx) for ld in loaders), out_dtype))


def where(cond: Like, a: Like, b: Like, dtype: torch.dtype | None = None) -> TensorBox:
    dtype = dtype or next(x.dtype for x in (a, b) if isinstance(x, TensorBox))
    c = cast(to_box(cond, torch.bool), torch.bool)
    a, b = cast(to_box(a, dtype), dtype), cast(to_box(b, dtype), dtype)
    size = broadcast_shapes(c.size, a.size, b.size)
    lc, la, lb = (_broadcast_loader(x, size) for x in (c, a, b))
    return TensorBox(size, dtype, lambda idx: Expr("where", (lc(idx), la(idx), lb(idx)), dtype))


def add(a, b, dtype=None): return pointwise("add", a, b, dtype=dtype)
def sub(a, b, dtype=None): return pointwise("sub", a, b, dtype=dtype)
def mul(a, b, dtype=None): return pointwise("mul", a, b, dtype=dtype)
def div(a, b, dtype=None): return pointwise("truediv", a, b, dtype=dtype)
def unary(op, a, dtype=None): return pointwise(op, a, dtype=dtype)


# ------------------------------------------------------------------------------------------------ realize
def realize(x: TensorBox, origin: str = "") -> TensorBox:
    """Materialize x into a buffer of the current graph (ember.codegen.lower) unless it already is one."""
    return ir.GRAPH.realize(x, origin)


def reuse(x: TensorBox, times: int) -> TensorBox:
    """x is about to be read `times` times: materialize it when recomputing it that often costs more."""
    if x.strided is not None or times <= 1:
        return x
    return realize(x) if x.cost() * (times - 1) > 4 else x


# ------------------------------------------------------------------------------------------------ reductions
def reduce(kind: str, x: TensorBox, dims: Sequence[int], keepdim: bool = False,
           dtype: torch.dtype | None = None, partial_dtype: torch.dtype | None = None) -> TensorBox:
    """A Reduction buffer over `dims` of x (computed in `dtype`; argmax/argmin give int64; a sum in a `dtype`
    wider than x's may add x's values in `partial_dtype` a short run at a time, ir.Reduction)."""
    assert kind in REDUCTIONS, kind
    dims = sorted({d % x.ndim for d in dims}) if x.ndim else []
    dtype = dtype or x.dtype
    if kind in ("argmax", "argmin"):
        out_dtype = torch.int64
    elif kind in ("any", "all"):
        out_dtype, dtype = torch.bool, torch.bool
    else:
        out_dtype = dtype
    xc = cast(x, dtype)
    rsize = tuple(x.size[d] for d in dims)
    kept = [d for d in range(x.ndim) if d not in dims]
    out_size = tuple(sympy.Integer(1) if d in dims else x.size[d] for d in range(x.ndim)) if keepdim else \
        tuple(x.size[d] for d in kept)

    def fn(idx, ridx):
        full = [None] * x.ndim
        for d, r in zip(dims, ridx):
            full[d] = r
        src = [idx[d] for d in range(x.ndim)] if keepdim else list(idx)
        for j, d in enumerate(kept):
            full[d] = src[d] if keepdim else src[j]
        return xc.loader(full)

    return ir.GRAPH.reduction(out_size, out_dtype, fn, rsize, kind, x.origin, partial_dtype=partial_dtype)


# ------------------------------------------------------------------------------------------------ views
def _view(x: TensorBox, size, index_map, strided=None) -> TensorBox:
    return TensorBox(size, x.dtype, lambda idx: x.loader(index_map(idx)), strided, x.origin)


def _restride(x: TensorBox, fn):
    """Apply fn(stride, offset) -> (stride, offset) to the strided description, when there is one."""
    if x.strided is None:
        return None
    buf, stride, offset = x.strided
    s, o = fn(list(stride), offset)
    return buf, tuple(s), o


def permute(x: TensorBox, perm: Sequence[int]) -> TensorBox:
    perm = [p % x.ndim for p in perm]
    inv = [perm.index(d) for d in range(x.ndim)]
    return _view(x, [x.size[p] for p in perm], lambda idx: [idx[inv[d]] for d in range(x.ndim)],
                 _restride(x, lambda s, o: ([s[p] for p in perm], o)))


def expand(x: TensorBox, size: Sequence) -> TensorBox:
    size = tuple(sympy.Integer(s) if isinstance(s, int) else s for s in size)
    k = len(size) - x.ndim
    size = tuple(x.size[d - k] if (s == -1 and d >= k) else s for d, s in enumerate(size))
    if size == x.size:
        return x
    loader = _broadcast_loader(x, size)
    st = _restride(x, lambda s, o: ([0] * k + [0 if (x.size[d] == 1 and size[d + k] != 1) else s[d]
                                                for d in range(x.ndim)], o))
    return TensorBox(size, x.dtype, loader, st, x.origin)


def unsqueeze(x: TensorBox, dim: int) -> TensorBox:
    dim = dim % (x.ndim + 1)
    return _view(x, x.size[:dim] + (sympy.Integer(1),) + x.size[dim:], lambda idx: list(idx[:dim]) + list(idx[dim + 1:]),
                 _restride(x, lambda s, o: (s[:dim] + [1] + s[dim:], o)))


def squeeze(x: TensorBox, dims: Sequence[int] | None = None) -> TensorBox:
    dims = range(x.ndim) if dims is None else [d % x.ndim for d in dims] if x.ndim else []
    drop = [d for d in dims if x.size[d] == 1]
    keep = [d for d in range(x.ndim) if d not in drop]

    def imap(idx):
        full = [sympy.Integer(0)] * x.ndim
        for j, d in enumerate(keep):
            full[d] = idx[j]
        return full
    return _view(x, [x.size[d] for d in keep], imap, _restride(x, lambda s, o: ([s[d] for d in keep], o)))


def slice_(x: TensorBox, dim: int, start: int, end: int, step: int = 1) -> TensorBox:
    dim = dim % x.ndim
    if all(v is None or symbols.is_static(v) for v in (x.size[dim], start, end, step)):
        n = int(x.size[dim])
        start, end, _ = slice(start, end, step).indices(n) if step > 0 else (start, end, step)
        length = sympy.Integer(max(0, (end - start + step - 1) // step))
    else:
        start, end, length = _symbolic_slice(x.size[dim], start, end, step)
    size = x.size[:dim] + (length,) + x.size[dim + 1:]
    return _view(x, size, lambda idx: [start + step * i if d == dim else i for d, i in enumerate(idx)],
                 _restride(x, lambda s, o: ([v * step if d == dim else v for d, v in enumerate(s)], o + start * s[dim])))


def _symbolic_slice(n, start, end, step):
    """(start, end, length) of x[start:end:step] along a dim of symbolic size n, Python's clamping decided at
    every size; NotImplementedError where it depends on the size (the op then stays an ATen call)."""
    if not symbols.is_static(step) or int(step) < 1:
        raise NotImplementedError("a slice of symbolic size with a symbolic or negative step")
    step = int(step)
    start = sympy.sympify(start)
    end = n if end is None or (symbols.is_static(end) and int(end) >= 2 ** 62) else sympy.sympify(end)
    start = start + n if start.is_Integer and start < 0 else start
    end = end + n if end.is_Integer and end < 0 else end
    if symbols.is_nonnegative(end - n):
        end = n
    if not (symbols.is_nonnegative(start) and symbols.is_nonnegative(n - end) and symbols.is_nonnegative(end - start)):
        raise NotImplementedError(f"slice [{start}:{end}] of a dim of size {n}: clamping depends on the size")
    return start, end, FloorDiv(end - start + step - 1, step)


def select(x: TensorBox, dim: int, index: int) -> TensorBox:
    dim = dim % x.ndim
    if symbols.is_static(x.size[dim]) and symbols.is_static(index):
        index = int(index) % int(x.size[dim])
    else:
        index = sympy.sympify(index)
        index = index + x.size[dim] if index.is_Integer and index < 0 else index
        if not symbols.is_nonnegative(index):
            raise NotImplementedError(f"select of index {index} on a dim of symbolic size")
    return squeeze(slice_(x, dim, index, index + 1), [dim])


def flip(x: TensorBox, dims: Sequence[int]) -> TensorBox:
    dims = {d % x.ndim for d in dims}
    return _view(x, x.size, lambda idx: [x.size[d] - 1 - i if d in dims else i for d, i in enumerate(idx)])


def reshape(x: TensorBox, size: Sequence) -> TensorBox:
    """Row-major reshape as index arithmetic: flatten the new index, unflatten it in the old shape."""
    size = list(size)
    if -1 in size:
        known = ir.prod([s for s in size if s != -1])
        size[size.index(-1)] = ir.prod(x.size) // known if known else 0
    size = tuple(sympy.Integer(s) if isinstance(s, int) else s for s in size)
    if size == x.size:
        return x
    old = x.size
    st = None
    if x.strided is not None:  # a reshape of a window stays a window where torch's view would (GPT-2's heads)
        buf, stride, offset = x.strided
        if tuple(stride) == ir.contiguous_strides(old):
            st = (buf, ir.contiguous_strides(size), offset)
        else:
            new_stride = view_strides(old, stride, size)
            st = (buf, new_stride, offset) if new_stride is not None else None

    def imap(idx):
        flat = sum((i * s for i, s in zip(idx, ir.contiguous_strides(size))), sympy.Integer(0))
        out = []
        for s, st_ in zip(old, ir.contiguous_strides(old)):
            out.append(ModIndex(FloorDiv(flat, st_), s) if s != 1 else sympy.Integer(0))
        return [ir.simplify_index(i) for i in out]
    return _view(x, size, imap, st)


def view_strides(old_size, old_stride, new_size):
    """The strides torch's view gives a tensor of old_size/old_stride reshaped to new_size, or None where view
    would have to copy: each run of old dims that are contiguous with one another (a chunk) must be split or
    merged into new dims exactly."""
    if not all(isinstance(v, (int, sympy.Integer)) for v in (*old_size, *old_stride, *new_size)):
        return None
    old_size, old_stride, new_size = ([int(v) for v in vs] for vs in (old_size, old_stride, new_size))
    if not old_size or 0 in old_size:
        return None
    new_stride = [0] * len(new_size)
    d = len(new_size) - 1
    base, chunk, got = old_stride[-1], 1, 1
    for i in range(len(old_size) - 1, -1, -1):
        chunk *= old_size[i]
        if i == 0 or (old_size[i - 1] != 1 and old_stride[i - 1] != chunk * base):
            while d >= 0 and (got < chunk or new_size[d] == 1):
                new_stride[d] = got * base
                got *= new_size[d]
                d -= 1
            if got != chunk:
                return None
            if i > 0:
                base, chunk, got = old_stride[i - 1], 1, 1
    return tuple(sympy.Integer(v) for v in new_stride) if d == -1 else None


def as_strided(x: TensorBox, size, stride, offset: int = 0) -> TensorBox:
    """A strided window onto x's storage: x must be materialized (realize first)."""
    x = realize(x) if x.strided is None else x
    buf, _, base = x.strided
    size = tuple(sympy.sympify(s) for s in size)   # (ints, or expressions of size symbols)
    stride = tuple(sympy.sympify(s) for s in stride)
    off = base + offset
    return TensorBox(size, x.dtype, lambda idx: Expr("load", (buf.name, sympy.sympify(off) + sum(
        (i * s for i, s in zip(idx, stride)), sympy.Integer(0))), x.dtype), (buf, stride, off), x.origin)


def clamp(i: sympy.Expr, hi: int) -> sympy.Expr:
    """min(max(i, 0), hi) for an index, built unevaluated: sympy's Min/Max compare their arguments under
    assumptions when made, which is slow where indices are clamped often (cats and pooling taps)."""
    return sympy.Min(sympy.Max(i, 0, evaluate=False), hi, evaluate=False)


def cat(xs: Sequence[TensorBox], dim: int, dtype: torch.dtype) -> TensorBox:
    """Concatenation as a piecewise loader: where(index < end_0, x_0, where(index < end_1, x_1, ...))."""
    xs = [x for x in xs if not (x.ndim == 1 and x.size[0] == 0)]
    dim = dim % xs[0].ndim
    starts, total = [], 0
    for x in xs:
        starts.append(total)
        total += int(x.size[dim]) if symbols.is_static(x.size[dim]) else x.size[dim]
    size = xs[0].size[:dim] + (sympy.sympify(total),) + xs[0].size[dim + 1:]
    static = all(isinstance(s, int) for s in starts)
    xs = [cast(x, dtype) for x in xs]

    def loader(idx):
        if isinstance(idx[dim], sympy.Integer) and static:  # a known position (a select of one element): that piece only
            k = max(j for j, s in enumerate(starts) if s <= int(idx[dim]))
            return xs[k].loader([i - starts[k] if d == dim else i for d, i in enumerate(idx)])
        e = None
        for x, s in reversed(list(zip(xs, starts))):
            # every piece is loaded at every position (the where picks afterwards): its index is clamped into its
            # own range, the last piece's too, so an untaken branch never reads out of bounds (a negative index
            # into the last piece is an illegal address on the GPU)
            inside = [clamp(i - s, symbols.ints((x.size[dim] - 1,))[0]) if d == dim and len(xs) > 1 else
                      (i - s if d == dim else i) for d, i in enumerate(idx)]
            if e is None:
                e = x.loader(inside)
            else:
                end = s + symbols.ints((x.size[dim],))[0]
                e = Expr("where", (Expr("lt", (Expr("index", (idx[dim],), torch.int64),
                                               size_value(end)), torch.bool),
                                   x.loader(inside), e), dtype)
        return e
    return TensorBox(size, dtype, loader)


def pad(x: TensorBox, pads: Sequence[int], value) -> TensorBox:
    """constant_pad_nd: pads = (last_lo, last_hi, second_last_lo, ...); negative pads crop."""
    size = list(x.size)
    lo = [0] * x.ndim
    for k in range(len(pads) // 2):
        d = x.ndim - 1 - k
        lo[d] = pads[2 * k]
        size[d] = size[d] + pads[2 * k] + pads[2 * k + 1]
    fill = Expr("const", (const(value, x.dtype).loader(()).args[0],), x.dtype)

    def loader(idx):
        conds, src = [], []
        for d, i in enumerate(idx):
            j = i - lo[d]
            if lo[d] != 0 or size[d] != x.size[d]:
                ij = Expr("index", (j,), torch.int64)
                conds.append(Expr("logical_and", (Expr("ge", (ij, Expr("const", (0,), torch.int64)), torch.bool),
                                                  Expr("lt", (ij, size_value(x.size[d])),
                                                       torch.bool)), torch.bool))
                j = clamp(j, symbols.ints((x.size[d] - 1,))[0])
            src.append(j)
        e = x.loader(src)
        for c in conds:
            e = Expr("where", (c, e, fill), x.dtype)
        return e
    return TensorBox(size, x.dtype, loader)


# ------------------------------------------------------------------------------------------------ gather
def indirect(value: Expr, size) -> sympy.Symbol:
    """An index read from data; negative values wrap like Python's (x[-1]); the kernel checks bounds."""
    v = Expr("cast", (value,), torch.int64) if value.dtype != torch.int64 else value
    return IndirectSymbol(Expr("checked_index", (v, size_value(size)), torch.int64))


def index(x: TensorBox, indices: Sequence[TensorBox | None]) -> TensorBox:
    """aten.index.Tensor: advanced indexing; indexed dims adjacent -> result dims in place, else in front."""
    pos = [d for d, t in enumerate(indices) if t is not None]
    idx_size = broadcast_shapes(*[indices[d].size for d in pos])
    adjacent = pos == list(range(pos[0], pos[-1] + 1))
    rest_before = list(range(pos[0])) if adjacent else []
    rest_after = [d for d in range(x.ndim) if d not in pos and d not in rest_before]
    size = tuple([x.size[d] for d in rest_before]) + idx_size + tuple(x.size[d] for d in rest_after)
    loaders = {d: _broadcast_loader(indices[d], idx_size) for d in pos}
    nb, ni = len(rest_before), len(idx_size)

    def loader(idx):
        iidx = list(idx[nb:nb + ni])
        full = [None] * x.ndim
        for j, d in enumerate(rest_before):
            full[d] = idx[j]
        for j, d in enumerate(rest_after):
            full[d] = idx[nb + ni + j]
        for d in pos:
            full[d] = indirect(loaders[d](iidx), x.size[d])
        return x.loader(full)
    return TensorBox(size, x.dtype, loader)


def gather(x: TensorBox, dim: int, idx_t: TensorBox) -> TensorBox:
    dim = dim % max(x.ndim, 1)

    def loader(idx):
        full = list(idx)
        if x.ndim:
            full[dim] = indirect(idx_t.loader(idx), x.size[dim])
        return x.loader(full)
    return TensorBox(idx_t.size, x.dtype, loader)


# ------------------------------------------------------------------------------------------------ rng
def rand(size: Sequence, dtype: torch.dtype, seed: TensorBox, offset: int = 0) -> TensorBox:
    """Uniform [0, 1) from a counter-based hash of (seed, flat index): same value for the same element in
    every kernel that recomputes it, so fusion cannot change results. Not eager's random stream."""
    strides = ir.contiguous_strides(size)
    return TensorBox(size, dtype, lambda idx: Expr("rand", (
        seed.loader(()), Expr("index", (offset + sum((i * s for i, s in zip(idx, strides)), sympy.Integer(0)),),
                              torch.int64)), dtype))
