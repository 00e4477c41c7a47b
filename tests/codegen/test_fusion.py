"""The scheduler's fusion decisions and the ember backend end to end (compiled vs eager, fresh random inputs)."""
import logging

import pytest
import torch
import torch.nn.functional as F

from ember.backends.cpp_backend import compile_aten
from ember.backends.ember_backend import compile_graph
from ember.codegen.schedule import FusedGroup
from ember.runtime import cache
from tests.codegen.aten_trace import trace_aten


def compiled(fn, inputs):
    gm, ref = trace_aten(fn, inputs)
    c = compile_aten(gm, inputs)
    out = c(*inputs)
    torch.testing.assert_close(out[0] if len(out) == 1 else out, ref)
    return c.compiled


def groups(c):
    return [it for it in c.sched.items if isinstance(it, FusedGroup) and it.numel > 0]


def test_pointwise_chain_is_one_kernel():
    c = compiled(lambda x: ((torch.sin(x) * 2 + torch.cos(x)).relu() * x - 1).sigmoid(), [torch.randn(4096)])
    assert len(groups(c)) == 1 and len(groups(c)[0].members) == 1


def test_layer_norm_gelu_softmax_is_one_loop_nest():
    w, b = torch.randn(256), torch.randn(256)
    c = compiled(lambda x, w, b: torch.softmax(F.gelu(F.layer_norm(x, (256,), w, b)), -1),
                 [torch.randn(64, 256), w, b])
    (g,) = groups(c)
    kinds = [m.buf.kind if m.is_reduction else "pointwise" for m in g.members]
    assert kinds.count("sum") == 3 and kinds.count("max") == 1
    assert all(m.local for m in g.members if m.is_reduction)  # row statistics never reach memory
    assert sum(m.local for m in g.members if not m.is_reduction) == 1  # gelu's row, read 3 times: a row buffer
    assert "#pragma omp simd reduction(+:" in c.source


def test_horizontal_fusion_of_independent_same_size_loops():
    ins = [torch.randn(128, 64) for _ in range(6)]
    c = compiled(lambda a, b, c, d, e, f: (a * 2 + b, c.exp() - d, e.sigmoid() * f), ins)
    assert len(groups(c)) == 1 and len(groups(c)[0].members) == 3


def test_transposed_read_is_not_fused_into_the_producing_row():
    x = torch.randn(64, 64)
    c = compiled(lambda x: (x.softmax(-1) + 1).t().softmax(-1), [x])
    assert len(groups(c)) >= 2


def test_dead_buffers_are_reused():
    ins = [torch.randn(256, 256), torch.randn(256, 256)]
    # matmuls force materialization; the first product's buffer is dead once the second is computed
    c = compiled(lambda a, w: ((a @ w).relu() @ w).relu() @ w, ins)
    assert "reuses a dead buffer" in c.call.source


def test_extern_gets_transposed_weight_without_copy():
    c = compiled(lambda x, w: F.linear(x, w), [torch.randn(8, 32), torch.randn(16, 32)])
    assert not groups(c)  # t(w) is a strided view passed to mm, no copy kernel


def test_gather_index_out_of_range_raises():
    w = torch.randn(10, 4)
    gm, _ = trace_aten(lambda w, i: w[i], [w, torch.tensor([1, 2])])
    c = compile_aten(gm, [w, torch.tensor([1, 2])])
    torch.testing.assert_close(c(w, torch.tensor([3, -1]))[0], w[torch.tensor([3, -1])])
    with pytest.raises(IndexError):
        c(w, torch.tensor([3, 10]))


def test_unknown_op_is_a_logged_fallback(caplog):
    x = torch.randn(16, 16)
    with caplog.at_level(logging.DEBUG, logger="ember.fallbacks"):
        c = compiled(lambda x: torch.linalg.inv(x * 2 + torch.eye(16) * 20).exp(), [x])
    assert any("ATen fallback" in r.getMessage() for r in caplog.records)
    assert any(it.fallback for it in c.sched.items if not isinstance(it, FusedGroup))


def test_kernel_cache_reused_across_compiles(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    x = torch.randn(1000)
    compiled(lambda x: x.tanh() * 3 + 0.5, [x])
    libs = list((tmp_path / "cpp").glob("*.so"))
    assert len(libs) == 1
    compiled(lambda x: x.tanh() * 3 + 0.5, [x])
    assert list((tmp_path / "cpp").glob("*.so")) == libs


def test_build_failure_names_the_source(monkeypatch, tmp_path):
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cache, "CXXFLAGS", cache.CXXFLAGS + ["-DEMBER_BROKEN=(", "-include", "/nonexistent.h"])
    x = torch.randn(100)
    gm, ref = trace_aten(lambda x: x.cos() + 1, [x])
    with pytest.raises(cache.BuildError, match=r"\.cpp"):
        compile_aten(gm, [x])(x)
    c = compile_aten(gm, [x], {"fallback": "eager"})
    torch.testing.assert_close(c(x)[0], ref)


def test_mlp_inference_and_training_through_autograd():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64), torch.nn.LayerNorm(64))
    fn = compile_graph(torch.fx.symbolic_trace(m), [torch.randn(32, 64)])
    x = torch.randn(32, 64, requires_grad=True)
    out = fn(x)
    out = out[0] if isinstance(out, (tuple, list)) else out
    torch.testing.assert_close(out, m(x))
    gy = torch.randn_like(out)
    got = torch.autograd.grad(out, [x, *m.parameters()], gy)
    want = torch.autograd.grad(m(x), [x, *m.parameters()], gy)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


COMPOSITES = {
    "col_norm": (lambda x: x / x.abs().sum(0, keepdim=True) + x.mean(1, keepdim=True), [(64, 48)]),
    "transpose_mix": (lambda x, y: (x.t() * y).softmax(0) + x.t().amax(1, keepdim=True), [(32, 16), (16, 32)]),
    "reshape_chain": (lambda x: x.reshape(8, 4, 6).permute(2, 0, 1).reshape(6, 32).cumsum(0).sum(1), [(32, 6)]),
    "cat_reduce": (lambda x, y: torch.cat([x.sum(-1, keepdim=True), y, x * 2], -1).log_softmax(-1), [(16, 8), (16, 3)]),
    "var_std": (lambda x: (x - x.mean((0, 2), keepdim=True)) / x.std((0, 2), keepdim=True) + x.var(), [(4, 5, 6)]),
    "argmax_gather": (lambda x: x.gather(1, x.argmax(1, keepdim=True)) + x.max(1).values[:, None], [(20, 30)]),
    "slices": (lambda x: x[1:, ::2] * x[:-1, 1::2] + x[1:, -1:].exp(), [(9, 10)]),
    "batchnorm_train": (lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True).relu(), [(4, 3, 5, 5), (3,), (3,)]),
    "groupnorm_silu": (lambda x, w, b: F.silu(F.group_norm(x, 2, w, b)), [(2, 4, 3, 3), (4,), (4,)]),
    "expand_where": (lambda x, y: torch.where(x > 0, x, y.expand(5, 7)).clamp(-0.5, 0.5), [(5, 7), (1, 7)]),
    "int_ops": (lambda a, b: ((a * b + 3).abs() % 5 + (a > b).long() * 7).sum(0), "int"),
}


@pytest.mark.parametrize("name", sorted(COMPOSITES))
def test_composite_graphs_match_eager(name):
    fn, shapes = COMPOSITES[name]
    torch.manual_seed(hash(name) % 1000)
    if shapes == "int":
        inputs = [torch.randint(-20, 20, (6, 9)), torch.randint(1, 20, (6, 9))]
    else:
        inputs = [torch.randn(s) for s in shapes]
    compiled(fn, inputs)


def test_conv_bn_cross_entropy_training_falls_back_only_for_batch_norm():
    import copy
    from ember.codegen import lower

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.c, self.bn, self.fc = torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Linear(144, 5)

        def forward(self, x, t):
            return F.cross_entropy(self.fc(F.relu(self.bn(self.c(x))).flatten(1)), t)
    torch.manual_seed(0)
    m = M()
    m2 = copy.deepcopy(m)
    x, t = torch.randn(3, 3, 8, 8), torch.tensor([1, 4, 0])
    before = dict(lower.FALLBACK_COUNTS)
    fn = compile_graph(torch.fx.symbolic_trace(m), [x, t])
    out = fn(x, t)
    out = out[0] if isinstance(out, (tuple, list)) else out
    out.backward()
    ref = m2(x, t)
    ref.backward()
    torch.testing.assert_close(out, ref)
    for a, b in zip(m.parameters(), m2.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
    torch.testing.assert_close(m.bn.running_var, m2.bn.running_var)
    new = {k: v - before.get(k, 0) for k, v in lower.FALLBACK_COUNTS.items() if v != before.get(k, 0)}
    # nll_loss forward/backward are decomposed; batch norm is the only ATen call allowed (train-mode batch norm
    # stays one where decomp/norms.py TRAIN_BATCH_NORM_DECOMPOSED does not list the device)
    assert all("batch_norm" in str(k) for k in new), new


def test_graph_of_a_dtype_without_kernels_runs_eagerly_and_correctly():
    x = torch.randn(64, dtype=torch.complex64)
    gm, ref = trace_aten(lambda x: x.exp() * 2, [x])
    c = compile_aten(gm, [x])
    assert not hasattr(c, "compiled")  # no complex kernels in C++: the whole graph is eager (logged)
    torch.testing.assert_close(c(x)[0], ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dropout_backward_fuses_with_the_layer_norm_backward_around_it(dtype):
    """native_dropout_backward (grad * mask * scale) is pointwise ember code, not an ATen call: it fuses with
    the residual add after it (GPT-2's backward: 25 such calls were ATen kernels of their own)."""
    def f(g, mask, r):
        return torch.ops.aten.native_dropout_backward(g, mask, 1 / 0.9) + r
    g, r = torch.randn(64, 96, dtype=dtype), torch.randn(64, 96, dtype=dtype)
    c = compiled(f, [g, torch.rand(64, 96) > 0.1, r])
    assert len(groups(c)) == 1 and len(c.sched.items) == 1    # one kernel, no ATen call beside it


def test_sum_of_a_one_hot_row_is_its_element_without_a_reduction():
    """nll_loss_backward's one-hot gradient summed over its row (log_softmax's backward): where(0 <= label < n,
    v, 0) per row, no reduction (reductions.one_hot_sum); -100 (ignore_index) and n hit no column."""
    labels = torch.randint(0, 3000, (7,))
    labels[1], labels[2], labels[3] = -100, 3000, 2999
    v = torch.randn(7)

    def f(labels, v):
        return torch.where(torch.arange(3000)[None, :] == labels[:, None], v[:, None], 0.0).sum(1)
    c = compiled(f, [labels, v])
    assert not any(m.is_reduction for g in groups(c) for m in g.members)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_mse_loss_is_one_kernel_forward_and_backward(reduction):
    """mse_loss is decomposed (an ATen call wrote the squares and read them back): one kernel, no extern call;
    its gradient through ember.compile matches eager's."""
    import ember
    torch.manual_seed(0)
    x, y = torch.randn(300, 70), torch.randn(300, 70)
    c = compiled(lambda x, y: F.mse_loss(x, y, reduction=reduction), [x, y])
    assert len(groups(c)) == 1 and not [it for it in c.sched.items if not isinstance(it, FusedGroup)], c.source
    xg = x.clone().requires_grad_()
    fn = lambda x, y: F.mse_loss(x, y, reduction=reduction)  # noqa: E731
    out, ref = ember.compile(fn)(xg, y), fn(xg, y)
    torch.testing.assert_close(out, ref)
    go = torch.randn_like(ref)
    torch.testing.assert_close(torch.autograd.grad(out, xg, go)[0], torch.autograd.grad(ref, xg, go)[0])
