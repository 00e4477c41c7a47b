"""16-bit floats in the C++ backend (float16, bfloat16): stored as their bits (uint16_t buffers), computed in float.

A load converts to float (exactly), arithmetic runs in float with no rounding in between (as Inductor's fused
kernels, and as eager's own kernels compute one op), and a store rounds to the buffer's type (round to nearest
even, as eager converts). Values that stay in the kernel (row buffers, a reduction's result, a value a later member
of the loop reads) keep float; a cast to a 16-bit type rounds and keeps computing in float, and a cast of a
16-bit value computed here rounds it first, so an explicit `.to()` rounds where eager's does.

The element conversions are plain integer and float code, no _Float16 (g++ 12 vectorizes neither _Float16
conversion): g++ vectorizes them at every target (-march=native, AVX2, the portable x86-64 build), and they agree
with torch's conversions on every float32 and every 16-bit pattern (tests/codegen/test_cpp_lowp.py). A float16
inner loop converts its contiguous operands and results in chunks with F16C/AVX-512 instructions (Chunks, below).
float16 -> float: normal and infinite/NaN values rebias the exponent, subnormals are their integer times 2^-24;
float -> float16: a normal value rounds by adding half an ulp (less one, plus the kept mantissa's last bit) and
shifting, a subnormal by a float addition to 0.5 (whose ulp is float16's smallest subnormal), 65520 and up
overflow to infinity; bfloat16 is the high half of a float, rounded the same way, NaN kept quiet.
"""
from __future__ import annotations

import re

import sympy
import torch

from ember import config, ir

LOW_PRECISION = (torch.float16, torch.bfloat16)
STORAGE = "uint16_t"   # a 16-bit buffer's element type in the kernel's signature
_SUFFIX = {torch.float16: "h", torch.bfloat16: "bf"}

PRELUDE = r"""
#include <cstring>
static inline float ember_bits_f(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline uint32_t ember_f_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
// c ? a : b by masks: g++ turned the ternaries around a float operation into branches ("control flow in loop")
static inline uint32_t ember_sel(bool c, uint32_t a, uint32_t b) {
  uint32_t m = 0u - (uint32_t)c;
  return (a & m) | (b & ~m);
}
static inline float ember_bf2f(uint16_t h) { return ember_bits_f((uint32_t)h << 16); }
static inline uint16_t ember_f2bf(float f) {  // round to nearest even; NaN stays NaN (quiet)
  uint32_t u = ember_f_bits(f);
  uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return (uint16_t)ember_sel((u & 0x7fffffffu) > 0x7f800000u, (u >> 16) | 0x40u, r);
}
static inline float ember_h2f(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16, em = h & 0x7fffu;
  uint32_t normal = (em << 13) + ember_sel(em >= 0x7c00u, 0x70000000u, 0x38000000u);   // exponent + 112 (inf/NaN: 255)
  uint32_t sub = ember_f_bits((float)(int32_t)em * 0x1p-24f);
  return ember_bits_f(sign | ember_sel(em < 0x400u, sub, normal));
}
static inline uint16_t ember_f2h(float f) {  // IEEE round to nearest even, subnormals, overflow to inf, NaN quiet
  uint32_t u = ember_f_bits(f), a = u & 0x7fffffffu, sign = (u >> 16) & 0x8000u;
  uint32_t normal = (a + 0xc8000fffu + ((a >> 13) & 1u)) >> 13;   // exponent - 112, + half an ulp (ties to even)
  uint32_t sub = ember_f_bits(ember_bits_f(a) + 0.5f) - 0x3f000000u;
  uint32_t r = ember_sel(a > 0x7f800000u, 0x7e00u, ember_sel(a >= 0x477ff000u, 0x7c00u,
                                                              ember_sel(a < 0x38800000u, sub, normal)));
  return (uint16_t)(sign | r);
}
static inline float ember_round_h(float f) { return ember_h2f(ember_f2h(f)); }
static inline float ember_round_bf(float f) { return ember_bf2f(ember_f2bf(f)); }
"""


def load(dtype: torch.dtype, code: str) -> str:
    """C++ of the float value of element `code` of a buffer of `dtype` (as it is for other dtypes)."""
    return f"ember_{_SUFFIX[dtype]}2f({code})" if dtype in LOW_PRECISION else code


def store(dtype: torch.dtype, value: str) -> str:
    """C++ of float `value` as a buffer of `dtype` stores it (rounded to its bits for a 16-bit type)."""
    return f"ember_f2{_SUFFIX[dtype]}({value})" if dtype in LOW_PRECISION else value


def rounded(dtype: torch.dtype, value: str) -> str:
    """C++ of float `value` rounded to `dtype` and kept as a float (a 16-bit type), else `value`."""
    return f"ember_round_{_SUFFIX[dtype]}({value})" if dtype in LOW_PRECISION else value


# Contiguous float16 operands of an inner loop are converted a chunk at a time before it, and its contiguous
# float16 results after it, by F16C / AVX-512 instructions where the target has them (one instruction for 8 or 16
# values; the bit-level conversion takes about 14): the loop itself then computes on floats in L1.
CHUNK = 256
CHUNK_PRELUDE = r"""
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#define EMBER_RNE (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#endif
static inline void ember_h2f_n(const uint16_t* __restrict__ s, float* __restrict__ d, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(d + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(s + i))));
#elif defined(__F16C__)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(d + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(s + i))));
#endif
  for (; i < n; i++) d[i] = ember_h2f(s[i]);
}
static inline void ember_f2h_n(const float* __restrict__ s, uint16_t* __restrict__ d, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256((__m256i*)(d + i), _mm512_cvtps_ph(_mm512_loadu_ps(s + i), EMBER_RNE));
#elif defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128((__m128i*)(d + i), _mm256_cvtps_ph(_mm256_loadu_ps(s + i), EMBER_RNE));
#endif
  for (; i < n; i++) d[i] = ember_f2h(s[i]);
}
"""
PRELUDE += CHUNK_PRELUDE
_BASE = sympy.Symbol("cb", integer=True, nonnegative=True)   # the chunk's first index in the loop


class Chunks:
    """The chunked float16 loads and stores of one inner loop over `var` (`size` iterations): `load` and `store`
    give the element of a chunk array the loop body reads or writes instead of memory, `wrap` the loop nest with
    the chunk loop and the conversions around the inner loop."""

    def __init__(self, var: sympy.Symbol, size: str):
        self.var, self.size = var, size
        self.loads: dict = {}    # (pointer, offset) -> chunk array
        self.stores: list = []   # (chunk array, pointer, offset)

    def _contiguous(self, dtype: torch.dtype, off) -> bool:
        return dtype == torch.float16 and not off.atoms(ir.IndirectSymbol) and off.has(self.var) \
            and sympy.expand(off.subs(self.var, self.var + 1) - off) == 1

    def load(self, dtype: torch.dtype, ptr: str, off) -> str | None:
        if not self._contiguous(dtype, off):
            return None
        return self.loads.setdefault((ptr, off), f"cl{len(self.loads)}") + "[ci]"

    def store(self, dtype: torch.dtype, ptr: str, off) -> str | None:
        if not self._contiguous(dtype, off):
            return None
        self.stores.append((f"cs{len(self.stores)}", ptr, off))
        return self.stores[-1][0] + "[ci]"

    def wrap(self, head: list[str], body: list[str], close: list[str], index_code) -> list[str]:
        """head + body + close with the innermost loop (its `#pragma omp ... simd` line and `for` line, the last
        two of head) run in chunks of CHUNK iterations: a loop shared among threads shares its chunks, each
        chunk's loop is `omp simd` with the loop's reduction clauses; index_code prints an offset."""
        if not (self.loads or self.stores):
            return head + body + close
        pragma = head[-2]
        ind = pragma[:len(pragma) - len(pragma.lstrip())]
        shared = [pragma.replace(" simd", "", 1)] if " for simd" in pragma else []
        simd = f"{ind}#pragma omp simd" + "".join(re.findall(r" reduction\([^)]*\)", pragma))
        v = str(self.var)
        at = {(p, o): index_code(o.subs(self.var, _BASE)) for p, o in self.loads} | \
            {(p, o): index_code(o.subs(self.var, _BASE)) for _, p, o in self.stores}
        lines = head[:-2] + shared + [f"{ind}for (int64_t cb = 0; cb < {self.size}; cb += {CHUNK}) {{",
                             f"{ind}  const int64_t cn = ember_imin({CHUNK}, {self.size} - cb);"]
        lines += [f"{ind}  alignas(64) float {a}[{CHUNK}]; ember_h2f_n(&{p}[{at[p, o]}], {a}, cn);"
                  for (p, o), a in self.loads.items()]
        lines += [f"{ind}  alignas(64) float {a}[{CHUNK}];" for a, _, _ in self.stores]
        lines += ["  " + simd, f"{ind}  for (int64_t ci = 0; ci < cn; ci++) {{",
                  f"{ind}    const int64_t {v} = cb + ci;"]
        lines += ["  " + line for line in body] + ["  " + close[0]]
        lines += [f"{ind}  ember_f2h_n({a}, &{p}[{at[p, o]}], cn);" for a, p, o in self.stores]
        return lines + [f"{ind}}}"] + close[1:]


def chunked() -> bool:
    """Whether float16 loops convert in chunks: a build for a target that may have conversion instructions (the
    portable build has none; its chunks would convert bit by bit anyway)."""
    return config.CPU_ISA != "portable"
