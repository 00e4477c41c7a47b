"""CUDA matrix products with a leading dimension cuBLAS reads slowly (GPT-2's 50257-word LM head) store their
results, and the operands ember computes, with rows padded to 16 bytes (ember.codegen.matmul.padded_product).
The decision is checked on the CPU on a traced graph (meta tensors standing for CUDA ones); on CUDA, an LM head's
forward and backward compiled and equal to eager."""
import pytest
import torch

import ember
from ember.codegen import lower, matmul
from ember.ir import ExternBuffer
from tests.codegen.aten_trace import trace_aten

aten = torch.ops.aten
CUDA = torch.cuda.is_available()


@pytest.fixture
def meta_as_cuda(monkeypatch):
    monkeypatch.setattr(matmul, "PADDED_DEVICES", ("cuda", "meta"))
    monkeypatch.setattr(matmul, "PAD_MIN_MACS", 0)


def _products(f, args):
    gm, _ = trace_aten(f, args)
    low, _, _ = lower.lower(gm, [], target="gpu")
    bufs = {b.name: b for b in low.buffers}
    return [b for b in low.buffers if isinstance(b, ExternBuffer)], bufs


def test_an_unaligned_vocabulary_pads_the_result_and_the_computed_gradient(meta_as_cuda):
    """logits = h @ w.t() (75 columns: 4 float32s per 16 bytes -> rows of 76); the gradient g, computed by ember,
    stored once with rows of 76 and read by both backward products (g @ w, and g.t() @ h through its transpose)."""
    h, w, g0 = (torch.empty(64, 24, device="meta"), torch.empty(75, 24, device="meta"),
                torch.empty(64, 75, device="meta"))

    def f(h, w, g0):
        logits = aten.mm.default(h, aten.t.default(w))
        g = aten.mul.Tensor(g0, 2.0)
        return logits, aten.mm.default(g, w), aten.mm.default(aten.t.default(g), h)
    calls, bufs = _products(f, [h, w, g0])
    assert [c.target for c in calls] == [matmul.padded_mm] * 3, [c.target for c in calls]
    logits_call, grad_call, weight_call = calls
    assert logits_call.args[2] == 76 and tuple(logits_call.outputs[0].stride) == (76, 1)
    g, gt = grad_call.args[0], weight_call.args[0]
    assert g.buffer == gt.buffer and tuple(g.stride) == (76, 1) and tuple(gt.stride) == (1, 76)
    assert grad_call.args[1].buffer == "arg1"                # a stored operand is read as it is


def test_aligned_and_small_products_stay_library_calls(meta_as_cuda, monkeypatch):
    def f(a, b):
        return aten.mm.default(aten.mul.Tensor(a, 2.0), b)
    calls, _ = _products(f, [torch.empty(64, 32, device="meta"), torch.empty(32, 16, device="meta")])
    assert [c.target for c in calls] == [aten.mm.default]
    monkeypatch.setattr(matmul, "PAD_MIN_MACS", 1 << 27)
    calls, _ = _products(f, [torch.empty(64, 30, device="meta"), torch.empty(30, 75, device="meta")])
    assert [c.target for c in calls] == [aten.mm.default]


@pytest.mark.skipif(not CUDA, reason="cuBLAS's leading-dimension alignment is a CUDA matter")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lm_head_with_an_odd_vocabulary_matches_eager_on_cuda(dtype):
    torch.manual_seed(0)
    head = torch.nn.Linear(256, 50257, bias=False, device="cuda", dtype=dtype)
    x = torch.randn(2048, 256, device="cuda", dtype=dtype, requires_grad=True)
    y = torch.randint(0, 50257, (2048,), device="cuda")

    def loss(x):
        logits = head(torch.nn.functional.gelu(x))
        return torch.nn.functional.cross_entropy(logits.float(), y), logits
    expected, logits = loss(x)
    grads = torch.autograd.grad(expected, [x, head.weight])
    got, got_logits = ember.compile(loss)(x)
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got, expected, **tol)
    torch.testing.assert_close(got_logits, logits, **tol)
    assert got_logits.stride() == logits.stride()
    for a, b in zip(torch.autograd.grad(got, [x, head.weight]), grads):
        torch.testing.assert_close(a, b, **tol)
