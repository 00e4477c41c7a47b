"""Pointwise groups that read an input across its rows (x.t().contiguous(), a transposed operand added to a
contiguous one) in the C++ backend: walked in tiles of rows (cpp.transposed_reads / _tiled_rows), compiled vs eager
on fresh random inputs, including a partial last tile, several members, and the cases that keep the row form."""
import pytest
import torch

from ember.backends.cpp_backend import compile_aten
from ember.codegen import cpp
from tests.codegen.aten_trace import trace_aten


def compiled_source(fn, inputs) -> str:
    gm, ref = trace_aten(fn, inputs)
    c = compile_aten(gm, inputs)
    out = c(*inputs)
    got = out[0] if len(out) == 1 else tuple(out)
    torch.testing.assert_close(got, ref)
    return c.compiled.source if hasattr(c, "compiled") else ""


TILED = [
    ("copy", lambda x: x.t().contiguous() + 1, lambda: [torch.randn(300, 70)]),          # 70 rows: a partial tile
    ("with_contiguous", lambda x, y: x.t() * y - 2, lambda: [torch.randn(64, 96), torch.randn(96, 64)]),
    ("two_members", lambda x, y: ((x.t() + y).exp(), x.t() * y), lambda: [torch.randn(128, 48), torch.randn(48, 128)]),
    ("permute_3d", lambda x: x.permute(0, 2, 1).contiguous().relu(), lambda: [torch.randn(4, 200, 40)]),
    ("int", lambda x: x.t().contiguous() * 3, lambda: [torch.randint(-100, 100, (90, 33))]),
]


@pytest.mark.parametrize("name,fn,make", TILED, ids=[c[0] for c in TILED])
def test_transposed_reads_are_tiled_and_match_eager(name, fn, make):
    src = compiled_source(fn, make())
    assert f"xb += {cpp.TILE_ROWS}" in src, src


ROW_FORM = [
    ("contiguous", lambda x: x.sin() + 1, lambda: [torch.randn(256, 64)]),
    ("few_rows", lambda x: x.t().contiguous() + 1, lambda: [torch.randn(300, 8)]),   # 8 rows: less than two tiles
    ("gather", lambda x, i: x.t()[i] + 1, lambda: [torch.randn(64, 80), torch.randint(0, 80, (50,))]),
]


@pytest.mark.parametrize("name,fn,make", ROW_FORM, ids=[c[0] for c in ROW_FORM])
def test_other_groups_keep_the_row_form(name, fn, make):
    src = compiled_source(fn, make())
    assert f"xb += {cpp.TILE_ROWS}" not in src, src


def test_an_input_transposed_into_itself_in_place():
    """x.copy_(x.t()) reads elements the same loop writes: it must not be tiled into a different visiting order
    (eager's result is checked, whatever form is chosen)."""
    def f(x):
        return x.t().contiguous().add_(1).t().contiguous()
    compiled_source(f, [torch.randn(64, 64)])


@pytest.mark.parametrize("dtype,transposed_in_registers", [(torch.float32, True), (torch.int32, True),
                                                           (torch.float64, False), (torch.int64, False)])
def test_whole_tiles_of_4_byte_values_transpose_in_registers(dtype, transposed_in_registers):
    """Whole 16x16 tiles of 4-byte values are computed in the input's order and transposed with AVX-512 shuffles
    (`ember_transpose16`, the scattered stores into the tile cost ~2x the copy); partial tiles (here 37 x 45: both
    directions) and 8-byte values keep the scattered form; every tile matches eager."""
    x = (torch.randn(133, 85) * 100).to(dtype)
    src = compiled_source(lambda x: x.t().contiguous() * 3, [x])
    kernels = src[src.index("// ember: next kernel"):]
    assert ("ember_transpose16(" in kernels) == transposed_in_registers, kernels
