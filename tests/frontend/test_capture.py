"""ember.frontend.capture: recording ops on fake tensors. Direct output metadata (ember.ir.meta.fast_result) for
captures with symbolic sizes: the ops are answered without a FakeTensorMode dispatch, add no guard, and the graph
is right at every size."""
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import ember
from tests.frontend.harness import Recorder, assert_same, compile, reset


def _block(x, w, b, lw, lb):
    h = F.gelu(F.linear(x, w, b))
    return F.layer_norm(h + 1.0, (h.shape[-1],), lw, lb) * 2.0


def _dispatched(fn, args) -> list[str]:
    """The ATen ops (names) FakeTensorMode dispatched while fn ran (the Recorder backend runs no fake op, so
    these are the capture's)."""
    seen = []
    orig = FakeTensorMode.dispatch

    def spy(self, func, types, args=(), kwargs=None):
        seen.append(func.overloadpacket.__name__)
        return orig(self, func, types, args, kwargs or {})
    FakeTensorMode.dispatch = spy
    try:
        fn(*args)
    finally:
        FakeTensorMode.dispatch = orig
    return seen


def test_symbolic_capture_answers_common_ops_directly():
    torch.manual_seed(0)
    w, b, lw, lb = torch.randn(16, 8), torch.randn(16), torch.randn(16), torch.randn(16)
    reset()
    rec = Recorder()
    cf = compile(_block, rec)
    with torch.no_grad():
        x = torch.randn(2, 5, 8)
        assert_same(_block(x, w, b, lw, lb), cf(x, w, b, lw, lb))
        x = torch.randn(2, 7, 8)   # a new length: the capture with a symbolic length
        seen = _dispatched(lambda *a: assert_same(_block(*a), cf(*a)), (x, w, b, lw, lb))
        for n in (9, 12, 3):
            x = torch.randn(2, n, 8)
            assert_same(_block(x, w, b, lw, lb), cf(x, w, b, lw, lb))
    assert rec.graphs == 2
    # linear's 3-d result is a view of its 2-d product, as eager's is (a view dispatch); nothing else dispatched
    assert not {"addmm", "mm", "gelu", "native_layer_norm", "add", "mul"} & set(seen), seen
    ember.reset()
