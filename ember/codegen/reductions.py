"""Reductions lowered as more than one Reduction buffer's loop: split into partial reductions where too few
results would keep the machine busy (split_reduction), or a one-hot sum read as the element it picks
(one_hot_sum)."""
from __future__ import annotations

import functools
import math
import os
from typing import TYPE_CHECKING

import sympy
import torch

from ember import config
from ember import ir
from ember.errors import CannotLower
from ember.ir import Reduction, TensorBox, symbols

if TYPE_CHECKING:
    from ember.codegen.lower import Graph

# --------------------------------------------------------------------------------------- split reductions
SPLIT_KINDS = ("sum", "prod", "max", "min", "any", "all")   # argmax/argmin: the first index would need both
GPU_SMS = 132             # SMs assumed where no GPU is visible; torch.cuda's own count otherwise (gpu_sm_count)


@functools.lru_cache(maxsize=None)
def gpu_sm_count() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else GPU_SMS


def cpu_threads() -> int:
    return os.cpu_count() or 1   # what cpp.py's OpenMP loops share their work among


GPU_COLUMN_STRIP = 8   # columns a Triton program takes at least in a column reduction (triton.column_config)


# GPU row reductions of >= 16384 elements are split while fewer than this many SMs' worth of rows: one program a row
# over a few hundred long rows leaves much of the memory bandwidth unused
LONG_ROWS_SPLIT_BELOW = 2


def reduction_parts(out: int, rnumel: int, column: bool, target: str, divides: int | None = None) -> int:
    """Into how many parts to split a reduction of `rnumel` elements for each of `out` results (1: none), so the
    partial reductions fill the machine the printer's loops leave idle. column: the reduction runs down columns
    (adjacent results adjacent in memory, the reduced index strides over rows).
    - gpu (Triton): a row reduction is one program per result, a column one a strip of >= 8 columns per program
      (triton.column_config); fewer than the SMs (rows; 2x that for rows of >= 16384 elements,
      LONG_ROWS_SPLIT_BELOW) / 2x that (strips) leave SMs idle (GPT-2's layer-norm backward column sums over
      2048 x 768: 96 programs). Parts are chosen for ~4 programs per SM, each part at least 32 rows (columns)
      or 1024 elements (rows).
    - cpu (C++): rows are shared among OpenMP threads (one row: its loop is), column groups in blocks of >= 16
      results (cpp._column_group); split when fewer rows / blocks than threads and the work is worth it.
    The count is a divisor of rnumel (no ragged last part), the smallest >= the wanted one; of `divides` where
    given (a symbolic rnumel's integer coefficient: a divisor of it divides rnumel at every size)."""
    if out < 1 or rnumel < 2:
        return 1
    if target == "gpu":
        sms = gpu_sm_count()
        if column:
            strip = GPU_COLUMN_STRIP
            busy, want, min_chunk = math.ceil(out / strip), math.ceil(4 * sms * strip / out), 32
            if busy >= 2 * sms or rnumel < 256:
                return 1
        else:
            busy, want, min_chunk = out, math.ceil(4 * sms / out), 1024
            if rnumel < 8192 or busy >= sms * (LONG_ROWS_SPLIT_BELOW if rnumel >= 16384 else 1):
                return 1
    else:
        threads = cpu_threads()
        if out * rnumel < 4 * 32768:
            return 1
        if column:
            busy, want, min_chunk = math.ceil(out / 16), math.ceil(2 * 16 * threads / out), 64
        else:
            busy, want, min_chunk = (out if out > 1 else threads), math.ceil(2 * threads / out), 4096
        if busy >= threads:
            return 1
    fits = [d for d in sympy.divisors(divides or rnumel) if d > 1 and rnumel // d >= min_chunk]
    if not fits:
        return 1
    return next((d for d in fits if d >= want), fits[-1])


def _reduces_columns(size, fn, rsize, symbolic: bool = False) -> bool:
    """Whether a reduction's loads run down columns: the innermost kept index steps by one element and the
    innermost reduced one by more (x.sum(0) of a row-major matrix); no load of the results' elements is contiguous
    along the reduction (triton.is_columnwise's rule)."""
    idx = [sympy.Symbol(f"sx{i}", integer=True, nonnegative=True) for i in range(len(size))]
    ridx = [sympy.Symbol(f"sr{i}", integer=True, nonnegative=True) for i in range(len(rsize))]
    kept = [i for i, n in zip(idx, size) if n != 1]
    if not kept:
        return False
    x, r = kept[-1], ridx[-1]
    column = False
    # (symbolic sizes: a view's div/mod of a merged index is undone first, as the scheduler does; a static view
    # merges its dims when it is lowered)
    ranges = {**dict(zip(idx, size)), **dict(zip(ridx, rsize))} if symbolic else None
    for e in fn(idx, ridx).walk():
        if e.op != "load":
            continue
        off = ir.expand_index(ir.simplify_index(e.args[1], ranges) if symbolic else e.args[1])
        along_r = sympy.expand(off.subs(r, r + 1) - off)
        along_x = sympy.expand(off.subs(x, x + 1) - off)
        if along_r == 1 and along_x != 0:   # (a per-row statistic, mean[r], is read along r by every column)
            return False
        column |= along_x == 1 and along_r.is_Integer and abs(int(along_r)) >= 2
    return column


def split_reduction(g: "Graph", size: tuple, dtype: torch.dtype, fn, rsize: tuple, kind: str):
    """A reduction with too few results to keep the machine busy as a reduction of partial results: a Reduction
    buffer of S partial results per result, each over a part of the range, added to the graph, and returned as
    (fn, rsize) of the reduction over those S (None: no split). Column reductions keep the partials as
    [S, *size] (the partial reduction runs down columns too: a strip of columns per program), others as
    [*size, S] (each part a contiguous piece of a row). float16/bfloat16 partial sums and products are stored in
    float32 (the printers accumulate in float32; eager rounds once, at the end); max/min/any/all are exact in any
    order and keep NaN (a part's NaN is its max); integer sums wrap as the unsplit sum would."""
    if not config.SPLIT_REDUCTIONS or kind not in SPLIT_KINDS or not rsize:
        return None
    rnumel, out = ir.prod(rsize), ir.prod(size)
    divides = None
    if not all(symbols.is_static(n) for n in (*size, *rsize)):
        # symbolic sizes (GPU): split in a number of parts that divides the reduced count at every size, a divisor
        # of its integer coefficient (BN's N*H*W = 1024*s0), chosen at the example's sizes
        coefficient, _ = sympy.expand(rnumel).as_coeff_Mul()
        if g.target != "gpu" or not coefficient.is_Integer or int(coefficient) < 2:
            return None
        divides = int(coefficient)
    rn, n_out = symbols.hint(rnumel), symbols.hint(out)
    if reduction_parts(n_out, rn, True, g.target, divides) == reduction_parts(n_out, rn, False, g.target, divides) == 1:
        return None   # (most reductions: no need to look at the loads)
    column = _reduces_columns(size, fn, rsize, divides is not None)
    parts = reduction_parts(n_out, rn, column, g.target, divides)
    if parts <= 1:
        return None
    chunk = _quotient(rnumel, parts)
    if _divisible(rsize[0], parts):   # the outermost reduced dim splits: part s is rows [s*c0, (s+1)*c0)
        c0 = _quotient(rsize[0], parts)
        prsize = ((c0,) if not symbols.same(c0, 1) else ()) + tuple(rsize[1:])

        def reduced(s, pr):
            return [s * c0 + pr[0], *pr[1:]] if not symbols.same(c0, 1) else [s, *pr]
    else:   # a flat range of the reduced dims: their indices as div/mod of it (simplified by the scheduler)
        prsize, strides = (chunk,), ir.contiguous_strides(rsize)

        def reduced(s, pr):
            flat = s * chunk + pr[0]
            return [ir.FloorDiv(flat, st) if k == 0 else ir.ModIndex(ir.FloorDiv(flat, st), n)
                    for k, (n, st) in enumerate(zip(rsize, strides))]
    if column:
        psize = (sympy.Integer(parts),) + size
        pfn = lambda idx, pr: fn(list(idx[1:]), reduced(idx[0], pr))  # noqa: E731
        read = lambda idx, r: [r[0], *idx]  # noqa: E731
    else:
        psize = size + (sympy.Integer(parts),)
        pfn = lambda idx, pr: fn(list(idx[:-1]), reduced(idx[-1], pr))  # noqa: E731
        read = lambda idx, r: [*idx, r[0]]  # noqa: E731
    pdtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) and kind in ("sum", "prod") else dtype
    partial = g.add(Reduction(g.new_name(), psize, ir.contiguous_strides(psize), pdtype, fn=pfn, rsize=prsize,
                              kind=kind, origins=g.origins))
    return (lambda idx, r: partial.load(read(list(idx), r))), (sympy.Integer(parts),)


def _divisible(n, k: int) -> bool:
    """Whether k divides size n at every size (a symbolic n: its integer coefficient)."""
    if symbols.is_static(n):
        return int(n) % k == 0
    c, _ = sympy.expand(n).as_coeff_Mul()
    return c.is_Integer and int(c) % k == 0


def _quotient(n, k: int):
    """n / k for a k that divides n at every size (_divisible): a sympy Integer or expression."""
    return sympy.Integer(int(n) // k) if symbols.is_static(n) else sympy.expand(n / k)


def one_hot_sum(size: tuple, dtype: torch.dtype, fn, rsize: tuple, kind: str) -> TensorBox | None:
    """A sum over r of where(r == k, v, 0) with k and v not depending on r (a row that is one-hot: the gradient
    nll_loss_backward makes, summed again by log_softmax's backward) as the value it adds up to,
    where(0 <= k < R, v, 0) + 0.0, with no loop over the row (GPT-2's loss backward looped over 50,257 columns
    of each row to find the one at the label). k outside [0, R) (ignore_index -100) hits no column: 0. The + 0.0
    is eager's sum adding v to zeros (-0.0 comes out 0.0). float32/float64 sums over one reduced dim of >= 2;
    None for anything else."""
    if kind != "sum" or dtype not in (torch.float32, torch.float64) or len(rsize) != 1 or \
            not getattr(rsize[0], "is_Integer", False) or int(rsize[0]) < 2:
        return None
    r = sympy.Symbol("onehot_r", integer=True, nonnegative=True)
    idx = [sympy.Symbol(f"onehot_x{i}", integer=True, nonnegative=True) for i in range(len(size))]
    if _one_hot_parts(fn(idx, [r]), r) is None:
        return None
    zero = ir.Expr("const", (0.0,), dtype)

    def loader(index):
        parts = _one_hot_parts(fn(list(index), [r]), r)
        if parts is None:   # (the same loaders at other indices: the same Expr structure)
            raise CannotLower("a one-hot sum whose body changed form at another index")
        k, v = parts
        inside = ir.Expr("logical_and", (ir.Expr("ge", (k, ir.Expr("const", (0,), k.dtype)), torch.bool),
                                         ir.Expr("lt", (k, ir.Expr("const", (int(rsize[0]),), k.dtype)), torch.bool)),
                         torch.bool)
        return ir.Expr("add", (ir.Expr("where", (inside, v, zero), dtype), zero), dtype)
    return TensorBox(size, dtype, loader)


def _one_hot_parts(body: ir.Expr, r) -> tuple | None:
    """(k, v) of a body where(index(r) == k, v, 0) (or k == index(r)), k an integer and v a value of the body's
    dtype, neither depending on r; else None."""
    if body.op != "where":
        return None
    cond, v, other = body.args
    if other.op != "const" or other.args[0] != 0 or math.copysign(1.0, other.args[0]) < 0 or v.dtype != body.dtype \
            or cond.op != "eq":
        return None
    a, b = cond.args
    if not (a.op == "index" and a.args[0] == r):
        a, b = b, a
    if not (a.op == "index" and a.args[0] == r) or a.dtype.is_floating_point or a.dtype == torch.bool or \
            b.dtype != a.dtype or _depends_on(b, r) or _depends_on(v, r):
        return None
    return b, v


def _depends_on(e: ir.Expr, r) -> bool:
    """Whether the value e changes with the index symbol r (a load's offset or an index value holds it)."""
    return any((x.op == "load" and r in x.args[1].free_symbols) or (x.op == "index" and r in x.args[0].free_symbols)
               for x in e.walk())
