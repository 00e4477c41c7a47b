"""float16 and bfloat16 in the C++ backend (ember/codegen/cpp_lowp.py): uint16_t storage, float arithmetic, rounding
at stores and casts. Each case is compiled vs eager on fresh random inputs: single ops (eager computes one op in
float32 and rounds once, as the kernel does) with assert_close at the dtype's default tolerances; chains of ops,
where eager rounds every intermediate and the kernel does not, by the float64 rule (tests/numerics.py); the
conversions themselves bit for bit on every 16-bit pattern and on float32 values around every rounding boundary;
and that the conversions vectorize at the build's target (tests.other_targets runs this for AVX2 and portable)."""
import subprocess
import zlib

import pytest
import torch
import torch.nn.functional as F

import ember
from ember.backends.cpp_backend import compile_aten
from ember import config
from ember.codegen import cpp_lowp
from ember.runtime import cache
from tests.codegen.aten_trace import trace_aten
from tests.numerics import assert_as_close_as_eager

LOWP = [torch.float16, torch.bfloat16]


def compiled(fn, inputs):
    """(ember's result, eager's result, the kernel source) of fn's ATen graph compiled by the C++ backend; the
    graph must compile (no eager fallback for 16-bit values)."""
    gm, ref = trace_aten(fn, inputs)
    c = compile_aten(gm, inputs)
    assert hasattr(c, "compiled"), "the graph ran eagerly"
    out = c(*inputs)
    return (out[0] if len(out) == 1 else tuple(out)), ref, c.compiled.source


def randn(*shape, dtype):
    return torch.randn(*shape).to(dtype)


# (name, fn, inputs(dtype)): one eager op each, so eager rounds once, where the kernel stores
SINGLE_OPS = [
    ("exp", torch.exp, lambda d: [randn(4096, dtype=d)]),
    ("tanh", torch.tanh, lambda d: [randn(1000, dtype=d)]),
    ("sigmoid", torch.sigmoid, lambda d: [randn(1000, dtype=d)]),
    ("gelu", F.gelu, lambda d: [randn(64, 130, dtype=d)]),
    ("silu", F.silu, lambda d: [randn(64, 130, dtype=d)]),
    ("add", torch.add, lambda d: [randn(128, 64, dtype=d), randn(64, dtype=d)]),
    ("div", torch.div, lambda d: [randn(300, dtype=d), randn(300, dtype=d) + 3]),
    ("maximum", torch.maximum, lambda d: [randn(300, dtype=d), randn(300, dtype=d)]),
    ("where", lambda x, y: torch.where(x > 0, x, y), lambda d: [randn(300, dtype=d), randn(300, dtype=d)]),
    ("sum_rows", lambda x: x.sum(-1), lambda d: [randn(64, 1000, dtype=d)]),
    ("sum_columns", lambda x: x.sum(0), lambda d: [randn(512, 64, dtype=d)]),     # the column-wise loop nest
    ("mean_all", lambda x: x.mean(), lambda d: [randn(100000, dtype=d) + 4]),    # its 16-bit sum would be inf
    ("amax", lambda x: x.amax(-1), lambda d: [randn(32, 257, dtype=d)]),
    ("argmax", lambda x: x.argmax(-1), lambda d: [randn(32, 257, dtype=d)]),
    ("var_mean", lambda x: torch.var_mean(x, -1), lambda d: [randn(16, 500, dtype=d) * 3 + 100]),
    ("softmax", lambda x: x.softmax(-1), lambda d: [randn(32, 1000, dtype=d) * 4]),
    ("layer_norm", lambda x, w, b: F.layer_norm(x, (256,), w, b),
     lambda d: [randn(64, 256, dtype=d) * 2 + 1, randn(256, dtype=d), randn(256, dtype=d)]),
    ("group_norm", lambda x, w, b: F.group_norm(x, 8, w, b),
     lambda d: [randn(4, 32, 12, 12, dtype=d) + 3, randn(32, dtype=d), randn(32, dtype=d)]),
    ("transposed_add", lambda x: x.t().contiguous() + 1, lambda d: [randn(300, 70, dtype=d)]),   # the tiled loop nest
    ("to_float32", lambda x: x.float(), lambda d: [randn(1000, dtype=d)]),
    ("from_float32", lambda x: x.to(torch.float16) if x.dtype == torch.float32 else x.to(torch.bfloat16),
     lambda d: [torch.randn(1000) * 1e3]),
    ("to_other_16bit", lambda x: x.to(torch.bfloat16 if x.dtype == torch.float16 else torch.float16),
     lambda d: [randn(1000, dtype=d) * 100]),
    ("from_int", lambda i: i.to(torch.float16) + i.to(torch.bfloat16), lambda d: [torch.randint(-5000, 5000, (999,))]),
]


@pytest.mark.parametrize("dtype", LOWP, ids=["fp16", "bf16"])
@pytest.mark.parametrize("name,fn,make", SINGLE_OPS, ids=[c[0] for c in SINGLE_OPS])
def test_single_ops_match_eager(name, fn, make, dtype):
    torch.manual_seed(zlib.crc32(name.encode()))
    got, ref, src = compiled(fn, make(dtype))
    torch.testing.assert_close(got, ref)
    if name not in ("argmax", "from_int", "from_float32"):
        assert "uint16_t* __restrict__" in src


def test_special_values_and_subnormals():
    """inf, NaN, signed zeros, float16 subnormals (results of x * 1e-5) and overflow (x * 1e4) through one op."""
    for dtype in LOWP:
        special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 6e-8, -6e-8, 65504.0, 1e-40])
        x = torch.cat([special, torch.randn(500) * 10]).to(dtype)
        for fn in (lambda x: x * 1e-5, lambda x: x * 1e4, lambda x: x.abs().sqrt()):
            got, ref, _ = compiled(fn, [x])
            torch.testing.assert_close(got, ref, equal_nan=True)


@pytest.mark.parametrize("dtype", LOWP, ids=["fp16", "bf16"])
def test_conversions_bit_for_bit(dtype):
    """Every 16-bit pattern to float32, and float32 values at, next to and between the rounding boundaries of
    every 16-bit value (ties to even, subnormals, overflow) plus random bit patterns, to 16 bits: eager's bits
    (NaNs: NaN)."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    got, ref, _ = compiled(lambda h: h.float(), [bits])
    assert torch.equal(got.isnan(), ref.isnan())
    assert torch.equal(got[~ref.isnan()].view(torch.int32), ref[~ref.isnan()].view(torch.int32))
    # midpoints between neighbouring 16-bit values, and float32's neighbours of each midpoint and value
    v = bits[~bits.isnan()].float().unique()
    mid = (v[:-1].double() + v[1:].double()) / 2
    mid = mid[mid.abs() < 3.4e38].float()
    near = torch.cat([v, mid, torch.nextafter(mid, torch.tensor(float("inf"))),
                      torch.nextafter(mid, torch.tensor(-float("inf"))), torch.nextafter(v, torch.tensor(0.0))])
    rand = torch.randint(-2 ** 31, 2 ** 31, (1 << 18,), dtype=torch.int64).to(torch.int32).view(torch.float32)
    x = torch.cat([near, rand, torch.tensor([65519.996, 65520.0, 1e-45, -1e-45, 3.4e38])])
    got, ref, _ = compiled(lambda f: f.to(dtype), [x])
    nan = ref.isnan()
    assert torch.equal(got.isnan(), nan)
    mismatch = (got[~nan].view(torch.int16) != ref[~nan].view(torch.int16)).nonzero()
    assert mismatch.numel() == 0, (x[~nan][mismatch[:5, 0]], got[~nan][mismatch[:5, 0]], ref[~nan][mismatch[:5, 0]])


# chains of ops: eager rounds after each one, the kernel once at the end (closer to float64)
CHAINS = [
    ("gelu_affine", lambda x: F.gelu(x * 1.5 + 0.5), lambda d: [randn(4096, dtype=d)]),
    ("group_norm_silu", lambda x, w, b: F.silu(F.group_norm(x, 8, w, b)),
     lambda d: [randn(2, 32, 16, 16, dtype=d), randn(32, dtype=d), randn(32, dtype=d)]),
    ("scaled_softmax", lambda x, y: (x * 0.125 + y).softmax(-1), lambda d: [randn(16, 500, dtype=d), randn(500, dtype=d)]),
    ("rms_norm", lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w,
     lambda d: [randn(64, 512, dtype=d), randn(512, dtype=d)]),
    ("residual_layer_norm", lambda x, r, w: F.layer_norm(x + r, (128,), w),
     lambda d: [randn(32, 128, dtype=d), randn(32, 128, dtype=d), randn(128, dtype=d)]),
    ("mixed_in_float32_out", lambda x, w: (x.float() * w).sum(-1), lambda d: [randn(64, 300, dtype=d), torch.randn(300)]),
    ("mixed_float32_in_16bit_out", lambda x, y: (x * 2).to(y.dtype) * y, lambda d: [torch.randn(1000), randn(1000, dtype=d)]),
    ("promoted", lambda x, y: (x + y).exp(), lambda d: [randn(500, dtype=d), torch.randn(500)]),
    # one op, but near its zero x - max - log(sum) cancels: float32 rounding differences of eager's exp and log and
    # glibc's become 16-bit ulps there
    ("log_softmax", lambda x: x.log_softmax(-1), lambda d: [randn(32, 1000, dtype=d) * 4]),
    ("explicit_casts", lambda x: (x.float().exp().to(x.dtype) * 3).float().sum(), lambda d: [randn(2000, dtype=d)]),
]


@pytest.mark.parametrize("dtype", LOWP, ids=["fp16", "bf16"])
@pytest.mark.parametrize("name,fn,make", CHAINS, ids=[c[0] for c in CHAINS])
def test_chains_as_close_as_eager(name, fn, make, dtype):
    torch.manual_seed(zlib.crc32(name.encode()))
    inputs = make(dtype)
    got, ref, _ = compiled(fn, inputs)
    exact = fn(*[t.double() if t.is_floating_point() else t for t in inputs])
    assert_as_close_as_eager(got, ref, exact, ulps=2.0, msg=name)


# float16 loops converted in chunks (cpp_lowp.Chunks): partial chunks and vectors, a loop shared among threads,
# reductions, two inner dims, strided operands beside contiguous ones
CHUNKED = [
    ("partial_chunks", lambda x, w: (x * w).sum(-1), lambda: [randn(40, 1001, dtype=torch.float16), randn(1001, dtype=torch.float16)]),
    ("shared_loop", lambda x: F.gelu(x) * 2, lambda: [randn((1 << 17) + 5, dtype=torch.float16)]),
    ("shared_reduction", lambda x: x.sum(), lambda: [randn((1 << 18) + 3, dtype=torch.float16)]),
    ("two_inner_dims", lambda x: x.amax((1, 2)), lambda: [randn(8, 30, 50, dtype=torch.float16)]),
    ("strided_beside_contiguous", lambda x, y: x[:, ::2] * y, lambda: [randn(64, 600, dtype=torch.float16), randn(64, 300, dtype=torch.float16)]),
    ("float32_result", lambda x, y: x.float() * y, lambda: [randn(50, 700, dtype=torch.float16), torch.randn(50, 700)]),
]


@pytest.mark.parametrize("name,fn,make", CHUNKED, ids=[c[0] for c in CHUNKED])
def test_float16_chunks(name, fn, make):
    torch.manual_seed(zlib.crc32(name.encode()))
    got, ref, src = compiled(fn, make())
    torch.testing.assert_close(got, ref)
    assert ("ember_h2f_n(&" in src) == cpp_lowp.chunked(), config.CPU_ISA   # a call, not the prelude


def test_float16_in_place_update():
    """x.mul_(2).add_(y) on float16 inputs: each chunk is read before it is written back."""
    def f(x, y):
        x.mul_(2).add_(y)
        return x.sum(-1)
    x, y = randn(16, 3000, dtype=torch.float16), randn(16, 3000, dtype=torch.float16)
    x_eager = x.clone()
    torch.testing.assert_close(ember.compile(f)(x, y), f(x_eager, y))
    torch.testing.assert_close(x, x_eager)


@pytest.mark.parametrize("dtype", LOWP, ids=["fp16", "bf16"])
def test_training_layer_norm_mlp(dtype):
    """A 16-bit forward and backward through ember.compile: layer norm (its backward's sums in float32), gelu,
    a linear layer; gradients as close to float64 as eager's."""
    torch.manual_seed(0)
    ln, lin = torch.nn.LayerNorm(64), torch.nn.Linear(64, 64)

    def f(x, w, b, lw, lb):
        return F.linear(F.gelu(F.layer_norm(x, (64,), w, b)), lw, lb).square().mean()
    base = [torch.randn(32, 64) * 2, ln.weight.detach() + 0.5 * torch.randn(64), torch.randn(64),
            lin.weight.detach(), lin.bias.detach()]

    def run(fn, d):
        xs = [t.to(d).requires_grad_() for t in base]
        loss = fn(*xs)
        loss.backward()
        return [loss] + [t.grad for t in xs]
    got, ref, exact = run(ember.compile(f), dtype), run(f, dtype), run(f, torch.float64)
    for g, r, e in zip(got, ref, exact):
        assert_as_close_as_eager(g, r, e, ulps=2.0)


def test_conversions_vectorize():
    """g++ vectorizes loops of the four conversions at the build's target (EMBER_CPU_ISA): the selects are masks,
    which it did not turn into branches ("control flow in loop")."""
    src = "#include <cstdint>\n" + cpp_lowp.PRELUDE + "\n".join(
        f'extern "C" void k{i}(const {a}* __restrict__ x, {b}* __restrict__ y, int64_t n) {{\n'
        f'  #pragma omp simd\n  for (int64_t i = 0; i < n; i++) y[i] = {f}(x[i]);\n}}'
        for i, (a, b, f) in enumerate([("uint16_t", "float", "ember_h2f"), ("float", "uint16_t", "ember_f2h"),
                                       ("uint16_t", "float", "ember_bf2f"), ("float", "uint16_t", "ember_f2bf"),
                                       ("float", "float", "ember_round_h")]))
    r = subprocess.run(["g++", *cache.cxxflags(shared=False), "-x", "c++", "-", "-S", "-o", "/dev/null",
                        "-fopt-info-vec-optimized"], input=src, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    vectorized = {ln.split(":")[1] for ln in r.stderr.splitlines() if "loop vectorized" in ln}
    lines = src.splitlines()
    for n, line in enumerate(lines, 1):
        if line.startswith("  for (int64_t i = 0"):
            assert str(n) in vectorized, (lines[n - 2], r.stderr)


def test_float16_symbolic_sizes():
    """One symbolic graph for every row length: its chunk loops end at the run-time length."""
    def f(x, w):
        return F.layer_norm(F.gelu(x) * 2, (x.shape[-1],), w)
    c = ember.compile(f, dynamic=True)
    for n in (300, 517, 1030):
        x, w = randn(7, n, dtype=torch.float16), randn(n, dtype=torch.float16)
        torch.testing.assert_close(c(x, w), f(x, w))


def test_float16_shared_max_min_keep_nan():
    """A max/min over one long float16 row (a loop shared among threads, in chunks, with the NaN flag's reduction
    clause on each chunk's loop), with and without a NaN."""
    def f(x):
        return x.amax(), x.amin(), x.argmax()
    x = randn((1 << 18) + 7, dtype=torch.float16)
    c = ember.compile(f)
    torch.testing.assert_close(c(x), f(x))
    x[12345] = float("nan")
    torch.testing.assert_close(c(x), f(x), equal_nan=True)
