"""Symbolic graphs through ember.autograd (docs/dynamic.md): traced once on the ShapeEnv's fakes, the compiled
callable (both graphs run as ATen GraphModules) equals eager, outputs and gradients, at every size."""
import copy
import logging
import math
import operator

import pytest
import torch
import torch.fx
import torch.nn.functional as F

from ember.autograd import aot_module, partition, trace_forward, trace_joint
from tests.symbolic_graphs import symbolic_graph


class Counting:
    """A compiler running the ATen graph as it is, counting and keeping what it was given."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append((gm, list(example_inputs)))
        return gm.forward


def _clone(x, requires_grad=None):
    if not isinstance(x, torch.Tensor):
        return x
    y = x.detach().clone()
    return y.requires_grad_(x.requires_grad if requires_grad is None else requires_grad)


def _leaves_grads(inputs):
    return [x.grad for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]


def check_graph(gm):
    """Every node of an ATen graph has meta["val"]; sizes are ints or nodes (SymInt valued), never SymInts."""
    for n in gm.graph.nodes:
        if n.op != "output":
            assert "val" in n.meta, n.format_node()
        for a in torch.utils._pytree.tree_leaves((n.args, n.kwargs)):
            assert not isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)), n.format_node()


def run_sizes(fn, make, sizes, dynamic=None, train=True, module=None):
    """Trace fn's symbolic graph once at sizes[0] (make(n) -> inputs), then compare with eager at every size:
    outputs, input mutations, and gradients of every input (and parameter) that requires grad."""
    example = make(sizes[0])
    gm = symbolic_graph(module if module is not None else fn, example, dynamic)
    fw, bw = Counting(), Counting()
    with torch.set_grad_enabled(train):
        compiled = aot_module(gm, example, fw, bw)
    ref_mod = copy.deepcopy(module) if module is not None else None
    for n in sizes:
        inputs = make(n)
        ref_inputs = [_clone(x) for x in inputs]
        with torch.set_grad_enabled(train):
            torch.manual_seed(n)                  # (random ops draw the same numbers as eager's)
            out = compiled(*inputs)
            torch.manual_seed(n)
            want = (ref_mod if ref_mod is not None else fn)(*ref_inputs)
        torch.testing.assert_close(out, want)
        for a, b in zip(inputs, ref_inputs):     # input mutations
            if isinstance(a, torch.Tensor):
                torch.testing.assert_close(a.detach(), b.detach())
        if train:
            outs = [o for o in torch.utils._pytree.tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]
            wants = [o for o in torch.utils._pytree.tree_leaves(want)
                     if isinstance(o, torch.Tensor) and o.requires_grad]
            assert len(outs) == len(wants)
            grads = [torch.randn_like(o) for o in outs]
            torch.autograd.backward(outs, grads)
            torch.autograd.backward(wants, grads)
            torch.testing.assert_close(_leaves_grads(inputs), _leaves_grads(ref_inputs))
            if module is not None:
                for (name, p), q in zip(module.named_parameters(), ref_mod.parameters()):
                    torch.testing.assert_close(p.grad, q.grad, msg=name)
                    p.grad = q.grad = None
    assert len(compiled.artifacts) == 1, list(compiled.artifacts)
    (key,) = compiled.artifacts
    assert key[0] == "symbolic"
    assert len(fw.graphs) == 1 and len(bw.graphs) <= 1
    for g, _ in fw.graphs + bw.graphs:
        check_graph(g)
    return compiled, fw, bw


def _x(*shape, grad=True):
    return torch.randn(*shape, dtype=torch.float64).requires_grad_(grad)


SIZES = [6, 3, 11, 2, 8]


def test_views_by_symbolic_sizes():
    def f(s0, x):
        y = x.view(s0, 3, 2) * 2
        z = y.reshape(-1, 6).sin() + x.new_zeros((s0, 6))
        return z.permute(1, 0).contiguous().view(6 * s0), x.expand(2, s0, 6).sum(0)
    compiled, fw, bw = run_sizes(f, lambda n: [n, _x(n, 6)], SIZES, {"x": (0,)})
    aten_fw, example = fw.graphs[0]
    (s0,) = [n for n in aten_fw.graph.nodes if n.op == "placeholder" and isinstance(n.meta["val"], torch.SymInt)]
    assert example[0] == 6 and s0.name == "primal_0"
    # the symbolic sizes are the placeholder or arithmetic over it
    assert any(n.target is operator.mul and s0 in n.args for n in aten_fw.graph.nodes)


def test_reductions():
    def f(x):
        return x.sum(0), x.mean(1, keepdim=True) * x, x.amax(0), x.var(0), x.norm()
    run_sizes(f, lambda n: [_x(n, 5)], SIZES, {"x": (0,)})


def test_two_symbolic_dims_and_broadcasting():
    def f(x, y):
        z = x + y                               # (s0, 1) + (1, s1) -> (s0, s1)
        return (z * z.softmax(1)).sum(0), z.log_softmax(0)
    run_sizes(f, lambda n: [_x(n, 1), _x(1, n + 3)], SIZES, {"x": (0,), "y": (1,)})


def test_matmul_and_linear():
    w, b = _x(7, 5), _x(7)

    def f(x, v):
        h = F.linear(x, w, b).relu()           # (s0, 7)
        return h @ v, torch.bmm(x.view(1, -1, 5).expand(2, -1, -1), x.t().unsqueeze(0).expand(2, -1, -1))
    run_sizes(f, lambda n: [_x(n, 5), _x(7, 3)], SIZES, {"x": (0,)})


def test_layer_norm_and_batch_norm_training():
    w, b = _x(4), _x(4)

    def f(x, rm, rv):
        y = F.layer_norm(x, [x.shape[-1]], w, b)
        z = F.batch_norm(y.transpose(1, 2), rm, rv, w, b, training=True, momentum=0.1)
        return z.relu()
    # (s0, s1, 4): batch and sequence both symbolic; the running stats are written in place
    run_sizes(f, lambda n: [_x(n, n + 2, 4), torch.randn(4, dtype=torch.float64),
                            torch.rand(4, dtype=torch.float64) + 0.5], SIZES, {"x": (0, 1)})


def test_cat_backward_needs_a_saved_symbol():
    def f(x, y):
        return torch.cat([x, y.sin()], 0) * 3
    compiled, fw, bw = run_sizes(f, lambda n: [_x(n, 4), _x(n + 5, 4)], SIZES, {"x": (0,), "y": (0,)})
    (art,) = compiled.artifacts.values()
    assert art.part.saved_symbols, "the backward splits the gradient at x's size: a saved symbol"
    fw_out = list(art.part.forward.graph.output_node().args[0])
    assert all(isinstance(o.meta["val"], torch.SymInt) for o in fw_out[-len(art.part.saved_symbols):])
    bw_inputs = [n for n in art.part.backward.graph.nodes if n.op == "placeholder"]
    assert any(isinstance(n.meta["val"], torch.SymInt) for n in bw_inputs)
    # the backward compiler got the real sizes as ints
    (_, example), = bw.graphs
    assert any(type(v) is int for v in example)


def test_in_place_input_mutation():
    def f(s0, x, y):
        x.add_(1)
        y[:, 0].mul_(2)
        y.view(s0 * 3)[1:].add_(x.view(-1)[: 3 * s0 - 1])
        return x * y
    run_sizes(f, lambda n: [n, _x(n, 3, grad=False), _x(n, 3, grad=False)], SIZES, {"x": (0,), "y": (0,)},
              train=False)


def test_mutated_input_in_training():
    def f(x, buf):
        buf.mul_(0.5).add_(x.detach().sum(0))
        return (x * buf).tanh()
    run_sizes(f, lambda n: [_x(n, 4), torch.randn(4, dtype=torch.float64)], SIZES, {"x": (0,)})


def test_outputs_aliasing_inputs():
    def f(s0, x):
        return x.view(s0 * 2, -1), x[: s0 // 2], x.t(), x.narrow(0, 1, s0 - 1) * 2
    # (not size 2: narrow's size s0 - 1 would be 1, which the trace's guards exclude)
    compiled, _, _ = run_sizes(f, lambda n: [n, _x(n, 4)], [6, 3, 11, 8], {"x": (0,)})
    (art,) = compiled.artifacts.values()
    assert [s.kind for s in art.meta.outputs] == ["alias", "alias", "alias", "graph"]
    x = torch.randn(5, 4)
    out = compiled(5, x)
    assert out[0]._base is x and out[1]._base is x     # they alias the input, as in eager


def test_sizes_as_scalar_operands():
    def f(s0, x):
        return (x * s0, x + s0 / 2, x.new_full((s0,), 3.0) * s0,
                torch.arange(s0, dtype=torch.float64) * x.sum(1), x.sum() * (s0 - 1) ** 2)
    compiled, fw, _ = run_sizes(f, lambda n: [n, _x(n, 3)], SIZES, {"x": (0,)})
    targets = {n.target for n in fw.graphs[0][0].graph.nodes}
    assert operator.truediv in targets and operator.sub in targets     # s0 / 2, (s0 - 1) ** 2


def test_int_outputs_follow_the_sizes():
    def f(x):
        return x * 2, x.size(0) * 3 + 1
    compiled, _, _ = run_sizes(f, lambda n: [_x(n, 2)], SIZES, {"x": (0,)})
    assert compiled(_x(9, 2))[1] == 28


def test_module_with_parameters():
    torch.manual_seed(0)
    mod = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8), torch.nn.GELU(),
                              torch.nn.Linear(8, 3)).double()
    run_sizes(None, lambda n: [_x(n, 6)], SIZES, {0: (0,)}, module=mod)


def test_cnn_module_reads_the_batch_size_off_its_input():
    torch.manual_seed(0)
    mod = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                              torch.nn.Flatten(), torch.nn.Linear(4 * 5 * 5, 3)).double()
    # no int argument: Flatten's view needs the batch size, read off the input in the graph (sym_size), and
    # the backward's view of the gradient gets it saved by the forward
    compiled, fw, bw = run_sizes(None, lambda n: [_x(n, 3, 5, 5)], SIZES, {0: (0,)}, module=mod)
    assert any(n.target is torch.ops.aten.sym_size.int for n in fw.graphs[0][0].graph.nodes)
    (art,) = compiled.artifacts.values()
    assert art.part.saved_symbols == ["sym_size_int"]


def test_attention_with_a_causal_mask_of_the_sequence_length():
    wq = _x(8, 8)

    def f(x):
        q = x @ wq
        s = q @ x.transpose(1, 2) / math.sqrt(8)
        n = x.size(1)
        mask = x.new_ones((n, n)).tril().bool()
        return s.masked_fill(~mask, float("-inf")).softmax(-1) @ x
    run_sizes(f, lambda n: [_x(2, n, 8)], SIZES, {0: (1,)})


def test_sdpa_dropout_cross_entropy():
    w = _x(4, 7)

    def f(q, k, v, t):
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)       # (2, 2, s0, 4)
        h = F.dropout(a.transpose(1, 2).reshape(-1, 4), 0.2, True)       # (4 * s0, 4)
        return F.cross_entropy(h @ w, t)
    run_sizes(f, lambda n: [_x(2, 2, n, 4), _x(2, 2, n, 4), _x(2, 2, n, 4), torch.randint(0, 7, (4 * n,))],
              SIZES, {0: (2,), 1: (2,), 2: (2,), 3: (0,)})


class Embed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 6).double()

    def forward(self, ids, s0):
        h = self.emb(ids)
        return h.cumsum(1)[:, torch.arange(s0 - 1)], h.split([2, s0 - 2], 1)[1].mean(1)


def test_embedding_cumsum_indexing_split():
    # (not size 3: the split's s0 - 2 would be 1, which the guards exclude)
    run_sizes(None, lambda n: [torch.randint(0, 10, (2, n)), n], [6, 4, 11, 8], {0: (1,)}, module=Embed())


def test_write_through_a_chain_of_views_of_an_input():
    def f(x):
        x.t()[1:].add_(1)           # an as_strided_scatter with symbolic sizes, strides and offset
        return x * 2
    run_sizes(f, lambda n: [_x(n, 4, grad=False)], SIZES, {0: (0,)}, train=False)


def test_a_trace_that_fixes_a_size_is_logged_and_still_right(caplog):
    class Pool(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.c = torch.nn.Conv1d(3, 4, 3, padding=1).double()

        def forward(self, x):
            return F.max_pool1d(self.c(x), 2)
    mod = Pool()
    ex = [_x(2, 3, 12)]
    gm = symbolic_graph(mod, ex, {0: (2,)})
    with caplog.at_level(logging.INFO, logger="ember.dynamic"):
        compiled = aot_module(gm, ex, Counting(), Counting())
    # max_pool1d's C++ kernel reads the length as an int: the ShapeEnv fixes it
    assert any("fixed sizes" in r.getMessage() for r in caplog.records), caplog.records
    for n in (12, 7):
        x = _x(2, 3, n)
        torch.testing.assert_close(compiled(x), mod(x))
    assert len(compiled.artifacts) == 2


def test_inference_graph_is_symbolic():
    def f(s0, x):
        return x.view(s0, 2, -1).softmax(-1).sum(1)
    gm = symbolic_graph(f, [4, torch.randn(4, 6)], {"x": (0,)})
    g, meta = trace_forward(gm, [4, torch.randn(4, 6)])
    check_graph(g)
    ph = [n for n in g.graph.nodes if n.op == "placeholder"]
    assert isinstance(ph[0].meta["val"], torch.SymInt) and isinstance(ph[1].meta["val"].shape[0], torch.SymInt)
    for n in (3, 9):
        x = torch.randn(n, 6)
        torch.testing.assert_close(g(n, x)[0], f(n, x))


def test_partition_costs_use_the_example_sizes():
    def f(x, w):
        return (x @ w).relu().sum(1)
    ex = [_x(64, 16), _x(16, 32)]
    gm = symbolic_graph(f, ex, {"x": (0,)})
    joint, meta = trace_joint(gm, ex)
    part = partition(joint, meta)
    assert type(part.saved_bytes) is int and part.saved_bytes > 0


def test_a_size_the_guards_do_not_admit_gets_a_static_artifact():
    def f(s0, x):
        return x.view(s0, -1).sum(0)
    gm = symbolic_graph(f, [4, torch.randn(4, 3)], {"x": (0,)})
    compiled = aot_module(gm, [4, torch.randn(4, 3)], Counting(), Counting())
    for n in (1, 5, 1):          # size 1 is never symbolic (ShapeEnv's range starts at 2)
        x = torch.randn(n, 3)
        torch.testing.assert_close(compiled(n, x), f(n, x))
    keys = list(compiled.artifacts)
    assert len(keys) == 2 and keys[0][0] == "symbolic" and keys[1][0] != "symbolic"


def test_through_the_aot_eager_backend():
    from ember.backends import lookup_backend

    def f(s0, x, y):
        return torch.cat([x.view(s0, -1), y], 1).relu().sum(0)
    ex = [5, _x(5, 4), _x(5, 2)]
    gm = symbolic_graph(f, ex, {"x": (0,), "y": (0,)})
    compiled = lookup_backend("aot_eager")(gm, ex)
    for n in (5, 7, 3):
        inputs = [n, _x(n, 4), _x(n, 2)]
        ref = [_clone(x) for x in inputs]
        out, want = compiled(*inputs), f(*ref)
        torch.testing.assert_close(out, want)
        out.sum().backward()
        want.sum().backward()
        torch.testing.assert_close(_leaves_grads(inputs), _leaves_grads(ref))


def test_ember_backend_runs_symbolic_graphs_as_aten_graphs(caplog, monkeypatch):
    """A device backend without SYMBOLIC = True gets no symbolic graph: the ATen graph runs as it is, logged once."""
    from ember.backends import ember_backend
    import ember.backends.cpp_backend as cpp
    monkeypatch.delattr(cpp, "SYMBOLIC", raising=False)
    monkeypatch.setattr(ember_backend, "_logged_symbolic", set())
    called = []
    monkeypatch.setattr(cpp, "compile_aten", lambda *a, **k: called.append(a))

    def f(s0, x):
        return (x.view(s0, -1) * 2).sum(1)
    ex = [6, _x(6, 4)]
    gm = symbolic_graph(f, ex, {"x": (0,)})
    with caplog.at_level(logging.INFO, logger="ember.dynamic"):
        compiled = ember_backend.compile_graph(gm, ex)
        for n in (6, 4, 9):
            inputs = [n, _x(n, 4)]
            ref = [_clone(x) for x in inputs]
            out, want = compiled(*inputs), f(*ref)
            torch.testing.assert_close(out, want)
            out.sum().backward()
            want.sum().backward()
            torch.testing.assert_close(_leaves_grads(inputs), _leaves_grads(ref))
    assert not called
    msgs = [r.getMessage() for r in caplog.records if r.name == "ember.dynamic"]
    assert len(msgs) == 1 and "SYMBOLIC" in msgs[0], msgs


def test_a_graph_the_frontend_guards_is_traced_symbolically_once():
    def f(s0, x):
        return (x.view(s0, 2, -1) * 2).sum(1)
    ex = [4, _x(4, 6)]
    gm = symbolic_graph(f, ex, {"x": (0,)})
    gm.meta["ember_guarded"] = True      # (the frontend checks its guards before each call)
    fw = Counting()
    compiled = aot_module(gm, ex, fw, Counting())
    for n in (4, 9, 5):
        x = _x(n, 6)
        torch.testing.assert_close(compiled(n, x), f(n, x))
    assert len(fw.graphs) == 1 and list(compiled.artifacts)[0][0] == "symbolic"


def test_fake_dispatch_fast_paths_step_aside_for_symbolic_tensors():
    from ember.autograd.fake_dispatch import _DIRECT, _memo_key
    gm = symbolic_graph(lambda x, w: x, [torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3)], {"x": (0, 2, 3)})
    x, w = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    mode = x.fake_mode
    with mode:
        vec = [torch.empty(3) for _ in range(4)]
    assert _DIRECT[torch.ops.aten.native_batch_norm.default]((x, *vec, False, 0.1, 1e-5), {}) is None
    assert _DIRECT[torch.ops.aten.convolution.default](
        (x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1), {}) is None
    assert _memo_key(mode, x) is None and _memo_key(mode, w) is not None
    assert not mode.shape_env.guards        # and none of them guarded on a size


def test_inference_with_an_input_mutation_through_the_ember_backend(monkeypatch):
    from ember.backends import ember_backend
    import ember.backends.cpp_backend as cpp
    monkeypatch.delattr(cpp, "SYMBOLIC", raising=False)

    def f(s0, x, buf):
        buf[: s0 // 2].add_(x.sum(0))                   # a write into a view of an input, by a symbolic size
        return x.view(s0, 2, -1).amax(1), buf.view(-1)   # (the second output aliases the input)
    ex = [6, torch.randn(6, 4), torch.randn(6, 4)]
    gm = symbolic_graph(f, ex, {"x": (0,), "buf": (0,)})
    with torch.no_grad():
        compiled = ember_backend.compile_graph(gm, ex)
        for n in (6, 9, 4):
            x, buf = torch.randn(n, 4), torch.randn(n, 4)
            ref_buf = buf.clone()
            out, want = compiled(n, x, buf), f(n, x, ref_buf)
            torch.testing.assert_close(out, want)
            torch.testing.assert_close(buf, ref_buf)
            assert out[1]._base is buf


def _op_cases():
    from tests.autograd.test_ops import OPS
    # (split_chunk iterates over a split: symbolic_trace cannot)
    return {k: v for k, v in OPS.items() if k != "split_chunk"}


@pytest.mark.parametrize("name", sorted(_op_cases()))
def test_op_set_with_every_dim_symbolic(name):
    """test_ops.py's op set, each input's every dim symbolic (a trace may still fix some: then it is guarded),
    at the example's sizes: outputs and gradients equal eager's."""
    fn, floats, extra = _op_cases()[name]
    args = ", ".join(f"a{i}" for i in range(len(floats) + len(extra)))
    scope = {"fn": fn}
    exec(f"def g({args}):\n    return fn({args})", scope)
    g = scope["g"]
    ex = [f.clone().requires_grad_() for f in floats] + [e.clone() for e in extra]
    compiled = aot_module(symbolic_graph(g, ex, None), ex, Counting(), Counting())
    (key, art), = compiled.artifacts.items()
    assert key[0] == "symbolic" and art is not None
    inputs = [_clone(x) for x in ex]
    ref = [_clone(x) for x in ex]
    torch.manual_seed(0)
    out = compiled(*inputs)
    torch.manual_seed(0)
    want = g(*ref)
    torch.testing.assert_close(out, want)
    outs = [o for o in torch.utils._pytree.tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]
    wants = [o for o in torch.utils._pytree.tree_leaves(want) if isinstance(o, torch.Tensor) and o.requires_grad]
    grads = [torch.randn_like(o) for o in outs]
    torch.autograd.backward(outs, grads)
    torch.autograd.backward(wants, grads)
    torch.testing.assert_close(_leaves_grads(inputs), _leaves_grads(ref))
