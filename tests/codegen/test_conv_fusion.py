"""Convolution epilogues of CPU inference graphs (ember.codegen.onednn.plan_conv_fusions): eval batch norms folded
into the convolution before them, relu and residual add + relu as oneDNN post-ops. Results equal eager's on fresh
inputs, also after the parameters or statistics change between calls (the fold is computed on every call)."""
import pytest
import torch
import torch.nn.functional as F

import ember
from ember import config
from ember.backends.ember_backend import compile_graph
from ember.codegen import cat_chains, onednn, wrapper
from ember.ir import ExternBuffer

ONEDNN = onednn._mkldnn_op("_convolution_pointwise") is not None


@pytest.fixture(autouse=True)
def _library_convolutions(monkeypatch):
    """These tests are of the library convolution's epilogues: their 1x1 convolutions stay convolutions (as
    matrix products: tests/codegen/test_conv_products.py)."""
    monkeypatch.setattr(config, "CONV_PRODUCTS", False)


class BasicBlock(torch.nn.Module):
    """resnet's block: conv-bn-relu, conv-bn, + (downsampled) input, relu; then a conv with a bias and a relu,
    and one without batch norm whose result is also returned (so nothing may be fused after it)."""

    def __init__(self, cin=8, cout=16, stride=2):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(cout)
        self.conv2 = torch.nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(cout)
        self.down = torch.nn.Conv2d(cin, cout, 1, stride, bias=False)
        self.bn_down = torch.nn.BatchNorm2d(cout)
        self.conv3 = torch.nn.Conv2d(cout, cout, 3, 1, 1)
        self.conv4 = torch.nn.Conv2d(cout, cout, 1)

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        y = torch.relu(self.bn2(self.conv2(y)) + self.bn_down(self.down(x)))
        y = torch.relu(self.conv3(y))
        z = self.conv4(y)
        return torch.relu(z) + 1, z


def _randomized(m: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, torch.nn.BatchNorm2d):  # non-trivial statistics and affine parameters
                mod.running_mean.uniform_(-0.5, 0.5)
                mod.running_var.uniform_(0.5, 2.0)
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.5, 0.5)
    return m.eval()


def _same(got, want):
    for g, w in zip(got, want):
        # float32: the folded weights round differently from eager's convolution then batch norm (a few ulps per
        # layer); float64 at its default tolerance
        tol = dict(rtol=2e-5, atol=2e-5) if g.dtype == torch.float32 else {}
        torch.testing.assert_close(g, w, **tol)
        assert g.stride() == w.stride()


def _compiled_and_checked(m, x):
    """m compiled for x, equal to eager on x and on another random input of its shape."""
    with torch.no_grad():
        run = compile_graph(torch.fx.symbolic_trace(m), [x])
        _same(run(x), m(x))
        x2 = torch.randn_like(x)
        _same(run(x2), m(x2))
    return run


def _sched(run):
    art = next(a for a in run.artifacts.values() if a is not None)
    return art.forward.compiled.sched


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last], ids=["nchw", "nhwc"])
def test_block_folds_batch_norms_and_fuses_epilogues(memory_format):
    m = _randomized(BasicBlock())
    x = torch.randn(2, 8, 20, 18).contiguous(memory_format=memory_format)
    run = _compiled_and_checked(m, x)
    sched = _sched(run)
    convs = [it for it in sched.items if isinstance(it, ExternBuffer) and it.target in onednn.CONV_CALLS]
    assert len(convs) == 5
    if ONEDNN:  # conv1+bn+relu, conv2+bn+add+relu, conv3+relu fused; down+bn folded; conv4 left alone
        targets = sorted(str(c.target) for c in convs)
        assert targets.count("mkldnn._convolution_pointwise.default") == 2, targets
        assert targets.count("mkldnn._convolution_pointwise.binary") == 1, targets
    # no batch-norm pass of its own: every kernel doing batch-norm work prepares a convolution's weight or bias
    kernels = [mb.buf.origins for it in sched.items if not isinstance(it, ExternBuffer) for mb in it.members]
    assert not [o for o in kernels if any("batch_norm" in n for n in o) and not any("convolution" in n for n in o)]


def test_float64_folds_into_the_aten_convolution():
    m = _randomized(BasicBlock()).double()
    x = torch.randn(2, 8, 12, 12, dtype=torch.float64)
    with torch.no_grad():
        run = compile_graph(torch.fx.symbolic_trace(m), [x])
        _same(run(x), m(x))
    convs = [it for it in _sched(run).items if isinstance(it, ExternBuffer) and it.target in onednn.CONV_CALLS]
    assert len(convs) == 5 and all(c.target is torch.ops.aten.convolution.default for c in convs)


def _changes(m):
    """Ways the parameters and statistics change between calls: eager sees each, so must the compiled module."""
    def data_replaced():
        m.conv1.weight.data = torch.randn_like(m.conv1.weight)
        m.bn2.running_var.data = torch.rand_like(m.bn2.running_var) + 0.5

    def in_place_no_grad():
        with torch.no_grad():
            m.bn1.weight.mul_(-1.5)
            m.conv2.weight.add_(0.1)
            m.bn_down.running_mean.add_(0.3)

    def in_place_through_data():  # no version counter sees these
        m.bn2.bias.data.add_(1.0)
        m.down.weight.data.mul_(2.0)
        m.bn1.running_var.data.mul_(3.0)
    return [data_replaced, in_place_no_grad, in_place_through_data]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_parameter_changes_between_calls_give_eagers_new_result(dtype):
    m = _randomized(BasicBlock(), seed=1).to(dtype)
    cm = ember.compile(m)
    with torch.no_grad():
        x = torch.randn(2, 8, 16, 16, dtype=dtype)
        _same(cm(x), m(x))
        for change in _changes(m):
            change()
            x = torch.randn(2, 8, 16, 16, dtype=dtype)
            _same(cm(x), m(x))


def test_shared_convolution_output_is_not_fused_away():
    """A convolution whose output (or batch norm's) has other readers keeps it: only the last reader-free
    steps are fused."""
    conv, bn = torch.nn.Conv2d(4, 6, 3, padding=1), torch.nn.BatchNorm2d(6)
    _randomized(bn)

    def f(x):
        c = conv(x)
        y = bn(c)
        return torch.relu(y + c), y.sum()
    x = torch.randn(2, 4, 9, 9)
    with torch.no_grad():
        got, want = ember.compile(f)(x), f(x)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-4)


def test_residual_from_a_later_branch_and_broadcast_add():
    """The residual of a fused add computed after the convolution (resnet's downsample comes later in the graph);
    an add that broadcasts is not a post-op."""
    c1, c2 = torch.nn.Conv2d(3, 5, 3, padding=1), torch.nn.Conv2d(3, 5, 1)
    bias = torch.randn(5, 1, 1)

    def f(x):
        a = c1(x)
        return torch.relu(a + c2(x)), torch.relu(c2(x) + bias)
    x = torch.randn(2, 3, 7, 7)
    with torch.no_grad():
        got, want = ember.compile(f)(x), f(x)
    _same(got, want)


def test_training_mode_batch_norm_is_not_folded():
    m = BasicBlock().train()
    m2 = BasicBlock().train()
    m2.load_state_dict(m.state_dict())
    x = torch.randn(2, 8, 10, 10)
    with torch.no_grad():
        got, want = ember.compile(m)(x), m2(x)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(m.bn1.running_var, m2.bn1.running_var)


class DenseBlock(torch.nn.Module):
    """densenet's block: each layer reads the concatenation of the input and all earlier layers' features."""

    def __init__(self, cin=6, growth=4, layers=4):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(
            torch.nn.BatchNorm2d(cin + k * growth), torch.nn.ReLU(), torch.nn.Conv2d(cin + k * growth, 8, 1, bias=False),
            torch.nn.BatchNorm2d(8), torch.nn.ReLU(), torch.nn.Conv2d(8, growth, 3, padding=1, bias=False))
            for k in range(layers))
        self.stem = torch.nn.Conv2d(3, cin, 3, padding=1)

    def forward(self, x):
        feats = [self.stem(x)]
        for layer in self.layers:
            feats.append(layer(torch.cat(feats, 1)))
        out = torch.cat(feats, 1)
        return F.adaptive_avg_pool2d(torch.relu(out), 1).flatten(1), out


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last], ids=["nchw", "nhwc"])
def test_dense_block_concatenations_share_one_buffer(memory_format):
    m = _randomized(DenseBlock())
    x = torch.randn(2, 3, 9, 11).contiguous(memory_format=memory_format)
    run = _compiled_and_checked(m, x)
    calls = [it.target for it in _sched(run).items if isinstance(it, ExternBuffer)]
    assert calls.count(cat_chains.cat_chain_first) == 1 and calls.count(cat_chains.cat_chain_extend) == 4, calls
    assert torch.ops.aten.cat.default not in calls


def test_concatenations_extending_one_prefix_twice():
    """Two concatenations begin with the same pieces: only one may widen the shared buffer (the other copies),
    else it would overwrite channels the first one's readers see."""
    class Branches(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.c1, self.c2, self.c3 = torch.nn.Conv2d(3, 4, 1), torch.nn.Conv2d(3, 5, 1), torch.nn.Conv2d(3, 6, 1)

        def forward(self, x):
            a, b, c = self.c1(x), self.c2(x), self.c3(x)
            base = torch.cat([a, b], 1)
            left = torch.cat([a, b, c], 1)
            d = c * 2
            right = torch.cat([a, b, d], 1)
            return torch.relu(base).sum((2, 3)), left + 1, right - 1, torch.cat([a, b, d, a], 1)
    m = Branches().eval()
    x = torch.randn(2, 3, 6, 5)
    with torch.no_grad():
        run = compile_graph(torch.fx.symbolic_trace(m), [x])
        _same(run(x), m(x))
    calls = [it.target for it in _sched(run).items if isinstance(it, ExternBuffer)]
    # base -> left share a buffer, right -> [right, a] another
    assert calls.count(cat_chains.cat_chain_first) == 2 and calls.count(cat_chains.cat_chain_extend) == 2, calls


class ResidualUses(torch.nn.Module):
    """Residuals with every kind of later life: a kernel's buffer dead after the add (accumulated into), a
    convolution's result dead after it (accumulated into), one read again after the add, the convolution's own
    input as its residual, and one that is returned (none of these three may be overwritten)."""

    def __init__(self, c=8):
        super().__init__()
        self.convs = torch.nn.ModuleList(torch.nn.Conv2d(c, c, 3, 1, 1) for _ in range(5))
        self.down = torch.nn.Conv2d(c, c, 1)

    def forward(self, x):
        a, b, c, d, e = self.convs
        h = torch.relu(x - 1)                    # a kernel's buffer (cost 2: recomputed by its add)
        y = torch.relu(a(h) + h)                 # h dead after: accumulated into
        t = self.down(y)
        y = torch.relu(b(y) + t)                 # t is read again below
        u = self.down(y)
        z = torch.relu(c(y) + u)                 # a convolution's fresh result, dead after: accumulated into
        z = torch.relu(d(z) + z)                 # z is d's input too
        kept = torch.relu(z + t)
        out = e(z) + kept                        # kept is returned (no relu after: still a post-op)
        return out, kept, z.sum()


@pytest.mark.skipif(wrapper.CONV_ADD_INPLACE is None, reason="this torch has no in-place oneDNN convolution")
def test_residual_adds_accumulate_in_place_only_into_dead_buffers():
    m = ResidualUses().eval()
    x = torch.randn(2, 8, 11, 13).contiguous(memory_format=torch.channels_last)
    run = _compiled_and_checked(m, x)
    for _ in range(2):  # kept buffers written in place by the previous call are whole again
        x2 = torch.randn_like(x)
        with torch.no_grad():
            got, want = run(x2), m(x2)
        torch.testing.assert_close(got[0], want[0], rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(got[1], want[1], rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(got[2], want[2], rtol=1e-4, atol=1e-3)
    src = next(a for a in run.artifacts.values() if a is not None).forward.compiled.call.source
    assert src.count("# accumulates into") == 2, src
