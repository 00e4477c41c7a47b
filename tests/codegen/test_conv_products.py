"""1x1 convolutions of channels-last CPU inference graphs as matrix products of the pixels and the weight
(ember.codegen.matmul.product_conv / conv_product), their bias, folded batch norm, residual add and relu left to
the kernels reading the product. Results equal eager's (values and strides) on fresh inputs, also after the
parameters change between calls."""
import copy

import pytest
import torch

import ember
from ember import config
from ember.backends.ember_backend import compile_graph
from ember.codegen import onednn
from ember.ir import ExternBuffer
from tests.codegen.test_conv_fusion import _randomized

MM = torch.ops.aten.mm.default


class Block(torch.nn.Module):
    """An inverted residual (mobilenet/efficientnet): 1x1 expand + bn + relu, 3x3 depthwise + bn + relu, a squeeze
    (1x1 convolutions of the pooled [N, C, 1, 1] with a bias), 1x1 project + bn + residual add; then 1x1
    convolutions that must stay convolutions (stride 2, two groups, padding) and a 1x1 one whose result is
    returned as it is."""

    def __init__(self, c=8, e=24):
        super().__init__()
        self.expand, self.bn1 = torch.nn.Conv2d(c, e, 1, bias=False), torch.nn.BatchNorm2d(e)
        self.dw, self.bn2 = torch.nn.Conv2d(e, e, 3, 1, 1, groups=e, bias=False), torch.nn.BatchNorm2d(e)
        self.se1, self.se2 = torch.nn.Conv2d(e, 4, 1), torch.nn.Conv2d(4, e, 1)
        self.project, self.bn3 = torch.nn.Conv2d(e, c, 1, bias=False), torch.nn.BatchNorm2d(c)
        self.strided = torch.nn.Conv2d(c, c, 1, stride=2)
        self.grouped = torch.nn.Conv2d(c, c, 1, groups=2)
        self.padded = torch.nn.Conv2d(c, c, 1, padding=1)
        self.last = torch.nn.Conv2d(c, 5, 1)

    def forward(self, x):
        y = torch.relu(self.bn1(self.expand(x)))
        y = torch.relu(self.bn2(self.dw(y)))
        s = torch.sigmoid(self.se2(torch.relu(self.se1(y.mean((2, 3), keepdim=True)))))
        y = self.bn3(self.project(y * s)) + x
        return self.last(y), self.strided(y).sum((2, 3)), self.grouped(y) * 2, self.padded(y).amax((2, 3))


def _same(got, want):
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=2e-5, atol=2e-5)
        assert g.stride() == w.stride()


def _checked(m, x, again: bool = False):
    """m compiled by the ember backend, its result equal to eager's on x (and on fresh values of x's shape)."""
    with torch.no_grad():
        run = compile_graph(torch.fx.symbolic_trace(m), [x])
        _same(run(x), m(x))
        if again:
            x2 = torch.randn_like(x)
            _same(run(x2), m(x2))
    return run


def _items(run):
    art = next(a for a in run.artifacts.values() if a is not None)
    return [it for it in art.forward.compiled.sched.items if isinstance(it, ExternBuffer)]


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last], ids=["nchw", "nhwc"])
def test_one_by_one_convolutions_are_products_and_match_eager(memory_format):
    m = _randomized(Block())
    x = torch.randn(2, 8, 10, 12).contiguous(memory_format=memory_format)
    run = _checked(m, x, again=True)
    targets = [it.target for it in _items(run)]
    convs = [t for t in targets if t in onednn.CONV_CALLS]
    # se2, project (+ bn + residual add), last: products; expand (+ bn + relu) and se1 (+ relu): oneDNN's relu
    # post-op where it has one; depthwise, strided, grouped, padded: convolutions
    relu_fused = onednn._mkldnn_op("_convolution_pointwise") is not None
    assert len(convs) == (6 if relu_fused else 4), targets
    assert targets.count(MM) + targets.count(onednn._LINEAR.default if onednn._LINEAR else None) == \
        (3 if relu_fused else 5), targets


def test_switch_off_keeps_library_convolutions(monkeypatch):
    monkeypatch.setattr(config, "CONV_PRODUCTS", False)
    m = _randomized(Block())
    x = torch.randn(2, 8, 10, 12)
    run = _checked(m, x)
    targets = [it.target for it in _items(run)]
    assert MM not in targets and sum(t in onednn.CONV_CALLS for t in targets) == 9, targets


def test_training_and_float64_graphs_keep_convolutions():
    m = _randomized(Block()).double()
    x = torch.randn(2, 8, 10, 12, dtype=torch.float64)
    run = _checked(m, x)
    assert MM not in [it.target for it in _items(run)]
    m = _randomized(Block()).train()
    ref = copy.deepcopy(m)
    x = torch.randn(2, 8, 10, 12)
    cm = ember.compile(m)
    got, want = cm(x), ref(x)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    sum(g.sum() for g in got).backward()
    sum(w.sum() for w in want).backward()
    torch.testing.assert_close(m.expand.weight.grad, ref.expand.weight.grad, rtol=1e-4, atol=1e-4)


def test_parameter_changes_between_calls_are_seen():
    m = _randomized(Block(), seed=1)
    cm = ember.compile(m)
    with torch.no_grad():
        x = torch.randn(2, 8, 9, 9)
        _same(cm(x), m(x))
        m.expand.weight.data.mul_(-2.0)            # no version counter sees these
        m.bn3.running_var.data.add_(1.0)
        m.se1.bias.data.add_(0.5)
        x = torch.randn(2, 8, 9, 9)
        _same(cm(x), m(x))


class Dense(torch.nn.Module):
    """densenet's pattern: 1x1 convolutions reading concatenations (windows of one wider buffer where the
    concatenation is written in place) and a concatenation that is also returned."""

    def __init__(self, c=8):
        super().__init__()
        self.a = torch.nn.Conv2d(c, c, 3, 1, 1)
        self.one = torch.nn.Conv2d(2 * c, c, 1)
        self.two = torch.nn.Conv2d(3 * c, 4, 1, bias=False)

    def forward(self, x):
        y = self.a(x)
        cat1 = torch.cat([x, y], 1)
        z = self.one(cat1)
        cat2 = torch.cat([cat1, z], 1)
        return self.two(cat2), cat2


def test_one_by_one_convolutions_of_concatenations():
    torch.manual_seed(0)
    m = Dense().eval()
    x = torch.randn(2, 8, 7, 9)
    run = _checked(m, x, again=True)
    targets = [it.target for it in _items(run)]
    assert targets.count(MM) + targets.count(onednn._LINEAR.default if onednn._LINEAR else None) == 2, targets
