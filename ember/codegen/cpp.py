"""C++/OpenMP backend: a Schedule -> one C++ file (one `extern "C"` function per FusedGroup) plus a Python
wrapper that allocates buffers, calls kernels through ctypes (tensors passed as data pointers) and calls
extern ops. No libtorch headers, so a build takes about a second.

Rows of a group are an `omp parallel for`; the innermost loop of each member is `omp simd` (reductions with
a vectorizable accumulator), so g++ -O3 -march=native vectorizes contiguous inner loops.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os

import sympy
import torch

from ember import ir
from ember.ir import Expr, IndirectSymbol, symbols
from ember.codegen import cpp_lanes, cpp_lowp, cpp_sums, printer
from ember.codegen.cpp_libm import ERF_AS, EXP_DOMAIN, MVEC_BINARY, MVEC_UNARY, _mvec_decls, exp_leaves_domain  # noqa: F401
from ember.codegen.schedule import X0, FusedGroup, Member, Schedule, rvars
from ember.runtime import cache

# the C++ type a value of each dtype is computed in (16-bit floats: float, stored as uint16_t, see cpp_lowp)
CTYPE = {torch.float32: "float", torch.float64: "double", torch.int64: "int64_t", torch.int32: "int32_t",
         torch.int16: "int16_t", torch.int8: "int8_t", torch.uint8: "uint8_t", torch.bool: "bool",
         torch.float16: "float", torch.bfloat16: "float"}
# values kept inside a kernel (row buffers, tiles): bool ones as bytes, read as `bool t = p[i]` (a compare with 0):
# g++ does not vectorize a select on a bool loaded as `bool` ("bit-precision arithmetic not supported": a
# masked_fill's softmax ran its exp loop scalar, 0.67x eager); 16-bit floats as float, unrounded (cpp_lowp)
LOCAL_CTYPE = {**CTYPE, torch.bool: "uint8_t"}
LOCAL_CTYPE_SIZE = {d: 1 if t == "uint8_t" else torch.empty((), dtype=d).element_size() if t != "float" else 4
                    for d, t in LOCAL_CTYPE.items()}
PARALLEL_MIN = 1 << 15  # elements of work below which a loop is not worth waking the thread team

PRELUDE = r"""
#include <cmath>
#include <cstdint>
#include <limits>
#include <algorithm>
//@MVEC@
// index clamps by value: std::min/max (by reference) inside an index kept g++ from vectorizing the loop
// ("control flow in loop": a max-pool's padded taps, 8x slower)
static inline int64_t ember_imin(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t ember_imax(int64_t a, int64_t b) { return a > b ? a : b; }
template <typename T> static inline T ember_max(T a, T b) { return (a != a || a > b) ? a : b; }
template <typename T> static inline T ember_min(T a, T b) { return (a != a || a < b) ? a : b; }
template <typename T> static inline T ember_floordiv(T a, T b) {  // as at::native div_floor_floating
  if (b == T(0)) return a / b;
  T mod = std::fmod(a, b), div = (a - mod) / b;
  if (mod != T(0) && ((b < T(0)) != (mod < T(0)))) div -= T(1);
  T fl;
  if (div != T(0)) { fl = std::floor(div); if (div - fl > T(0.5)) fl += T(1); }
  else fl = std::copysign(T(0), a / b);
  return fl;
}
template <typename T> static inline T ember_remainder(T a, T b) {
  T mod = std::fmod(a, b);
  if (mod != T(0) && ((b < T(0)) != (mod < T(0)))) mod += b;
  return mod;
}
template <typename T> static inline T ember_sign(T a) { return T((T(0) < a) - (a < T(0))); }
static inline int64_t ember_index(int64_t i, int64_t n, int64_t* err) {
  if (i < 0) i += n;
  if (i < 0 || i >= n) { *err = 1; return 0; }
  return i;
}
#if defined(__AVX512F__) && !defined(__clang__)   // (GCC's __builtin_shuffle)
#define EMBER_TRANSPOSE16
//@TRANSPOSE@
#endif
static inline uint64_t ember_mix(uint64_t x) {  // splitmix64
  x += 0x9e3779b97f4a7c15ULL; x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL; return x ^ (x >> 31);
}
template <typename T> static inline T ember_rand(int64_t seed, int64_t i) {
  return T(ember_mix((uint64_t)seed * 0x632be59bd9b4e019ULL ^ ember_mix((uint64_t)i)) >> 11) * T(1.0 / 9007199254740992.0);
}
"""

def _transpose16() -> str:
    """ember_transpose16(src, dst): dst = the transpose of src, 16x16 4-byte values, in registers (a tiled
    transpose's scattered stores into its tile cost ~2x the whole copy). Stage s swaps the off-diagonal s x s blocks
    of every 2s x 2s block (two-source shuffles of rows i and i + s); after s = 8, 4, 2, 1 all is transposed."""
    out = ["typedef float ember_v16 __attribute__((vector_size(64)));",
           "typedef int ember_m16 __attribute__((vector_size(64)));",
           "static inline void ember_transpose16(const void* src, void* dst) {",
           "  ember_v16 r[16];", "  __builtin_memcpy(r, src, sizeof r);"]
    for st in (8, 4, 2, 1):
        top = [16 + j - st if j & st else j for j in range(16)]
        bottom = [16 + j if j & st else j + st for j in range(16)]
        out += [f"  for (int i = 0; i < 16; i++) if (!(i & {st})) {{",
                f"    ember_v16 a = r[i], b = r[i + {st}];",
                f"    r[i] = __builtin_shuffle(a, b, (ember_m16){{{', '.join(map(str, top))}}});",
                f"    r[i + {st}] = __builtin_shuffle(a, b, (ember_m16){{{', '.join(map(str, bottom))}}});", "  }"]
    return "\n".join(out + ["  __builtin_memcpy(dst, r, sizeof r);", "}"])


PRELUDE = PRELUDE.replace("//@MVEC@", _mvec_decls()).replace("//@TRANSPOSE@", _transpose16()) + cpp_lowp.PRELUDE + ERF_AS
cache.SHARED_PRELUDES.add(PRELUDE)
UNARY_FLOAT = {"exp": "std::exp({})", "exp2": "std::exp2({})", "log": "std::log({})", "log2": "std::log2({})",
               "log10": "std::log10({})", "sqrt": "std::sqrt({})", "rsqrt": "({t}(1) / std::sqrt({}))",
               "sin": "std::sin({})", "cos": "std::cos({})", "tan": "std::tan({})", "asin": "std::asin({})",
               "acos": "std::acos({})", "atan": "std::atan({})", "sinh": "std::sinh({})", "cosh": "std::cosh({})",
               "tanh": "std::tanh({})", "asinh": "std::asinh({})", "acosh": "std::acosh({})",
               "atanh": "std::atanh({})", "sigmoid": "({t}(1) / ({t}(1) + ember_exp{sfx}(-{})))", "erf": "std::erf({})",
               "erfc": "std::erfc({})", "log1p": "std::log1p({})", "expm1": "std::expm1({})",
               "floor": "std::floor({})", "ceil": "std::ceil({})", "round": "std::nearbyint({})",
               "trunc": "std::trunc({})", "reciprocal": "({t}(1) / {})", "lgamma": "std::lgamma({})",
               "frac": "({0} - std::trunc({0}))", "isnan": "std::isnan({})", "isinf": "std::isinf({})",
               "isfinite": "std::isfinite({})", "signbit": "std::signbit({})"}
UNARY_ANY = {"neg": "(-{})", "abs": "({0} < {t}(0) ? -{0} : {0})", "sign": "ember_sign({})",
             "logical_not": "(!{})", "relu": "({0} < {t}(0) ? {t}(0) : {0})"}
BINARY_INT = {"floordiv": "({} / {})", "remainder": "({} % {})"}  # only decompositions use these, on indices >= 0
UNARY_INT = {"floor": "{}", "ceil": "{}", "round": "{}", "trunc": "{}", "isnan": "false", "isinf": "false",
             "isfinite": "true", "signbit": "({} < 0)", "bitwise_not": "(~{})", "abs": "({0} < 0 ? -{0} : {0})"}
BINARY = {"add": "({} + {})", "sub": "({} - {})", "mul": "({} * {})", "truediv": "({} / {})",
          "maximum": "ember_max({}, {})", "minimum": "ember_min({}, {})", "fmax": "std::fmax({}, {})",
          "fmin": "std::fmin({}, {})", "eq": "({} == {})", "ne": "({} != {})", "lt": "({} < {})",
          "le": "({} <= {})", "gt": "({} > {})", "ge": "({} >= {})", "logical_and": "({} && {})",
          "logical_or": "({} || {})", "logical_xor": "(bool({}) != bool({}))", "bitwise_and": "({} & {})",
          "bitwise_or": "({} | {})", "bitwise_xor": "({} ^ {})", "atan2": "std::atan2({}, {})",
          "copysign": "std::copysign({}, {})", "hypot": "std::hypot({}, {})", "pow": "std::pow({}, {})",
          "floordiv": "ember_floordiv({}, {})", "remainder": "ember_remainder({}, {})",
          "fmod": "std::fmod({}, {})", "nextafter": "std::nextafter({}, {})",
          "lshift": "({} << {})", "rshift": "({} >> {})"}
UNARY_BOOL = {"bitwise_not": "(!{})"}
BINARY_BOOL = {"add": "({} || {})", "mul": "({} && {})", "maximum": "({} || {})", "minimum": "({} && {})"}
# libmvec's functions, through their `simd` aliases (see MVEC_UNARY)
MVEC_UNARY_FORMS = {**{n: f"ember_{n}{{sfx}}({{}})" for n in MVEC_UNARY}, "erf": "ember_erf_as{sfx}({})"}
MVEC_BINARY_FORMS = {n: f"ember_{n}{{sfx}}({{}}, {{}})" for n in MVEC_BINARY}
REDUCE_INIT = {"sum": "0", "prod": "1", "any": "false", "all": "true"}
OMP_REDUCTION = {"sum": "+", "prod": "*", "any": "||", "all": "&&", "max": "max", "min": "min"}


# C expression of a sympy index (int64 arithmetic)
index_code = functools.partial(ir.index_code,
                               syntax=ir.IndexSyntax("/", "ember_imin", "ember_imax", "LL"))


class Body(printer.Body):
    """Straight-line C++ for Exprs (printer.Body); values that do not change inside a loop may be hoisted."""

    TYPES = CTYPE
    NAN, FINITE = "std::numeric_limits<{t}>::quiet_NaN()", "{t}({v!r})"
    INF, NEG_INF = "std::numeric_limits<{t}>::infinity()", "-std::numeric_limits<{t}>::infinity()"

    def __init__(self, ptrs: dict, scalars: dict, indent: str, rows: dict, hoist: tuple | None = None):
        super().__init__(scalars, indent)
        self.ptrs, self.rows = ptrs, rows
        # hoist = (indent before the loop nest, its loop variables, outermost first): values that do not change
        # inside the nest (a learning rate from a scalar tensor) are computed before it, once (g++ does not hoist
        # calls such as powf out of a simd loop); values of the outer loops only, before the innermost loop (`mid`,
        # placed by `nest`): g++ sinks such a load into a select's branch and leaves the loop scalar
        self.hoist, self.pre, self.invariant, self.mid, self.mid_invariant = None, [], {}, [], {}
        self.mid_at = None   # (indent of the innermost loop, its variable) where the nest has outer loops
        if hoist is not None:
            self.hoist = (hoist[0], set(hoist[1]))
            if len(hoist[1]) >= 2:
                self.mid_at = (hoist[0] + "  " * (len(hoist[1]) - 1), {hoist[1][-1]})
        self.unrounded: dict = {}   # a cast to a 16-bit type's variable -> (its dtype, the float it rounds)
        self.chunks: cpp_lowp.Chunks | None = None   # the float16 operands converted a chunk at a time

    @property
    def prefix(self) -> str:   # h<n>: hoisted before the loop nest, q<n>: before its innermost loop, t<n>: in it
        return "h" if self.lines is self.pre else "q" if self.lines is self.mid else "t"

    def _node(self, x: Expr) -> str:
        if self.hoist is None:
            return super()._node(x)
        if self._invariant(x, self.hoist[1], self.invariant):
            where = (self.pre, self.hoist[0])
        elif self.mid_at is not None and self._invariant(x, self.mid_at[1], self.mid_invariant):
            where = (self.mid, self.mid_at[0])
        else:
            return super()._node(x)
        lines, indent = self.lines, self.indent
        self.lines, self.indent = where
        try:
            return super()._node(x)
        finally:
            self.lines, self.indent = lines, indent

    def _invariant(self, x: Expr, loopvars: set, memo: dict) -> bool:
        if id(x) not in memo:
            if x.op == "load":
                name, off = x.args
                ok = name in self.scalars or (not (off.free_symbols & loopvars) and name not in self.rows
                                              and (name, off) not in self.stored
                                              and not off.atoms(IndirectSymbol))
            elif x.op == "index":
                ok = not (x.args[0].free_symbols & loopvars) and not x.args[0].atoms(IndirectSymbol)
            elif x.op == "rand":
                ok = False
            else:
                ok = all(self._invariant(a, loopvars, memo) for a in x.args if isinstance(a, Expr))
            memo[id(x)] = ok
        return memo[id(x)]

    def nest(self, head: list[str]) -> list[str]:
        """The loop nest's opening lines with the values hoisted before its innermost loop (`mid`) placed there."""
        k = len(head) - (2 if len(head) > 1 and head[-2].lstrip().startswith("#pragma") else 1)
        return head[:k] + self.mid + head[k:]

    def assignment(self, name: str, code: str, dtype: torch.dtype) -> str:
        return f"{self.indent}{CTYPE[dtype]} {name} = {code};"

    def integer_literal(self, v: int, dtype: torch.dtype) -> str:
        return f"{CTYPE[dtype]}({v}LL)" if abs(v) < 2 ** 63 else f"{CTYPE[dtype]}({v}ULL)"

    def load(self, x: Expr) -> str:
        name, off = x.args
        ind = {s: self.names[id(s.value)] for s in off.atoms(IndirectSymbol)}
        if name in self.rows:  # a row buffer holds this row only
            return self.var(f"{name}[{index_code(ir.simplify_index(off - X0 * self.rows[name]), ind)}]", x.dtype)
        if self.chunks is not None and (element := self.chunks.load(x.dtype, self.ptrs[name], off)):
            return self.var(element, x.dtype)
        return self.var(cpp_lowp.load(x.dtype, f"{self.ptrs[name]}[{index_code(off, ind)}]"), x.dtype)

    def index(self, x: Expr) -> str:
        ind = {s: self.names[id(s.value)] for s in x.args[0].atoms(IndirectSymbol)}
        return self.var(cpp_lowp.rounded(x.dtype, f"static_cast<{CTYPE[x.dtype]}>({index_code(x.args[0], ind)})"),
                        x.dtype)

    def cast(self, x: Expr, a: list) -> str:
        # a 16-bit value computed here (in float) is rounded to its type first, as eager materialized it
        v, src = a[0], x.args[0]
        if src.dtype in cpp_lowp.LOW_PRECISION and src.op not in ("load", "const"):
            v = cpp_lowp.rounded(src.dtype, v)
        if x.dtype not in cpp_lowp.LOW_PRECISION:
            return self.var(f"static_cast<{CTYPE[x.dtype]}>({v})", x.dtype)
        name = self.var(cpp_lowp.rounded(x.dtype, f"static_cast<float>({v})"), x.dtype)
        self.unrounded[name] = (x.dtype, f"static_cast<float>({v})")
        return name

    def store(self, dtype: torch.dtype, v: str) -> str:
        """Variable v as a buffer of `dtype` stores it (a value cast to that 16-bit type rounds once, here)."""
        return cpp_lowp.store(dtype, self.before_rounding(dtype, v))

    def before_rounding(self, dtype: torch.dtype, v: str) -> str:
        """The float whose rounding to `dtype` variable v holds (v itself but for a cast to that type)."""
        return self.unrounded[v][1] if self.unrounded.get(v, (None,))[0] == dtype else v

    def chunk(self, head: list[str], inner) -> None:
        """Convert the loop's contiguous float16 operands and results in chunks (cpp_lowp.Chunks): an innermost
        `omp simd` loop, built for a target with conversion instructions."""
        if cpp_lowp.chunked() and len(head) >= 2 and head[-2].strip().startswith("#pragma omp") and " simd" in head[-2]:
            self.chunks = cpp_lowp.Chunks(rvars(len(inner))[-1], _size_code(inner[-1]))

    def loop(self, head: list[str], body: list[str], close: list[str]) -> list[str]:
        """The loop nest around body (chunked where `chunk` set it up)."""
        if self.chunks is None:
            return head + body + close
        return self.chunks.wrap(head, body, close, lambda off: index_code(off, {}))

    def checked_index(self, x: Expr, a: list) -> str:
        return self.var(f"ember_index({a[0]}, {a[1]}, err)", x.dtype)

    def rand(self, x: Expr, a: list) -> str:
        return self.var(f"ember_rand<{CTYPE[x.dtype]}>({a[0]}, {a[1]})", x.dtype)

    def where(self, x: Expr, a: list) -> str:
        return self.var(f"({a[0]} ? {a[1]} : {a[2]})", x.dtype)

    def format_fields(self, dtype: torch.dtype) -> dict:
        return {"t": CTYPE[dtype], "sfx": "f" if CTYPE[dtype] == "float" else ""}

    def operation(self, x: Expr, a: list) -> str:
        code = super().operation(x, a)
        if x.op in ("exp", "sigmoid") and exp_leaves_domain(x.args[0]):
            self.lines[-1] = self.lines[-1].replace("ember_exp", "ember_exp_guarded")
        return code

    def unary_tables(self, dtype: torch.dtype) -> list[dict]:
        # bool first: C++'s ~ on a bool promotes to int (~true == -2, true again), so it is logical not there
        return [*([UNARY_BOOL] if dtype == torch.bool else []), *([UNARY_INT] if not dtype.is_floating_point else []),
                UNARY_ANY, MVEC_UNARY_FORMS, UNARY_FLOAT]

    def binary_tables(self, dtype: torch.dtype) -> list[dict]:
        return [*([BINARY_BOOL] if dtype == torch.bool else []), *([BINARY_INT] if not dtype.is_floating_point else []),
                *([MVEC_BINARY_FORMS] if dtype.is_floating_point else []), BINARY]


def _loops(inner, indent, parallel: bool, clause: str = "", simd: bool = True, team: bool = False):
    """Open a loop nest over `inner` (parallel: OpenMP threads on the outermost loop, simd on the innermost,
    `clause` the reduction clause of both; team: inside a parallel region already, the loop is shared out
    with no barrier after it); returns (opening lines, body indent, closing lines)."""
    lines, closes, r = [], [], rvars(len(inner))
    par = "for" if team else "parallel for"
    cond = "" if team else _PARALLEL_IF[0]
    nowait = " nowait" if team else ""  # on the shared-out loop only (never on an inner `omp simd`)
    for k, (v, n) in enumerate(zip(r, inner)):
        first, last = k == 0, k == len(inner) - 1
        if first and last and parallel:
            lines.append(f"{indent}#pragma omp {par} simd{clause}{nowait}{cond}" if simd else
                         f"{indent}#pragma omp {par}{clause}{nowait}{cond}")
        elif first and parallel:
            lines.append(f"{indent}#pragma omp {par}{clause}{nowait}{cond}")
        elif last and simd:
            lines.append(f"{indent}#pragma omp simd{clause}")
        lines.append(f"{indent}for (int64_t {v} = 0; {v} < {_size_code(n)}; {v}++) {{")
        closes.insert(0, indent + "}")
        indent += "  "
    return lines, indent, closes


MAX_KERNEL_ARGS = 1000   # ctypes passes at most 1024 arguments in one call (the error pointer is one more)


def _local(m: Member) -> bool:
    """A local member's values stay in the kernel (a register, a row buffer): no pointer argument."""
    return m.local


MAX_MEMBERS_PER_KERNEL = 64


def too_big_for_one_function(group: FusedGroup) -> bool:
    """Whether a group's kernel would take more pointers than one ctypes call passes (an Adam step over ~150
    parameters fused horizontally: 7 pointers each), or more members than g++ compiles quickly in one function
    (g++ -O3's time grows faster than a function's size); functions of at most 64 members also compile side by
    side (cache._build). An Adam step over 10 parameters (~40 members) stays one function with one parallel
    region."""
    return len(group.members) > MAX_MEMBERS_PER_KERNEL or len(printer.kernel_args(group, _local)[0]) > MAX_KERNEL_ARGS


def kernel_source(group: FusedGroup, sched: Schedule) -> tuple[str, list[str]]:
    """C++ of one group: `extern "C" void name(pointers..., int64_t* err)`; returns (source, buffer args)."""
    args, writes = printer.kernel_args(group, _local)
    ptrs = {n: n for n in args}
    ptrs.update({m.buf.name: m.target for m in group.members if m.dest})
    params = ", ".join(f"{'const ' if n not in writes else ''}{_storage(sched.buffers[n].dtype)}* __restrict__ {n}"
                       for n in args)
    sizes = group_symbols(group)   # symbolic sizes the kernel takes as arguments, after the pointers
    if sizes:
        params += (", " if params else "") + ", ".join(f"int64_t {n}" for n in sizes)
        args = args + sizes
    widest = max((ir.prod(m.inner) for m in group.members), key=symbols.hint, default=1)
    total = group.numel * max(widest, 1) if symbols.is_static(widest) else group.numel * widest
    if symbols.is_static(total):
        parallel, _PARALLEL_IF[0] = total >= PARALLEL_MIN, ""
    else:   # whether to wake the thread team is decided at run time (OpenMP's if clause)
        parallel, _PARALLEL_IF[0] = True, f" if({index_code(total, {})} >= {PARALLEL_MIN})"
    lines = [f"// fused fx nodes: {', '.join(group.origins())}",
             f"extern \"C\" void {group.name}({params}{', ' if params else ''}int64_t* __restrict__ err) {{"]
    ind = "  "
    rows = {m.buf.name: ir.prod(m.inner) for m in group.members if m.local and not m.is_reduction}
    if not rows and columnwise(group):
        lines += _column_group(group, ptrs, parallel)
        lines.append("}")
        return _widen(lines), args
    if not rows and transposed_reads(group):
        lines += _tiled_rows(group, ptrs, parallel)
        lines.append("}")
        return _widen(lines), args
    if not symbols.same(group.numel, 1) and rows:  # per-thread row buffers, declared inside the parallel region
        if parallel:
            lines.append(ind + "#pragma omp parallel" + _PARALLEL_IF[0])
        lines.append(ind + "{")
        for m in group.members:
            if m.buf.name in rows and symbols.is_static(rows[m.buf.name]):
                lines.append(f"{ind}  alignas(64) {LOCAL_CTYPE[m.buf.dtype]} {m.buf.name}[{rows[m.buf.name]}];  // row buffer")
            elif m.buf.name in rows:   # a run-time width: on the heap, one per thread (the stack may not hold it)
                t = LOCAL_CTYPE[m.buf.dtype]
                lines.append(f"{ind}  {t}* __restrict__ {m.buf.name} = static_cast<{t}*>(__builtin_malloc(sizeof({t}) * "
                             f"{index_code(rows[m.buf.name], {})}));  // row buffer")
        if parallel:
            lines.append(ind + "  #pragma omp for")
        lines.append(f"{ind}  for (int64_t x0 = 0; x0 < {_size_code(group.numel)}; x0++) {{")
        ind += "    "
    elif not symbols.same(group.numel, 1):
        if parallel:
            lines.append(ind + "#pragma omp parallel for" + _PARALLEL_IF[0])
        lines.append(f"{ind}for (int64_t x0 = 0; x0 < {_size_code(group.numel)}; x0++) {{")
        ind += "  "
    else:
        lines.append(f"{ind}{{ const int64_t x0 = 0; (void)x0;")
        ind += "  "
    # one row of elementwise blocks (an optimizer step): one parallel region, each block's loop shared out
    # with no barrier between blocks (nothing one block writes is read by another)
    team = group.numel == 1 and parallel and group.elementwise and len(group.members) > 1
    if team:
        lines += [ind + "#pragma omp parallel" + _PARALLEL_IF[0], ind + "{"]
        ind += "  "
    scalars: dict = {}
    for block in _blocks(group.members):
        if block[0].is_reduction:
            if len(block) > 1:
                lines += _sums(block, ptrs, scalars, ind, parallel and group.numel == 1, rows)
            else:
                lines += _member(block[0], ptrs, scalars, ind, parallel and group.numel == 1, rows)
            for m in block:
                scalars[m.buf.name] = f"{m.buf.name}_v"
        else:
            lines += _pointwise_block(block, ptrs, scalars, ind, parallel and group.numel == 1, rows, team)
    if team:
        lines.append(ind[:-2] + "}")
    if not symbols.same(group.numel, 1) and rows:
        lines += ["    }"] + [f"    __builtin_free({n});" for n, w in rows.items() if not symbols.is_static(w)] + ["  }"]
    else:
        lines.append("  }")
    lines.append("}")
    return _widen(lines), args


def _widen(lines: list[str]) -> str:
    if any(f"ember_{n}" in line for line in lines for n in MVEC_UNARY + MVEC_BINARY):
        # loops calling libm: 512-bit vectors and libmvec's AVX-512 variants (g++ otherwise prefers 256 bits)
        # run them faster
        lines[1] = lines[1].replace('extern "C" void', 'extern "C" EMBER_WIDE void', 1)
    if any("ember_exp_guarded" in line for line in lines):
        # the guarded exp's selects vectorize on AVX2 only without trapping math (no code enables traps); per
        # kernel, not per file: the flag changes how g++ compiles every other kernel too, not for the better
        lines[1] = lines[1].replace('extern "C"', 'extern "C" EMBER_NO_TRAPS', 1)
    return "\n".join(lines)


COLUMN_BLOCK = 256  # kept elements (x0) per block of a column-wise reduction: its accumulators stay in L1
COLUMN_CHUNK = 16  # reduction steps summed into a partial sum before it joins the next level of a float sum


def _step(off, var) -> object:
    """How far `off` moves when `var` grows by one (a sympy number when the index is linear in var)."""
    return sympy.expand(off.subs(var, var + 1) - off)


def columnwise(group: FusedGroup) -> bool:
    """Whether a group reduces over outer dims of its inputs (x.sum(0) of a contiguous matrix): its rows x0
    are adjacent in memory and its reduction loops are not. The row-per-x0 loop nest then walks each
    reduction with a large stride (no vectorization, a cache line per element: many times slower than the
    same reduction over inner dims); `_column_group` swaps the loops instead. Only groups of plain reductions
    (no argmax/argmin) and pointwise members of one element per row, without row buffers."""
    if not symbols.gt(group.numel, 1) or not any(m.is_reduction for m in group.members):
        return False
    contiguous_x0 = False
    for m in group.members:
        if m.body is None or (m.is_reduction and (m.buf.kind not in OMP_REDUCTION or not m.inner)) \
                or (not m.is_reduction and m.inner):
            return False
        if not m.is_reduction:
            continue
        last = rvars(len(m.inner))[-1]
        for x in m.body.walk():
            if x.op == "load":
                off = x.args[1]
                if _step(off, last) == 1:  # already contiguous in its reduction loop: the row form is right
                    return False
                contiguous_x0 |= _x0_step(off) == 1
    return contiguous_x0


TILE_ROWS = 16   # rows x0 of a tile: 16 floats, a 64-byte cache line of an input read across rows


def transposed_reads(group: FusedGroup) -> bool:
    """Whether a group of pointwise members over one inner loop reads an input across its rows (x.t().contiguous():
    the load steps 1 with x0 and far with the inner index, the store the other way round). Its row-per-x0 loop reads
    a cache line per element (2x slower than eager's copy); `_tiled_rows` walks square tiles instead, each input
    line read once and each output line written once. Static sizes only; members reading a buffer the group writes keep the row form (a
    different visiting order could read an element before or after it is written)."""
    if not symbols.is_static(group.numel) or int(group.numel) < 2 * TILE_ROWS or len(_blocks(group.members)) != 1:
        return False
    r = rvars(1)[0]
    written = {m.target for m in group.members} | {m.buf.name for m in group.members}
    across = False
    for m in group.members:
        if m.is_reduction or m.body is None or m.local or len(m.inner) != 1 or not symbols.is_static(m.inner[0]) \
                or _step(m.store, r) != 1:
            return False
        for x in m.body.walk():
            if x.op != "load":
                continue
            name, off = x.args
            if off.atoms(IndirectSymbol):
                return False
            if name in written and (name, off) not in {(p.buf.name, p.store) for p in group.members}:
                return False
            step_r = _step(off, r)
            # (adjacent rows adjacent in memory: x0 % C of a permuted 3-d input too)
            across |= step_r.is_Integer and abs(int(step_r)) >= TILE_ROWS and _x0_step(off) == 1
    return across


def _tiled_rows(group: FusedGroup, ptrs, parallel: bool) -> list[str]:
    """transposed_reads' groups in square tiles of TILE_ROWS rows x0 by TILE_ROWS inner indices: the values are
    computed with the rows inside (a vector loop over the contiguous input elements) into a tile in L1, then
    stored with the inner index inside (a vector loop over the contiguous output elements)."""
    n, inner, r, t = int(group.numel), int(group.members[0].inner[0]), rvars(1)[0], TILE_ROWS
    lines = ([f"  #pragma omp parallel for{_PARALLEL_IF[0]}"] if parallel else []) + [
        f"  for (int64_t xb = 0; xb < {n}; xb += {t}) {{",
        f"    const int64_t xn = ember_imin({t}, {n} - xb);",
        f"    for (int64_t rb = 0; rb < {inner}; rb += {t}) {{",
        f"      const int64_t rn = ember_imin({t}, {inner} - rb);"]
    lines += [f"      alignas(64) {LOCAL_CTYPE[m.buf.dtype]} {m.buf.name}_tile[{t}][{t}];" for m in group.members]

    def compute(tile: str, rn: str = "rn", xn: str = "xn") -> list[str]:
        """The values, rows inside, into each member's `tile` ([xi][rt] or [rt][xi])."""
        b, keep = Body(ptrs, {}, "          ", {}), []
        for m in group.members:
            v = b.emit(m.body)
            keep.append(f"          {m.buf.name}{tile} = {v};")
            b.stored[(m.buf.name, m.store)] = v
        return [f"      for (int64_t rt = 0; rt < {rn}; rt++) {{", f"        const int64_t {r} = rb + rt;",
                "        #pragma omp simd", f"        for (int64_t xi = 0; xi < {xn}; xi++) {{",
                "          const int64_t x0 = xb + xi;"] + b.lines + keep + ["        }", "      }"]
    if t == 16 and all(LOCAL_CTYPE_SIZE[m.buf.dtype] == 4 for m in group.members):
        # whole tiles of 4-byte values with AVX-512: stored as computed ([rt][xi], contiguous), transposed in registers
        lines += ["#if defined(EMBER_TRANSPOSE16)", "      if (xn == 16 && rn == 16) {"]
        lines += [f"      alignas(64) {LOCAL_CTYPE[m.buf.dtype]} {m.buf.name}_rows[{t}][{t}];" for m in group.members]
        lines += compute("_rows[rt][xi]", str(t), str(t)) + [f"      ember_transpose16({m.buf.name}_rows, {m.buf.name}_tile);"
                                             for m in group.members]
        lines += ["      } else", "#endif", "      {"] + compute("_tile[xi][rt]") + ["      }"]
    else:
        lines += compute("_tile[xi][rt]")
    lines += ["      for (int64_t xi = 0; xi < xn; xi++) {", "        const int64_t x0 = xb + xi;", "        #pragma omp simd",
              "        for (int64_t rt = 0; rt < rn; rt++) {", f"          const int64_t {r} = rb + rt;"]
    lines += [f"          {m.target}[{index_code(m.store, {})}] = "
              f"{cpp_lowp.store(m.buf.dtype, m.buf.name + '_tile[xi][rt]')};" for m in group.members]
    return lines + ["        }", "      }", "    }", "  }"]


def _x0_step(off):
    """How far `off` moves from row x0 = 0 to x0 = 1 (reduction indices at 0): a split reduction's partial results
    [S, C] index their rows as x0 // C and x0 % C, linear in x0 only within each run of C rows."""
    if _step(off, X0) == 1:
        return 1
    # loop indices at 0, size symbols at the example's sizes (at 0, `x0 % s0` would divide by zero)
    at = {v: symbols.HINTS.get(v, 0) for v in off.free_symbols if v != X0}
    try:
        return int(off.subs({**at, X0: 1})) - int(off.subs({**at, X0: 0}))
    except (TypeError, ValueError):
        return None


XQ, XI = sympy.Symbol("xq", integer=True, nonnegative=True), sympy.Symbol("xi", integer=True, nonnegative=True)


def _indices(group: FusedGroup):
    for m in group.members:
        for x in m.body.walk():
            yield from [x.args[1]] if x.op == "load" else [x.args[0]] if x.op == "index" else []


def _row_period(group: FusedGroup):
    """The d of every `x0 // d` and `x0 % d` in the group's indices (also inside another div/mod: a split
    reduction's parts over several reduced dims), as their gcd (0: none; None: x0 appears inside such a division
    with other terms, which no block size makes linear)."""
    period = 0
    for off in _indices(group):
        for a in sympy.preorder_traversal(off):
            if isinstance(a, (ir.FloorDiv, ir.ModIndex)) and X0 in a.args[0].free_symbols:
                if a.args[0] == X0 and a.args[1].is_Integer:
                    period = math.gcd(period, int(a.args[1]))
                elif not isinstance(a.args[0], (ir.FloorDiv, ir.ModIndex)):
                    return None
    return period


def _column_group(group: FusedGroup, ptrs: dict, parallel: bool) -> list[str]:
    """A column-wise group as blocks of up to COLUMN_BLOCK adjacent rows x0 (OpenMP-parallel over blocks); in a
    block each reduction keeps one accumulator per row in a local array and loops over its reduction range
    outside, the rows inside (`omp simd`: contiguous loads, one vector of accumulators per step)."""
    # (a symbolic row count: block widths chosen at the example's, the last block cut at run time)
    n = group.numel
    blk = min(COLUMN_BLOCK, n if symbols.is_static(n) else symbols.hint(n))
    # threaded: 768 columns on 16 threads run as 16 blocks of 48, not 3 of 256 (not narrower than 16: the loop
    # over a block's columns would be one vector per reduction step)
    if parallel:  # as many blocks per thread for every thread (one per CPU), each at most COLUMN_BLOCK, 16 | width
        cpus = os.cpu_count() or 1
        hn = symbols.hint(n)
        blocks = cpus * math.ceil(hn / (cpus * COLUMN_BLOCK))
        blk = min(blk, max(16, math.ceil(hn / blocks / 16) * 16))
        lines = ["  #pragma omp parallel for schedule(static)" + _PARALLEL_IF[0]]
    else:
        lines = []
    if not symbols.is_static(n):   # (whole vectors of columns: the run-time count may be far above the example's)
        blk = min(COLUMN_BLOCK, max(16, math.ceil(blk / 16) * 16))
    # rows indexed as x0 // C and x0 % C (a split reduction's partial results [S, C]): blocks of a width that
    # divides C, each index then `xq`-dependent (the block's, hoisted) plus xi (contiguous, vectorized)
    period, bodies = _row_period(group), {}
    fits = [b for b in range(16, COLUMN_BLOCK + 1, 16) if period and period % b == 0] or \
        ([period] if period and period < 16 else [])   # narrow: a block per part (one vector per step)
    if fits:
        blk = max((b for b in fits if b <= blk), default=fits[0])
        ranges = {XI: blk, XQ: n // blk if symbols.is_static(n) else ir.FloorDiv(n, blk), **{v: k for m in group.members for v, k in zip(rvars(len(m.inner)), m.inner)}}
        bodies = {id(m): ir.substitute(m.body, {X0: XQ * blk + XI}, ranges) for m in group.members}
        if any(isinstance(a, (ir.FloorDiv, ir.ModIndex)) and XI in a.free_symbols for off in _indices(
                FusedGroup(n, [dataclasses.replace(m, body=bodies[id(m)]) for m in group.members]))
               for a in sympy.preorder_traversal(off)):
            bodies = {}   # (a division left in xi: the plain x0 form)
    nc = _size_code(n)
    whole = symbols.is_static(n) and n % blk == 0
    lines += [f"  for (int64_t xb = 0; xb < {nc}; xb += {blk}) {{",   # (a constant trip count where blocks are whole)
              f"    const int64_t xn = {blk};" if whole else f"    const int64_t xn = ember_imin({blk}, {nc} - xb);"]
    if bodies:
        lines.append(f"    const int64_t xq = xb / {blk}; (void)xq;")
    ind, scalars = "    ", {}
    xloop = [f"{ind}#pragma omp simd", f"{ind}for (int64_t xi = 0; xi < xn; xi++) {{"]
    for m in group.members:
        t, name = CTYPE[m.buf.dtype], m.buf.name
        body = bodies.get(id(m), m.body)
        if not m.is_reduction:
            b = Body(ptrs, scalars, ind + "    ", {})
            v = b.emit(body)
            lines += [f"{ind}// pointwise: {name}"] + xloop + [f"{ind}  {{ const int64_t x0 = xb + xi; (void)x0;"] \
                + b.lines + [f"{ind}    {m.target}[{index_code(m.store, {})}] = {b.store(m.buf.dtype, v)};",
                             f"{ind}  }}", f"{ind}}}"]
            continue
        kind, vt, acc, fl = m.buf.kind, CTYPE[m.body.dtype], f"{name}_acc", m.body.dtype.is_floating_point
        if kind in REDUCE_INIT:
            init = REDUCE_INIT[kind]
        elif m.body.dtype == torch.bool:
            init = "false" if kind == "max" else "true"
        elif fl:
            init = f"{'-' if kind == 'max' else ''}std::numeric_limits<{vt}>::infinity()"
        else:
            init = f"std::numeric_limits<{vt}>::{'lowest' if kind == 'max' else 'max'}()"
        nan = kind in ("max", "min") and fl
        flag = "int64_t" if m.body.dtype.itemsize == 8 else "int32_t"  # as wide as the value (see _member)
        lines += [f"{ind}// {name}: {kind} reduction over {list(symbols.ints(m.inner))}, column-wise",
                  f"{ind}alignas(64) {vt} {acc}[{blk}];", f"{ind}alignas(64) {t} {name}_v[{blk}];"]
        if nan:
            lines.append(f"{ind}alignas(64) {flag} {acc}_nan[{blk}];")
        lines += xloop + [f"{ind}  {acc}[xi] = {init};" + (f" {acc}_nan[xi] = 0;" if nan else ""), f"{ind}}}"]
        # the reduction runs as one flat loop (each index from it: a division per step of the reduction, outside
        # the loop over the block's rows); a float sum adds COLUMN_CHUNK steps into one partial sum and
        # COLUMN_CHUNK of those into a second before the column's sum (one running sum per column drifted past
        # assert_close's tolerance on 512 rows; the row form sums in 16 vector lanes)
        nr, rs = ir.prod(m.inner), rvars(len(m.inner))
        levels = 2 if kind == "sum" and fl and symbols.hint(nr) > COLUMN_CHUNK else 0
        nr = _size_code(nr)
        head, rind, close = [], ind, []
        lo, span = "0", nr
        for lev in range(levels, 0, -1):
            step = COLUMN_CHUNK ** lev
            lines.append(f"{ind}alignas(64) {vt} {acc}_p{lev}[{blk}];")
            head += [f"{rind}for (int64_t c{lev} = {lo}; c{lev} < ember_imin({lo} + {span}, {nr}); c{lev} += {step}) {{",
                     f"{rind}  #pragma omp simd", f"{rind}  for (int64_t xi = 0; xi < xn; xi++) {acc}_p{lev}[xi] = 0;"]
            into = f"{acc}_p{lev + 1}" if lev < levels else acc
            close = [f"{rind}  #pragma omp simd",
                     f"{rind}  for (int64_t xi = 0; xi < xn; xi++) {into}[xi] += {acc}_p{lev}[xi];", f"{rind}}}"] + close
            lo, span, rind = f"c{lev}", step, rind + "  "
        head.append(f"{rind}for (int64_t rf = {lo}; rf < ember_imin({lo} + {span}, {nr}); rf++) {{")
        close.insert(0, f"{rind}}}")
        rind += "  "
        for k, (r, st) in enumerate(zip(rs, ir.contiguous_strides(m.inner))):
            e = "rf" if k == 0 else f"(rf % {_size_code(st * m.inner[k])})"
            head.append(f"{rind}const int64_t {r} = {e} / {_size_code(st)};" if not symbols.same(st, 1) else
                        f"{rind}const int64_t {r} = {e};")
        b = Body(ptrs, scalars, rind + "  ", {})
        v = b.emit(body)
        a = f"{acc}_p1[xi]" if levels else f"{acc}[xi]"
        if kind in ("sum", "prod") and m.body.dtype != torch.bool:
            upd = f"{a} {'+' if kind == 'sum' else '*'}= {v};"
        elif kind in ("sum", "any", "max") and m.body.dtype == torch.bool:
            upd = f"{a} = {a} || {v};"
        elif m.body.dtype == torch.bool:  # prod, all, min of bools
            upd = f"{a} = {a} && {v};"
        elif kind in ("any", "all"):
            upd = f"{a} = {a} {'||' if kind == 'any' else '&&'} {v};"
        else:
            upd = f"{a} = ({v} {'>' if kind == 'max' else '<'} {a}) ? {v} : {a};" + \
                (f" {acc}_nan[xi] |= ({v} != {v});" if nan else "")
        lines += head + [f"{rind}#pragma omp simd", f"{rind}for (int64_t xi = 0; xi < xn; xi++) {{",
                         f"{rind}  const int64_t x0 = xb + xi; (void)x0;"] + b.lines + [f"{rind}  {upd}", f"{rind}}}"] + close
        a = f"{acc}[xi]"
        fin = f"{ind}  {name}_v[xi] = {cpp_lowp.rounded(m.buf.dtype, f'static_cast<{t}>({a})')};"
        if nan:
            fin = f"{ind}  {name}_v[xi] = {acc}_nan[xi] ? std::numeric_limits<{t}>::quiet_NaN() : " \
                  f"{cpp_lowp.rounded(m.buf.dtype, f'static_cast<{t}>({a})')};"
        lines += xloop + [fin]
        if not m.local:
            lines.append(f"{ind}  {{ const int64_t x0 = xb + xi; "
                         f"{m.target}[{index_code(m.store, {})}] = {cpp_lowp.store(m.buf.dtype, name + '_v[xi]')}; }}")
        lines.append(f"{ind}}}")
        scalars[name] = f"{name}_v[xi]"
    return lines + ["  }"]


def _blocks(members: list) -> list[list]:
    """Consecutive pointwise members over the same inner loops share one loop (horizontal fusion inside the
    row), as long as what a member reads from an earlier one in the loop is that member's own element."""
    out = []
    for m in members:
        prev = out[-1] if out else None
        if prev and cpp_sums.siblings(prev, m):
            prev.append(m)
            continue
        if prev and not m.is_reduction and not prev[0].is_reduction and tuple(prev[0].inner) == tuple(m.inner) \
                and prev[0].block == m.block:
            stores = {p.buf.name: p.store for p in prev}
            loads = [x for x in m.body.walk() if x.op == "load" and x.args[0] in stores]
            if all(sympy.expand(x.args[1] - stores[x.args[0]]) == 0 for x in loads):
                prev.append(m)
                continue
        out.append([m])
    return out


def _sums(ms: list, ptrs, scalars, ind, parallel_inner, rows) -> list[str]:
    """Sibling sums (cpp_sums.siblings) in one loop nest, an accumulator each: values their bodies share are
    computed once per element (the Body's common subexpressions)."""
    inner = ms[0].inner
    accs = [f"{m.buf.name}_acc" for m in ms]
    lines = [f"{ind}// {', '.join(m.buf.name for m in ms)}: sum reductions over {list(symbols.ints(inner))}, one loop"]
    lines += [f"{ind}{CTYPE[m.body.dtype]} {acc} = {REDUCE_INIT['sum']};" for m, acc in zip(ms, accs)]
    lind = ind + "  "
    head, bind, close = _loops(inner, lind, parallel_inner, "".join(f" reduction(+:{a})" for a in accs), simd=True)
    b = Body(ptrs, scalars, bind, rows, hoist=(lind, rvars(len(inner))))
    b.chunk(head, inner)
    parts = {acc: f"{acc}_part" for m, acc in zip(ms, accs) if cpp_sums.widened_sum(m, ms)}
    updates = [f"{bind}{parts[acc] if acc in parts else acc} += {b.emit(m.body.args[0] if acc in parts else m.body)};"
               for m, acc in zip(ms, accs)]
    head, close = cpp_sums.partial_loops(b.nest(head), close, inner, parts, _size_code(inner[-1]))
    loop = b.pre + b.loop(head, b.lines + updates, close)
    types = {**{acc: CTYPE[m.body.dtype] for m, acc in zip(ms, accs)}, **{p: "float" for p in parts.values()}}
    if cpp_lanes.worth(types, _hint(inner[-1])):
        loop = cpp_lanes.split(loop, types)
    lines += [ind + "{"] + loop + [ind + "}"]
    for m, acc in zip(ms, accs):
        lines += _reduced(m, acc, ind)
    return lines


def _reduced(m: Member, acc: str, ind: str) -> list[str]:
    """A reduction's value `{name}_v` from its accumulator (rounded to its type), stored unless it is local."""
    t = CTYPE[m.buf.dtype]
    lines = [f"{ind}{t} {m.buf.name}_v = {cpp_lowp.rounded(m.buf.dtype, f'static_cast<{t}>({acc})')};"]
    if not m.local:
        lines.append(f"{ind}{m.buf.name}[{index_code(m.store, {})}] = {cpp_lowp.store(m.buf.dtype, m.buf.name + '_v')};")
    return lines


MAX_PIECES = 8   # inner loops cut at more points than this keep their selects


def _inner_cuts(ms: list) -> list[int]:
    """Where the comparisons of the innermost index with constants in the block's values change (the pieces of a
    concatenation along the last dim: `r0 < 64`), strictly inside the static loop; [] when none or too many."""
    n, r = ms[0].inner[-1] if ms[0].inner else None, rvars(len(ms[0].inner))[-1] if ms[0].inner else None
    if n is None or not symbols.is_static(n):
        return []
    cuts = set()
    for m in ms:
        for x in m.body.walk():
            if x.op not in ("lt", "le", "gt", "ge") or {a.op for a in x.args} != {"index", "const"}:
                continue
            i, c = x.args if x.args[0].op == "index" else x.args[::-1]
            k = i.args[0] - r
            if not (k.is_Integer and isinstance(c.args[0], int)):
                continue
            # r + k < c flips at r = c - k; <= and > at c - k + 1 (with the constant on the left, the mirror)
            strict = x.op in ("lt", "ge") if x.args[0] is i else x.op in ("gt", "le")
            cuts.add(int(c.args[0]) - int(k) + (0 if strict else 1))
    cuts = sorted(c for c in cuts if 0 < c < int(n))
    return cuts if len(cuts) < MAX_PIECES else []


def _piece(m: Member, lo: int, hi: int, ranges: dict) -> Member:
    """m over inner indices lo <= r < hi of its last loop, the loop index shifted to start at 0: comparisons the
    range decides are constants, the selects on them their arm, and index clamps the range decides dropped."""
    r = rvars(len(m.inner))[-1]
    ranges = {**ranges, r: hi - lo}

    def unclamped(off):
        def decided(e):
            a, b = e.args if len(e.args) == 2 else (None, None)
            d = ir.bounds(a - b, ranges) if a is not None else None
            if d is None or not all(isinstance(v, int) for v in d):
                return e
            first = (d[1] <= 0) if isinstance(e, sympy.Min) else (d[0] >= 0)
            second = (d[0] >= 0) if isinstance(e, sympy.Min) else (d[1] <= 0)
            return a if first else (b if second else e)
        return off.replace(lambda e: isinstance(e, (sympy.Min, sympy.Max)), decided)

    def rule(x, go):
        if x.op == "load":
            return Expr("load", (x.args[0], unclamped(x.args[1])), x.dtype)
        if x.op in ("lt", "le", "gt", "ge") and {a.op for a in x.args} == {"index", "const"}:
            a, b = (ir.bounds(y.args[0], ranges) if y.op == "index" else (y.args[0], y.args[0]) for y in x.args)
            if a is not None and b is not None and all(isinstance(v, int) for v in (*a, *b)):
                yes = {"lt": a[1] < b[0], "le": a[1] <= b[0], "gt": a[0] > b[1], "ge": a[0] >= b[1]}[x.op]
                no = {"lt": a[0] >= b[1], "le": a[0] > b[1], "gt": a[1] <= b[0], "ge": a[1] < b[0]}[x.op]
                if yes or no:
                    return Expr("const", (bool(yes),), torch.bool)
        if x.op in ("logical_and", "logical_or"):   # a padded piece's lo <= r & r < hi
            a, b = go(x.args[0]), go(x.args[1])
            const = [y for y in (a, b) if y.op == "const"]
            if const and bool(const[0].args[0]) == (x.op == "logical_or"):
                return const[0]
            if const:   # the other is the value
                return b if a.op == "const" else a
        if x.op == "where":
            c = go(x.args[0])
            if c.op == "const":
                return go(x.args[1] if c.args[0] else x.args[2])
        return None
    body = ir.rewrite(ir.substitute(m.body, {r: r + lo}, ranges), rule)
    # the store's offset as a load of it is rewritten: a later member of the loop finds the value by it
    store = unclamped(ir.simplify_index(ir.xreplace_index(m.store, {r: r + lo}), ranges))
    return dataclasses.replace(m, inner=(*m.inner[:-1], sympy.Integer(hi - lo)), body=body, store=store)


def _pointwise_block(ms: list, ptrs, scalars, ind, parallel_inner, rows, team: bool = False) -> list[str]:
    cuts = [] if parallel_inner else _inner_cuts(ms)
    if cuts:   # the inner loop in pieces, each with its own values: no per-element select, no index clamps
        ranges = dict(zip(rvars(len(ms[0].inner)), ms[0].inner))
        edges = [0, *cuts, int(ms[0].inner[-1])]
        return [line for lo, hi in zip(edges, edges[1:]) for line in
                _pointwise_block([_piece(m, lo, hi, ranges) for m in ms], ptrs, scalars, ind, False, rows, team)]
    inner = ms[0].inner or (sympy.Integer(1),)  # a loop of one keeps temporaries in their own scope
    head, bind, close = _loops(inner, ind, parallel_inner, team=team)
    b = Body(ptrs, scalars, bind, rows, hoist=(ind, rvars(len(inner))) if ms[0].inner else None)
    if ms[0].inner:
        b.chunk(head, inner)
    stores = []
    for m in ms:
        v = b.emit(m.body)
        off = m.store - X0 * rows[m.buf.name] if m.buf.name in rows else m.store
        element = b.chunks.store(m.buf.dtype, m.target, m.store) if b.chunks and m.buf.name not in rows else None
        if element:
            stores.append(f"{bind}{element} = {b.before_rounding(m.buf.dtype, v)};")
        else:
            kept = v if m.buf.name in rows else b.store(m.buf.dtype, v)   # a row buffer holds computed values
            stores.append(f"{bind}{m.target}[{index_code(ir.simplify_index(off), {})}] = {kept};")
        b.stored[(m.buf.name, m.store)] = v  # later members of the loop read the value, not memory
    # stores last: every load of the iteration comes first (an input updated in place is read before written)
    # hoisted values go before the loop, in a scope of their own (shared, read-only, under `omp parallel for`)
    out = [f"{ind}// pointwise: {', '.join(m.buf.name for m in ms)}"]
    head = b.nest(head)
    if b.pre:
        return out + [ind + "{"] + b.pre + b.loop(head, b.lines + stores, close) + [ind + "}"]
    return out + b.loop(head, b.lines + stores, close)


def _member(m: Member, ptrs, scalars, ind, parallel_inner, rows) -> list[str]:
    inner = m.inner or (sympy.Integer(1),)  # a loop of one keeps each member's temporaries in its own scope
    kind, vt = m.buf.kind, CTYPE[m.body.dtype]
    acc = f"{m.buf.name}_acc"
    lines = [f"{ind}// {m.buf.name}: {kind} reduction over {list(symbols.ints(m.inner))}"]
    if kind in REDUCE_INIT:
        lines.append(f"{ind}{vt} {acc} = {REDUCE_INIT[kind]};")
    elif kind in ("max", "min", "argmax", "argmin"):
        init = "-" if kind in ("max", "argmax") else ""
        lim = f"std::numeric_limits<{vt}>::infinity()" if m.body.dtype.is_floating_point else \
            f"std::numeric_limits<{vt}>::{'lowest' if init else 'max'}()"
        if m.body.dtype == torch.bool:
            lim = "false" if init else "true"
            init = ""
        lines.append(f"{ind}{vt} {acc} = {init}{lim};")
        # the NaN flag of max/min is an integer as wide as the value: a bool flag next to float lanes makes
        # g++ vectorize the loop at mixed widths (slower)
        flag = "int64_t" if m.body.dtype.itemsize == 8 else "int32_t"
        lines.append(f"{ind}{flag if kind in ('max', 'min') else 'bool'} {acc}_nan = 0;")
        if kind.startswith("arg"):
            lines.append(f"{ind}int64_t {acc}_i = 0;")
    simple = kind in OMP_REDUCTION
    clause = ""
    if simple:
        clause = f" reduction({OMP_REDUCTION[kind]}:{acc})" + (f" reduction(|:{acc}_nan)" if kind in ("max", "min") else "")
    # the loop in a scope of its own, values that do not change in it (a gathered row's checked index) computed
    # before it, once (another member's hoisted names may be the same)
    lind = ind + "  " if m.inner else ind
    head, bind, close = _loops(inner, lind, parallel_inner and simple, clause, simd=simple)
    b = Body(ptrs, scalars, bind, rows, hoist=(lind, rvars(len(inner))) if m.inner else None)
    if m.inner:
        b.chunk(head, inner)
    parts = {acc: f"{acc}_part"} if m.inner and cpp_sums.widened_sum(m) else {}
    v = b.emit(m.body.args[0] if parts else m.body)
    head = b.nest(head)
    fl = m.body.dtype.is_floating_point
    if parts:
        upd = f"{acc}_part += {v};"
        head, close = cpp_sums.partial_loops(head, close, inner, parts, _size_code(inner[-1]))
    elif kind == "sum":
        upd = f"{acc} += {v};" if m.body.dtype != torch.bool else f"{acc} = {acc} || {v};"
    elif kind == "prod":
        upd = f"{acc} *= {v};" if m.body.dtype != torch.bool else f"{acc} = {acc} && {v};"
    elif kind == "any":
        upd = f"{acc} = {acc} || {v};"
    elif kind == "all":
        upd = f"{acc} = {acc} && {v};"
    elif kind in ("max", "min"):
        cmp = ">" if kind == "max" else "<"
        upd = f"{acc} = ({v} {cmp} {acc}) ? {v} : {acc};" + (f" {acc}_nan |= ({v} != {v});" if fl else "")
    else:
        cmp = ">" if kind == "argmax" else "<"
        flat = index_code(sum((r * s for r, s in zip(rvars(len(inner)), ir.contiguous_strides(inner))),
                              sympy.Integer(0)), {})
        nan = f" || ({v} != {v} && !{acc}_nan)" if fl else ""
        upd = f"if (({v} {cmp} {acc} && !{acc}_nan){nan}) {{ {acc} = {v}; {acc}_i = {flat}; {acc}_nan = ({v} != {v}); }}"
        if not fl:
            upd = f"if ({v} {cmp} {acc}) {{ {acc} = {v}; {acc}_i = {flat}; }}"
    loop = b.pre + b.loop(head, b.lines + [bind + upd], close)
    types = {acc: vt, f"{acc}_nan": flag if kind in ("max", "min") else "bool", **{p: "float" for p in parts.values()}}
    if simple and m.inner and cpp_lanes.worth({acc: vt}, _hint(inner[-1])):
        loop = cpp_lanes.split(loop, types)
    lines += [ind + "{"] + loop + [ind + "}"] if m.inner else loop
    if kind in ("max", "min") and fl:
        lines.append(f"{ind}if ({acc}_nan) {acc} = std::numeric_limits<{vt}>::quiet_NaN();")
    return lines + _reduced(m, f"{acc}_i" if kind.startswith("arg") else acc, ind)


def _hint(n) -> int:
    """A loop's extent, or its example's where symbolic (a heuristic's input)."""
    return int(n) if symbols.is_static(n) else symbols.hint(n)


def _storage(dtype: torch.dtype) -> str:
    """A buffer's element type in a kernel's signature (16-bit floats as their bits, bools as bytes)."""
    return cpp_lowp.STORAGE if dtype in cpp_lowp.LOW_PRECISION else LOCAL_CTYPE[dtype]


def _size_code(n) -> str:
    """A loop bound: a static size as it always printed, a symbolic one as C over the kernel's size arguments."""
    return str(int(n)) if symbols.is_static(n) else index_code(n, {})


_PARALLEL_IF = [""]   # the OpenMP if clause of the kernel being printed (run-time work size), "" when static


def group_symbols(group: FusedGroup) -> list[str]:
    """Names of the size symbols a group's code uses (sorted): its kernel's int64 arguments."""
    if not symbols.HINTS:   # a static graph
        return []
    found = set(symbols.free_symbols(group.numel))
    for m in group.members:
        for e in (*m.inner, m.store):
            found |= symbols.free_symbols(e)
        if m.body is not None:
            for x in m.body.walk():
                if x.op == "load":
                    found |= symbols.free_symbols(x.args[1])
                elif x.op == "index":
                    found |= symbols.free_symbols(x.args[0])
                elif x.op == "const" and isinstance(x.args[0], sympy.Basic):
                    found |= symbols.free_symbols(x.args[0])
    return sorted(str(s) for s in found)


def generate(sched: Schedule) -> tuple[str, list]:
    """The C++ file of a schedule, and per group (function name, argument buffer names, checks indices)."""
    parts, kernels = [PRELUDE], []
    for it in sched.items:
        if isinstance(it, FusedGroup) and (not symbols.is_static(it.numel) or it.numel > 0):
            src, args = kernel_source(it, sched)
            parts.append(src)
            kernels.append((it.name, args, "ember_index(" in src))
    # kernels are independent functions: the marker lets the build compile a large file in parts, in parallel
    return cache.KERNEL_MARK.join(parts) + "\n", kernels
