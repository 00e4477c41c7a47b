"""16-bit floats in the C++ backend (float16, bfloat16): stored as their bits (uint16_t buffers), computed in float.

A load converts to float (exactly), arithmetic runs in float with no rounding in between (as Inductor's fused
kernels, and as eager's own kernels compute one op), and a store rounds to the buffer's type (round to nearest
even, as eager converts). Values that stay in the kernel (row buffers, a reduction's result, a value a later member
of the loop reads) keep float; a cast to a 16-bit type rounds and keeps computing in float, and a cast of a
16-bit value computed here rounds it first, so an explicit `.to()` rounds where eager's does.

The conversions are plain integer and float code, no intrinsics and no _Float16 (g++ 12 vectorizes neither
_Float16 conversion): g++ vectorizes them at every target (-march=native, AVX2, the portable x86-64 build),
and they agree with torch's conversions on every float32 and every 16-bit pattern (tests/codegen/test_cpp_lowp.py).
float16 -> float: normal and infinite/NaN values rebias the exponent, subnormals are their integer times 2^-24;
float -> float16: a normal value rounds by adding half an ulp (less one, plus the kept mantissa's last bit) and
shifting, a subnormal by a float addition to 0.5 (whose ulp is float16's smallest subnormal), 65520 and up
overflow to infinity; bfloat16 is the high half of a float, rounded the same way, NaN kept quiet.
"""
from __future__ import annotations

import torch

LOW_PRECISION = (torch.float16, torch.bfloat16)
STORAGE = "uint16_t"   # a 16-bit buffer's element type in the kernel's signature
_SUFFIX = {torch.float16: "h", torch.bfloat16: "bf"}

PRELUDE = r"""
#include <cstring>
static inline float ember_bits_f(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline uint32_t ember_f_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
// c ? a : b by masks: g++ turned the ternaries around a float operation into branches ("control flow in loop")
static inline uint32_t ember_sel(bool c, uint32_t a, uint32_t b) { uint32_t m = 0u - (uint32_t)c; return (a & m) | (b & ~m); }
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
