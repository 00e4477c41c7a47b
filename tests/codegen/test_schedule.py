"""The C++ schedule's loop shapes (ember.codegen.schedule): dims that every access walks as one contiguous range
are merged into one inner loop, also where a reshape's div/mod cancels within the dims' ranges; results equal
eager's on fresh random inputs."""
import pytest
import torch
import torch.nn.functional as F

from ember.backends.cpp_backend import compile_aten
from ember.ir import Pointwise
from tests.codegen.aten_trace import trace_aten


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_group_norm_output_loops_over_rows_of_height_times_width(dtype):
    """A group norm's output reads its input through the [N, G, C/G*H*W] view of its statistics: the offsets'
    div/mod cancel within H and W's ranges, so the output kernel loops over N*C rows of H*W (not N*C*H rows of
    W = 32, each paying the row's statistics, weight and bias again)."""
    torch.manual_seed(0)
    x, w, b = (torch.randn(2, 64, 32, 32, dtype=dtype), torch.randn(64, dtype=dtype), torch.randn(64, dtype=dtype))
    fn = lambda x, w, b: F.silu(F.group_norm(x, 16, w, b))  # noqa: E731
    gm, ref = trace_aten(fn, [x, w, b])
    c = compile_aten(gm, [x, w, b])
    out = c(x, w, b)
    torch.testing.assert_close(out[0], ref, atol=2e-3 if dtype == torch.float16 else 1e-5, rtol=1e-3)
    outs = [m for g in c.compiled.sched.items if hasattr(g, "members") for m in g.members
            if isinstance(m.buf, Pointwise) and tuple(int(s) for s in m.buf.size) == (2, 64, 32, 32)]
    assert outs and all(tuple(int(s) for s in m.inner) == (1024,) for m in outs), [m.inner for m in outs]

