import triton
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
def _pow_const(y, l_hi, l_lo):  # c ** y for a constant c > 0 (log2 c = l_hi + l_lo), without libdevice (~40 ms of
    # compile a kernel: Adam's bias corrections `beta ** step`): 2 ** (y log2 c), the product kept in two floats
    e = y * l_hi
    e_lo = _fma(y, l_hi, -e) + y * l_lo
    n = tl.minimum(tl.maximum(tl.floor(e + 0.5), -252.0), 254.0)
    f = (e - n) + e_lo   # |f| <= 1/2: 2 ** f = exp(f ln 2), its Taylor series to the 7th power (error < 0.1 ulp)
    p = _fma(f, 1.5252733804059841e-05, 0.00015403530393381606)
    p = _fma(f, p, 0.0013333558146428443)
    p = _fma(f, p, 0.009618129107628477)
    p = _fma(f, p, 0.05550410866482158)
    p = _fma(f, p, 0.2402265069591007)
    p = _fma(f, p, 0.6931471805599453)
    p = _fma(f, p, 1.0)
    k = n.to(tl.int32)   # 2 ** k as two normal floats (k in [-252, 254]): one rounding, even to a subnormal
    h = k >> 1
    r = p * ((h + 127) << 23).to(tl.float32, bitcast=True) * ((k - h + 127) << 23).to(tl.float32, bitcast=True)
    r = tl.where(e > 254.0, float('inf'), tl.where(e < -252.0, 0.0, r))
    return tl.where(e != e, e, r)


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



# fused fx nodes: mul_tensor, addcmul_default, lerp_scalar, full_default_3, detach_default_3, full_default_1, detach_default_1, full_default, detach_default, add_tensor, _to_copy_default, pow_tensor_tensor, sub_tensor,
@triton.jit
def k_04b22c8682b8c4ef(p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14, p15, p16, p17, p18, p19, p20, p21, p22, p23, p24, p25, p26, p27, p28, p29, p30, p31, p32, p33, p34, p35, p36, p37, p38, p39, p40, p41, p42, p43, p44, p45, p46, p47, p48, p49, p50, p51, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    if pid < 10240:
        seg = pid // 1024
        lpid = pid - seg * 1024
        q0 = tl.where(seg == 9, p33, tl.where(seg == 8, p30, tl.where(seg == 7, p27, tl.where(seg == 6, p24, tl.where(seg == 5, p20, tl.where(seg == 4, p17, tl.where(seg == 3, p14, tl.where(seg == 2, p10, tl.where(seg == 1, p7, p4)))))))))
        q1 = tl.where(seg == 9, p31, tl.where(seg == 8, p28, tl.where(seg == 7, p25, tl.where(seg == 6, p21, tl.where(seg == 5, p18, tl.where(seg == 4, p15, tl.where(seg == 3, p11, tl.where(seg == 2, p8, tl.where(seg == 1, p5, p2)))))))))
        q2 = tl.where(seg == 9, p40, tl.where(seg == 8, p39, tl.where(seg == 7, p38, tl.where(seg == 6, p37, tl.where(seg == 5, p36, tl.where(seg == 4, p34, tl.where(seg == 3, p23, tl.where(seg == 2, p12, tl.where(seg == 1, p1, p0)))))))))
        q3 = tl.where(seg == 9, p32, tl.where(seg == 8, p29, tl.where(seg == 7, p26, tl.where(seg == 6, p22, tl.where(seg == 5, p19, tl.where(seg == 4, p16, tl.where(seg == 3, p13, tl.where(seg == 2, p9, tl.where(seg == 1, p6, p3)))))))))
        q4 = tl.where(seg == 9, p35 + 9, tl.where(seg == 8, p35 + 8, tl.where(seg == 7, p35 + 7, tl.where(seg == 6, p35 + 6, tl.where(seg == 5, p35 + 5, tl.where(seg == 4, p35 + 4, tl.where(seg == 3, p35 + 3, tl.where(seg == 2, p35 + 2, tl.where(seg == 1, p35 + 1, p35 + 0)))))))))
        xindex = lpid * BLOCK + tl.arange(0, BLOCK)
        xmask = tl.full([BLOCK], True, tl.int1)
        s0_0 = tl.load(q0 + xindex, xmask, other=0)
        s0_1 = (s0_0 * 0.999)
        s0_2 = tl.load(q1 + xindex, xmask, other=0)
        s0_3 = (s0_2 * s0_2)
        s0_4 = (0.0010000000000000009 * s0_3)
        s0_5 = (s0_1 + s0_4)
        s0_6 = tl.load(q2 + xindex, xmask, other=0)
        s0_7 = tl.load(q3 + xindex, xmask, other=0)
        s0_8 = (s0_2 - s0_7)
        s0_9 = (0.09999999999999998 * s0_8)
        s0_10 = (s0_7 + s0_9)
        s0_11 = tl.load(q4)
        s0_12 = (s0_11 + 1.0)
        s0_13 = (s0_12).to(tl.float64)
        s0_14 = libdevice.pow(tl.full([1], 0.9, tl.float64), s0_13)
        s0_15 = (tl.full([1], 1.0, tl.float64) - s0_14)
        s0_16 = (tl.full([1], 0.001, tl.float64) / s0_15)
        s0_17 = (-s0_16)
        s0_18 = (s0_17).to(tl.float32)
        s0_19 = (s0_10 * s0_18)
        s0_20 = tl.sqrt(s0_5)
        s0_21 = libdevice.pow(tl.full([1], 0.999, tl.float64), s0_13)
        s0_22 = (tl.full([1], 1.0, tl.float64) - s0_21)
        s0_23 = libdevice.pow(s0_22, tl.full([1], 0.5, tl.float64))
        s0_24 = (s0_23).to(tl.float32)
        s0_25 = (s0_20 / s0_24)
        s0_26 = (s0_25 + 1e-08)
        s0_27 = (s0_19 / s0_26)
        s0_28 = (s0_6 + s0_27)
        tl.store(q0 + xindex, (s0_5).to(tl.float32), xmask)
        tl.store(q2 + xindex, (s0_28).to(tl.float32), xmask)
        tl.store(q3 + xindex, (s0_10).to(tl.float32), xmask)
    if (pid >= 10240) & (pid < 10241):
        lpid = pid - 10240
        xindex = lpid * BLOCK + tl.arange(0, BLOCK)
        xmask = xindex < 10
        s1_0 = (xindex).to(tl.int64)
        s1_1 = (s1_0 < 1)
        s1_2 = tl.load(p35 + 0)
        s1_3 = (s1_2 + 1.0)
        s1_4 = (s1_0 < 2)
        s1_5 = tl.load(p35 + 1)
        s1_6 = (s1_5 + 1.0)
        s1_7 = (s1_0 < 3)
        s1_8 = tl.load(p35 + 2)
        s1_9 = (s1_8 + 1.0)
        s1_10 = (s1_0 < 4)
        s1_11 = tl.load(p35 + 3)
        s1_12 = (s1_11 + 1.0)
        s1_13 = (s1_0 < 5)
        s1_14 = tl.load(p35 + 4)
        s1_15 = (s1_14 + 1.0)
        s1_16 = (s1_0 < 6)
        s1_17 = tl.load(p35 + 5)
        s1_18 = (s1_17 + 1.0)
        s1_19 = (s1_0 < 7)
        s1_20 = tl.load(p35 + 6)
        s1_21 = (s1_20 + 1.0)
        s1_22 = (s1_0 < 8)
        s1_23 = tl.load(p35 + 7)
        s1_24 = (s1_23 + 1.0)
        s1_25 = (s1_0 < 9)
        s1_26 = tl.load(p35 + 8)
        s1_27 = (s1_26 + 1.0)
        s1_28 = tl.load(p35 + 9)
        s1_29 = (s1_28 + 1.0)
        s1_30 = tl.where(s1_25, s1_27, s1_29)
        s1_31 = tl.where(s1_22, s1_24, s1_30)
        s1_32 = tl.where(s1_19, s1_21, s1_31)
        s1_33 = tl.where(s1_16, s1_18, s1_32)
        s1_34 = tl.where(s1_13, s1_15, s1_33)
        s1_35 = tl.where(s1_10, s1_12, s1_34)
        s1_36 = tl.where(s1_7, s1_9, s1_35)
        s1_37 = tl.where(s1_4, s1_6, s1_36)
        s1_38 = tl.where(s1_1, s1_3, s1_37)
        tl.store(p51 + xindex, (s1_38).to(tl.float32), xmask)
