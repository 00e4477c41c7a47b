"""The C++ backend's libm: glibc's libmvec vector functions behind `simd` aliases, exp guarded past its fast
domain, and erf as eager computes it (cpp.PRELUDE holds what this module prints)."""
from __future__ import annotations

import torch

from ember.ir import Expr

# libm functions with vector variants in glibc's libmvec: called through ember_<name>[f] aliases declared
# `simd`, so loops calling them vectorize (and g++ does not merge sin+cos into sincos, which has none)
MVEC_UNARY = ("acos", "acosh", "asin", "asinh", "atan", "atanh", "cos", "cosh", "erf", "erfc", "exp", "exp2", "expm1",
              "log", "log10", "log1p", "log2", "sin", "sinh", "tan", "tanh")
MVEC_BINARY = ("atan2", "hypot", "pow")


# libmvec's exp sends a lane beyond |x| of 87.33 (float) / 708.39 (double) to the scalar exp, a slow path per
# lane: a softmax over rows masked with -inf spends its time there. Where an infinite or huge
# constant can reach exp's argument (`exp_leaves_domain`: masked_fill(-inf), where(m, x, -finfo.max)) the
# exp is ember_exp_guarded[f]: libmvec's on |x| at most 87 / 704 and exp(x / 2)^2 beyond (1 ulp more), 0 where
# it underflows by a select, never a multiply (a denormal product is a microcode assist too). Elsewhere the
# guard would double exp's cost, so plain libmvec.
EXP_DOMAIN = {torch.float32: 87.0, torch.float64: 704.0}
GUARDED_EXP = "".join(rf"""
static inline EMBER_NO_TRAPS {t} ember_exp_guarded{sfx}({t} x) {{
  bool in = (x >= -{lim}) & (x <= {lim});   // false for NaN, which the libm path keeps
  {t} h = x * (in ? {t}(1) : {t}(0.5));   // (no arithmetic in a select's arm: g++ then vectorizes it on AVX2)
  {t} c = h < -{lim} ? -{lim} : h;
  c = c > {lim} ? {lim} : c;
  {t} e(ember_exp{sfx}(c));
  return e * (in ? {t}(1) : (x < {t}({zero}) ? {t}(0) : e));
}}""" for t, sfx, lim, zero in (("float", "f", "87.0f", -104), ("double", "", "704.0", -746)))


def exp_leaves_domain(x: Expr) -> bool:
    """Whether a constant beyond libmvec's fast exp domain (an infinity, -finfo.max) is among what `x` is
    computed from."""
    lim = EXP_DOMAIN.get(x.dtype)
    return lim is not None and any(y.op == "const" and isinstance(y.args[0], float) and not abs(y.args[0]) <= lim
                                   for y in x.walk())


def _mvec_decls() -> str:
    out = ['#define EMBER_SIMD __attribute__((simd("notinbranch"), const, nothrow))', 'extern "C" {']
    for n in MVEC_UNARY:
        out.append(f'EMBER_SIMD float ember_{n}f(float) __asm__("{n}f"); EMBER_SIMD double ember_{n}(double) __asm__("{n}");')
    for n in MVEC_BINARY:
        out.append(f'EMBER_SIMD float ember_{n}f(float, float) __asm__("{n}f"); '
                   f'EMBER_SIMD double ember_{n}(double, double) __asm__("{n}");')
    out.append("}")
    out.append('#if defined(__AVX512F__)\n#define EMBER_WIDE __attribute__((target("prefer-vector-width=512")))\n'
               '#else\n#define EMBER_WIDE\n#endif')
    out.append('#if defined(__GNUC__) && !defined(__clang__)\n#define EMBER_NO_TRAPS __attribute__((optimize("no-trapping-math")))\n'
               '#else\n#define EMBER_NO_TRAPS\n#endif')
    return "\n".join(out) + GUARDED_EXP


# float erf (cpp.PRELUDE, after cpp_lowp's bit helpers) on AVX-512: Abramowitz-Stegun 7.1.26 over libmvec's exp,
# as eager's and Inductor's GELU kernels compute it (at::vec's Vectorized<float>::erf, 1.4e-7 from erf): 4.3 ms
# against libmvec erff's 4.6 in a bfloat16 GELU of 4M values (one thread; eager 4.1-4.7). Below |x| = 0.5 its
# absolute error would be a large relative one (erf(1e-30) = 0): the Taylor series there (seven terms, 1e-9
# relative). erf is 1.0f from |x| = 4 on: the exp's argument stops at -16 there, so it never takes libmvec's slow
# path (|x| > 9.3); NaN stays NaN. With AVX2 libmvec's erff was faster (that GELU 6.0 ms against 7.0): kept, as
# for float64.
ERF_AS = r"""
#if defined(__AVX512F__)
static inline float ember_erf_asf(float x) {
  float a = __builtin_fabsf(x), x2 = x * x;
  float t = 1.0f / (0.3275911f * a + 1.0f);
  float r = (((1.061405429f * t + -1.453152027f) * t + 1.421413741f) * t + -0.284496736f) * t + 0.254829592f;
  float e(ember_expf(-(x2 > 16.0f ? 16.0f : x2)));
  bool small = a < 0.5f;   // one compare, applied by masks (cpp_lowp's ember_sel): two selects made g++ branch
  float xs = ember_bits_f(ember_sel(small, ember_f_bits(x), 0u)), xs2 = xs * xs;
  float s = xs * (1.1283791670955126f + xs2 * (-0.37612638903183754f + xs2 * (0.11283791670955126f
      + xs2 * (-0.026866170645131252f + xs2 * (0.005223977625442188f + xs2 * (-0.0008548327023450852f
      + xs2 * 0.00012055332981789664f))))));
  float y = __builtin_copysignf(1.0f - r * t * e, x);
  return ember_bits_f(ember_sel(small, ember_f_bits(s), ember_f_bits(y)));
}
#else
static inline float ember_erf_asf(float x) { return ember_erff(x); }
#endif
static inline double ember_erf_as(double x) { return ember_erf(x); }"""
