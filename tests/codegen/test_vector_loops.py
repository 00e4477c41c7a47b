"""Loops the C++ backend must leave vectorizable, checked on the code g++ makes of them (its assembly for the
target under test), next to compiled-vs-eager checks on fresh random inputs: bool tensors read as bytes (a select
on a loaded `bool` kept g++ from vectorizing a masked softmax's exp loop), exp past libmvec's fast domain where an
infinite constant reaches its argument."""
import re
import subprocess

import pytest
import torch

from ember import config
from ember.backends.cpp_backend import compile_aten
from ember.runtime import cache
from tests.codegen.aten_trace import trace_aten


def compiled(fn, inputs) -> tuple[str, str]:
    """(the generated file, its kernels without the prelude), the results checked against eager."""
    gm, ref = trace_aten(fn, inputs)
    c = compile_aten(gm, inputs)
    out = c(*inputs)
    torch.testing.assert_close(out[0] if len(out) == 1 else tuple(out), ref, equal_nan=True)
    src = c.compiled.source
    return src, src[src.index("// ember: next kernel"):]


def scalar_libm_calls(source: str) -> list[str]:
    """The calls to a scalar libm function (not a libmvec `_ZGV` variant) in the assembly g++ makes of `source`:
    one in a kernel means its loop did not vectorize."""
    asm = subprocess.run(["g++", *cache.cxxflags(shared=False), "-x", "c++", "-", "-S", "-o", "-"], input=source,
                         capture_output=True, text=True, check=True).stdout
    return re.findall(r"call\s+(?:__)?(?:exp|log|sin|cos|tanh|erf)f?\w*(?:@PLT)?\b", asm)


def test_masked_softmax_reads_its_mask_as_bytes_and_vectorizes():
    """softmax(x.masked_fill(m, -inf) * s): the mask is `const uint8_t*` (read `bool t = m[i]`), so the exp loop
    vectorizes; rows masked all along are NaN as in eager, rows masked in part sum to one."""
    torch.manual_seed(0)
    x, m = torch.randn(64, 256), torch.rand(64, 256) < 0.3
    m[5] = True
    m[9, :255] = True
    fn = lambda x, m: torch.softmax(x.masked_fill(m, float("-inf")) * 0.125, -1)  # noqa: E731
    src, kernels = compiled(fn, [x, m])
    assert "const uint8_t* __restrict__ arg1" in kernels, kernels
    assert "ember_exp_guardedf(" in kernels, kernels
    if config.CPU_ISA != "portable":   # SSE2 has no blend: g++ keeps a select on a loaded mask scalar there
        assert scalar_libm_calls(src) == [], kernels


def test_bool_values_stored_and_read_back_as_bytes():
    """A bool result written by one kernel and read by another (a graph output and its use), and a bool row
    buffer: values 0/1 in memory, as eager's."""
    torch.manual_seed(0)
    x, y = torch.randn(32, 300), torch.randn(32, 300)
    fn = lambda x, y: ((x > y), torch.where(x > y, x, y).sum(-1), (x > 0) & (y < 0.5))  # noqa: E731
    _, kernels = compiled(fn, [x, y])
    assert "bool* __restrict__" not in kernels and "uint8_t* __restrict__" in kernels, kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_exp_past_the_fast_domain_matches_eager(dtype):
    """exp and sigmoid of values reaching an infinite constant (masked_fill(-inf), where(m, x, +inf)) take the
    guarded exp; across both ends of exp's range (underflow to 0 and denormals, overflow to inf, NaN) they equal
    eager's."""
    torch.manual_seed(0)
    lim = 120.0 if dtype == torch.float32 else 800.0
    x = (torch.rand(4096, dtype=dtype) * 2 - 1) * lim
    x[:8] = torch.tensor([float("nan"), 0.0, -0.0, 1.0, -lim, lim, -87.5, 88.6], dtype=dtype)
    m, p = torch.rand(4096) < 0.2, torch.rand(4096) < 0.1
    fn = lambda x, m, p: (x.masked_fill(m, float("-inf")).exp(),  # noqa: E731
                          torch.where(p, float("inf"), x).exp(), torch.sigmoid(x.masked_fill(m, float("inf"))))
    _, kernels = compiled(fn, [x, m, p])
    sfx = "f" if dtype == torch.float32 else ""
    assert kernels.count(f"ember_exp_guarded{sfx}(") == 3, kernels


def test_exp_of_values_from_memory_stays_plain_libmvec():
    """No infinite constant among what the argument is computed from: the plain libmvec exp (the guard would
    double its cost)."""
    torch.manual_seed(0)
    x = torch.randn(64, 128)
    _, kernels = compiled(lambda x: torch.softmax(x * 2, -1), [x])
    assert "ember_expf(" in kernels and "ember_exp_guarded" not in kernels, kernels


PIECES = [
    # name, function, inputs, inner loops printed (pieces of the last dim)
    ("slice_cat", lambda x: torch.cat([x[..., 1::2], x[..., ::2] * -1], -1), lambda: [torch.randn(50, 128)], 2),
    ("rotary", lambda x, c, s: x * c + torch.cat([-x[..., 32:], x[..., :32]], -1) * s,
     lambda: [torch.randn(40, 64), torch.randn(40, 64), torch.randn(40, 64)], 2),
    ("three_uneven", lambda a, b, c: torch.cat([a.exp(), b, c * 2], -1),
     lambda: [torch.randn(3, 7, 5), torch.randn(3, 7, 11), torch.randn(3, 7, 1)], 3),
    ("pad_last", lambda x: torch.nn.functional.pad(x, (3, 5), value=1.5) + 1, lambda: [torch.randn(30, 40)], 3),
    ("two_members", lambda a, b: (lambda y: (y, y.exp() + y))(torch.cat([a, b * 2], -1)),
     lambda: [torch.randn(30, 20), torch.randn(30, 12)], 2),   # the second reads the first's value in the loop
    ("int_cat", lambda a, b: torch.cat([a, b * 3], -1),
     lambda: [torch.randint(-9, 9, (20, 6)), torch.randint(-9, 9, (20, 10))], 2),
]


@pytest.mark.parametrize("name,fn,make,loops", PIECES, ids=[c[0] for c in PIECES])
def test_concatenation_along_the_last_dim_is_a_loop_per_piece(name, fn, make, loops):
    """A concatenation (or pad) along the innermost dim is printed as one inner loop per piece, each with its own
    value: no per-element select on the index and no index clamps, so each piece's loads are plain strided loads
    (a select between clamped loads made g++ gather both pieces at every element)."""
    torch.manual_seed(0)
    _, kernels = compiled(fn, make())
    assert kernels.count("#pragma omp simd") == loops, kernels
    assert "ember_imin" not in kernels and "ember_imax" not in kernels and " ? " not in kernels, kernels


def test_concatenation_along_another_dim_keeps_its_select():
    """Only comparisons of the innermost index cut a loop: cat along dim 0 keeps one loop (x0 picks the piece)."""
    torch.manual_seed(0)
    _, kernels = compiled(lambda a, b: torch.cat([a, b + 1], 0), [torch.randn(5, 64), torch.randn(9, 64)])
    assert kernels.count("#pragma omp simd") == 1, kernels


def test_sibling_sums_of_one_value_run_in_one_loop():
    """Two sums over the same loops that share their value (a batch norm backward's sum(g) and sum(g * x_hat) of
    one recomputed gradient): one loop nest with two accumulators, the shared value computed once per element;
    both equal eager's. A sum that reads another's result keeps a loop of its own."""
    torch.manual_seed(0)
    g, x = torch.randn(4, 8, 6, 6), torch.randn(4, 8, 6, 6)

    def siblings(g, x):
        v = torch.where(x > 0, g, 0.0) * x.exp()
        return v.sum((0, 2, 3)), (v * x).sum((0, 2, 3))

    def dependent(x):
        mean = x.mean((0, 2, 3), keepdim=True)
        return ((x - mean) ** 2).sum((0, 2, 3))
    _, kernels = compiled(siblings, [g, x])
    assert kernels.count("one loop") == 1 and re.search(r"simd reduction\(\+:\w+\) reduction\(\+:\w+\)", kernels), kernels
    _, kernels = compiled(dependent, [x])
    assert "one loop" not in kernels, kernels


def scalar_float_compares(source: str) -> list[str]:
    """The scalar float compares (`comiss`: a select g++ turned into a branch) in the assembly of `source`."""
    asm = subprocess.run(["g++", *cache.cxxflags(shared=False), "-x", "c++", "-", "-S", "-o", "-"], input=source,
                         capture_output=True, text=True, check=True).stdout
    return re.findall(r"\bv?u?comis[sd]\b", asm)


def test_batch_norm_backward_sums_take_float_partials_and_vectorize():
    """A train-mode batch norm's backward behind a ReLU and an average pool (a conv net's last block): its two
    sums accumulate float32 values in float64 (eager's accuracy); the innermost loop adds them to float partials
    (added to the float64 accumulators after it), and the pooled gradient, which changes with the outer loops
    only, is read before the innermost loop. Either one per element kept g++ from vectorizing the loop (a select
    feeding a float64 cast; a load sunk into the select's branch): scalar code with a branch per element."""
    torch.manual_seed(0)
    n, c, h, w = 4, 8, 6, 16
    x, y, gp = torch.randn(n, c, h, w), torch.randn(n, c, h, w), torch.randn(n, c, 1, 1)
    weight, mean, invstd = torch.randn(c), torch.randn(c), torch.rand(c) + 0.5

    def bn_backward(x, y, gp, weight, mean, invstd):
        dy = torch.where(y <= 0, 0.0, (gp / (h * w)).expand(n, c, h, w))
        return torch.ops.aten.native_batch_norm_backward(dy, x, weight, None, None, mean, invstd, True, 1e-5,
                                                         [True, True, True])
    src, kernels = compiled(bn_backward, [x, y, gp, weight, mean, invstd])
    assert kernels.count("_part += ") >= 2 and "double" in kernels, kernels   # (more where in lanes, cpp_lanes)
    assert re.search(r"float q\d+ = arg2\[", kernels), kernels   # the pooled gradient, before the innermost loop
    if config.CPU_ISA != "portable":
        assert scalar_float_compares(src) == [], kernels


def test_float64_sums_a_program_asks_for_keep_every_value_in_float64():
    """`x.double().sum()` of float32 values: every value is added in float64 (no float partials), as eager."""
    torch.manual_seed(0)
    x = torch.randn(64, 3000) * 1000 + 1
    _, kernels = compiled(lambda x: torch.where(x > 0, x, 0.5).double().sum(1), [x])
    assert "_part" not in kernels, kernels
