"""Triton expressions and statements: PRELUDE (the helper functions every printed module starts with), the op
tables, and Body, which prints an Expr DAG as straight-line Triton, one statement per node. Arithmetic on
float16/bfloat16 values runs in float32 (loads upcast, stores round); casts to a 16-bit type round-trip."""
from __future__ import annotations

import functools

import torch

from ember import config
from ember import ir
from ember.ir import Expr, symbols
from ember.codegen import printer
from ember.codegen.schedule import FusedGroup, Member

TL = {torch.float32: "tl.float32", torch.float64: "tl.float64", torch.float16: "tl.float16",
      torch.bfloat16: "tl.bfloat16", torch.int64: "tl.int64", torch.int32: "tl.int32", torch.int16: "tl.int16",
      torch.int8: "tl.int8", torch.uint8: "tl.uint8", torch.bool: "tl.int1"}
LOW_PRECISION = (torch.float16, torch.bfloat16)

PRELUDE = '''import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def _max_nan(a, b):  # torch.max semantics: NaN wins
    return tl.where((a > b) | (a != a), a, b)


@triton.jit
def _min_nan(a, b):
    return tl.where((a < b) | (a != a), a, b)


@triton.jit
def _prod(a, b):
    return a * b


@triton.jit
def _argmax(a, ai, b, bi):  # first index of the max; NaN counts as the max
    an = a != a
    bn = b != b
    take = ((b > a) & ~an) | (bn & ~an) | (((a == b) | (an & bn)) & (bi < ai))
    return tl.where(take, b, a), tl.where(take, bi, ai)


@triton.jit
def _argmin(a, ai, b, bi):
    an = a != a
    bn = b != b
    take = ((b < a) & ~an) | (bn & ~an) | (((a == b) | (an & bn)) & (bi < ai))
    return tl.where(take, b, a), tl.where(take, bi, ai)


@triton.jit
def _floordiv_f(a, b):  # as at::native div_floor_floating
    mod = libdevice.fmod(a, b)
    div = (a - mod) / b
    div = tl.where((mod != 0) & ((b < 0) != (mod < 0)), div - 1.0, div)
    fl = tl.floor(div)
    fl = tl.where(div - fl > 0.5, fl + 1.0, fl)
    fl = tl.where(div == 0, libdevice.copysign(tl.zeros_like(div), a / b), fl)
    return tl.where(b == 0, a / b, fl)


@triton.jit
def _remainder_f(a, b):
    mod = libdevice.fmod(a, b)
    return tl.where((mod != 0) & ((b < 0) != (mod < 0)), mod + b, mod)


@triton.jit
def _rsqrt(x):  # float32: the one instruction libdevice's __nv_rsqrtf is, without linking libdevice (~35 ms each)
    if x.dtype == tl.float32:
        return tl.inline_asm_elementwise("rsqrt.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:   # float64 (batch norm's statistics): 1 / sqrt (PTX sqrt.rn.f64, div.rn.f64: correctly rounded, as eager's
        return 1.0 / tl.sqrt(x)   # CPU kernel computes it), no libdevice


@triton.jit
def _floordiv_i(a, b):
    q = a // b
    return tl.where(((a % b) != 0) & ((a < 0) != (b < 0)), q - 1, q)


@triton.jit
def _remainder_i(a, b):
    r = a % b
    return tl.where((r != 0) & ((r < 0) != (b < 0)), r + b, r)


@triton.jit
def _fma(a, b, c):  # (the interpreter's tl.fma rounds the product: load_module gives it an exact one)
    return tl.fma(a, b, c)


@triton.jit
def _sincos_fast(x):  # float32 sin(x), cos(x) from one range reduction, right while |x| < 105615 (OWN_SINCOS)
    # x = j * pi/2 + r, |r| <= pi/4: pi/2 in three float32 parts, exact in that range
    j = libdevice.rint(x * 0.6366197466850281)
    r = _fma(j, -1.570796251296997, x)
    r = _fma(j, -7.549789415861596e-08, r)
    r = _fma(j, -5.390302953474238e-15, r)
    q = j.to(tl.int32)
    r2 = r * r
    # the minimax polynomials of CUDA's sinf / cosf, evaluated in the same order: eager's bits
    ps = _fma(r2, _fma(r2, -0.00019574658654164523, 0.00833270326256752), -0.16666662693023682)
    pc = _fma(r2, _fma(r2, _fma(r2, 2.4279579520225525e-05, -0.0013887860113754869), 0.041666727513074875),
              -0.4999999701976776)
    sin_r = _fma(_fma(r2, r, 0.0), ps, r)
    cos_r = _fma(r2, pc, 1.0)
    s = tl.where((q & 1) != 0, cos_r, sin_r)
    s = tl.where((q & 2) != 0, 0.0 - s, s)
    c = tl.where((q & 1) != 0, sin_r, cos_r)
    c = tl.where(((q + 1) & 2) != 0, 0.0 - c, c)
    return s, c


@triton.jit
def _sincos(x):  # _sincos_fast, and libdevice's (Payne-Hanek) for a block holding a larger |x| (or inf)
    s, c = _sincos_fast(x)
    big = tl.abs(x) >= 105615.0
    if tl.max(big.to(tl.int32)) > 0:
        s = tl.where(big, tl.sin(x), s)
        c = tl.where(big, tl.cos(x), c)
    return s, c


@triton.jit
def _sincos_flagged(x, flag):  # _sincos_fast, raising the flag for a larger |x|: the kernel's _fixup redoes it
    s, c = _sincos_fast(x)
    tl.store(flag + tl.zeros(x.shape, tl.int32), 1, mask=tl.abs(x) >= 105615.0)
    return s, c
'''

UNARY_FLOAT = {"exp": "tl.exp({})", "exp2": "tl.exp2({})", "log": "tl.log({})", "log2": "tl.log2({})",
               "log10": "libdevice.log10({})", "sqrt": "tl.sqrt({})", "rsqrt": "_rsqrt({})",
               "sin": "tl.sin({})", "cos": "tl.cos({})", "tan": "libdevice.tan({})", "asin": "libdevice.asin({})",
               "acos": "libdevice.acos({})", "atan": "libdevice.atan({})", "sinh": "libdevice.sinh({})",
               "cosh": "libdevice.cosh({})", "tanh": "libdevice.tanh({})", "asinh": "libdevice.asinh({})",
               "acosh": "libdevice.acosh({})", "atanh": "libdevice.atanh({})", "sigmoid": "tl.sigmoid({})",
               "erf": "tl.erf({})", "erfc": "libdevice.erfc({})", "log1p": "libdevice.log1p({})",
               "expm1": "libdevice.expm1({})", "floor": "tl.floor({})", "ceil": "tl.ceil({})",
               "round": "libdevice.nearbyint({})", "trunc": "libdevice.trunc({})", "reciprocal": "(1.0 / {})",
               "lgamma": "libdevice.lgamma({})", "frac": "({0} - libdevice.trunc({0}))", "isnan": "({0} != {0})",
               "isinf": "(tl.abs({}) == float('inf'))", "isfinite": "(tl.abs({}) < float('inf'))",
               "signbit": "(libdevice.signbit({}) != 0)", "abs": "tl.abs({})",
               "sign": "tl.where({0} > 0, 1.0, tl.where({0} < 0, -1.0, 0.0 * {0}))"}
UNARY_BOOL = {"bitwise_not": "({} == 0)", "logical_not": "({} == 0)"}
UNARY_ANY = {"neg": "(-{})", "relu": "tl.where({0} < 0, 0, {0})", "logical_not": "({} == 0)"}
UNARY_INT = {"floor": "{}", "ceil": "{}", "round": "{}", "trunc": "{}", "isnan": "({} != {0})",
             "isinf": "({0} != {0})", "isfinite": "({0} == {0})", "signbit": "({} < 0)", "bitwise_not": "(~{})",
             "abs": "tl.abs({})", "sign": "(({0} > 0).to({t}) - ({0} < 0).to({t}))"}
BINARY = {"add": "({} + {})", "sub": "({} - {})", "mul": "({} * {})", "truediv": "({} / {})",
          "maximum": "_max_nan({}, {})", "minimum": "_min_nan({}, {})", "fmax": "tl.maximum({}, {})",
          "fmin": "tl.minimum({}, {})", "eq": "({} == {})", "ne": "({} != {})", "lt": "({} < {})",
          "le": "({} <= {})", "gt": "({} > {})", "ge": "({} >= {})", "logical_and": "(({} != 0) & ({} != 0))",
          "logical_or": "(({} != 0) | ({} != 0))", "logical_xor": "(({} != 0) ^ ({} != 0))",
          "bitwise_and": "({} & {})", "bitwise_or": "({} | {})", "bitwise_xor": "({} ^ {})",
          "atan2": "libdevice.atan2({}, {})", "copysign": "libdevice.copysign({}, {})",
          "hypot": "libdevice.hypot({}, {})", "pow": "libdevice.pow({}, {})", "fmod": "libdevice.fmod({}, {})",
          "nextafter": "libdevice.nextafter({}, {})", "lshift": "({} << {})", "rshift": "({} >> {})",
          "floordiv": "_floordiv_f({}, {})", "remainder": "_remainder_f({}, {})"}
# ops printed as libdevice calls (or helpers making them): a kernel using one links libdevice, a large share of its
# compile time
LIBDEVICE_OPS = frozenset(op for table in (UNARY_FLOAT, BINARY) for op, text in table.items()
                          if "libdevice" in text or text.startswith(("_floordiv_f", "_remainder_f")))
BINARY_INT = {"floordiv": "_floordiv_i({}, {})", "remainder": "_remainder_i({}, {})", "fmod": "({} % {})",
              "truediv": "({} / {})", "maximum": "tl.maximum({}, {})", "minimum": "tl.minimum({}, {})",
              "fmax": "tl.maximum({}, {})", "fmin": "tl.minimum({}, {})"}
BINARY_BOOL = {"add": "({} | {})", "mul": "({} & {})", "maximum": "({} | {})", "minimum": "({} & {})",
               "sub": "({} ^ {})"}


def compute_type(d: torch.dtype) -> str:
    """The Triton type arithmetic on a value of dtype d runs in (16-bit floats: float32)."""
    return "tl.float32" if d in LOW_PRECISION else TL[d]


# Triton expression of a sympy index
index_code = functools.partial(ir.index_code, syntax=ir.IndexSyntax("//", "tl.minimum", "tl.maximum"))


def _lane_free(e) -> bool:
    """An index expression with no loop index in it: constants and a symbolic graph's size arguments only."""
    return not (getattr(e, "free_symbols", set()) - set(symbols.HINTS))


def _scalar_offset(off) -> bool:
    """An offset that is the same for every lane: only indirect indices, each computed from one element, besides
    size arguments."""
    ind = ir.indirect_symbols(off)
    return bool(ind) and _lane_free(off.xreplace({s: 0 for s in ind})) and all(_scalar_expr(s.value) for s in ind)


def _scalar_expr(e: Expr) -> bool:
    for x in e.walk():
        if x.op == "load" and not _lane_free(x.args[1]) and not _scalar_offset(x.args[1]):
            return False
        if x.op == "index" and not _lane_free(x.args[0]):
            return False
    return True


class Body(printer.Body):
    """Straight-line Triton for Exprs (printer.Body): loads masked to their buffers, 16-bit values computed in
    float32."""

    TYPES = TL
    TRUE, FALSE = "True", "False"   # (tl.where takes a bool condition: an int constant is deprecated)
    NAN, INF, NEG_INF, FINITE = "float('nan')", "float('inf')", "float('-inf')", "{v!r}"

    def __init__(self, scalars: dict, mask: str, indent: str, ranges: dict, extents: dict):
        super().__init__(scalars, indent)
        self.mask = mask
        self.ranges, self.extents = ranges, extents   # loop symbol -> size; buffer -> elements addressable
        self.sincos: dict = {}   # id(argument Expr) -> (sin, cos) variables of one _sincos call
        self.sincos_call = "_sincos({})"   # or _sincos_flagged's (a flagged flat kernel)
        # a row kernel's mask of the row alone: a load whose index holds no position in the row (a batch norm's
        # weight, mean) is one [XBLOCK, 1] value under it, not an [XBLOCK, RBLOCK] tile of one address each
        self.row_mask: str | None = None

    def assignment(self, name: str, code: str, dtype: torch.dtype) -> str:
        return f"{self.indent}{name} = {code}"

    def literal(self, v, dtype: torch.dtype) -> str:
        s = super().literal(v, dtype)
        # Python floats are float32 constants in Triton: give float64 ones their type
        return f"tl.full([1], {s}, tl.float64)" if dtype == torch.float64 else s

    def integer_literal(self, v: int, dtype: torch.dtype) -> str:
        return f"tl.full([1], {v}, tl.int64)" if dtype == torch.int64 and not -2 ** 31 <= v < 2 ** 31 else str(v)

    def rounded(self, e: Expr) -> str:
        """The value of e as eager would have materialized it: 16-bit results computed here in float32 are
        rounded where they are cast (and stored). Reductions take the float32 values, as eager's fused
        kernels (softmax, norms) do internally."""
        v = self.names[id(e)]
        if e.dtype in LOW_PRECISION and e.op not in ("load", "const"):
            v = f"({v}).to({TL[e.dtype]}).to(tl.float32)"
        return v

    def _sincos(self, arg: Expr, name: str) -> tuple:
        """sin and cos of one value share _sincos's range reduction (libdevice's sinf and cosf each reduce, a
        large part of their arithmetic); the one not used is dead code to Triton."""
        if id(arg) not in self.sincos:
            n = f"{self.prefix}{len(self.lines)}"
            self.lines.append(f"{self.indent}{n}s, {n}c = {self.sincos_call.format(name)}")
            self.sincos[id(arg)] = (f"{n}s", f"{n}c")
        return self.sincos[id(arg)]

    def offset(self, off) -> str:
        return index_code(off, {s: f"{self.names[id(s.value)]}" for s in ir.indirect_symbols(off)})

    def load(self, x: Expr) -> str:
        name, off = x.args
        code = self.offset(off)
        if _lane_free(off):  # one element for the whole program (a seed, a scalar tensor, x[n - 1] at size n)
            v = f"tl.load({name} + {code})"
        elif _scalar_offset(off):  # one element at an index read from memory (index_select of one index):
            # a scalar pointer takes a scalar mask only
            v = f"tl.load({name} + {code}, ({code} >= 0) & ({code} < {self.extent(name)}), other=0)"
        else:
            # Both sides of a `where` are evaluated here (C++ evaluates one): a load that may fall outside
            # its buffer (cat, pad, gather) is masked to it. Provably in-range loads keep the plain mask,
            # so contiguous ones stay vectorized.
            b = ir.bounds(off, self.ranges) if not ir.indirect_symbols(off) else None
            mask = self.mask
            if self.row_mask and b is not None and not any(s.name == "rflat" for s in off.free_symbols):
                mask = self.row_mask
            if b is None or not symbols.is_nonnegative(b[0]) or not symbols.gt(self.extents[name], b[1]):
                mask = f"{mask} & ({code} >= 0) & ({code} < {self.extent(name)})"
            v = f"tl.load({name} + {code}, {mask}, other=0)"
        if x.dtype in LOW_PRECISION:
            v += ".to(tl.float32)"
        return self.var(v, x.dtype)

    def extent(self, name: str) -> str:
        """Elements buffer `name` can address: an int, or Triton over the kernel's size arguments."""
        n = self.extents[name]
        return str(n) if symbols.is_static(n) else index_code(n, {})

    def index(self, x: Expr) -> str:
        if not x.args[0].free_symbols:  # a constant index (a select of one element): a python int has no .to
            return self.literal(int(x.args[0]), x.dtype)
        return self.var(f"({self.offset(x.args[0])}).to({TL[x.dtype]})" if x.dtype != torch.bool
                        else f"({self.offset(x.args[0])}) != 0", x.dtype)

    def cast(self, x: Expr, a: list) -> str:
        v = self.rounded(x.args[0])
        if x.dtype == torch.bool:
            return self.var(f"({v} != 0)", x.dtype)
        if x.dtype in LOW_PRECISION:  # round to the 16-bit type, keep computing in float32
            return self.var(f"({v}).to({TL[x.dtype]}).to(tl.float32)", x.dtype)
        return self.var(f"({v}).to({TL[x.dtype]})", x.dtype)

    def checked_index(self, x: Expr, a: list) -> str:
        # negative indices wrap; out-of-range reads are masked to 0 (no error flag)
        return self.var(f"tl.where({a[0]} < 0, {a[0]} + {a[1]}, {a[0]})", x.dtype)

    def rand(self, x: Expr, a: list) -> str:
        return self.var(f"tl.rand(({a[0]}).to(tl.uint32), ({a[1]}).to(tl.uint32))"
                        + (f".to({compute_type(x.dtype)})" if x.dtype != torch.float32 else ""), x.dtype)

    def where(self, x: Expr, a: list) -> str:
        return self.var(f"tl.where({a[0]}, {a[1]}, {a[2]})", x.dtype)

    def operation(self, x: Expr, a: list) -> str:
        dtype = x.args[0].dtype
        if x.op in ("sin", "cos") and config.OWN_SINCOS and compute_type(dtype) == "tl.float32":
            return self._sincos(x.args[0], a[0])[x.op == "cos"]
        if x.op == "truediv" and not dtype.is_floating_point:
            raise NotImplementedError("integer truediv (decompositions cast to float first)")
        if x.op == "pow" and not dtype.is_floating_point:
            raise NotImplementedError("integer pow")
        return super().operation(x, a)

    def format_fields(self, dtype: torch.dtype) -> dict:
        return {"t": compute_type(dtype)}

    def unary_tables(self, dtype: torch.dtype) -> list[dict]:
        return [*([UNARY_BOOL] if dtype == torch.bool else []), *([UNARY_INT] if not dtype.is_floating_point else []),
                UNARY_ANY, *([UNARY_FLOAT] if dtype.is_floating_point else [])]

    def binary_tables(self, dtype: torch.dtype) -> list[dict]:
        return [*([BINARY_BOOL] if dtype == torch.bool else []), *([BINARY_INT] if not dtype.is_floating_point else []),
                BINARY]

    def no_template(self, op: str, dtype: torch.dtype, arity: int) -> Exception:
        return NotImplementedError(f"{op} on {dtype}") if arity == 1 and not dtype.is_floating_point else KeyError(op)


def kernel_header(group: FusedGroup, name: str, args: list[str], consts: list[str]) -> list[str]:
    """A kernel's first lines: the fx nodes it computes, @triton.jit, and its signature (pointers, then the
    constexpr block sizes)."""
    return [f"# fused fx nodes: {', '.join(group.origins())[:200]}", "@triton.jit",
            f"def {name}({', '.join(args + [f'{c}: tl.constexpr' for c in consts])}):"]


def _is_literal(v: str) -> bool:
    return v.startswith("float(") or v.startswith("tl.full(") or v.lstrip("-").replace(".", "", 1).replace(
        "e", "", 1).replace("-", "", 1).isdigit()


def store_statement(m: Member, value: str, offset: str, mask: str, shape: str) -> str:
    """tl.store of `value` to member m's buffer at `offset`, cast to its dtype; `shape` is the tile's."""
    t = TL[m.buf.dtype]
    if offset.lstrip("-").isdigit():  # one element (a full reduction): a pointer per lane, all the same
        offset = f"{offset} + 0 * {'xindex' if shape in ('[BLOCK]', '[YBLOCK, XBLOCK]') else 'x0'}"
    if _is_literal(value):  # a constant: give it the tile's shape
        value = f"tl.full({shape}, {value}, {t})"
    return f"tl.store({m.target} + {offset}, ({value}).to({t}), {mask})"

