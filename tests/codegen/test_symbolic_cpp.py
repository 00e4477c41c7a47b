"""Symbolic ATen graphs through the C++ backend (docs/dynamic.md): compiled once, run at many sizes (2, sizes that
are not multiples of the vector width, large ones) against eager; the generated code is checked to be symbolic (a
kernel, not the ATen graph's fallback) where ember does it symbolically."""
import pytest
import torch

from ember.backends import cpp_backend
from ember.codegen import cpp
from ember.runtime import cache
from tests.codegen.symbolic_graphs import aten_fn, symbolic_graph

aten = torch.ops.aten
SIZES = (2, 3, 7, 16, 17, 33, 100, 257)


@pytest.fixture(params=["native", "avx2"])
def vector_width(request, monkeypatch, tmp_path):
    """The code generator's vector-width choice is g++'s (-march=native, 512 bits for libm loops where AVX-512 is
    present); "avx2" builds the same code without AVX-512 (as on a CPU that has none), in a cache of its own."""
    if request.param == "avx2":
        monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
        monkeypatch.setattr(cache, "CXXFLAGS", [*cache.CXXFLAGS, "-mno-avx512f"])
        monkeypatch.setattr(cache, "_PCH_FLAGS", [*cache._PCH_FLAGS, "-mno-avx512f"])
    return request.param


def compile_symbolic(fn, args, dynamic):
    """(compiled, gm): fn's symbolic ATen graph compiled once by the C++ backend; asserts it compiled to kernels."""
    gm, _ = symbolic_graph(aten_fn(fn), args, dynamic)
    compiled = cpp_backend.compile_aten(gm, list(args))
    assert hasattr(compiled, "compiled"), "the symbolic graph fell back to its ATen graph"
    return compiled, gm


def check(compiled, fn, args):
    out = compiled(*args)
    want = fn(*args)
    want = want if isinstance(want, tuple) else (want,)
    assert len(out) == len(want)
    for o, w in zip(out, want):
        torch.testing.assert_close(o, w)


def test_pointwise_chain_broadcast(vector_width):
    def f(s0, x, y):
        return aten.relu.default(aten.add.Tensor(aten.mul.Tensor(aten.sin.default(x), y), 1.0))
    compiled, _ = compile_symbolic(f, [5, torch.randn(5, 7), torch.randn(7)], {1: [0]})
    for n in SIZES:
        check(compiled, f, [n, torch.randn(n, 7), torch.randn(7)])


def test_view_of_computed_size_and_row_sum(vector_width):
    def f(s0, x, y):
        a = aten.add.Tensor(aten.sin.default(x), y)
        b = aten.view.default(a, [s0 * 4, 8])
        return aten.sum.dim_IntList(b, [1])
    compiled, _ = compile_symbolic(f, [5, torch.randn(5, 4, 8), torch.randn(8)], {1: [0]})
    for n in SIZES:
        check(compiled, f, [n, torch.randn(n, 4, 8), torch.randn(8)])
