"""CUDA matrix products whose contiguous extents cuBLAS reads slowly (GPT-2's 50257-word LM head) run on operands
zero-padded to 16 bytes, their result a slice (ember.codegen.matmul.padded_product).
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


def test_an_unaligned_vocabulary_pads_the_product_and_slices_it(meta_as_cuda):
    """logits = h @ w.t() with 75 columns (4 float32s per 16 bytes): w padded to 76 rows (a copy: it is stored),
    the product 76 wide and sliced; the gradient products pad K (g @ w) and M (g.t() @ h) to 76, the gradient g,
    computed by ember, stored once, padded, and read by both (itself and through its transpose)."""
    h, w, g0 = (torch.empty(64, 24, device="meta"), torch.empty(75, 24, device="meta"),
                torch.empty(64, 75, device="meta"))

    def f(h, w, g0):
        logits = aten.mm.default(h, aten.t.default(w))
        g = aten.mul.Tensor(g0, 2.0)
        return logits, aten.mm.default(g, w), aten.mm.default(aten.t.default(g), h)
    calls, bufs = _products(f, [h, w, g0])
    assert [c.target for c in calls] == [aten.mm.default] * 3
    (h_arg, w_arg), (g_arg, w2_arg), (gt_arg, h2_arg) = (c.args for c in calls)
    assert h_arg.buffer == "arg0" and h2_arg.buffer == "arg0"     # aligned, stored: read as it is
    assert tuple(w_arg.size) == (24, 76) and tuple(w_arg.stride) == (1, 24)   # w's rows padded, read transposed
    assert tuple(w2_arg.size) == (76, 24)
    assert tuple(g_arg.size) == (64, 76) and tuple(gt_arg.size) == (76, 64)
    assert g_arg.buffer == gt_arg.buffer and tuple(g_arg.stride) == (76, 1) and tuple(gt_arg.stride) == (1, 76)
    assert tuple(calls[0].outputs[0].size) == (64, 76)


def test_aligned_and_small_products_stay_as_they_are(meta_as_cuda, monkeypatch):
    def f(a, b):
        return aten.mm.default(aten.mul.Tensor(a, 2.0), b)
    calls, _ = _products(f, [torch.empty(64, 32, device="meta"), torch.empty(32, 16, device="meta")])
    assert [tuple(c.args[1].size) for c in calls] == [(32, 16)]
    monkeypatch.setattr(matmul, "PAD_MIN_MACS", 1 << 27)
    calls, _ = _products(f, [torch.empty(64, 30, device="meta"), torch.empty(30, 75, device="meta")])
    assert [tuple(c.args[1].size) for c in calls] == [(30, 75)]


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


def test_padded_products_match_eager_when_run(monkeypatch):
    """The same rule run for real on the CPU (its device list widened, oneDNN's products off): an LM head's
    forward, loss and gradients through padded products equal eager's, the logits in eager's layout."""
    monkeypatch.setattr(matmul, "PADDED_DEVICES", ("cpu",))
    monkeypatch.setattr(matmul, "PAD_MIN_MACS", 0)
    monkeypatch.setattr(matmul, "cpu_matmul", lambda *a, **k: None)
    padded = []
    real = matmul.padded_product
    monkeypatch.setattr(matmul, "padded_product", lambda *a: padded.append(real(*a)) or padded[-1])
    torch.manual_seed(0)
    head = torch.nn.Linear(32, 1001, bias=False)
    x = torch.randn(63, 32, requires_grad=True)
    y = torch.randint(0, 1001, (63,))

    def loss(x):
        logits = head(torch.nn.functional.gelu(x))
        return torch.nn.functional.cross_entropy(logits, y), logits
    expected, logits = loss(x)
    grads = torch.autograd.grad(expected, [x, head.weight])
    got, got_logits = ember.compile(loss)(x)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(got_logits, logits)
    assert got_logits.stride() == logits.stride()
    torch.testing.assert_close(torch.autograd.grad(got, [x, head.weight]), grads)
    assert sum(p is not None for p in padded) == 3, padded
