"""ember's loop IR: each tensor is a function from an index to a value over primitives (define-by-run).

Three layers, data structures first:
  Expr       a value: a hash-consed DAG node `op(args) : dtype` over loads, constants, index values and the
             pointwise primitives of ember.decomp.prims. Backends (C++, Triton) only walk Exprs.
  Buffer     a materialized tensor with a layout (size, stride): an input, a computed loop nest
             (Pointwise or Reduction, their bodies are Exprs at symbolic loop indices) or an extern call.
  TensorBox  a lazy tensor during lowering: size, dtype and `loader(index) -> Expr`. Pointwise primitives
             compose loaders (so chains fuse for free); views rewrite the index (sympy arithmetic, no copy);
             `realize()` turns a box into a Buffer when a value must exist in memory.

Indices are sympy expressions over loop variables; sizes are sympy integers (symbolic sizes are carried
through the IR; the C++ backend specializes them to the example's values).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Callable, Sequence

import sympy
import torch

from ember.ir import symbols


# ----------------------------------------------------------------------------------------------- index math
class FloorDiv(sympy.Function):
    """Integer floor division of a non-negative index by a positive integer (C: a / b)."""
    is_integer = True

    @classmethod
    def eval(cls, a, b):
        if b == 1:
            return a
        if a == 0 or b == 0:   # (b 0: a size-0 dim's index, of a tensor no element of which is ever read)
            return sympy.Integer(0)
        if a.is_Integer and b.is_Integer:
            return sympy.Integer(int(a) // int(b))
        if a == -1 and b.is_positive:   # (a bound's x*b - 1, split below: -1 // b for a size b >= 1)
            return sympy.Integer(-1)
        if isinstance(a, sympy.Add):  # split off terms that are multiples of b
            mult = [t for t in a.args if _divisible(t, b)]
            if mult:
                rest = sympy.Add(*[t for t in a.args if not _divisible(t, b)])
                return sympy.Add(*[_exact_div(t, b) for t in mult]) + FloorDiv(rest, b)
        if _divisible(a, b):
            return _exact_div(a, b)
        if isinstance(a, FloorDiv):  # (x // c) // b == x // (c*b)
            return FloorDiv(a.args[0], a.args[1] * b)
        if isinstance(a, ModIndex) and _at_most(a.args[1], b):  # x % m < m <= b
            return sympy.Integer(0)


class ModIndex(sympy.Function):
    """a % b for a non-negative index a and positive integer b."""
    is_integer = True

    @classmethod
    def eval(cls, a, b):
        if b == 1 or a == 0 or b == 0:   # (b 0: as FloorDiv's)
            return sympy.Integer(0)
        if a.is_Integer and b.is_Integer:
            return sympy.Integer(int(a) % int(b))
        if isinstance(a, sympy.Add):
            keep = [t for t in a.args if not _divisible(t, b)]
            if len(keep) < len(a.args):
                return ModIndex(sympy.Add(*keep), b)
        if _divisible(a, b):
            return sympy.Integer(0)
        if isinstance(a, ModIndex):
            # (x % m) % b: x % b when b divides m; x % m when m <= b. Without these, index expressions of
            # repeated reshape-transpose-reshape chains (channel shuffles) nest a level per chain and grow
            # exponentially through the simplifier.
            x, m = a.args
            if _divisible(m, b):
                return ModIndex(x, b)
            if _at_most(m, b):
                return a


def _at_most(m, b) -> bool:
    return bool(m.is_Integer and b.is_Integer and int(m) <= int(b))


def _exact_div(t, b):
    """t / b for a t that b divides (_divisible): term by term, where sympy's own product cancels b's factors
    (sympy.cancel rewrites every argument through the polys module: slow on the indices of reshapes)."""
    return sympy.Add(*[term / b for term in sympy.Add.make_args(t)])


def _divisible(t, b) -> bool:
    """Whether b divides t at every value of the symbols (integers), proved term by term: each term's integer
    coefficient is a multiple of b's, and its factors include b's (a symbolic size's powers, or b itself where b
    is a sum). Structural, so a size expression is never handed to sympy.simplify (seconds per query on a
    transformer's symbolic graph); a divisibility it cannot see is answered False, which only leaves an index
    unsimplified."""
    if b.is_Integer:
        c, _ = t.as_coeff_Mul()
        return c.is_Integer and int(c) % int(b) == 0
    if t == 0:
        return True
    bc, bm = b.as_coeff_Mul()
    if not bc.is_Integer or bc == 0:
        return False
    need = bm.as_powers_dict() if not bm.is_Add else {bm: 1}
    for term in sympy.Add.make_args(t):
        c, m = term.as_coeff_Mul()
        if not c.is_Integer or int(c) % int(bc) != 0:
            return False
        have = m.as_powers_dict()
        if not all(sympy.sympify(e).is_Integer and have.get(f, 0) >= e for f, e in need.items()):
            return False
    return True


def bounds(e, ranges: dict) -> tuple | None:
    """Inclusive integer bounds of index `e` given {symbol: size}; None when unknown (indirect indices). With
    symbolic sizes the bounds are sympy expressions over the size symbols (compare with `symbols.is_positive`)."""
    if e.is_Integer:
        return int(e), int(e)
    if e.is_Symbol:
        if e in ranges:
            return 0, _num(ranges[e]) - 1
        # a size symbol is its own bound; others (indirect indices) are unknown
        return (e, e) if e in symbols.HINTS or e.is_positive else None
    if isinstance(e, sympy.Add):
        lo = hi = 0
        for a in e.args:
            b = bounds(a, ranges)
            if b is None:
                return None
            lo, hi = lo + b[0], hi + b[1]
        return lo, hi
    if isinstance(e, sympy.Mul):
        c, rest = e.as_coeff_Mul()
        if c == 1:   # no number in front (a size times an index): bounded where every factor is nonnegative
            bs = [bounds(a, ranges) for a in e.args]
            if any(b is None or not symbols.is_nonnegative(b[0]) for b in bs):
                return None
            return math.prod(b[0] for b in bs), math.prod(b[1] for b in bs)
        b = bounds(rest, ranges)
        if b is None or not c.is_Integer:
            return None
        return (int(c) * b[0], int(c) * b[1]) if c >= 0 else (int(c) * b[1], int(c) * b[0])
    if isinstance(e, FloorDiv):
        b = bounds(e.args[0], ranges)
        if b is None:
            return None
        d = e.args[1]
        if d.is_Integer and _static(b[0]) and _static(b[1]):
            return b[0] // int(d), b[1] // int(d)
        if not symbols.is_nonnegative(b[0]):
            return None
        return 0, FloorDiv(sympy.sympify(b[1]), d)
    if isinstance(e, (sympy.Min, sympy.Max)):
        bs = [bounds(a, ranges) for a in e.args]
        if any(b is None for b in bs) or not all(_static(v) for b in bs for v in b):
            return None
        f = min if isinstance(e, sympy.Min) else max
        return f(b[0] for b in bs), f(b[1] for b in bs)
    if isinstance(e, ModIndex):
        b = bounds(e.args[0], ranges)
        d = e.args[1]
        if b is not None and _below(b, d):
            return b
        return 0, _num(d) - 1
    return None


def _below(b, d) -> bool:
    """0 <= lo and hi < d for bounds b = (lo, hi) (ints compared as ints: the static graphs' hot path)."""
    lo, hi = b
    if isinstance(lo, int) and isinstance(hi, int) and d.is_Integer:
        return lo >= 0 and hi < int(d)
    return symbols.is_nonnegative(lo) and symbols.is_positive(d - hi)


def _static(v) -> bool:
    return isinstance(v, int) or v.is_Integer


def _num(v):
    """An int for a static bound (what the static path always had), else the sympy expression."""
    return int(v) if _static(v) else v


_SIMPLIFIED: dict = {}   # (index, ranges) -> simplified: a pure function, called ~6 times per distinct argument


def simplify_index(e, ranges: dict | None = None):
    """Undo the div/mod that reshapes introduce: k*(a//d) + (k/d)... patterns, and a//d, a%d when a < d."""
    key = (e, frozenset(ranges.items()) if ranges else None)
    got = _SIMPLIFIED.get(key)
    if got is None:
        if len(_SIMPLIFIED) > 200_000:
            _SIMPLIFIED.clear()
        got = _SIMPLIFIED[key] = _simplify_index(e, ranges)
    return got


def expand_index(e):
    """sympy.expand(e) for an index expression; most are already expanded (x0*64 + r0), which a structural test
    tells for a fraction of what expand's five hint passes cost."""
    return e if _expanded(e) else sympy.expand(e)


def _expanded(e) -> bool:
    """Whether sympy.expand(e) is e: sums and products of integers, symbols and FloorDiv/ModIndex/Min/Max of
    such, with no sum inside a product. (expand rebuilds a function only when an argument changes: a clamp's
    Min/Max, built unevaluated, stays as it is; rebuilt, sympy would evaluate it, slowly.)"""
    if e.is_Integer or e.is_Symbol:
        return True
    if e.is_Add or e.is_Mul:
        return all(not a.is_Add and _expanded(a) for a in e.args)
    if isinstance(e, (FloorDiv, ModIndex)):
        return _expanded(e.args[0]) and e.args[1].is_Integer
    if isinstance(e, (sympy.Min, sympy.Max)):
        return all(_expanded(a) for a in e.args)
    return False


def _simplify_index(e, ranges: dict | None = None):
    e = expand_index(e)
    if not e.has(FloorDiv, ModIndex):   # most indices (an optimizer's thousands of flat ones): nothing to undo
        return e
    e = _within_ranges(e, ranges)
    e = _collected(e)
    # (collecting may leave a % d over a < d: a symbolic merged row's (r0 // n) % n * n + r0 % n is r0 % (n * n))
    return _within_ranges(e, ranges) if symbols.HINTS and e.has(FloorDiv, ModIndex) else e


def _within_ranges(e, ranges: dict | None):
    """a // d -> 0 and a % d -> a where 0 <= a < d, and the splits of _split_low, given the index ranges."""
    if ranges:
        def small(x):  # a // d == 0 and a % d == a when 0 <= a < d
            b = bounds(x.args[0], ranges)
            return b is not None and _below(b, x.args[1])
        for _ in range(3):  # a split can leave a div/mod that the first two rules then remove
            before = e
            e = e.replace(lambda x: isinstance(x, FloorDiv) and small(x), lambda x: sympy.Integer(0))
            e = e.replace(lambda x: isinstance(x, ModIndex) and small(x), lambda x: x.args[0])
            e = e.replace(lambda x: isinstance(x, (FloorDiv, ModIndex)) and _split_low(x, ranges) is not None,
                          lambda x: _split_low(x, ranges))
            e = expand_index(e)
            if e == before:
                break
    return e


def _collected(e):
    """k*d*(a//d) + k*(a%d) -> k*a and k*d*((a//d)%c) + k*(a%d) -> k*(a%(d*c)), over terms with equal factors
    besides their coefficients (numbers, and expressions of the size symbols in a symbolic graph)."""
    changed = True
    while changed and isinstance(e, sympy.Add):
        changed = False
        terms = {}
        for t in e.args:
            c, rest = t.as_coeff_Mul() if not symbols.HINTS else _size_coeff(t)
            terms[rest] = terms.get(rest, 0) + c
        for f, kf in terms.items():
            if isinstance(f, FloorDiv):
                a, d = f.args
                m = ModIndex(a, d)
                if m in terms and kf == terms[m] * d:  # k*d*(a//d) + k*(a%d) == k*a
                    e = expand_index(e - kf * f - terms[m] * m + terms[m] * a)
                    changed = True
                    break
            elif isinstance(f, ModIndex) and isinstance(f.args[0], FloorDiv):
                # k*d*((a//d)%c) + k*(a%d) == k*(a%(d*c)): the inner dims of an unmerged contiguous index
                (a, d), c = f.args[0].args, f.args[1]
                m = ModIndex(a, d)
                if m in terms and kf == terms[m] * d:
                    e = expand_index(e - kf * f - terms[m] * m + terms[m] * ModIndex(a, d * c))
                    changed = True
                    break
    return e


def _size_coeff(t):
    """(coefficient, rest) of a term whose coefficient may hold size symbols (s1*((x // s1) % s0) -> s1, ...)."""
    coeff, rest = [], []
    for f in sympy.Mul.make_args(t):
        (coeff if f.is_Number or f.free_symbols <= symbols.HINTS.keys() else rest).append(f)
    return sympy.Mul(*coeff), sympy.Mul(*rest)


def _split_low(x, ranges):
    """(a + k*b) // (k*m) == b // m and (a + k*b) % (k*m) == a + k*(b % m) when 0 <= a < k: the row index of
    a reshape seen through another reshape ((r0 + 3072*x0) // 393216 -> x0 // 128 for r0 < 3072), which
    would otherwise leave a division in a vectorized inner loop. None when no such split exists."""
    a, d = x.args
    if not d.is_Integer or not isinstance(a, sympy.Add):
        return None
    d = int(d)
    terms = [(t, t.as_coeff_Mul()[0]) for t in a.args]
    for k in sorted({math.gcd(int(c), d) for _, c in terms if c.is_Integer}, reverse=True):
        if k <= 1:
            continue
        high = [t for t, c in terms if c.is_Integer and int(c) % k == 0]
        low = sympy.Add(*[t for t, c in terms if not (c.is_Integer and int(c) % k == 0)])
        b = bounds(low, ranges)
        if len(high) == len(terms) or b is None or not _below(b, sympy.Integer(k)):
            continue
        hk = expand_index(sympy.Add(*high) / k)
        return FloorDiv(hk, d // k) if isinstance(x, FloorDiv) else low + k * ModIndex(hk, d // k)
    return None


def contiguous_strides(size: Sequence) -> tuple:
    size = tuple(size)
    got = _STRIDES.get(size)
    if got is None:
        out, acc = [], sympy.Integer(1)
        for s in reversed(size):
            out.append(acc)
            acc = acc * s
        got = _STRIDES[size] = tuple(reversed(out))
    return got


_STRIDES: dict = {}  # size -> contiguous strides: reshapes ask for them at every index they map


def numel(size: Sequence):
    return sympy.Mul(*size) if len(size) else sympy.Integer(1)


# ---------------------------------------------------------------------------------------------------- values
_INTERN: dict = {}


class Expr:
    """One node of a value DAG. Hash-consed: structurally equal Exprs are the same object (free CSE).

    op: "load" (buffer name, sympy offset) | "const" (python value) | "index" (sympy expr) |
        "cast" (x,) | "reduce" is not an Expr (reductions are Buffers) | any pointwise prim name in prims.POINTWISE.
    """
    __slots__ = ("op", "args", "dtype", "__weakref__")

    def __new__(cls, op: str, args: tuple, dtype: torch.dtype):
        key = (op, args, dtype)
        e = _INTERN.get(key)
        if e is None:
            e = object.__new__(cls)
            e.op, e.args, e.dtype = op, args, dtype
            _INTERN[key] = e
        return e

    def __repr__(self):
        return f"{self.op}({', '.join(map(repr, self.args))})"

    def walk(self):
        """All Exprs reachable from self, producers first (each once)."""
        seen, order = set(), []

        def go(e):
            if id(e) in seen:
                return
            seen.add(id(e))
            for a in e.args:
                if isinstance(a, Expr):
                    go(a)
            # the values a data-dependent index stands for come before the load or index value that uses them
            # (none made yet in this lowering: no offset holds one)
            if e.op in ("load", "index") and _INDIRECT:
                for s in indirect_symbols(e.args[1] if e.op == "load" else e.args[0]):
                    go(s.value)
            order.append(e)
        go(self)
        return order


class IndirectSymbol(sympy.Symbol):
    """A data-dependent index (gather/embedding): a sympy symbol standing for an integer-valued Expr."""
    value: Expr

    def __new__(cls, value: Expr):
        # sympy caches symbols by name: names are unique per process so no two values ever share one
        s = super().__new__(cls, f"ind{next(_INDIRECT_IDS)}", integer=True)
        s.value = value
        _INDIRECT.append(s)
        return s


_INDIRECT: list = []
_INDIRECT_IDS = itertools.count()
_INDIRECT_OF: dict = {}  # index expression -> the IndirectSymbols in it


def indirect_symbols(e) -> set:
    """e.atoms(IndirectSymbol), memoized: Expr.walk asks for every load it passes (sympy's atoms() walks each
    offset again)."""
    got = _INDIRECT_OF.get(e)
    if got is None:
        if len(_INDIRECT_OF) > 200_000:
            _INDIRECT_OF.clear()
        got = _INDIRECT_OF[e] = e.atoms(IndirectSymbol) if _INDIRECT else set()
    return got


GRAPH = None  # the lowering in progress (ember.codegen.lower.Graph); primitives add buffers to it


def reset_interning() -> None:
    _INTERN.clear()
    _INDIRECT.clear()
    _INDIRECT_OF.clear()


def substitute(e: Expr, subst: dict, ranges: dict) -> Expr:
    """e with index symbols replaced (subst: symbol -> index expression) in every load offset and index value,
    simplified given `ranges` ({symbol: size})."""
    key = (frozenset(subst.items()), frozenset(ranges.items()))

    def index(off):
        """off with subst, simplified: memoized across kernels (repeated layers print the same offsets; sympy
        evaluating the substituted div/mod is slow)."""
        k = (off, key)
        got = _SUBSTITUTED.get(k)
        if got is None:
            if len(_SUBSTITUTED) > 200_000:
                _SUBSTITUTED.clear()
            got = _SUBSTITUTED[k] = simplify_index(xreplace_index(off, subst), ranges)
        return got

    def rule(x, go):
        if x.op == "load":
            # indirect indices carry their own Exprs: substitute inside them too, as new symbols
            ind = {s: IndirectSymbol(go(s.value)) for s in indirect_symbols(x.args[1])}
            off = x.args[1].xreplace({**subst, **ind}) if ind else index(x.args[1])
            return Expr("load", (x.args[0], off), x.dtype)
        if x.op == "index":   # (an index used as a value, e.g. which piece of a concatenation a gather reads)
            ind = {s: IndirectSymbol(go(s.value)) for s in indirect_symbols(x.args[0])}
            return Expr("index", (x.args[0].xreplace({**subst, **ind}) if ind else index(x.args[0]),), x.dtype)
        return None
    return rewrite(e, rule)


def xreplace_index(e, subst: dict):
    """e.xreplace(subst) that rebuilds a clamp's Min/Max unevaluated, as prims.clamp built it: sympy's own
    rebuild evaluates them, comparing their arguments under assumptions (slow: most of a large graph's code
    generation)."""
    got = subst.get(e)
    if got is not None:
        return got
    if not e.args:
        return e
    args = tuple(xreplace_index(a, subst) for a in e.args)
    if all(a is b for a, b in zip(args, e.args)):
        return e
    if isinstance(e, (sympy.Min, sympy.Max)):
        return type(e)(*args, evaluate=False)
    return e.func(*args)


def rewrite(e: Expr, rule: Callable) -> Expr:
    """e rebuilt bottom-up, each distinct node once: `rule(x, go)` is x's replacement (go rewrites a sub-Expr
    the same way), or None for x rebuilt from its rewritten args (a load, constant or index value: x itself)."""
    memo = {}

    def go(x):
        if not isinstance(x, Expr):
            return x
        y = memo.get(id(x))
        if y is None:
            y = rule(x, go)
            if y is None:
                y = x if x.op in ("load", "const", "index") else Expr(x.op, tuple(go(a) for a in x.args), x.dtype)
            memo[id(x)] = y
        return y
    return go(e)


_SUBSTITUTED: dict = {}   # (offset, (substitution, ranges)) -> the substituted, simplified offset


# --------------------------------------------------------------------------------------------------- buffers
@dataclasses.dataclass(eq=False)
class Buffer:
    name: str
    size: tuple
    stride: tuple
    dtype: torch.dtype
    offset: object = 0

    def load(self, index) -> Expr:
        return Expr("load", (self.name, strided_offset(tuple(index), self.stride, self.offset)), self.dtype)


def strided_offset(index: tuple, stride: tuple, offset=0):
    """offset + sum(index * stride), memoized: repeated layers load their buffers at the same indices."""
    key = (index, tuple(stride), offset)
    got = _OFFSETS.get(key)
    if got is None:
        if len(_OFFSETS) > 200_000:
            _OFFSETS.clear()
        got = _OFFSETS[key] = sympy.Integer(offset) + sum((i * s for i, s in zip(index, stride)), sympy.Integer(0))
    return got


_OFFSETS: dict = {}


@dataclasses.dataclass(eq=False)
class InputBuffer(Buffer):
    pass


@dataclasses.dataclass(eq=False)
class Pointwise(Buffer):
    """out[index] = fn(index) for index over size."""
    fn: Callable = None
    origins: tuple = ()  # names of the fx nodes whose work this buffer does (for readable output code)


@dataclasses.dataclass(eq=False)
class Reduction(Buffer):
    """out[index] = reduce_{rindex over rsize} fn(index, rindex); kind in prims.REDUCTIONS."""
    fn: Callable = None
    rsize: tuple = ()
    kind: str = "sum"
    origins: tuple = ()
    # a sum in a wider dtype whose values may first be summed in this one, a short run at a time (a statistic
    # rounded to it afterwards, which eager's kernels sum so: codegen.cpp_sums); None: every value in dtype
    partial_dtype: object = None


@dataclasses.dataclass(eq=False)
class ExternBuffer(Buffer):
    """The result of a library call (matmul, convolution, SDPA) or of an ATen op kept as is (fallback).

    args/kwargs hold TensorArg placeholders for ember tensors; `index` picks an element of a tuple result.
    """
    target: object = None
    args: tuple = ()
    kwargs: dict = dataclasses.field(default_factory=dict)
    inputs: tuple = ()  # names of buffers read
    fallback: bool = False
    origins: tuple = ()
    aliases_input: bool = False
    side_effect: bool = False  # returns nothing, runs for its checks (never dead code)


@dataclasses.dataclass(frozen=True)
class TensorArg:
    """An ember tensor passed to an extern call: a strided view (size, stride, offset) of a buffer."""
    buffer: str
    size: tuple
    stride: tuple
    offset: int


# ----------------------------------------------------------------------------------------------- lazy tensors
class TensorBox:
    """A tensor under construction: what it is (loader) and, when it is plainly a strided window onto a
    buffer, where it lives (`strided`: buffer, stride, offset), so library calls can take it without a copy."""

    def __init__(self, size, dtype: torch.dtype, loader: Callable, strided: tuple | None = None, origin: str = ""):
        # (a SymInt, a meta value's size a decomposition passed on, as its sympy expression: the IR's sizes are
        # sympy, never SymInts, whose int() or comparison would be a guard on the capture's ShapeEnv)
        self.size = tuple(sympy.Integer(s) if isinstance(s, int) else symbols.sym_expr(s) if isinstance(s, torch.SymInt)
                          else s for s in size)
        self.dtype, self.loader, self.strided, self.origin = dtype, loader, strided, origin
        self.origin_names: tuple = ()  # fx nodes whose work this (unmaterialized) box carries

    @staticmethod
    def of_buffer(buf: Buffer) -> "TensorBox":
        return TensorBox(buf.size, buf.dtype, buf.load, (buf, buf.stride, buf.offset))

    @property
    def ndim(self) -> int:
        return len(self.size)

    def numel(self):
        return numel(self.size)

    def __repr__(self):
        return f"TensorBox({list(self.size)}, {self.dtype})"

    def cost(self) -> int:
        """Number of compute nodes in this box's expression (what recomputing it at each use would cost)."""
        if getattr(self, "_cost", None) is None:  # (asked again for a box read by several nodes)
            idx = [sympy.Symbol(f"c{i}", integer=True, nonnegative=True) for i in range(self.ndim)]
            self._cost = compute_cost(self.loader(idx))
        return self._cost


    def index_size(self) -> int:
        """Size (sympy nodes) of the largest index expression this box's expression reads at: views and
        concatenations compose their index arithmetic into the reader's, which a chain of them can grow without
        bound (each concatenation clamps its piece's index and tests it again in its mask)."""
        if getattr(self, "scattered_rows", None) is not None:   # read only by its add, never through an index
            return 0
        idx = [sympy.Symbol(f"c{i}", integer=True, nonnegative=True) for i in range(self.ndim)]
        sizes = [_sympy_nodes(x.args[1] if x.op == "load" else x.args[0])
                 for x in self.loader(idx).walk() if x.op in ("load", "index")]
        return max(sizes, default=0)


_NODES: dict = {}  # sympy expression -> its node count (index expressions share their subtrees)


def _sympy_nodes(e) -> int:
    got = _NODES.get(e)
    if got is None:
        if len(_NODES) > 100_000:
            _NODES.clear()
        got = _NODES[e] = 1 + sum(_sympy_nodes(a) for a in e.args)
    return got


def compute_cost(e: Expr) -> int:
    """Compute nodes of e, the transcendental ones and divisions twice: what recomputing e where it is read costs."""
    return sum(2 if x.op in EXPENSIVE else 1 for x in e.walk() if x.op not in ("load", "const", "index", "cast"))


EXPENSIVE = {"exp", "log", "tanh", "erf", "sin", "cos", "pow", "sigmoid", "log1p", "expm1", "tan", "atan",
             "asin", "acos", "sinh", "cosh", "atan2", "lgamma", "erfc", "rsqrt", "sqrt", "div", "truediv"}


def dtype_is_float(d: torch.dtype) -> bool:
    return d.is_floating_point or d.is_complex


def itemsize(d: torch.dtype) -> int:
    return torch.empty((), dtype=d).element_size()


def prod(xs):
    """The product of sizes: an int, or a sympy expression where a size is symbolic."""
    xs = list(xs)
    if all(_static(x) for x in xs):
        return math.prod(int(x) for x in xs)
    return sympy.Mul(*xs)


@dataclasses.dataclass(frozen=True)
class IndexSyntax:
    """How a printer writes integer index arithmetic (C++ and Triton differ only in these)."""
    floordiv: str
    minimum: str
    maximum: str
    long_suffix: str = ""  # on integer literals outside int32


def index_code(e, names: dict, syntax: IndexSyntax) -> str:
    """An index expression (sympy, all terms non-negative where // and % appear) in a printer's syntax."""
    if isinstance(e, IndirectSymbol):
        return names[e]
    if e.is_Integer:
        return f"{int(e)}{syntax.long_suffix}" if abs(int(e)) >= 2 ** 31 else str(int(e))
    if e.is_Symbol:
        return names.get(e, str(e))
    rec = lambda a: index_code(a, names, syntax)  # noqa: E731
    if isinstance(e, sympy.Add):
        return "(" + " + ".join(rec(a) for a in e.args) + ")"
    if isinstance(e, sympy.Mul):
        return "(" + " * ".join(rec(a) for a in e.args) + ")"
    if isinstance(e, sympy.Pow) and e.exp.is_Integer and int(e.exp) > 0:   # a symbolic size squared (s1 * s1)
        return "(" + " * ".join([rec(e.base)] * int(e.exp)) + ")"
    if isinstance(e, FloorDiv):
        return f"({rec(e.args[0])} {syntax.floordiv} {rec(e.args[1])})"
    if isinstance(e, ModIndex):
        return f"({rec(e.args[0])} % {rec(e.args[1])})"
    if isinstance(e, (sympy.Min, sympy.Max)):
        f = syntax.minimum if isinstance(e, sympy.Min) else syntax.maximum
        out = rec(e.args[0])
        for a in e.args[1:]:
            out = f"{f}({out}, {rec(a)})"
        return out
    raise NotImplementedError(f"index expression {e} ({type(e).__name__})")
