"""The C++ backend's libm (ember.codegen.cpp_libm): float erf computed as eager's GELU kernels compute it
(AVX-512: Abramowitz-Stegun over libmvec's exp, a Taylor series near 0; else libmvec's erff) in a loop g++
vectorizes, equal to eager's erf on
fresh random inputs and specials, within a few float32 roundings of the float64 erf relative to each value."""
import re
import subprocess

import pytest
import torch
import torch.nn.functional as F

from ember import config
from ember.backends.cpp_backend import compile_aten
from ember.runtime import cache
from tests.codegen.aten_trace import trace_aten


def compiled(fn, inputs) -> tuple[str, list]:
    """(the generated file, the compiled results), the results checked against eager's."""
    gm, ref = trace_aten(fn, inputs)
    c = compile_aten(gm, inputs)
    out = c(*inputs)
    torch.testing.assert_close(out[0] if len(out) == 1 else tuple(out), ref, equal_nan=True)
    return c.compiled.source, out


def calls(source: str) -> list[str]:
    """The functions called in the assembly g++ makes of `source`."""
    asm = subprocess.run(["g++", *cache.cxxflags(shared=False), "-x", "c++", "-", "-S", "-o", "-"], input=source,
                         capture_output=True, text=True, check=True).stdout
    return re.findall(r"call\s+(\w+)", asm)


def test_float_erf_matches_eager_and_float64_and_vectorizes():
    torch.manual_seed(0)
    x = torch.cat([torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-30, -1e-4, 0.4999, 0.5,
                                 -0.5, 3.9, 4.0, 5.0, 9.5, -12.0, 30.0]),
                   torch.randn(50000) * 3, torch.rand(50000) * 1.2 - 0.6])
    src, (got,) = compiled(lambda x: torch.erf(x), [x])
    assert "= ember_erf_asf(" in src[src.index("// ember: next kernel"):], src
    exact = torch.erf(x.double())
    finite = exact != 0
    rel = ((got.double() - exact).abs() / exact.abs())[finite & ~exact.isnan()]
    assert rel.max().item() < 1e-6, (rel.max().item(), x[finite][rel.argmax()].item())
    assert got[4].item() == 0.0 and str(got[4].item()) == "-0.0" and got[5].item() > 0
    if config.CPU_ISA != "portable":   # a libmvec vector function in the loop (scalar ones in its remainder only)
        called = calls(src)
        assert any(re.match(r"_ZGV\w+_(expf|erff)", c) for c in called), called


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gelu_of_16_bit_values_matches_eager(dtype):
    """A GELU in a 16-bit type computes erf in float: eager's values at the type's tolerance."""
    torch.manual_seed(0)
    x = torch.randn(1 << 16, dtype=dtype) * 4
    src, _ = compiled(lambda x: F.gelu(x), [x])
    assert "ember_erf_asf(" in src, src


def test_float64_erf_keeps_libmvec():
    torch.manual_seed(0)
    x = torch.randn(4096, dtype=torch.float64) * 3
    src, _ = compiled(lambda x: torch.erf(x), [x])
    assert "= ember_erf_as(" in src, src
