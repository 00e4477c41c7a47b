"""ATen tracing and functionalization: graphs are functional, input mutations and aliases behave as in eager."""
import copy

import pytest
import torch
import torch.fx

from ember import config
from ember.autograd import aot_eager, aot_module, trace_forward, trace_joint
from ember.autograd.after_graph import run_graph


def _is_mutating(node):
    t = node.target
    return isinstance(t, torch._ops.OpOverload) and any(
        a.alias_info is not None and a.alias_info.is_write for a in t._schema.arguments)


def check_functional(gm):
    for n in gm.graph.nodes:
        assert not _is_mutating(n), f"{n.format_node()} mutates"
        if n.op not in ("output",):
            assert "val" in n.meta, n.format_node()


class Mutations(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(6, 6)
        self.bn = torch.nn.BatchNorm1d(6)

    def forward(self, x, y):
        h = self.bn(self.lin(x)).relu()
        y.add_(1)                      # user mutation of an input
        h[:, 0].mul_(2)                # write into a view of an intermediate
        h.transpose(0, 1)[1:3].zero_()  # write through a chain of views
        z = torch.nn.functional.dropout(h, 0.3, True)
        return h + z.sum(), y.view(-1), x.t(), y


def test_forward_graph_is_functional_and_mutations_match_eager():
    m = Mutations()
    ref = copy.deepcopy(m)
    x, y = torch.randn(4, 6), torch.randn(4, 6)
    y_ref = y.clone()
    gm = torch.fx.symbolic_trace(m)
    g, meta = trace_forward(gm, [x, y])
    check_functional(g)
    for spec in meta.outputs:
        if spec.kind == "graph":
            v = g.graph.output_node().args[0][spec.index].meta["val"]
            assert isinstance(v, torch.Tensor)
    # y, running_mean, running_var, num_batches_tracked are written
    assert {meta.lifted[m.input_index - 2] if m.input_index >= 2 else "y" for m in meta.mutations} == {
        "y", "bn.running_mean", "bn.running_var", "bn.num_batches_tracked"}
    run = run_graph(g, meta, gm)
    torch.manual_seed(0)
    out = run(x, y)
    torch.manual_seed(0)
    want = ref(x, y_ref)
    for a, b in zip(out, want):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(y, y_ref)
    for a, b in zip(m.buffers(), ref.buffers()):
        torch.testing.assert_close(a, b)
    # outputs aliasing inputs alias them, as in eager
    assert out[1].data_ptr() == y.data_ptr() and out[1].shape == (24,)
    assert out[2].data_ptr() == x.data_ptr() and out[2].stride() == x.t().stride()
    assert out[3] is y


def test_meta_val_has_shape_dtype_stride():
    def f(x):
        return (x.permute(1, 0) * 2).to(torch.float64).sum(0)
    x = torch.randn(3, 5)
    g, meta = trace_forward(torch.fx.symbolic_trace(f), [x])
    vals = {n.target: n.meta["val"] for n in g.graph.nodes if n.op == "call_function"}
    p = vals[torch.ops.aten.permute.default]
    assert p.shape == (5, 3) and p.stride() == (1, 5) and p.dtype == torch.float32
    assert vals[torch.ops.aten.sum.dim_IntList].dtype == torch.float64


def test_write_into_view_of_input_is_copied_back():
    def f(x):
        x[1:].mul_(3)
        x.select(1, 0).add_(1)
        return x.sum(0)
    x = torch.randn(4, 5)
    x_ref = x.clone()
    fn = aot_eager(torch.fx.symbolic_trace(f), [x])
    torch.testing.assert_close(fn(x), f(x_ref))
    torch.testing.assert_close(x, x_ref)


def test_views_read_after_base_write_see_the_write():
    def f(x):
        a = x * 1
        v = a[0]          # view taken before the write
        a.add_(10)        # write through the base
        w = a.view(-1)
        w.select(0, 3).fill_(0.5)  # write through a view of a view
        return v * 2, a
    x = torch.randn(3, 4)
    g, meta = trace_forward(torch.fx.symbolic_trace(f), [x])
    check_functional(g)
    for a, b in zip(run_graph(g, meta)(x), f(x)):
        torch.testing.assert_close(a, b)


def test_inplace_on_intermediate_training_grads():
    def f(x, w):
        h = x @ w
        h.add_(1)
        h[:, :2].mul_(3)
        return h.sigmoid().sum()
    x, w = torch.randn(5, 4, requires_grad=True), torch.randn(4, 3, requires_grad=True)
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    fn = aot_eager(torch.fx.symbolic_trace(f), [x, w])
    fn(x, w).backward()
    f(x2, w2).backward()
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(w.grad, w2.grad)


def test_mutated_non_leaf_input_requiring_grad():
    def f(x, y):
        x.mul_(y)
        return x.sum(1)
    a = torch.randn(3, 4, requires_grad=True)
    b = torch.randn(3, 4, requires_grad=True)
    a2, b2 = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    fn = aot_eager(torch.fx.symbolic_trace(f), [a * 1, b])
    xa, xa2 = a * 2, a2 * 2                 # non-leaf inputs, as eager allows
    out, out2 = fn(xa, b), f(xa2, b2)
    torch.testing.assert_close(out, out2)
    torch.testing.assert_close(xa, xa2)
    (out.sum() + xa.sum()).backward()
    (out2.sum() + xa2.sum()).backward()
    torch.testing.assert_close(a.grad, a2.grad)
    torch.testing.assert_close(b.grad, b2.grad)


def test_inference_builds_no_backward():
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
    x = torch.randn(2, 4)
    with torch.no_grad():
        fn = aot_eager(torch.fx.symbolic_trace(m), [x])
        torch.testing.assert_close(fn(x), m(x))
    (art,) = fn.artifacts.values()
    assert not art.training
    out = fn(x)             # grad mode on, parameters require grad: a training artifact
    assert out.requires_grad and len(fn.artifacts) == 2


def test_inner_compilers_get_aten_graphs():
    seen = []

    def compiler(gm, example_inputs):
        check_functional(gm)
        assert all(isinstance(t, torch.Tensor) for t in example_inputs)
        seen.append(gm.__class__.__name__)
        return gm.forward

    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())
    x = torch.randn(2, 4)
    fn = aot_module(torch.fx.symbolic_trace(m), [x], compiler)
    fn(x).sum().backward()
    assert seen == ["AtenForward", "AtenBackward"]


def test_double_backward_names_the_graph():
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
    x = torch.randn(2, 4, requires_grad=True)
    gm = torch.fx.symbolic_trace(m)
    fn = aot_eager(gm, [x])
    out = fn(x).sum()
    with pytest.raises(RuntimeError, match="double backward.*compiled graph 'Sequential'"):
        torch.autograd.grad(out, x, create_graph=True)


def test_data_dependent_graph_falls_back_to_eager(caplog):
    def f(x):
        return x[x > 0].sum()          # nonzero: output shape depends on data
    x = torch.randn(10)
    fn = aot_eager(torch.fx.symbolic_trace(f), [x])
    torch.testing.assert_close(fn(x), f(x))
    assert list(fn.artifacts.values()) == [None]


def test_joint_graph_layout():
    def f(x, w, b):
        return (x @ w + b).relu().sum(1), x.shape[0] * 1.0
    x, w, b = torch.randn(3, 4), torch.randn(4, 2, requires_grad=True), torch.randn(2)
    joint, meta = trace_joint(torch.fx.symbolic_trace(f), [x, w, b])
    assert meta.requires_grad == [False, True, False]
    assert meta.tangent_of == [0]
    names = [n.name for n in joint.graph.nodes if n.op == "placeholder"]
    assert names == ["primal_0", "primal_1", "primal_2", "tangent_0"]
    outs = joint.graph.output_node().args[0]
    assert len(outs) == meta.num_graph_outputs + len(meta.mutations) + 1
    assert meta.outputs[1].kind == "const" and meta.outputs[1].value == 3.0


def test_inplace_view_ops():
    def f(x):
        y = x * 2
        y.t_()
        y.unsqueeze_(0)
        return y + 1
    x = torch.randn(3, 4)
    fn = aot_eager(torch.fx.symbolic_trace(f), [x])
    torch.testing.assert_close(fn(x), f(x))
    assert list(fn.artifacts.values()) != [None]

    def g(x):
        x.t_()                              # metadata of an input changes: not expressible, runs eagerly
        return x * 1
    a, b = torch.randn(3, 4), None
    b = a.clone()
    fg = aot_eager(torch.fx.symbolic_trace(g), [a])
    torch.testing.assert_close(fg(a), g(b))
    assert a.shape == b.shape == (4, 3)
    assert list(fg.artifacts.values()) == [None]


def test_foreach_inplace_optimizer_style_update():
    """Optimizer-like mutation of many inputs (parameters under no_grad), via _foreach ops and addcdiv_."""
    def step(p1, p2, g1, g2, v1, v2):
        torch._foreach_mul_([v1, v2], 0.9)
        torch._foreach_addcmul_([v1, v2], [g1, g2], [g1, g2], value=0.1)
        for p, g, v in ((p1, g1, v1), (p2, g2, v2)):
            p.addcdiv_(g, v.sqrt().add_(1e-8), value=-0.01)
    args = [torch.randn(4, 3), torch.randn(5), torch.randn(4, 3), torch.randn(5), torch.rand(4, 3), torch.rand(5)]
    ref = [a.clone() for a in args]
    with torch.no_grad():
        fn = aot_eager(torch.fx.symbolic_trace(step), args)
        fn(*args)
        step(*ref)
    for a, b in zip(args, ref):
        torch.testing.assert_close(a, b)
    (art,) = fn.artifacts.values()
    assert sorted(m.input_index for m in art.meta.mutations) == [0, 1, 4, 5]


def test_non_tensor_input_falls_back_to_eager():
    def f(x, n):
        return x * n
    gm = torch.fx.symbolic_trace(f)
    x = torch.randn(3)
    fn = aot_eager(gm, [x, 3])
    torch.testing.assert_close(fn(x, 3), x * 3)
    assert list(fn.artifacts.values()) == [None]


def test_aten_nodes_name_their_torch_level_origin():
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())
    gm = torch.fx.symbolic_trace(m)
    joint, _ = trace_joint(gm, [torch.randn(2, 4)])
    origins = {n.target: n.meta.get("origin") for n in joint.graph.nodes if n.op == "call_function"}
    assert origins[torch.ops.aten.addmm.default] == "_0"          # the call_module node of the Linear
    assert origins[torch.ops.aten.gelu.default] == "_1"
    assert origins[torch.ops.aten.gelu_backward.default] == "backward"


@pytest.mark.parametrize("x_requires_grad", [True, False])
def test_graph_that_switches_grad_mode_leaves_it_switched(x_requires_grad):
    """A `with torch.no_grad():` cut by a graph break: the first graph turns grad off for the code after it."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    g.call_function(torch._C._set_grad_enabled, (False,))
    g.output((g.call_function(torch.mul, (x, 2)),))
    gm = torch.fx.GraphModule(torch.nn.Module(), g)
    a = torch.randn(3, requires_grad=x_requires_grad)
    try:
        fn = aot_eager(gm, [a])
        torch.set_grad_enabled(True)
        (out,) = fn(a)
        assert not torch.is_grad_enabled() and not out.requires_grad
        torch.set_grad_enabled(True)
        (want,) = gm(a)
        assert not torch.is_grad_enabled()
        torch.testing.assert_close(out, want)
    finally:
        torch.set_grad_enabled(True)


# ------------------------------------------------------------------ direct output metadata (fake_dispatch._DIRECT)

def _fake_meta(t):
    return (tuple(t.shape), t.stride(), t.dtype, t.device, t.storage_offset(), t._is_view(), t.requires_grad,
            t.untyped_storage().nbytes(), type(t).__name__)


def _direct_and_dispatched(op, make_args):
    """(the rule's outputs, FakeTensorMode's outputs) for the same arguments, each made in its own fake mode
    (so the rule cannot reuse a cached dispatch)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from ember.autograd.fake_dispatch import _DIRECT
    out = []
    for direct in (True, False):
        mode = FakeTensorMode()
        with mode:
            args = make_args()
        if direct:
            r = _DIRECT[op](args, {})
        else:
            with mode:
                r = op(*args)
        out.append(r)
    return out


def _bn_args(device, dtype, affine=True, layout=None, training=False, stat_dtype=None):
    def make():
        x = torch.empty(3, 5, 4, 6, device=device, dtype=dtype)
        if layout is not None:
            x = x.to(memory_format=layout)
        vec = lambda: torch.empty(5, device=device, dtype=stat_dtype or dtype)  # noqa: E731
        w, b = (vec(), vec()) if affine else (None, None)
        return (x, w, b, vec(), vec(), training, 0.1, 1e-5)
    return make


@pytest.mark.parametrize("device", ["cpu", "cuda"])   # (fake CUDA tensors need no GPU)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("affine", [True, False])
def test_direct_eval_batch_norm_is_fake_tensor_mode(device, dtype, affine):
    aten = torch.ops.aten
    direct, dispatched = _direct_and_dispatched(aten.native_batch_norm.default, _bn_args(device, dtype, affine))
    assert direct is not None
    assert [_fake_meta(t) for t in direct] == [_fake_meta(t) for t in dispatched]


@pytest.mark.parametrize("case", ["channels_last", "training", "stat_dtype"])
def test_direct_batch_norm_falls_through(case):
    from torch._subclasses.fake_tensor import FakeTensorMode
    from ember.autograd.fake_dispatch import _DIRECT
    aten = torch.ops.aten
    kw = {"channels_last": dict(layout=torch.channels_last), "training": dict(training=True),
          "stat_dtype": dict(dtype=torch.float16, stat_dtype=torch.float32)}[case]
    with FakeTensorMode():
        args = _bn_args("cpu", kw.pop("dtype", torch.float32), **kw)()
    assert _DIRECT[aten.native_batch_norm.default](args, {}) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape,stride,padding,dilation,groups,bias", [
    ((2, 4, 9, 7), (1, 1), (0, 0), (1, 1), 1, True),
    ((1, 6, 8, 8), (2, 2), (1, 1), (1, 1), 2, False),
    ((2, 4, 7, 11), (2, 1), (3, 0), (2, 1), 4, True),
    ((3, 4, 5, 5), (1, 1), (1, 1), (1, 1), 1, False),
    ((1, 2, 1, 1), (1, 1), (0, 0), (1, 1), 1, True),     # 1x1 output: strides of size-1 dims
])
def test_direct_convolution_is_fake_tensor_mode(dtype, shape, stride, padding, dilation, groups, bias):
    aten = torch.ops.aten
    c = shape[1]

    def make():
        x = torch.empty(shape, dtype=dtype)
        w = torch.empty(8, c // groups, 3 if shape[2] > 1 else 1, 3 if shape[3] > 1 else 1, dtype=dtype)
        b = torch.empty(8, dtype=dtype) if bias else None
        return (x, w, b, list(stride), list(padding), list(dilation), False, [0, 0], groups)
    direct, dispatched = _direct_and_dispatched(aten.convolution.default, make)
    assert direct is not None
    assert _fake_meta(direct) == _fake_meta(dispatched)


def test_direct_convolution_falls_through():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from ember.autograd.fake_dispatch import _DIRECT
    aten = torch.ops.aten
    with FakeTensorMode():
        x = torch.empty(2, 4, 8, 8).to(memory_format=torch.channels_last)
        w = torch.empty(6, 4, 3, 3)
        half = torch.empty(2, 4, 8, 8, dtype=torch.float16)
    conv = _DIRECT[aten.convolution.default]
    assert conv((x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1), {}) is None        # channels-last input
    assert conv((x.contiguous(), w, None, [1, 1], [0, 0], [1, 1], True, [0, 0], 1), {}) is None   # transposed
    assert conv((half, w.half(), None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1), {}) is None   # half on a CPU


def _graph_meta(gm):
    def val(v):
        if isinstance(v, torch.Tensor):
            return (tuple(v.shape), v.stride(), v.dtype, v.device, v.storage_offset(), v.requires_grad)
        if isinstance(v, (tuple, list)):
            return tuple(val(x) for x in v)
        return v
    return [(n.op, str(n.target), str(n.args), val(n.meta.get("val"))) for n in gm.graph.nodes]


@pytest.mark.parametrize("training", [False, True])
def test_dispatch_memo_same_graphs(monkeypatch, training):
    """The recorder's memo of fake dispatches (fake_dispatch._memo_fake_call) gives the graphs and node metadata that
    dispatching every op gives, on repeated layers where it answers most ops; its outputs are fresh tensors."""
    import ember.autograd.fake_dispatch as fake_dispatch

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = torch.nn.LayerNorm(16)
            self.fc = torch.nn.Linear(16, 48)
            self.out = torch.nn.Linear(16, 16)

        def forward(self, x):
            q, k, v = self.fc(self.ln(x)).split(16, dim=-1)
            a = torch.softmax(q @ k.transpose(-1, -2) / 4.0, dim=-1)
            return x + self.out(torch.nn.functional.gelu(a @ v))

    model = torch.nn.Sequential(*[Block() for _ in range(3)])
    x = torch.randn(2, 5, 16, requires_grad=training)
    trace = trace_joint if training else trace_forward
    hits = []
    from_spec = fake_dispatch._from_spec

    def counting(mode, spec):
        out = from_spec(mode, spec)
        if isinstance(out, torch.Tensor):   # (a tuple's items come through here one by one)
            hits.append(out)
        return out
    monkeypatch.setattr(fake_dispatch, "_from_spec", counting)
    with torch.set_grad_enabled(training):
        with_memo = _graph_meta(trace(model, [x])[0])
        monkeypatch.setattr(config, "MEMO", False)
        without = _graph_meta(trace(model, [x])[0])
    assert with_memo == without
    outs = hits
    assert len(outs) >= 20   # the second and third blocks' ops, at least
    assert len({o.untyped_storage()._cdata for o in outs}) == len(outs)


def test_dispatch_memo_keys():
    """What the memo keys on: tensor metadata, scalars by type and value; anything else is not memoized."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from ember.autograd.fake_dispatch import _memo_key
    mode, other = FakeTensorMode(), FakeTensorMode()
    with mode:
        a, b, c = torch.empty(2, 3), torch.empty(2, 3), torch.empty(3, 2).t()
    with other:
        d = torch.empty(2, 3)
    assert _memo_key(mode, (a, 1, [2, 3])) == _memo_key(mode, (b, 1, [2, 3]))
    assert _memo_key(mode, (a,)) != _memo_key(mode, (c,))                  # strides differ
    assert _memo_key(mode, (a, 1)) != _memo_key(mode, (a, 1.0))            # type of a scalar matters
    assert _memo_key(mode, (a, True)) != _memo_key(mode, (a, 1))
    assert _memo_key(mode, (d,)) is None                                  # another mode's tensor
    assert _memo_key(mode, (a, float("nan"))) is None
    assert _memo_key(mode, (a, object())) is None


def test_no_grad_copy_backs_follow_the_pattern_of_in_place_writes():
    """finish() plans no-grad copy-backs (an optimizer step's) per pattern of which inputs the graph wrote in
    place: a call whose graph wrote none in place (the host program's fallback for overlapping inputs) copies
    every value back, one where it wrote all bumps their versions only, and the first pattern's plan is
    reused when it comes back; mixed dtypes are copied as eager would."""
    from ember.autograd.after_graph import finish
    from ember.autograd.trace_meta import InputMutation, OutputSpec, TraceMeta
    import torch.utils._pytree as pytree
    muts = [InputMutation(i, i, grad_enabled=False, grad_written=False) for i in range(3)]
    meta = TraceMeta(num_inputs=3, lifted=[], outputs=[OutputSpec("const", value=None)],
                     out_spec=pytree.tree_flatten(None)[1], mutations=muts)
    inputs = [torch.zeros(2), torch.zeros(3, dtype=torch.float64), torch.zeros(())]
    for call in range(3):
        if call == 1:       # all written in place
            outs = list(inputs)
            versions = [t._version for t in inputs]
            assert finish(meta, inputs, outs) is None
            assert [t._version for t in inputs] == [v + 1 for v in versions]
        else:               # none in place: copied back (the float64 one from a float32 value)
            outs = [torch.randn(2), torch.randn(3), torch.randn(())]
            assert finish(meta, inputs, outs) is None
            for dst, src in zip(inputs, outs):
                torch.testing.assert_close(dst, src.to(dst.dtype))
    assert len(meta._copy_back[2]) == 2   # two patterns, two plans
