"""Reductions' innermost loops with their accumulators in lanes (ember.codegen.cpp_lanes): the kernels of long
sums, max/min (with their NaN flags) and a layer norm's row sums keep a local array of partial accumulators, one
vector chain per register, and their results equal eager's on fresh random inputs, at sizes that leave a tail past
the last whole block, with NaN and infinities where max/min must keep them."""
import re

import pytest
import torch
import torch.nn.functional as F

from ember.backends.cpp_backend import compile_aten
from ember.codegen import cpp_lanes
from tests.codegen.aten_trace import trace_aten


def compiled(fn, inputs) -> str:
    """The kernels of fn's C++ file (without the prelude), its results checked against eager."""
    gm, ref = trace_aten(fn, inputs)
    c = compile_aten(gm, inputs)
    out = c(*inputs)
    torch.testing.assert_close(out[0] if len(out) == 1 else tuple(out), ref, equal_nan=True)
    src = c.compiled.source
    return src[src.index("// ember: next kernel"):]


@pytest.mark.parametrize("kind", ["amax", "amin", "sum"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_whole_tensor_reductions_take_lanes_shared_by_threads(kind, dtype):
    """One reduction over a long vector (its loop shared among threads): the threads share the blocks, each with
    its own lanes (an array section in the OpenMP reduction clause); the tail past the last block and the fold
    give eager's value."""
    torch.manual_seed(0)
    x = torch.randn(1 << 16 | 37, dtype=dtype)
    fn = {"amax": lambda x: x.amax(), "amin": lambda x: x.amin(), "sum": lambda x: x.sum()}[kind]
    kernels = compiled(fn, [x])
    assert re.search(r"reduction\((max|min|\+):\w+_acc_l\[:\d+\]\)", kernels), kernels


@pytest.mark.parametrize("special", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("where", [5, 1 << 15, (1 << 16) + 30])
def test_max_and_min_keep_nan_and_infinities_in_lanes(special, where):
    """A NaN anywhere (in a lane of a block, in the tail) makes max and min NaN; an infinity is the result."""
    torch.manual_seed(0)
    x = torch.randn(1 << 16 | 37)
    x[where] = special
    kernels = compiled(lambda x: (x.amax(), x.amin(), x.max(-1, keepdim=True)[0]), [x])
    assert "_nan_l[" in kernels, kernels


def test_row_sums_of_a_layer_norm_take_lanes():
    """A layer norm's mean and variance sums over each row of 768: lanes inside the row loop (its rows shared
    among threads), folded into the row's accumulator."""
    torch.manual_seed(0)
    x, w, b = torch.randn(64, 768), torch.randn(768), torch.randn(768)
    kernels = compiled(lambda x, w, b: F.layer_norm(x, (768,), w, b), [x, w, b])
    assert kernels.count("_acc_l[r0l] +=") == 2, kernels


def test_short_rows_and_integer_sums_keep_one_accumulator():
    """A row shorter than two blocks, and a sum of integers (an integer add's chain costs a cycle): the plain
    `omp simd` reduction."""
    torch.manual_seed(0)
    x, i = torch.randn(256, 40), torch.randint(-100, 100, (1 << 16,))
    kernels = compiled(lambda x, i: (x.sum(-1), x.amax(-1), i.sum()), [x, i])
    assert "_l[" not in kernels, kernels


def test_lanes_per_block_from_the_accumulators_bytes():
    """LANE_BYTES over all of a loop's accumulators: one float, 64 lanes; a max's float and its int32 NaN flag,
    32 each; doubles, 32; three float sums, 16 (a power of two)."""
    assert cpp_lanes.lanes({"a": "float"}) == 64
    assert cpp_lanes.lanes({"a": "float", "a_nan": "int32_t"}) == 32
    assert cpp_lanes.lanes({"a": "double"}) == 32
    assert cpp_lanes.lanes({"a": "float", "b": "float", "c": "float"}) == 16
    assert not cpp_lanes.worth({"a": "int64_t"}, 1 << 20) and not cpp_lanes.worth({"a": "float"}, 100)
