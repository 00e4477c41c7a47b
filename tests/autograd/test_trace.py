"""ATen tracing and functionalization: graphs are functional, input mutations and aliases behave as in eager."""
import copy

import pytest
import torch
import torch.fx

from ember.autograd import aot_eager, aot_module, trace_forward, trace_joint
from ember.autograd.trace import run_graph


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
    fn = aot_eager(torch.fx.symbolic_trace(m), [x])
    with torch.no_grad():
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
