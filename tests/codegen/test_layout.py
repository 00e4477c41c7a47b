"""Channels-last layout of inference graphs with 4-D convolutions (ember.codegen.layout.wants_channels_last):
results and strides equal eager's, the convolutions and the kernels between them run channels-last, training
graphs (and a training step in one graph) keep eager's layouts; the pooling decompositions index correctly in either layout."""
import copy

import pytest
import sympy
import torch
import torch.nn.functional as F

import ember
from ember.backends.ember_backend import compile_graph
from ember.codegen import cat_chains, layout, lower, onednn
from ember.ir import ExternBuffer, Pointwise, Reduction
from ember.codegen.schedule import X0, rvars


class Block(torch.nn.Module):
    """A resnet/densenet mix: conv-bn-relu-maxpool, a residual block with a strided 1x1 downsample, average
    pooling, a concatenation of two branches, global pooling and a linear head."""

    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 16, 5, 2, 2, bias=False)
        self.bn0 = torch.nn.BatchNorm2d(16)
        self.conv1 = torch.nn.Conv2d(16, 24, 3, 2, 1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(24)
        self.conv2 = torch.nn.Conv2d(24, 24, 3, 1, 1)
        self.down = torch.nn.Conv2d(16, 24, 1, 2)
        self.branch = torch.nn.Conv2d(24, 8, 3, 1, 1, groups=8)
        self.head = torch.nn.Linear(32, 10)

    def forward(self, x):
        x = F.max_pool2d(torch.relu(self.bn0(self.stem(x))), 3, 2, 1)
        y = torch.relu(self.conv2(torch.relu(self.bn1(self.conv1(x)))) + self.down(x))
        y = torch.cat([y, self.branch(y)], 1)
        y = F.avg_pool2d(y, 2)
        return self.head(torch.flatten(F.adaptive_avg_pool2d(y, 1), 1)), y


class WithConv(torch.nn.Module):
    """fn(conv, x) as a module (fx traces the convolution as a call of a submodule)."""

    def __init__(self, conv, fn):
        super().__init__()
        self.conv, self.fn = conv, fn

    def forward(self, x):
        return self.fn(self.conv, x)


def _randomized(m: torch.nn.Module) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, torch.nn.BatchNorm2d):  # non-trivial statistics (eval mode reads them)
                mod.running_mean.uniform_(-0.5, 0.5)
                mod.running_var.uniform_(0.5, 2.0)
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.5, 0.5)
    return m.eval()


def _forward(run):
    art = next(a for a in run.artifacts.values() if a is not None)
    return art.forward.compiled


def _assert_same(got, want):
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
        assert g.stride() == w.stride(), (g.stride(), w.stride())


def _is_cl(b) -> bool:
    """b is laid out channels-last in memory (the strides of size-1 dims do not matter)."""
    return len(b.size) == 4 and all(int(s) == int(c) for s, c, n in zip(
        b.stride, layout.channels_last_strides(b.size), b.size) if int(n) != 1)


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last], ids=["nchw", "nhwc"])
def test_conv_block_runs_channels_last_and_returns_eager_strides(memory_format):
    m = _randomized(Block())
    x = torch.randn(2, 3, 40, 36).contiguous(memory_format=memory_format)
    lower.FALLBACK_COUNTS.clear()
    with torch.no_grad():
        run = compile_graph(torch.fx.symbolic_trace(m), [x])
        got, want = run(x), m(x)
    _assert_same(got, want)
    assert not lower.FALLBACK_COUNTS  # max/avg pooling decomposed, no ATen call between convolutions
    sched = _forward(run).sched
    convs = [it for it in sched.items if isinstance(it, ExternBuffer) and it.target in onednn.CONV_CALLS]
    assert len(convs) == 5 and all(_is_cl(o) for c in convs for o in c.outputs)
    outputs = {o.buffer for o in sched.lowered.outputs}
    inner = [m.buf for it in sched.items if not isinstance(it, ExternBuffer) for m in it.members
             if len(m.buf.size) == 4 and m.buf.name not in outputs and int(m.buf.size[1]) > 3]
    assert inner and all(_is_cl(b) for b in inner), [(b.name, b.stride) for b in inner if not _is_cl(b)]


def test_channels_last_loops_walk_channels_innermost():
    """A batch norm between convolutions (after a relu, so not folded into the first one): one contiguous store
    over C in the inner loop, no division."""
    conv1, conv2, bn = torch.nn.Conv2d(8, 32, 3), torch.nn.Conv2d(32, 8, 1), torch.nn.BatchNorm2d(32)
    m = _randomized(torch.nn.Sequential(conv1, torch.nn.ReLU(), bn, conv2))
    x = torch.randn(2, 8, 12, 12)
    with torch.no_grad():
        run = compile_graph(torch.fx.symbolic_trace(m), [x])
        _assert_same([run(x)], [m(x)])
    members = [mb for it in _forward(run).sched.items if not isinstance(it, ExternBuffer) for mb in it.members
               if isinstance(mb.buf, Pointwise) and tuple(int(s) for s in mb.buf.size) == (2, 32, 10, 10)]
    assert len(members) == 1
    mb = members[0]
    row = rvars(1)[0] + 32 * X0  # x0: one (n, h, w) position, r0: the channel
    assert tuple(int(s) for s in mb.inner) == (32,) and sympy.expand(mb.store - row) == 0
    loads = [e.args[1] for e in mb.body.walk() if e.op == "load" and e.args[1].has(X0)]  # the conv output
    assert loads and all(sympy.expand(off - row) == 0 for off in loads)


def test_resnet18_small_input_matches_eager():
    import torchvision
    m = _randomized(torchvision.models.resnet18())
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        got, want = ember.compile(m)(x), m(x)
    _assert_same([got], [want])


@pytest.mark.slow
def test_densenet121_small_input_matches_eager():
    import torchvision
    m = _randomized(torchvision.models.densenet121())
    x = torch.randn(2, 3, 64, 64)
    lower.FALLBACK_COUNTS.clear()
    with torch.no_grad():
        got, want = ember.compile(m)(x), m(x)
    _assert_same([got], [want])
    assert not lower.FALLBACK_COUNTS


def test_feature_maps_returned_with_eager_strides():
    """Graph outputs computed from channels-last buffers: eager's strides (NCHW for an NCHW input, channels-last
    for a channels-last one), a convolution output returned as is included."""
    class Maps(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn = torch.nn.Conv2d(4, 6, 3, padding=1), torch.nn.BatchNorm2d(6)

        def forward(self, x):
            y = self.conv(x)
            return y, torch.relu(self.bn(y)), F.max_pool2d(y, 2), y.sum((2, 3))
    f = _randomized(Maps())
    for fmt in (torch.contiguous_format, torch.channels_last):
        x = torch.randn(2, 4, 8, 10).contiguous(memory_format=fmt)
        with torch.no_grad():
            run = compile_graph(torch.fx.symbolic_trace(f), [x])
            _assert_same(run(x), f(x))


def test_training_graphs_keep_eager_layouts():
    """A training forward's saved activations are read by the backward in eager's layout: no channels-last."""
    m = _randomized(Block()).train()
    ref = copy.deepcopy(m)
    x = torch.randn(2, 3, 40, 36)
    run = compile_graph(torch.fx.symbolic_trace(m), [x])
    got, want = run(x), ref(x)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    (got[0].square().sum() + got[1].sum()).backward()
    (want[0].square().sum() + want[1].sum()).backward()
    for (n, p), q in zip(ref.named_parameters(), m.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-3, atol=1e-4, msg=lambda s: f"{n}: {s}")
    sched = _forward(run).sched
    assert not any(_is_cl(b) and int(b.size[1]) > 1 and int(b.size[2]) * int(b.size[3]) > 1
                   for b in sched.buffers.values())


def test_training_step_in_one_graph_keeps_eager_layouts(monkeypatch):
    """A training step whose backward is inside its graph (the GPU's default; here forced on the CPU) goes down
    the inference path but keeps eager's layouts (wants_channels_last: no convolution's backward): every value of
    the step as eager's, gradients with eager's strides, no channels-last buffer."""
    from ember.frontend import policy as interpreter
    monkeypatch.setattr(interpreter, "BACKWARD_IN_GRAPH_DEVICES", {"cpu", "cuda"})
    lowered = []
    real_lower = lower.lower

    def spy(gm, example_inputs, target="cpu"):
        out = real_lower(gm, example_inputs, target)
        lowered.append((gm, out[2]))
        return out
    monkeypatch.setattr(lower, "lower", spy)
    torch.manual_seed(0)
    m = Block().train()
    ref = copy.deepcopy(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01, momentum=0.9)

    def step(model, o, x):
        o.zero_grad(set_to_none=True)
        out, y = model(x)
        loss = out.square().mean() + y.mean()
        loss.backward()
        o.step()
        return loss.detach()
    compiled = ember.compile(step)
    for _ in range(3):
        x = torch.randn(2, 3, 40, 36)
        torch.testing.assert_close(compiled(m, opt, x), step(ref, ref_opt, x), rtol=1e-4, atol=1e-5)
    for (n, p), q in zip(ref.named_parameters(), m.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5, msg=lambda s: f"{n}: {s}")
        assert q.grad.stride() == p.grad.stride(), n
    for b, rb in zip(m.buffers(), ref.buffers()):
        torch.testing.assert_close(b, rb, rtol=1e-4, atol=1e-5)
    one_graph = [g for gm, g in lowered if any(nd.target is torch.ops.aten.convolution_backward.default
                                               for nd in gm.graph.nodes)]
    assert one_graph and all(gm.meta.get("ember_inference") for gm, g in lowered if g in one_graph)
    assert all(not g.channels_last and not g.cl for g in one_graph)
    assert not any(_is_cl(b) and int(b.size[1]) > 1 and int(b.size[2]) * int(b.size[3]) > 1
                   for g in one_graph for b in g.buffers)


POOLS = [dict(kernel_size=3, stride=2, padding=1), dict(kernel_size=2), dict(kernel_size=(3, 2), stride=(2, 1)),
         dict(kernel_size=3, stride=2, padding=1, dilation=2), dict(kernel_size=3, stride=2, ceil_mode=True),
         dict(kernel_size=6, stride=1, padding=3)]  # 36 taps: a reduction, not a pointwise maximum


@pytest.mark.parametrize("kw", POOLS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last], ids=["nchw", "nhwc"])
def test_max_pool_values_and_indices_match_eager(kw, memory_format):
    f = WithConv(torch.nn.Conv2d(3, 5, 3), lambda conv, x: F.max_pool2d(torch.relu(conv(x)) - 0.1,
                                                                         return_indices=True, **kw))
    x = torch.randn(2, 3, 15, 17).contiguous(memory_format=memory_format)
    with torch.no_grad():  # inference: channels-last inside
        run = compile_graph(torch.fx.symbolic_trace(f), [x])
        _assert_same(run(x), f(x))
    xg = x.clone().requires_grad_()  # training: indices feed the backward
    run = compile_graph(torch.fx.symbolic_trace(f), [xg])
    got, want = run(xg), f(x.clone().requires_grad_())
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    big = kw["kernel_size"] == 6  # windows over 25 taps are reductions, smaller ones pointwise over the output
    assert any(isinstance(b, Reduction) for b in _forward(run).sched.buffers.values()) == big


@pytest.mark.parametrize("kw", POOLS[:5], ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_max_pool_edges_with_nan_and_inf_match_eager(kw):
    """Undilated windows load a tap outside the input at the clamped edge, a position of the same window, with
    no `where(inside, v, -inf)` select (which kept g++ from vectorizing the channels-last loop over C); the edges
    hold NaN, -inf and +inf, the maximum and its index must still be eager's."""
    f = WithConv(torch.nn.Conv2d(3, 6, 1), lambda conv, x: F.max_pool2d(conv(x) * 0 + x.repeat(1, 2, 1, 1),
                                                                         return_indices=True, **kw))
    x = torch.randn(2, 3, 9, 11)
    x[0, 0, 0, :] = float("nan")
    x[0, 1, :, 0] = -float("inf")
    x[1, 2, -1, :] = float("inf")
    x[1, 0, :, -1] = -float("inf")
    x[1, 1, :2, :2] = float("nan")
    x = x.contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        run = compile_graph(torch.fx.symbolic_trace(f), [x])
        got, want = run(x), f(x)
    torch.testing.assert_close(got[0], want[0], equal_nan=True)
    torch.testing.assert_close(got[1], want[1])
    src = _forward(run).source
    assert ("-std::numeric_limits<float>::infinity()" in src) == (kw.get("dilation", 1) > 1)


AVG = [dict(kernel_size=2), dict(kernel_size=3, stride=2, padding=1), dict(kernel_size=(2, 3), stride=(1, 2),
                                                                           divisor_override=5),
       dict(kernel_size=3, stride=2, padding=1, count_include_pad=False)]  # varying divisor: an ATen call


@pytest.mark.parametrize("kw", AVG, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last], ids=["nchw", "nhwc"])
def test_avg_pool_matches_eager_and_an_aten_call_gets_eager_layout(kw, memory_format):
    f = WithConv(torch.nn.Conv2d(4, 8, 3), lambda conv, x: conv(F.avg_pool2d(conv(x).relu()[:, :4], **kw)))
    x = torch.randn(2, 4, 17, 19).contiguous(memory_format=memory_format)
    lower.FALLBACK_COUNTS.clear()
    with torch.no_grad():
        run = compile_graph(torch.fx.symbolic_trace(f), [x])
        _assert_same([run(x)], [f(x)])
    assert bool(lower.FALLBACK_COUNTS) == ("count_include_pad" in kw)


def test_as_strided_of_a_channels_last_value_reads_eager_storage_order():
    """as_strided addresses storage: on a value ember stores channels-last it is an ATen call on eager's layout."""
    f = WithConv(torch.nn.Conv2d(3, 4, 3), lambda conv, x: torch.as_strided(torch.relu(conv(x)), (2, 4, 3), (5, 7, 2)))
    x = torch.randn(2, 3, 6, 7)
    with torch.no_grad():
        run = compile_graph(torch.fx.symbolic_trace(f), [x])
        _assert_same([run(x)], [f(x)])


@pytest.mark.parametrize("view", ["transposed", "reshaped", "window"])
def test_as_strided_of_a_view_of_a_computed_value_reads_eager_storage_order(view):
    """as_strided of a view of a value ember computes (not stored yet) addresses the storage eager lays the view
    out in: a transposed view of a product reads the product's order (Longformer's overlapping chunks: a reshape
    of transposed heads, then as_strided); the view is stored in eager's strides first."""
    def f(x):
        y = x * 2 + 1
        if view == "transposed":
            return torch.as_strided(y.t(), (3, 4), (1, 2)) + 1
        if view == "reshaped":
            v = y.view(8, 2, 4, 8).transpose(0, 1).transpose(1, 2).reshape(8, 8, 8).view(8, 2, 4, 8)
            return torch.as_strided(v, (8, 3, 4, 8), (8, 128, 64, 1)) * 3
        return torch.as_strided(y.t(), (2, 3), (2, 3)).sin()   # overlapping windows inside the view's elements
    x = torch.randn(8, 2, 32) if view == "reshaped" else torch.randn(4, 4)
    with torch.no_grad():
        run = compile_graph(torch.fx.symbolic_trace(f), [x])
        _assert_same([run(x)], [f(x)])


@pytest.mark.parametrize("out_size", [1, (3, 2)], ids=["global", "3x2"])
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last], ids=["nchw", "nhwc"])
def test_adaptive_avg_pool_after_a_convolution_matches_eager(out_size, memory_format):
    """Global pooling is a mean over H, W (read at a stride of C from a channels-last buffer); other sizes stay
    ATen calls, whose argument gets eager's layout back."""
    f = WithConv(torch.nn.Conv2d(3, 6, 3), lambda conv, x: (F.adaptive_avg_pool2d(conv(x).relu(), out_size),
                                                            F.adaptive_avg_pool2d(conv(x), out_size).flatten(1)))
    x = torch.randn(2, 3, 11, 9).contiguous(memory_format=memory_format)
    with torch.no_grad():
        run = compile_graph(torch.fx.symbolic_trace(f), [x])
        _assert_same(run(x), f(x))


def test_densenet_concatenations_are_windows_onto_one_channels_last_buffer():
    """Concatenations along C each extending the previous one (cat_chains.plan_cat_chains): library copies of the new
    pieces into one channels-last buffer, each cat a window onto its first channels (C innermost), not a
    per-element choice of the piece in the consumer's inner loop over C; equal to eager."""
    class Dense(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.convs = torch.nn.ModuleList(torch.nn.Conv2d(4 + 3 * i, 3, 3, padding=1) for i in range(3))
            self.bns = torch.nn.ModuleList(torch.nn.BatchNorm2d(4 + 3 * i) for i in range(4))

        def forward(self, x):
            feats = [x]
            for conv, bn in zip(self.convs, self.bns):
                feats.append(conv(torch.relu(bn(torch.cat(feats, 1)))))
            return torch.relu(self.bns[3](torch.cat(feats, 1)))
    m = _randomized(Dense())
    x = torch.randn(2, 4, 9, 7)
    lower.FALLBACK_COUNTS.clear()
    with torch.no_grad():
        run = compile_graph(torch.fx.symbolic_trace(m), [x])
        _assert_same([run(x)], [m(x)])
    assert not lower.FALLBACK_COUNTS
    items = [it for it in _forward(run).sched.items if isinstance(it, ExternBuffer)]
    assert not [it for it in items if it.target == torch.ops.aten.cat.default]
    cats = [it for it in items if it.target in (cat_chains.cat_chain_first, cat_chains.cat_chain_extend)]
    assert [c.target for c in cats] == [cat_chains.cat_chain_first] + [cat_chains.cat_chain_extend] * 3
    assert all(int(o.stride[1]) == 1 and int(o.stride[3]) == 13 for c in cats for o in c.outputs)  # 13 channels
