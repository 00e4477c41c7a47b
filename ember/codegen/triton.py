"""Triton backend: a Schedule (ember.codegen.schedule) -> one Python module of @triton.jit kernels, one per
FusedGroup, launched from the backend-neutral host program of ember.codegen.wrapper.

The second printer beside cpp.py, over the same loop IR. A group is printed in one of two shapes:

  flat   every member is pointwise over the same rows x inner range and none reads another member:
         one 1-D range over all numel*R elements, `BLOCK` per program. The row/inner indices are
         substituted as div/mod of the flat index and simplified back (sympy), so contiguous buffers
         get plainly contiguous offsets and Triton emits 16-byte vector loads.
  foreach  pointwise members over ranges of different sizes, or of several blocks of an `elementwise` group
         (horizontal fusion, e.g. an optimizer step): one flat range per (size, block), laid end to end
         over the program ids (`if pid < end0: ...`, `if (pid >= end0) & (pid < end1): ...`), so N
         parameters are one launch.
  rows   anything with a reduction (or members reading each other): a [XBLOCK, RBLOCK] tile, each
         program owning whole rows. Persistent when the longest inner range fits one RBLOCK (the row lives
         in registers, all members share it); looped otherwise (each member loops over its row with an
         [XBLOCK, RBLOCK] accumulator, reduced at the end). Members run in order; a reduction member's
         result is a [XBLOCK, 1] value later members read; a stored member read later in the same program
         is separated by a barrier.

Arithmetic on float16/bfloat16 values runs in float32 (loads upcast, stores round), like Inductor; casts to a
16-bit type round-trip so explicit casts keep their rounding. Sizes are specialized to the example's.
Block sizes come from the sizes (`launch_config`); the source module is cached on disk by content hash and
Triton caches its binaries; all kernels of a graph are compiled concurrently on first use (warmup).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import hashlib
import importlib.util
import math
import operator
import os
import re
import sys
import time
from typing import Callable

import sympy
import torch

from ember import config
from ember import ir
from ember.errors import CannotLower
from ember.ir import Expr, FloorDiv, ModIndex, TensorArg
from ember.codegen.wrapper import fast_unflatten
from ember.codegen.schedule import X0, FusedGroup, Member, Schedule, lifetimes, order_elementwise, rvars, \
    split_elementwise
from ember.runtime import native_guards
from ember.runtime import cuda_launch, triton_workers
from ember.tools import collector
from ember.tools.logs import get_logger

code_log = get_logger("output_code")
fallback_log = get_logger("fallbacks")
STATS = {"graphs": 0, "kernels": 0, "eager_graphs": 0, "compile_s": 0.0}   # for tests and benchmarks

TL = {torch.float32: "tl.float32", torch.float64: "tl.float64", torch.float16: "tl.float16",
      torch.bfloat16: "tl.bfloat16", torch.int64: "tl.int64", torch.int32: "tl.int32", torch.int16: "tl.int16",
      torch.int8: "tl.int8", torch.uint8: "tl.uint8", torch.bool: "tl.int1"}
LOW_PRECISION = (torch.float16, torch.bfloat16)
PERSISTENT_MAX_R = 4096     # longest row kept whole in registers
FOREACH_SHARED_MAX = 32     # ranges (parameters) at most that share one printed body (a where-chain of pointers)
FLAT = "flat"
FOREACH = "foreach"
ROWS = "rows"

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
# ops printed as libdevice calls (or helpers making them): a kernel using one links libdevice, ~35 ms of its compile
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


def literal(v, dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "1" if v else "0"
    if dtype.is_floating_point:
        v = float(v)
        if math.isnan(v):
            s = "float('nan')"
        elif math.isinf(v):
            s = "float('-inf')" if v < 0 else "float('inf')"
        else:
            s = repr(v)
        # Python floats are float32 constants in Triton: give float64 ones their type
        return f"tl.full([1], {s}, tl.float64)" if dtype == torch.float64 else s
    if dtype == torch.int64 and not -2 ** 31 <= int(v) < 2 ** 31:
        return f"tl.full([1], {int(v)}, tl.int64)"
    return str(int(v))


# Triton expression of a sympy index
index_code = functools.partial(ir.index_code, syntax=ir.IndexSyntax("//", "tl.minimum", "tl.maximum"))



def _scalar_offset(off) -> bool:
    """An offset that is the same for every lane: only indirect indices, each computed from one element."""
    ind = ir.indirect_symbols(off)
    return bool(ind) and not (off.free_symbols - ind) and all(_scalar_expr(s.value) for s in ind)


def _scalar_expr(e: Expr) -> bool:
    for x in e.walk():
        if x.op == "load" and x.args[1].free_symbols and not _scalar_offset(x.args[1]):
            return False
        if x.op == "index" and x.args[0].free_symbols:
            return False
    return True


class Body:
    """Straight-line Triton for Exprs, one statement per DAG node (Exprs are interned: CSE by identity)."""

    def __init__(self, scalars: dict, mask: str, indent: str, ranges: dict, extents: dict):
        self.scalars, self.mask, self.indent = scalars, mask, indent
        self.ranges, self.extents = ranges, extents   # loop symbol -> size; buffer -> elements addressable
        self.index_names: dict = {}
        self.lines: list[str] = []
        self.names: dict = {}
        self.stored: dict = {}   # (buffer, offset) -> the variable this program stored there (read back as is)
        self.sincos: dict = {}   # id(argument Expr) -> (sin, cos) variables of one _sincos call
        self.sincos_call = "_sincos({})"   # or _sincos_flagged's (a flagged flat kernel)
        # a row kernel's mask of the row alone: a load whose index holds no position in the row (a batch norm's
        # weight, mean) is one [XBLOCK, 1] value under it, not an [XBLOCK, RBLOCK] tile of one address each
        self.row_mask: str | None = None

    def emit(self, e: Expr) -> str:
        for x in e.walk():
            if id(x) not in self.names:
                self.names[id(x)] = self._node(x)
        return self.names[id(e)]

    prefix = "t"

    def var(self, code: str) -> str:
        n = f"{self.prefix}{len(self.lines)}"
        self.lines.append(f"{self.indent}{n} = {code}")
        return n

    def _node(self, x: Expr) -> str:
        return self._value(x)

    def rounded(self, e: Expr) -> str:
        """The value of e as eager would have materialized it: 16-bit results computed here in float32 are
        rounded where they are cast (and stored). Reductions take the float32 values, as eager's fused
        kernels (softmax, norms) do internally."""
        v = self.names[id(e)]
        if e.dtype in LOW_PRECISION and e.op not in ("load", "const"):
            v = f"({v}).to({TL[e.dtype]}).to(tl.float32)"
        return v

    def _sincos(self, arg: Expr, name: str) -> tuple:
        """sin and cos of one value share _sincos's range reduction (the pointwise chain's sin(y) * cos(y):
        libdevice's sinf and cosf each reduce, and the two were half the chain's arithmetic); the one not used
        is dead code to Triton."""
        if id(arg) not in self.sincos:
            n = f"{self.prefix}{len(self.lines)}"
            self.lines.append(f"{self.indent}{n}s, {n}c = {self.sincos_call.format(name)}")
            self.sincos[id(arg)] = (f"{n}s", f"{n}c")
        return self.sincos[id(arg)]

    def offset(self, off) -> str:
        ind = dict(self.index_names)
        ind.update({s: f"{self.names[id(s.value)]}" for s in ir.indirect_symbols(off)})
        return index_code(off, ind)

    def _value(self, x: Expr) -> str:
        if x.op == "const":
            return literal(x.args[0], x.dtype)
        if x.op == "load":
            name, off = x.args
            if name in self.scalars:
                return self.scalars[name]
            if (name, off) in self.stored:
                return self.stored[(name, off)]
            code = self.offset(off)
            if not off.free_symbols:  # one element for the whole program (a seed, a scalar tensor)
                v = f"tl.load({name} + {code})"
            elif _scalar_offset(off):  # one element at an index read from memory (index_select of one index):
                # a scalar pointer takes a scalar mask only
                v = f"tl.load({name} + {code}, ({code} >= 0) & ({code} < {self.extents[name]}), other=0)"
            else:
                # Both sides of a `where` are evaluated here (C++ evaluates one): a load that may fall outside
                # its buffer (cat, pad, gather) is masked to it. Provably in-range loads keep the plain mask,
                # so contiguous ones stay vectorized.
                b = ir.bounds(off, self.ranges) if not ir.indirect_symbols(off) else None
                mask = self.mask
                if self.row_mask and b is not None and not any(s.name == "rflat" for s in off.free_symbols):
                    mask = self.row_mask
                if b is None or b[0] < 0 or b[1] >= self.extents[name]:
                    mask = f"{mask} & ({code} >= 0) & ({code} < {self.extents[name]})"
                v = f"tl.load({name} + {code}, {mask}, other=0)"
            if x.dtype in LOW_PRECISION:
                v += ".to(tl.float32)"
            return self.var(v)
        if x.op == "index":
            if not x.args[0].free_symbols:  # a constant index (a select of one element): a python int has no .to
                return literal(int(x.args[0]), x.dtype)
            return self.var(f"({self.offset(x.args[0])}).to({TL[x.dtype]})" if x.dtype != torch.bool
                            else f"({self.offset(x.args[0])}) != 0")
        a = [self.names[id(y)] if isinstance(y, Expr) else y for y in x.args]
        if x.op == "cast":
            a[0] = self.rounded(x.args[0])
            if x.dtype == torch.bool:
                return self.var(f"({a[0]} != 0)")
            if x.dtype in LOW_PRECISION:  # round to the 16-bit type, keep computing in float32
                return self.var(f"({a[0]}).to({TL[x.dtype]}).to(tl.float32)")
            return self.var(f"({a[0]}).to({TL[x.dtype]})")
        if x.op == "checked_index":  # negative indices wrap; out-of-range reads are masked to 0 (no error flag)
            return self.var(f"tl.where({a[0]} < 0, {a[0]} + {a[1]}, {a[0]})")
        if x.op == "rand":
            return self.var(f"tl.rand(({a[0]}).to(tl.uint32), ({a[1]}).to(tl.uint32))"
                            + (f".to({compute_type(x.dtype)})" if x.dtype != torch.float32 else ""))
        if x.op == "where":
            return self.var(f"tl.where({a[0]}, {a[1]}, {a[2]})")
        arg_dtype = x.args[0].dtype
        t = compute_type(arg_dtype)
        if len(a) == 1:
            if arg_dtype == torch.bool and x.op in ("bitwise_not", "logical_not"):
                f = "({} == 0)"
            elif not arg_dtype.is_floating_point and x.op in UNARY_INT:
                f = UNARY_INT[x.op]
            elif x.op in UNARY_ANY:
                f = UNARY_ANY[x.op]
            elif x.op in ("sin", "cos") and config.OWN_SINCOS and t == "tl.float32":
                return self._sincos(x.args[0], a[0])[x.op == "cos"]
            elif arg_dtype.is_floating_point:
                f = UNARY_FLOAT[x.op]
            else:
                raise NotImplementedError(f"{x.op} on {arg_dtype}")
            return self.var(f.format(a[0], t=t))
        if arg_dtype == torch.bool and x.op in BINARY_BOOL:
            f = BINARY_BOOL[x.op]
        elif not arg_dtype.is_floating_point and x.op in BINARY_INT:
            f = BINARY_INT[x.op]
            if x.op == "truediv":
                raise NotImplementedError("integer truediv (decompositions cast to float first)")
        elif x.op == "pow" and not arg_dtype.is_floating_point:
            raise NotImplementedError("integer pow")
        else:
            f = BINARY[x.op]
        return self.var(f.format(*a))


# ----------------------------------------------------------------------------------------------------- kernels
def _rsize(m: Member) -> int:
    return ir.prod(m.inner) if m.inner else 1


def _inner_index(m: Member, rflat) -> dict:
    """r0, r1, ... of member m as div/mod of its flat inner index."""
    r = rvars(len(m.inner))
    strides = ir.contiguous_strides(m.inner)
    return {v: (ModIndex(FloorDiv(rflat, st), s) if len(m.inner) > 1 else rflat)
            for v, s, st in zip(r, m.inner, strides)}


def registers_for_private_values(sched: Schedule) -> None:
    """Pointwise members of a group without reductions that nothing outside the group reads (no graph output, no
    in-place write, no later kernel or library call): `local`, so `inline_locals` substitutes them into their
    readers and they are never stored (GPT-2's GELU backward stored the tanh and a partial product it computed
    for its gradient: 50 MB of writes per layer). After the splits and chunks that could part a value from its
    readers."""
    outputs = {o.buffer for o in sched.lowered.outputs if isinstance(o, TensorArg)}
    readers: dict[str, set] = {}
    for j, it in enumerate(sched.items):
        names = set().union(*(m.reads for m in it.members)) if isinstance(it, FusedGroup) else set(it.inputs)
        for n in names:
            readers.setdefault(n, set()).add(j)
    for j, it in enumerate(sched.items):
        if isinstance(it, FusedGroup) and not any(m.is_reduction for m in it.members):
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
    memory is the call's own, fresh each call). The result takes over the input's
    memory (`Schedule.takes_over`; the wrapper passes the name on), so the input's lines, which the kernel has
    just read into the L2 cache, are overwritten there, and a step's working set is one activation, not two:
    resnet50's batch norm + relu after a convolution at 64x56x56 (25.7 MB) took 23.7 us a launch into a fresh
    buffer, where Inductor's, in place, took 13 (H100, 2026-11-26). Safe where every element is read only by
    the thread that overwrites it: each load of the input in the group is at the member's store offset over
    the same loops and in the member's range (a horizontally fused kernel runs one range per size and block,
    each on programs of its own), and a range stores after all its loads."""
    from ember.ir import ExternBuffer, Pointwise
    from ember.codegen.wrapper import CONV_RESULTS, OUT_VARIANTS, buffer_layout
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
                        or buffer_layout(rb) != buffer_layout(b) or int(rb.offset) != 0 or int(b.offset) != 0:
                    continue
                if all(tuple(x.inner) == tuple(m.inner) and (x.block, _rsize(x)) == (m.block, _rsize(m)) and all(
                        sympy.expand(e.args[1] - m.store) == 0 for e in x.body.walk()
                        if e.op == "load" and e.args[0] == r) for x in it.members if r in x.reads):
                    m.dest = r
                    sched.takes_over[b.name] = r
                    taken.add(r)
                    break


def split_few_row_groups(sched: Schedule) -> Schedule:
    """Split groups of few rows into their independent parts.

    The scheduler joins independent buffers into one group when their row counts match (horizontal fusion);
    a contiguous buffer is one row, so unrelated pointwise buffers of different sizes became one group of one
    row: one Triton program looping over every member (a GPT-2 backward kernel ran 75M elements in a single
    program, 4.6 ms). On a GPU the parallelism is across rows, so a group with fewer rows than the GPU has SMs
    is split into its connected parts (members joined by reads); each part gets the shape that suits it
    (a lone pointwise part is flat). Parts keep the order of their first members."""
    items = []
    for it in sched.items:
        if not isinstance(it, FusedGroup) or len(it.members) < 2 or int(it.numel) >= _sm_count() \
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
        # one-element parts (each batch norm's num_batches_tracked + 1: densenet121 launched 121 kernels of one
        # element) share flat kernels of at most MAX_BLOCKS_PER_KERNEL members; nothing is read between parts.
        # (All of them and the loss in one program made a kernel of 1,873 lines, 11 s of Triton's compile.)
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
                # pointwise members reading each other's stored values in other shapes (a gelu recomputed in
                # GPT-2's backward: 6.3M elements in one program, 16 ms): one flat kernel each, in order
                items += [dataclasses.replace(it, members=[m]) for m in part.members]
            else:
                items.append(part)
    return dataclasses.replace(sched, items=items)


MAX_BLOCKS_PER_KERNEL = 32   # independent blocks (an optimizer's parameters) one horizontally fused kernel takes


def chunk_wide_groups(sched: Schedule, limit: int = MAX_BLOCKS_PER_KERNEL) -> Schedule:
    """Horizontally fused groups of many independent blocks in kernels of at most `limit` blocks each.

    densenet121's Adam step fused 364 parameters (1,500 pointer arguments, 364 program ranges) into one Triton
    kernel, which took minutes to compile; a few launches more cost microseconds."""
    def too_big(g: FusedGroup) -> bool:
        return len(g.members) > limit and group_shape(g) != ROWS and len({m.block for m in g.members}) > limit
    return split_elementwise(sched, too_big)


def _leading_scalars(group: FusedGroup) -> list:
    """The group's one-element pointwise members when they can run before all the others: none reads another
    kind of member of the group, and the group has no reduction (whose register values members may share)."""
    if int(group.numel) != 1 or any(m.is_reduction or m.local for m in group.members):
        return []
    scalars = [m for m in group.members if not m.inner]
    if not scalars or len(scalars) == len(group.members):
        return []
    dests = {m.dest for m in group.members if m.dest}
    if any(m.dest or m.reads & dests for m in scalars):   # moved first, they would write or read out of order
        return []
    others = {m.buf.name for m in group.members if m.inner}
    return [] if any(m.reads & others for m in scalars) else scalars


def group_shape(group: FusedGroup) -> str:
    pointwise = all(not m.is_reduction for m in group.members)
    same_r = len({(_rsize(m), m.block) for m in group.members}) == 1
    names = {m.buf.name for m in group.members}
    internal = any(m.reads & names for m in group.members)
    if pointwise and (not internal or group.elementwise):  # reads of each other: values forwarded in registers
        return FLAT if same_r else FOREACH
    return ROWS


@functools.lru_cache(maxsize=None)
def _sm_count() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 132


ARITHMETIC_BOUND = 3   # transcendental ops an element of a flat kernel (ir.EXPENSIVE) from which it gets smaller blocks


def launch_config(shape: str, rows: int, rmax: int, expensive: int = 0, reductions: str = "all") -> dict:
    """Block sizes and warps from the sizes (the heuristics). A large flat kernel doing at least
    ARITHMETIC_BOUND transcendental ops an element is bound by its arithmetic, not memory: 512-element blocks
    (one 16-byte vector a thread) ran the pointwise chain (sin, cos, sigmoid, tanh) 1.7% faster than 1024,
    and resnet50's memory-bound batch-norm kernels 3% slower (bench/gpu_flat_blocks.py, H100, 2026-11-25).

    Row kernels, from each kernel of GPT-2's, BERT's and densenet121's training steps timed alone under ~30
    configs (bench/gpu_kernel_configs.py, H100, 2026-11-26; bench/results/gpu_2026-11-26_s16_h100_configs_*):
    - a row padded to its power of two (GPT-2's and BERT's layer norms, 768 in 1024) runs one row a program on
      8 warps: 10.0 us against 11.5 for two rows on 8 warps over GPT-2's 2048 rows;
    - rows of 2048 to 4096 elements, at least 3 SMs' worth of them, loop instead of holding the row in
      registers: reductions alone (`reductions` "all") in 256-element steps on 8 warps, 5.4 us against 6.4 for
      densenet121's 1024 rows of 2048 (batch-norm backward sums); with an epilogue ("some": the input gradient
      after them) in 512-element steps on 16 warps, 10.3 us against 12.8 over 512 rows of 4096, 18.6 against
      19.5 with L2 emptied before each launch (--cold). Fewer rows, or a group without a reduction ("none":
      members reading each other's rows), keep the persistent kernel, as fast or faster there;
    - longer rows loop one row a program in 2048-element steps on 16 warps: GPT-2's cross-entropy over 2048
      rows of 50257, 151 us against 192 for two rows a program in 1024-element steps on 8 warps.
    A flat kernel of under 1M elements takes smaller blocks, down to 128, until it has 2 programs an SM:
    densenet121's backward sums 24 gradient slices of 32768 elements for each concatenated feature map, 8 us
    (0.4 TB/s) in 32 programs of 1024."""
    if shape in (FLAT, FOREACH):
        total = rows * rmax
        big = 512 if shape == FLAT and expensive >= ARITHMETIC_BOUND else 1024
        block = big if total >= (1 << 20) else max(128, min(1024, triton_next_pow2(total)))
        while shape == FLAT and block > 128 and math.ceil(total / block) < 2 * _sm_count():
            block //= 2   # few programs stream at a fraction of the bandwidth (the docstring's last case)
        warps = 4 if block >= 512 else (2 if block >= 256 else 1)
        return {"BLOCK": block, "num_warps": warps}
    if rmax <= 1:
        xblock = max(1, min(1024, triton_next_pow2(rows)))
        return {"XBLOCK": xblock, "RBLOCK": 1, "num_warps": 4 if xblock >= 512 else 2, "persistent": True}
    if rmax > PERSISTENT_MAX_R:
        return {"XBLOCK": 1, "RBLOCK": 2048, "num_warps": 16, "persistent": False}
    if reductions != "none" and rmax >= 2048 and rows >= 3 * _sm_count():
        return {"XBLOCK": 1, "RBLOCK": 256, "num_warps": 8, "persistent": False} if reductions == "all" else \
            {"XBLOCK": 1, "RBLOCK": 512, "num_warps": 16, "persistent": False}
    rblock = triton_next_pow2(rmax)
    if rmax < rblock and rblock >= 1024:
        return {"XBLOCK": 1, "RBLOCK": rblock, "num_warps": 8, "persistent": True}
    # enough programs to fill the GPU before making tiles taller
    xblock = 1
    while xblock * rblock < 2048 and xblock * 2 <= triton_next_pow2(rows) and \
            math.ceil(rows / (xblock * 2)) >= 2 * _sm_count():
        xblock *= 2
    tile = xblock * rblock
    warps = 16 if tile >= 8192 else 8 if tile >= 2048 else 4 if tile >= 512 else 2 if tile >= 128 else 1
    return {"XBLOCK": xblock, "RBLOCK": rblock, "num_warps": warps, "persistent": True}


def _reductions(group: FusedGroup) -> str:
    """Whether "all", "some" or "none" of a group's members are reductions (launch_config's rows)."""
    n = sum(m.is_reduction for m in group.members)
    return "all" if n == len(group.members) else "some" if n else "none"


def column_config(rows: int, rmax: int) -> dict:
    """Reductions down columns (a bias or layer-norm weight gradient: a sum over the rows of a row-major
    matrix). One column per program read each row's element alone, a 32-byte sector for 4 bytes (GPT-2's
    backward: 47 us for three sums over 2048 x 768); here a program takes a strip of at least 8 columns, so
    each row's piece is whole sectors, as many strips as fill the GPU, and loops down the rows. A strip that
    loops takes 16 columns or more in tiles of 1024 on 8 warps: GPT-2's column sums of 768 x 2048 ran 4.5 us
    against 8.2 with tiles of 8 x 512 on 4 warps (bench/gpu_kernel_configs.py, H100, 2026-11-26)."""
    from ember.codegen.reductions import GPU_COLUMN_STRIP
    xblock = GPU_COLUMN_STRIP
    while xblock < 64 and math.ceil(rows / (xblock * 2)) >= 2 * _sm_count():
        xblock *= 2
    rblock = max(1, min(triton_next_pow2(rmax), 4096 // xblock))
    if rmax <= rblock:
        return {"XBLOCK": xblock, "RBLOCK": rblock, "num_warps": 4, "persistent": True}
    xblock = max(xblock, 16)
    return {"XBLOCK": xblock, "RBLOCK": 1024 // xblock, "num_warps": 8, "persistent": False}


def is_columnwise(group: FusedGroup) -> bool:
    """Whether every member is a reduction and the loads run down columns: consecutive kept indices (x0) are
    neighbours in memory while the reduced index strides over rows, and no load runs along the reduction."""
    rflat = sympy.Symbol("rflat", integer=True, nonnegative=True)
    column = False
    for m in group.members:
        if not m.is_reduction or m.buf.kind.startswith("arg"):
            return False
        subst = _inner_index(m, rflat) if m.inner else {}
        for x in m.body.walk():
            if x.op != "load":
                continue
            off = sympy.sympify(x.args[1]).xreplace(subst)
            try:
                base = int(off.subs({X0: 0, rflat: 0}))
                along_x, along_r = int(off.subs({X0: 1, rflat: 0})) - base, int(off.subs({X0: 0, rflat: 1})) - base
            except (TypeError, ValueError):
                return False
            if along_x != 0 and abs(along_r) == 1:
                return False
            column |= along_x == 1 and abs(along_r) >= 8
    return column


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def kernel_args(group: FusedGroup) -> tuple[list[str], list[str]]:
    """Pointer arguments (buffers read, then written). A local reduction lives in registers; a local pointwise
    member that could not be inlined is stored (to a scratch buffer, see `inline_locals`)."""
    reductions = {m.buf.name for m in group.members if m.is_reduction}
    reads = sorted(set().union(*(m.reads for m in group.members)) - reductions)
    writes = [m.target for m in group.members if not (m.local and m.is_reduction)]  # in place: the input
    return list(dict.fromkeys(reads + writes)), writes


def inline_locals(group: FusedGroup) -> tuple[FusedGroup, list[str]]:
    """Members that only later members of the group read (schedule's `local` rows): substituted into their
    readers when every read is of the same element the member computes (a tile already holds it), else
    kept as scratch buffers. Returns the group to print and the scratch buffer names."""
    members, scratch = list(group.members), []
    for k in range(len(members)):
        m = members[k]   # (its body has the locals before it substituted already)
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
    return ir.rewrite(e, lambda x, go: value if x.op == "load" and x.args[0] == name else None)


def kernel_source(group: FusedGroup, sched: Schedule, name: str, fixup: bool = False) \
        -> tuple[str, list[str], dict, int]:
    """(source of one @triton.jit kernel, argument buffer names, launch config, number of programs). With
    `fixup`, a flat kernel computing float32 sin or cos may come as a flagged pair (_flagged_sincos): its
    config's "fixup" is then the second kernel's number of programs."""
    group, _ = inline_locals(group)
    args, writes = kernel_args(group)
    shape = group_shape(group)
    rows = max(int(group.numel), 1)
    rmax = max(_rsize(m) for m in group.members)
    expensive = sum(e.op in ir.EXPENSIVE for m in group.members if m.body is not None for e in m.body.walk()) \
        if shape == FLAT else 0
    cfg = column_config(rows, rmax) if shape == ROWS and rmax > 1 and is_columnwise(group) else \
        launch_config(shape, rows, rmax, expensive, _reductions(group))
    largest = max([rows * rmax] + [ir.prod(sched.buffers[a].size) + abs(int(sched.buffers[a].offset or 0))
                                   for a in args if sched.buffers[a].size])
    i64 = largest >= 2 ** 31 - 1
    extents = {a: _extent(sched.buffers[a]) for a in args}
    if shape == FLAT:
        flagged = fixup and _flagged_sincos(group, rows * rmax)
        if flagged:
            cfg = {**cfg, "BLOCK": max(cfg["BLOCK"], 1024), "fixup": 4 * _sm_count()}
        src = _flat_kernel(group, name, args, rows, rmax, i64, extents, cfg["BLOCK"], flagged)
        grid = math.ceil(rows * rmax / cfg["BLOCK"])
    elif shape == FOREACH:
        src, grid = _foreach_kernel(group, name, args, rows, cfg["BLOCK"], i64, extents)
    else:
        src = _rows_kernel(group, name, args, rows, cfg, i64, extents)
        grid = math.ceil(rows / cfg["XBLOCK"])
    return src, args, cfg, grid


def _extent(buf) -> int:
    """Elements of a buffer's storage its own layout can address (what a load may touch)."""
    if any(int(s) == 0 for s in buf.size):
        return 0
    return int(buf.offset or 0) + sum((int(n) - 1) * int(st) for n, st in zip(buf.size, buf.stride)) + 1


def is_empty(group: FusedGroup) -> bool:
    """Nothing to compute: no rows, or only pointwise members over empty inner ranges."""
    return int(group.numel) == 0 or all(not m.is_reduction and _rsize(m) == 0 for m in group.members)


def _header(group, name, args, consts) -> list[str]:
    return [f"# fused fx nodes: {', '.join(group.origins())[:200]}", "@triton.jit",
            f"def {name}({', '.join(args + [f'{c}: tl.constexpr' for c in consts])}):"]


def _is_literal(v: str) -> bool:
    return v.startswith("float(") or v.startswith("tl.full(") or v.lstrip("-").replace(".", "", 1).replace(
        "e", "", 1).replace("-", "", 1).isdigit()


def _store(m: Member, value: str, offset: str, mask: str, shape: str) -> str:
    t = TL[m.buf.dtype]
    if offset.lstrip("-").isdigit():  # one element (a full reduction): a pointer per lane, all the same
        offset = f"{offset} + 0 * {'xindex' if shape == '[BLOCK]' else 'x0'}"
    if _is_literal(value):  # a constant: give it the tile's shape
        value = f"tl.full({shape}, {value}, {t})"
    return f"tl.store({m.target} + {offset}, ({value}).to({t}), {mask})"


def _flagged_sincos(group: FusedGroup, elements: int) -> bool:
    """Whether a flat kernel of `elements` (FLAGGED_MIN or more) computes float32 sin or cos and may run twice
    over the same inputs: _sincos's test for an argument past the fast path, a block-wide max, cost the
    pointwise chain 15% (0.215 against 0.183 ms, bench/gpu_pointwise_bound.py, H100, 2026-11-26); a flagged
    kernel skips it and raises a flag instead, and a second kernel, which returns at once unless the flag is
    up, redoes the whole range with _sincos (~2 us a call). Not where the kernel stores over memory it reads
    (an in-place update, or a result taking over a dying input): running it again would read its own results."""
    if not config.OWN_SINCOS or elements < FLAGGED_MIN or any(m.dest for m in group.members):
        return False
    stored = {m.buf.name for m in group.members if not m.local}
    if any(r in stored for m in group.members for r in m.reads):
        return False
    return any(e.op in ("sin", "cos") and compute_type(e.args[0].dtype) == "tl.float32"
               for m in group.members if m.body is not None for e in m.body.walk())


FLAGGED_MIN = 1 << 22   # elements from which a flat kernel is flagged: the block test costs ~0.5 ns an element
# (0.03 ms of the chain's 64M), a fixup ~2 us of the GPU's and a launch of the host's
FIXUP_META = {"BLOCK": 128, "num_warps": 4}   # a fixup kernel's: one element a thread, so libdevice's sin and
# cos are inlined once, not once per element a thread holds (the pointwise chain's compiled in 0.15 s, not 0.27)


def _flat_kernel(group, name, args, rows, rsize, i64, extents, block: int, flagged: bool = False) -> list[str]:
    """One program a block of the flat range; `flagged`: the flagged pair of _flagged_sincos: the kernel, its sin
    and cos from _sincos_flagged, and KERNEL_fixup, the range in a loop over its blocks of FIXUP_META's size,
    with _sincos's sin and cos (libdevice's in blocks holding a large argument: the values of the others stay
    the same bits), which lowers the flag when all its programs have run."""
    pid = "tl.program_id(0).to(tl.int64)" if i64 else "tl.program_id(0)"
    if not flagged:
        return _header(group, name, args, ["BLOCK"]) + _flat_range(group.members, pid, rows, rsize, extents, "    ",
                                                                  block=block)
    L = _header(group, name, args + ["sincos_flag"], ["BLOCK"])
    L += _flat_range(group.members, pid, rows, rsize, extents, "    ", block=block,
                     sincos_call="_sincos_flagged({}, sincos_flag)")
    L += ["", ""] + _header(group, f"{name}_fixup", args + ["sincos_flag"], ["BLOCK"])[1:]
    fix_block = FIXUP_META["BLOCK"]
    # (an int64 start makes the loop's variable int64: Triton promotes it to the widest of start, end and step)
    L += ["    if tl.load(sincos_flag) != 0:",
          f"        for pid in range({pid}, {math.ceil(rows * rsize / fix_block)}, tl.num_programs(0)):"]
    L += _flat_range(group.members, "pid", rows, rsize, extents, " " * 12, block=fix_block)
    L += ["        if tl.atomic_add(sincos_flag + 1, 1) == tl.num_programs(0) - 1:   # every program has read it",
          "            tl.store(sincos_flag, 0)",
          "            tl.store(sincos_flag + 1, 0)"]
    return L


def _flat_range(members, pid: str, rows, rsize, extents, ind: str, prefix: str = "t",
                block: int | None = None, sincos_call: str | None = None) -> list[str]:
    """Members over rows x rsize as one flat range, program `pid` taking BLOCK elements of it. When `block`
    (BLOCK's value) divides the range, every lane is in it: a mask of constants, which Triton folds away (no
    compare, no predicated loads and stores: the pointwise chain is bound by its arithmetic)."""
    total = rows * rsize
    full = block is not None and total % block == 0
    L = [f"{ind}xindex = {pid} * BLOCK + tl.arange(0, BLOCK)",
         f"{ind}xmask = tl.full([BLOCK], True, tl.int1)" if full else f"{ind}xmask = xindex < {total}"]
    i = sympy.Symbol("xindex", integer=True, nonnegative=True)
    ranges = {i: total}
    b = Body({}, "xmask", ind, ranges, extents)  # one body: members share their loads (CSE)
    b.prefix = prefix
    if sincos_call:
        b.sincos_call = sincos_call
    stores = []
    values: dict = {}  # member name -> its value Expr: an elementwise group's members read each other's element
    for m in members:
        subst = {X0: FloorDiv(i, rsize) if rows > 1 else sympy.Integer(0)}
        subst.update(_inner_index(m, ModIndex(i, rsize) if rows > 1 else i))
        mbody = m.body
        for name in m.reads & values.keys():
            mbody = _replace_loads(mbody, name, values[name])
        values[m.buf.name] = mbody
        body = ir.substitute(mbody, subst, ranges)
        store = ir.simplify_index(sympy.sympify(m.store).xreplace(subst), ranges)
        v = b.emit(body)
        stores.append(ind + _store(m, v, index_code(store, {}), "xmask", "[BLOCK]"))
    # stores last: every load comes first (an input updated in place is read before it is written)
    return L + b.lines + stores


def _foreach_kernel(group, name, args, rows, block: int, i64, extents) -> tuple[list[str], int]:
    """Pointwise members of several sizes or blocks (schedule's `Member.block`: one parameter's updates): one
    flat range per (size, block), one after the other over the program ids, so a program touches the few
    tensors of one block (not every parameter's). Readers of an in-place input's old value and members
    reading each other's element share the writer's block, hence its range."""
    by_size: dict = {}
    for m in group.members:
        by_size.setdefault((_rsize(m), m.block), []).append(m)
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
        lines = _flat_range(members, "lpid", rows, rsize, extents, "        ", prefix="s_", block=block)
        pointers: list = []

        def numbered(m: re.Match) -> str:   # q<i>: the range's i-th pointer, in order of first use
            if m[0] not in pointers:
                pointers.append(m[0])
            return f"q{pointers.index(m[0])}"
        code = word.sub(numbered, "\n".join(lines))
        same_code.setdefault((n, code), []).append(pointers)
    L = _header(group, name, args, ["BLOCK"])
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


REDUCE_IDENTITY = {"sum": "0", "prod": "1", "any": "0", "all": "1"}


def _identity(kind: str, dtype: torch.dtype) -> str:
    if kind in REDUCE_IDENTITY:
        return REDUCE_IDENTITY[kind]
    big = kind in ("min", "argmin")
    if dtype.is_floating_point:
        return "float('inf')" if big else "float('-inf')"
    if dtype == torch.bool:
        return "1" if big else "0"
    info = torch.iinfo(dtype)
    return str(info.max if big else info.min)


def _rows_kernel(group, name, args, rows, cfg, i64, extents) -> list[str]:
    L = _header(group, name, args, ["XBLOCK", "RBLOCK"])
    ind = "    "
    pid = "tl.program_id(0).to(tl.int64)" if i64 else "tl.program_id(0)"
    L.append(f"{ind}x0 = {pid} * XBLOCK + tl.arange(0, XBLOCK)[:, None]")
    L.append(f"{ind}xmask = x0 < {rows}")
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
        R = _rsize(m)
        ranges = {X0: rows, rflat: max(R, 1)}
        subst = _inner_index(m, rflat) if m.inner else {}
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
        if R == 0:  # an empty inner range: a reduction gives its identity, a pointwise member writes nothing
            if m.is_reduction:
                ident = "0" if m.buf.kind.startswith("arg") else _identity(m.buf.kind, m.body.dtype)
                L.append(f"{ind}{m.buf.name}_v = tl.full([XBLOCK, 1], {ident}, {compute_type(m.buf.dtype)})")
                scalars[m.buf.name] = f"{m.buf.name}_v"
                if not m.local:
                    L.append(ind + _store(m, f"{m.buf.name}_v", index_code(sympy.sympify(m.store), {}), "xmask",
                                          "[XBLOCK, 1]"))
                    stored_here.add(m.buf.name)
            continue
        if R <= 1 and not m.inner:
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
                L.append(ind + _store(m, v, index_code(store, {}), "xmask", "[XBLOCK, 1]"))
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
                # (a layer norm's weight and bias were loaded after its two, each waiting a latency of its own)
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
                    L.append(ind + _store(m, f"{m.buf.name}_v", index_code(store, {}), "xmask", "[XBLOCK, 1]"))
            else:
                L.append(ind + _store(m, v, index_code(store, {}), f"rmask{R}", "[XBLOCK, RBLOCK]"))
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


def _acc_type(m: Member) -> str:
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
    body = ir.substitute(m.body, _inner_index(m, rflat), ranges)
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
    group computes, issued at the kernel's start: {(buffer, offset): variable, "lines": their statements}. Where
    they were first used, after a reduction's barrier, each waited a memory latency of its own. (A graph input
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
    L.append(f"{ind}for roff in range(0, {R}, RBLOCK):")
    ii = ind + "    "
    L.append(f"{ii}rflat = roff + tl.arange(0, RBLOCK)[None, :]")
    L.append(f"{ii}mask = xmask & (rflat < {R})")
    b = Body(scalars, "mask", ii, ranges, extents)
    b.row_mask = "xmask"
    b.stored.update(hoisted or {})
    b.prefix = f"{ms[0].buf.name}_t"   # a name reused from an earlier member would be a loop-carried variable to Triton
    after = []
    for m, body, store in zip(ms, bodies, stores):
        if m.buf.name in online:   # accumulated with its max's update, reduced right after it
            if not m.local:
                after.append(ind + _store(m, f"{m.buf.name}_v", index_code(store, {}), "xmask", "[XBLOCK, 1]"))
            continue
        done = len(b.lines)
        v = b.emit(body)
        L += b.lines[done:]
        if not m.is_reduction:
            L.append(ii + _store(m, v, index_code(store, {}), "mask", "[XBLOCK, RBLOCK]"))
            continue
        if m.buf.name in sum_of:
            upd, fin = _accumulate_online(m, by_name[sum_of[m.buf.name]], v, ii, ind)
        else:
            upd, fin = _accumulate(m, v, ii, ind)
        L += upd
        after += fin
        if not m.local:
            after.append(ind + _store(m, f"{m.buf.name}_v", index_code(store, {}), "xmask", "[XBLOCK, 1]"))
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
            name, text = _canonical(src, args + [m.buf.name for m in it.members])
            if name not in seen:
                seen.add(name)
                parts.append(text)
            kernels.append((it, name, args, cfg, grid))
        elif isinstance(it, FusedGroup) and not is_empty(it):
            src, args, cfg, grid = kernel_source(it, sched, "KERNEL", fixup=True)
            name, text = _canonical(src, args + [m.buf.name for m in it.members])
            if name not in seen:   # identical kernels (repeated layers) are compiled once
                seen.add(name)
                parts.append(text)
            kernels.append((it, name, args, cfg, grid))
    return "\n\n\n".join(parts) + "\n", kernels


def _canonical(src: list[str], buffers: list[str]) -> tuple[str, str]:
    """Kernel text with buffers renamed p0, p1... in argument order, named by the hash of that text."""
    comment, body = src[0], "\n".join(src[1:])
    new = {n: f"p{j}" for j, n in enumerate(dict.fromkeys(buffers))}
    if new:   # one pass over the text (a pass per buffer was quadratic in a wide kernel's size)
        names = "|".join(map(re.escape, sorted(new, key=len, reverse=True)))
        body = re.sub(rf"\b({names})(?=\b|_)", lambda m: new[m.group(1)], body)
    name = "k_" + hashlib.sha256(body.encode()).hexdigest()[:16]
    return name, comment + "\n" + body.replace("def KERNEL(", f"def {name}(").replace("def KERNEL_", f"def {name}_")


class _InterpretedLibdevice:
    """libdevice for TRITON_INTERPRET=1 (kernels run on the CPU with numpy, so the printer is tested without a
    GPU): Triton's interpreter patches triton.language but not libdevice's externs."""
    NUMPY = {"log10": "log10", "tan": "tan", "asin": "arcsin", "acos": "arccos", "atan": "arctan",
             "sinh": "sinh", "cosh": "cosh", "tanh": "tanh", "asinh": "arcsinh", "acosh": "arccosh",
             "atanh": "arctanh", "log1p": "log1p", "expm1": "expm1", "nearbyint": "rint", "rint": "rint",
             "trunc": "trunc", "signbit": "signbit", "atan2": "arctan2", "copysign": "copysign", "hypot": "hypot",
             "pow": "power", "fmod": "fmod", "nextafter": "nextafter"}

    def __getattr__(self, name):
        import numpy as np
        import triton.language as tl
        from triton.runtime.interpreter import TensorHandle
        if name == "rsqrt":
            f = lambda x: (1 / np.sqrt(x)).astype(x.dtype)  # noqa: E731
        elif name == "fma":   # the product exact in float64, as a fused multiply-add's (_sincos's reduction;
            # libdevice's own fma flushes denormals, eager's kernels do not)
            f = lambda a, b, c: a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)  # noqa: E731
        elif name in ("erfc", "lgamma"):
            fn = math.erfc if name == "erfc" else math.lgamma
            f = lambda x: np.vectorize(fn, otypes=[x.dtype])(x)  # noqa: E731
        else:
            f = getattr(np, self.NUMPY[name])

        def call(*args):
            first = next(a for a in args if isinstance(a, tl.tensor))
            data = [a.handle.data if isinstance(a, tl.tensor) else np.asarray(a, first.handle.data.dtype)
                    for a in args]
            out = np.asarray(f(*data))
            if out.dtype == np.bool_:
                out = out.astype(np.int32)
                return tl.tensor(TensorHandle(out, tl.int32), first.type.with_element_ty(tl.int32)
                                 if first.type.is_block() else tl.int32)
            return tl.tensor(TensorHandle(out.astype(first.handle.data.dtype), first.handle.dtype), first.type)
        return call


def cache_dir() -> str:
    root = os.environ.get("EMBER_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "ember")
    d = os.path.join(root, "triton")
    os.makedirs(d, exist_ok=True)
    return d


def load_module(source: str):
    """Import generated source from the on-disk cache (Triton needs a real file to read kernels' source)."""
    key = hashlib.sha256(source.encode()).hexdigest()[:24]
    name = f"ember_triton_{key}"
    if name in sys.modules:
        return sys.modules[name]
    path = os.path.join(cache_dir(), f"{key}.py")
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(source)
        os.replace(tmp, path)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if os.environ.get("TRITON_INTERPRET") == "1":
        mod.libdevice = _InterpretedLibdevice()
        mod._rsqrt = mod.libdevice.rsqrt    # (the interpreter runs no inline PTX)
        mod._fma = mod.libdevice.fma
    sys.modules[name] = mod
    return mod


_COMPILE_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=max(8, triton_workers.WORKERS),
                                                      thread_name_prefix="ember-triton")
WORKERS_FROM = 4   # kernels in a graph from which they compile in worker processes (starting one costs ~0.2 s)


def _precompile(mod, kernels: list, sched: Schedule, device: torch.device) -> list:
    """Compile and load every kernel now, concurrently, instead of one by one at first launch: Triton's passes
    and PTX assembly run outside the GIL, its Python frontend inside it, so a graph of many kernels compiles in
    worker processes (triton_workers) and only loads here. Loaded for ember's launcher (cuda_launch) where it
    fits: Triton 3.6's own launcher is a C stub built for each new argument signature (~0.3 s of gcc each;
    resnet50 has 8, a third of its cold compile when built serially at first launch). Argument dtypes stand in
    for tensors (Triton's warmup takes them). A kernel is compiled once per source, block sizes and argument
    dtypes: groups printing one source may launch it with other block sizes (a full-mask flat kernel's text
    does not hold its size: one compiled for 256-element blocks, launched on a grid counted in 128s, wrote past
    its output). Returns, per entry of `kernels`, (the loaded kernel, its fixup's): cuda_launch.Loaded or
    Triton's compiled kernel, None where it did not load."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return [(None, None)] * len(kernels)
    t0 = time.perf_counter()
    if device.type == "cuda":
        cuda_launch.EXTENSION.get()   # (starts its build, once per machine, while Triton compiles)
    names = {name for _, name, *_ in kernels}
    in_workers = mod.__file__ if device.type == "cuda" and len(names) >= WORKERS_FROM else None
    keys, wanted = [], {}
    for _, name, args, cfg, _grid in kernels:
        dtypes = [sched.buffers[a].dtype for a in args] + ([torch.int32] if "fixup" in cfg else [])
        keys.append((name, tuple(sorted(launch_meta(cfg).items())), tuple(dtypes)))
        wanted[keys[-1]] = (dtypes, cfg)
    jobs = {}
    # the longest sources first (the slowest to compile): one of them started last was the pool's tail
    for key in sorted(wanted, key=lambda k: -len(getattr(getattr(mod, k[0]), "src", ""))):
        name, (dtypes, cfg) = key[0], wanted[key]
        jobs[key] = (_COMPILE_POOL.submit(_compile_and_load, getattr(mod, name), dtypes, launch_meta(cfg), device,
                                          in_workers),
                     _COMPILE_POOL.submit(_compile_and_load, getattr(mod, f"{name}_fixup"), dtypes, FIXUP_META,
                                          device, in_workers) if "fixup" in cfg else None)

    def result(job, name: str):
        try:
            kernel = job.result() if job is not None else None
        except Exception as e:  # compiled again (and any error raised) at the first launch
            code_log.debug("precompiling %s failed: %s: %s", name, type(e).__name__, e)
            return None
        return kernel if getattr(kernel, "function", None) is not None else None
    loaded = {key: (result(main, key[0]), result(fixup, f"{key[0]}_fixup")) for key, (main, fixup) in jobs.items()}
    STATS["compile_s"] += time.perf_counter() - t0
    code_log.debug("compiled %d Triton kernels in %.2fs", len(jobs), time.perf_counter() - t0)
    return [loaded[key] for key in keys]


def launch_meta(cfg: dict) -> dict:
    """A launch config's Triton meta-parameters (BLOCK..., num_warps), without ember's own keys."""
    return {k: v for k, v in cfg.items() if k not in ("persistent", "fixup")}


def _compile_and_load(fn, dtypes: list, meta: dict, device: torch.device, module_path: str | None = None):
    """Triton's compiled kernel, loaded: for ember's launcher (cuda_launch.Loaded) where it fits, else Triton's.
    With `module_path`, a worker process compiles it first (triton_workers), and the warmup here reads it from
    Triton's cache."""
    if module_path is not None:
        spec = triton_workers.specialization(fn, dtypes, meta)
        if spec is not None:
            triton_workers.compile_in_worker(module_path, fn.fn.__name__, spec)
    kernel = fn.warmup(*dtypes, grid=(1,), **meta)
    if device.type == "cuda" and hasattr(kernel, "_init_handles"):
        with torch.cuda.device(device):   # the module loads into this device's context, from this thread
            loaded = cuda_launch.load(kernel, len(dtypes), device) if FAST_LAUNCH else None
            if loaded is not None:
                return loaded
            kernel._init_handles()
    return kernel


class Launcher:
    """Launches one compiled kernel with a fixed grid, skipping Triton's per-call binder.

    `kernel[grid](...)` re-derives the argument specialization and looks up the compiled kernel on every call
    (about 19 µs on the H100 machine, bench/gpu_launch.py); a graph launches hundreds of kernels, so that is
    most of a step's host time. The first launch goes through Triton and keeps the CompiledKernel; later ones
    call its launcher directly (about 8 µs). Triton specialized the pointers on 16-byte alignment, so a call
    whose pointers are not all aligned (a view at an odd offset) goes through Triton again.

    Pointers go to the launcher as integers, computed once for the alignment test: given a tensor, Triton's C
    launcher calls its data_ptr() and then asks the driver whether that address is device memory
    (cuPointerGetAttribute), ~1 us per argument (an Adam step over 10 parameters passes 50). A launcher that
    refuses integers gets the tensors (`raw` False, found at the first call)."""

    def __init__(self, fn, grid: int, meta: dict, device: torch.device):
        self.fn, self.grid, self.meta = fn, grid, meta
        names = list(fn.arg_names)
        self.constexprs = tuple(meta[n] for n in names if n in meta)   # kernel parameters after the pointers
        self.device_index = device.index if device.index is not None or not FAST_LAUNCH else torch.cuda.current_device()
        self.kernel = None
        self.aligned_only = True
        self.raw: bool | None = None    # whether the launcher takes integer pointers (None: not tried yet)
        self.native = None   # ember's launcher and its first arguments (cuda_launch), when it loaded the kernel

    def preloaded(self, kernel) -> None:
        """Launch `kernel` (compiled by warmup with every pointer 16-byte aligned) from the first call on."""
        if isinstance(kernel, cuda_launch.Loaded):
            self.native = (kernel.launch, (kernel.function, self.grid, kernel.threads, kernel.shared, kernel.nulls,
                                           kernel.device))
        elif not (FAST_LAUNCH and hasattr(kernel, "packed_metadata")):
            return
        self.kernel, self.aligned_only = kernel, True

    def __call__(self, *args):
        k = self.kernel
        if k is not None:
            if self.native is not None:
                ptrs = _aligned_ptrs(args)
                if ptrs is not None:
                    launch, head = self.native
                    launch(*head, _raw_stream(self.device_index), *ptrs)
                    return
            ptrs = list(map(_data_ptr, args))
            if self.native is None and (not self.aligned_only or not any(p % 16 for p in ptrs)):
                try:
                    k.run(self.grid, 1, 1, _raw_stream(self.device_index), k.function, k.packed_metadata, None,
                          None, None, *(ptrs if self.raw is not False else args), *self.constexprs)
                except (TypeError, ValueError):
                    if self.raw is not None:
                        raise
                    self.raw = False    # this launcher takes tensors only: this call and the next ones
                    return self(*args)
                if self.raw is None:
                    self.raw = True
                return
        kernel = self.fn[(self.grid,)](*args, **self.meta)   # (Triton's binder: a pointer not 16-byte aligned)
        if FAST_LAUNCH and self.kernel is None and hasattr(kernel, "packed_metadata"):
            self.kernel = kernel
            self.aligned_only = not any(a.data_ptr() % 16 for a in args)


FAST_LAUNCH = os.environ.get("TRITON_INTERPRET") != "1"
_data_ptr = torch.Tensor.data_ptr


def _aligned_ptrs(args: tuple) -> tuple | None:
    """The arguments' addresses, or None when one is not 16-byte aligned. Replaced by native_guards'
    aligned_data_ptrs once that is loaded (_use_native_pointers): one C++ call in place of a data_ptr() call
    and a test per argument (~1 us of a small kernel's launch; densenet121's default mode launches ~300)."""
    ptrs = tuple(map(_data_ptr, args))
    return None if any(p % 16 for p in ptrs) else ptrs


def _use_native_pointers() -> None:
    global _aligned_ptrs
    native = native_guards.checker()
    if native is not None and hasattr(native, "aligned_data_ptrs"):
        _aligned_ptrs = native.aligned_data_ptrs


def _raw_stream(index: int) -> int:
    return torch.cuda.current_stream(index).cuda_stream


if hasattr(torch._C, "_cuda_getCurrentRawStream"):  # what Triton itself calls: the same value, faster
    _raw_stream = torch._C._cuda_getCurrentRawStream  # noqa: F811


def compile_schedule(sched: Schedule, fallback: Callable, device: torch.device, check_inputs: bool = True) -> Callable:
    """The host program for a schedule on `device`: `call(list of inputs) -> list of outputs`."""
    from ember.codegen import wrapper
    source, kernels = generate(sched)
    mod = load_module(source)
    launch = {}
    globs = {}
    for group, name, args, cfg, grid in kernels:
        launch[group.name] = (name, args, grid, "fixup" in cfg)
        globs[f"_launch_{group.name}"] = Launcher(getattr(mod, name), grid, launch_meta(cfg), device)
        if "fixup" in cfg:   # a flagged pair (_flagged_sincos): its flag and counter, zero between calls
            globs[f"_flag_{group.name}"] = torch.zeros(2, dtype=torch.int32, device=device)
            globs[f"_fixup_{group.name}"] = Launcher(getattr(mod, f"{name}_fixup"), cfg["fixup"], FIXUP_META, device)
    for group, *_ in kernels:   # rows the schedule keeps local but a Triton tile cannot: one buffer each
        for b in inline_locals(group)[1]:
            buf = sched.buffers[b]
            globs[b] = torch.empty_strided(tuple(int(x) for x in buf.size), tuple(int(x) for x in buf.stride),
                                           dtype=buf.dtype, device=device)
    for (group, *_), (kernel, fixup) in zip(kernels, _precompile(mod, kernels, sched, device)):
        if kernel is not None:
            globs[f"_launch_{group.name}"].preloaded(kernel)
        if fixup is not None:
            globs[f"_fixup_{group.name}"].preloaded(fixup)

    def kernel_call(group: FusedGroup) -> str:
        if group.name not in launch:
            return "pass  # empty"
        name, args, grid, flagged = launch[group.name]
        if flagged:
            a = ", ".join(args + [f"_flag_{group.name}"])
            return f"_launch_{group.name}({a}); _fixup_{group.name}({a})  # {name}[({grid},)] and its fixup"
        return f"_launch_{group.name}({', '.join(args)})  # {name}[({grid},)]"

    globs["_fallback"] = fallback
    _use_native_pointers()
    call = wrapper.python_wrapper(sched, kernel_call, globs, check_inputs)
    call.namespace["_empty"] = functools.partial(torch.empty_strided, device=device)
    call.kernel_source = source
    call.kernels = kernels
    call.sched = sched
    if code_log.isEnabledFor(10):
        code_log.debug("triton kernels (%d):\n%s\nhost program:\n%s", len(kernels), source[len(PRELUDE):],
                       call.source)
    return call


def _cpu_values_pass_through(gm: torch.fx.GraphModule) -> bool:
    """Whether every CPU tensor of a CUDA graph only travels between library calls, inputs and outputs, so no
    generated kernel reads one: e.g. the philox seed and offset (CPU scalars) that CUDA attention with dropout
    returns and its backward takes."""
    from ember.decomp.table import EXTERN, TABLE

    def library_call(n: torch.fx.Node) -> bool:
        return n.op == "call_function" and (n.target in EXTERN or (
            isinstance(n.target, torch._ops.OpOverload) and n.target not in TABLE))

    def on_cpu(n: torch.fx.Node) -> bool:
        v = n.meta.get("val")
        return isinstance(v, torch.Tensor) and v.device.type == "cpu"

    for n in gm.graph.nodes:
        if not on_cpu(n):
            continue
        made_by = n.args[0] if n.target is operator.getitem else n
        if not (n.op == "placeholder" or library_call(made_by)):
            return False
        if not all(u.op == "output" or library_call(u) for u in n.users):
            return False
    return True


def compile_aten(gm: torch.fx.GraphModule, example_inputs: list, options: dict | None = None) -> Callable:
    """Compile a functional ATen-level fx graph (node.meta['val'] set) on CUDA tensors into Triton kernels.
    The same contract as ember.backends.ember_backend.compile_aten (the C++ one)."""
    import torch.utils._pytree as pytree

    from ember.codegen import lower, schedule
    t0 = time.perf_counter()
    devices = {v.device.type for n in gm.graph.nodes for v in pytree.tree_leaves(n.meta.get("val"))
               if isinstance(v, torch.Tensor)} | {t.device.type for t in example_inputs if isinstance(t, torch.Tensor)}
    devices.discard("meta")     # shape-only values some graphs carry
    if devices - {"cuda"} and not (os.environ.get("TRITON_INTERPRET") == "1" and devices == {"cpu"}) and \
            not _cpu_values_pass_through(gm):
        # e.g. torch.optim's step counters, kept on the CPU unless capturable=True: the CPU scalars are computed
        # by the C++ backend and reach the kernels in one copy (host_scalars)
        if devices == {"cpu", "cuda"}:
            from ember.backends.ember_backend import compile_aten as compile_cpp
            from ember.codegen import host_scalars
            # under mode="reduce-overhead" the device part is replayed as a CUDA graph (cudagraphs.aot_compilers)
            graphed = (options or {}).get("cudagraphs.device_part")
            device_options = {k: v for k, v in (options or {}).items() if k != "cudagraphs.device_part"}

            def compile_device(g, ex):
                f = compile_aten(g, ex, device_options)
                return graphed(f, g) if graphed is not None else f
            split = host_scalars.compile_split(gm, example_inputs, lambda g, ex: compile_cpp(g, ex, options),
                                               compile_device)
            if split is not None:
                return split
        fallback_log.warning("graph runs eagerly (Triton backend): it mixes %s tensors with CUDA ones",
                             "/".join(sorted(devices - {"cuda"})))
        STATS["eager_graphs"] += 1
        return gm.forward
    try:
        with lower.LOWERING_LOCK:
            low, out_spec, _ = lower.lower(gm, example_inputs, target="gpu")
            mutations = gm.meta.get("ember_input_mutations")
            sched = split_few_row_groups(schedule.schedule(low, mutations=mutations, across=True))
            schedule.write_in_place(sched, mutations)   # the split may have made more of them safe
            # after it: what it inlines must not be written
            schedule.recompute_scalars(sched, mutations, LIBDEVICE_OPS)
            sched = chunk_wide_groups(sched)
            if not (options or {}).get("max_autotune"):   # (the matmul templates print their epilogues' stores)
                registers_for_private_values(sched)
                overwrite_dying_inputs(sched)
            device = next((t.device for t in example_inputs if isinstance(t, torch.Tensor)), torch.device("cuda"))
            if (options or {}).get("max_autotune"):
                from ember.codegen import mm_template
                sched = mm_template.fuse_mm_epilogues(sched, device, force=options.get("max_autotune.force"))
            call = compile_schedule(sched, lambda args: gm(*args), device, not gm.meta.get("ember_guarded", False))
    except (CannotLower, NotImplementedError) as e:
        fallback_log.warning("graph runs eagerly (Triton backend): %s: %s", type(e).__name__, e)
        STATS["eager_graphs"] += 1
        return gm.forward
    except Exception as e:  # a bug in lowering/scheduling/printing: never wrong, so run this graph eagerly
        fallback_log.warning("graph runs eagerly: the Triton backend failed to compile it (an ember bug): %s: %s",
                             type(e).__name__, e, exc_info=True)
        STATS["eager_graphs"] += 1
        return gm.forward
    code_log.debug("graph %s lowered and printed in %.3fs", type(gm).__name__, time.perf_counter() - t0)
    STATS["graphs"] += 1
    STATS["kernels"] += len({name for _, name, *_ in call.kernels})

    unflatten = fast_unflatten(out_spec)

    def run(*args):
        return unflatten(call(list(args)))
    run.compiled = call
    return run
