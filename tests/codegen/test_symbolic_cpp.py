"""Symbolic ATen graphs through the C++ backend (docs/dynamic.md): compiled once, run at many sizes (2, sizes that
are not multiples of the vector width, large ones) against eager; the generated code is checked to be symbolic (a
kernel, not the ATen graph's fallback) where ember does it symbolically."""
import re

import pytest
import torch

from ember import config
from ember.backends import cpp_backend
from ember.codegen import cpp
from ember.runtime import cache
from tests.codegen.symbolic_graphs import (
    SGD_MUTATIONS, aten_fn, cache_mask, cat_and_slices_by_symbolic_bounds, check, check_sgd_in_place, sgd_momentum,
    symbolic_graph, views_by_symbolic_sizes,
)
from tests.numerics import assert_as_close_as_eager

aten = torch.ops.aten
SIZES = (2, 3, 7, 16, 17, 33, 100, 257)


@pytest.fixture(params=["native", "avx2"])
def vector_width(request, monkeypatch):
    """The vector widths g++ picks for this CPU, and AVX2's (config.CPU_ISA: as on a CPU without AVX-512)."""
    monkeypatch.setattr(config, "CPU_ISA", request.param)
    return request.param


def compile_symbolic(fn, args, dynamic, aten_calls=(), meta=None):
    """(compiled, gm): fn's symbolic ATen graph compiled once by the C++ backend; asserts it compiled to kernels
    with no op kept as an ATen call but those named in aten_calls. meta: gm.meta entries (what ember.autograd
    says of the graph)."""
    gm, _ = symbolic_graph(aten_fn(fn), args, dynamic)
    gm.meta.update(meta or {})
    compiled = cpp_backend.compile_aten(gm, list(args))
    assert hasattr(compiled, "compiled"), "the symbolic graph fell back to its ATen graph"
    assert set(compiled.compiled.sched.lowered.fallbacks) <= set(aten_calls), compiled.compiled.sched.lowered.fallbacks
    return compiled, gm


def test_pointwise_chain_broadcast(vector_width):
    def f(s0, x, y):
        return aten.relu.default(aten.add.Tensor(aten.mul.Tensor(aten.sin.default(x), y), 1.0))
    compiled, _ = compile_symbolic(f, [5, torch.randn(5, 7), torch.randn(7)], {1: [0]})
    for n in SIZES:
        check(compiled, f, [n, torch.randn(n, 7), torch.randn(7)])


def test_view_of_computed_size_and_row_sum(vector_width):
    def f(s0, x, y):
        a = aten.add.Tensor(aten.sin.default(x), y)
        b = aten.view.default(a, [s0 * 4, 8])
        return aten.sum.dim_IntList(b, [1])
    compiled, _ = compile_symbolic(f, [5, torch.randn(5, 4, 8), torch.randn(8)], {1: [0]})
    for n in SIZES:
        check(compiled, f, [n, torch.randn(n, 4, 8), torch.randn(8)])


def test_reductions_over_symbolic_dims(vector_width):
    def f(s0, s1, x):
        a = aten.sum.dim_IntList(x, [1], True)           # over s1 (a run-time trip count), keepdim
        b = aten.amax.default(x, [0])                    # over s0: column-wise
        c = aten.sum.dim_IntList(aten.exp.default(x), [0, 1])
        return aten.sub.Tensor(x, a), b, c
    compiled, _ = compile_symbolic(f, [6, 10, torch.randn(6, 10)], {2: [0, 1]})
    for n, m in [(2, 3), (7, 17), (33, 5), (100, 257), (3, 1000)]:
        # a float32 sum in another order than eager's (which differs by instruction set; eager's cascade sums
        # round less): as close to the float64 result as eager is, plus sqrt(k) roundings of the largest
        # value for a sum of k terms
        x = torch.randn(n, m)
        got, want, exact = compiled(n, m, x), f(n, m, x), f(n, m, x.double())
        for g, w, e, k in zip(got, want, exact, (m, 1, n * m)):
            assert_as_close_as_eager(g, w, e, ulps=8 + k ** 0.5, msg=f"{n}x{m}")


def test_softmax_rows(vector_width):
    def f(s0, s1, x):
        return aten._softmax.default(x, -1, False), aten._log_softmax.default(x, 1, False)
    compiled, _ = compile_symbolic(f, [6, 10, torch.randn(6, 10)], {2: [0, 1]})
    for n, m in [(2, 3), (7, 17), (33, 5), (64, 257), (3, 1000)]:
        check(compiled, f, [n, m, torch.randn(n, m)])


def test_layer_norm_rows(vector_width):
    def f(s0, x, w, b):
        return aten.native_layer_norm.default(x, [32], w, b, 1e-5)[0]
    compiled, _ = compile_symbolic(f, [6, torch.randn(6, 32), torch.randn(32), torch.randn(32)], {1: [0]})
    for n in SIZES:
        check(compiled, f, [n, torch.randn(n, 32), torch.randn(32), torch.randn(32)])


def test_views_by_symbolic_sizes(vector_width):
    f = views_by_symbolic_sizes
    compiled, _ = compile_symbolic(f, [5, 6, torch.randn(5, 6, 4)], {2: [0, 1]})
    for n, m in [(2, 3), (7, 17), (33, 5), (16, 16)]:
        check(compiled, f, [n, m, torch.randn(n, m, 4)])


def test_cat_and_slices_with_symbolic_bounds(vector_width):
    f = cat_and_slices_by_symbolic_bounds
    compiled, _ = compile_symbolic(f, [5, torch.randn(5, 8), torch.randn(5, 8)], {1: [0], 2: [0]})
    for n in SIZES:
        check(compiled, f, [n, torch.randn(n, 8), torch.randn(n, 8)])


def test_index_and_gather(vector_width):
    def f(s0, s1, x, idx, g):
        a = aten.index.Tensor(x, [idx])                            # rows of x picked by idx
        b = aten.gather.default(x, 1, g)
        return aten.mul.Tensor(a, 2.0), b
    def inputs(n, m):
        return [n, m, torch.randn(n, 8), torch.randint(0, n, (m,)), torch.randint(0, 8, (n, 3))]
    compiled, _ = compile_symbolic(f, inputs(5, 6), {2: [0], 3: [0], 4: [0]})
    for n, m in [(2, 3), (7, 17), (33, 5), (100, 257)]:
        check(compiled, f, inputs(n, m))


def test_matmul_and_addmm(vector_width):
    def f(s0, x, w, b, w2):
        a = aten.addmm.default(b, x, aten.t.default(w))
        c = aten.mm.default(aten.relu.default(a), w2)
        return aten.add.Tensor(c, 1.0)
    def inputs(n):
        return [n, torch.randn(n, 16), torch.randn(32, 16), torch.randn(32), torch.randn(32, 8)]
    compiled, _ = compile_symbolic(f, inputs(5), {1: [0]})
    for n in SIZES:
        check(compiled, f, inputs(n))


@pytest.mark.parametrize("inference", [False, True])
def test_conv2d_symbolic_batch(vector_width, inference):
    """inference: the graph runs channels-last (convolutions through oneDNN in NHWC, kernels walking C innermost)."""
    def f(s0, x, w, b, w2):
        y = aten.relu.default(aten.convolution.default(x, w, b, [1, 1], [1, 1], [1, 1], False, [0, 0], 1))
        y2 = aten.convolution.default(y, w2, None, [2, 2], [0, 0], [1, 1], False, [0, 0], 1)
        return y, aten.add.Tensor(y2, 2.0), aten.mean.dim(y, [2, 3])
    def inputs(n):
        return [n, torch.randn(n, 3, 9, 9), torch.randn(4, 3, 3, 3), torch.randn(4), torch.randn(8, 4, 1, 1)]
    compiled, _ = compile_symbolic(f, inputs(3), {1: [0]}, meta={"ember_inference": inference})
    for n in (2, 3, 5, 17):
        check(compiled, f, inputs(n), rtol=1e-4, atol=1e-4)   # (oneDNN's and eager's convolution sum in other orders)


def test_conv_output_planes_of_symbolic_image_sizes_are_one_inner_loop(vector_width):
    """N, H and W symbolic: a stride-2 convolution's output plane is (H - 1) // 2 + 1 by (W - 1) // 2 + 1. The
    pointwise kernel after it walks each (n, c) plane as one inner loop reading contiguously, as a static graph's
    does: not rows of one output width (a row's setup per few elements; 2.5x the static kernel's time at 32x32),
    nor one loop with a division and a modulo of its index per element."""
    def f(s0, s1, s2, x, w, scale):
        y = aten.convolution.default(x, w, None, [2, 2], [1, 1], [1, 1], False, [0, 0], 1)
        return aten.mul.Tensor(aten.relu.default(y), scale)

    def inputs(n, h, wd):
        return [n, h, wd, torch.randn(n, 3, h, wd), torch.randn(8, 3, 3, 3), torch.randn(8, 1, 1)]
    compiled, _ = compile_symbolic(f, inputs(3, 10, 12), {3: [0, 2, 3]})
    kernels = compiled.compiled.source.split("// ember: next kernel", 1)[1]
    assert re.search(r"x0 < \(8 \* s\d+\)", kernels) and not re.search(r"\br\d+ [/%] ", kernels), kernels
    for n, h, wd in [(2, 9, 9), (3, 10, 12), (5, 17, 6), (4, 32, 33)]:
        check(compiled, f, inputs(n, h, wd), rtol=1e-4, atol=1e-4)   # (oneDNN's and eager's sums in other orders)


def test_mean_var_by_symbolic_count(vector_width):
    def f(s0, x):
        v = aten.view.default(x, [s0 * 4, 16])
        return aten.mean.dim(v, [0]), aten.var.correction(x, [0, 1], correction=1), aten.mean.dim(x, [2], True)
    compiled, _ = compile_symbolic(f, [5, torch.randn(5, 4, 16)], {1: [0]})
    for n in SIZES:
        check(compiled, f, [n, torch.randn(n, 4, 16)])


def test_symbolic_row_width_softmax_layer_norm(vector_width):
    """Rows of a run-time width (attention's softmax over a sequence length): reductions and the row kept between
    them over s1 elements."""
    def f(s0, s1, x, w):
        a = aten._softmax.default(x, -1, False)
        b = aten.native_layer_norm.default(x, [s1], w, None, 1e-5)[0]
        return a, b
    compiled, _ = compile_symbolic(f, [6, 10, torch.randn(6, 10), torch.randn(10)], {2: [0, 1], 3: [0]})
    for n, m in [(2, 3), (7, 17), (33, 5), (64, 257), (3, 4099)]:
        check(compiled, f, [n, m, torch.randn(n, m), torch.randn(m)])


def test_sizes_alternate_and_symbols_returned():
    """Buffers kept across calls follow the sizes of each call; a size the graph returns (a backward's saved
    symbol) is the call's int."""
    def f(s0, x, w):
        h = aten.mm.default(aten.sin.default(x), w)
        return aten.relu.default(h), s0 * 2
    compiled, _ = compile_symbolic(f, [5, torch.randn(5, 8), torch.randn(8, 4)], {1: [0]})
    for n in (3, 9, 3, 3, 40, 9):
        args = [n, torch.randn(n, 8), torch.randn(8, 4)]
        out = compiled(*args)
        torch.testing.assert_close(out[0], f(*args)[0])
        assert out[1] == 2 * n and isinstance(out[1], int)


def test_one_build_serves_every_size(monkeypatch):
    """The generated source names the symbols, never the example's sizes: one C++ build (cached on disk by its
    source) runs every size."""
    def f(s0, x):
        return aten.exp.default(aten.mul.Tensor(x, 2.0))
    builds = []
    real = cache.build_cpp
    monkeypatch.setattr(cache, "build_cpp", lambda src: builds.append(src) or real(src))
    compiled, _ = compile_symbolic(f, [5, torch.randn(5, 3)], {1: [0]})
    for n in SIZES:
        check(compiled, f, [n, torch.randn(n, 3)])
    assert len(builds) == 1 and "int64_t s" in builds[0]


def test_cannot_lower_runs_the_aten_graph(monkeypatch, caplog):
    """A symbolic graph the code generator cannot do runs as its ATen graph, correct at every size, logged with
    the reason."""
    from ember.errors import CannotLower

    def refuse(sched):
        raise CannotLower("no symbolic code for this test")
    monkeypatch.setattr(cpp, "generate", refuse)

    def f(s0, x):
        return aten.view.default(aten.cos.default(x), [s0 * 3])
    gm, _ = symbolic_graph(aten_fn(f), [5, torch.randn(5, 3)], {1: [0]})
    with caplog.at_level("WARNING", logger="ember.fallbacks"):
        compiled = cpp_backend.compile_aten(gm, [5, torch.randn(5, 3)])
    assert not hasattr(compiled, "compiled")
    assert sum("symbolic graph runs as its ATen graph" in r.getMessage() and "no symbolic code for this test" in
               r.getMessage() for r in caplog.records) == 1
    for n in SIZES:
        check(compiled, f, [n, torch.randn(n, 3)])


def test_attention_like_graph():
    """What a transformer's forward with a symbolic batch s0 and sequence s1 holds: arange/zeros/full of symbolic
    sizes, embeddings, views by s0*s1, bmm, a causal mask, softmax over s1, max/argmax."""
    cpu = torch.device("cpu")

    def f(s0, s1, ids, emb, x, w):
        pos = aten.arange.start_step(0, s1, 1, dtype=torch.int64, device=cpu)
        h = aten.add.Tensor(aten.embedding.default(emb, ids), aten.embedding.default(emb, pos))   # [s0, s1, 16]
        z = aten.zeros.default([s0, s1], dtype=torch.float32, device=cpu)
        k3 = aten.view.default(aten.mm.default(aten.view.default(h, [s0 * s1, 16]), w), [s0, s1, 16])
        att = aten.bmm.default(k3, aten.transpose.int(h, 1, 2))                                   # [s0, s1, s1]
        tri = aten.tril.default(aten.full.default([s1, s1], 1.0, dtype=torch.float32, device=cpu))
        att = aten.masked_fill.Scalar(att, aten.eq.Scalar(tri, 0.0), float("-inf"))
        o = aten.bmm.default(aten._softmax.default(att, -1, False), k3)
        c = aten.clone.default(aten.transpose.int(o, 0, 1), memory_format=torch.contiguous_format)
        r = aten.sum.dim_IntList(aten.view.default(c, [s1, s0 * 16]), [1])
        mx = aten.max.dim(x, 1)
        return o, r, aten.add.Tensor(z, 1.0), mx[0], mx[1], aten.argmax.default(x, 0)

    def inputs(n, m):
        return [n, m, torch.randint(0, 50, (n, m)), torch.randn(50, 16), torch.randn(n, m), torch.randn(16, 16)]
    compiled, _ = compile_symbolic(f, inputs(3, 7), {2: [0, 1], 4: [0, 1]})
    for n, m in [(2, 2), (5, 33), (17, 9), (3, 7)]:
        check(compiled, f, inputs(n, m), rtol=1e-4, atol=1e-4)   # (sums of 16*s0 values, in another order)


def test_backward_ops():
    """A backward graph's ops over a symbolic batch: layer norm, softmax, threshold and gelu backward, the
    weight gradient's product, a bias gradient (a column sum)."""
    def f(s0, x, g, w, mean, rstd, y):
        a = aten.native_layer_norm_backward.default(g, x, [32], mean, rstd, w, w, [True, True, True])
        sb = aten._softmax_backward_data.default(g, y, -1, torch.float32)
        tb = aten.threshold_backward.default(g, y, 0.0)
        gb = aten.gelu_backward.default(g, x)
        mmb = aten.mm.default(aten.t.default(g), x)
        v = aten.view.default(aten.sum.dim_IntList(g, [0], True), [32])
        return a[0], a[1], a[2], sb, tb, gb, mmb, v

    def inputs(n):
        x = torch.randn(n, 32)
        return [n, x, torch.randn(n, 32), torch.randn(32), x.mean(1, keepdim=True), torch.rand(n, 1) + 0.5,
                torch.randn(n, 32).softmax(-1)]
    compiled, _ = compile_symbolic(f, inputs(5), {1: [0], 2: [0], 4: [0], 5: [0], 6: [0]})
    for n in (2, 3, 17, 100):
        args = inputs(n)
        for o, w in zip(compiled(*args), f(*args)):
            torch.testing.assert_close(o, w, rtol=1e-4, atol=1e-4)   # (sums of 100 products, another order)


def _specializing_cos(monkeypatch):
    """cos's decomposition made to read its symbolic size as an int (a decision on the size's value)."""
    from ember import ir
    from ember.codegen import lower
    decomp = lower.TABLE[aten.cos.default]

    def specializing(x):
        int(ir.GRAPH.val.shape[0])
        return decomp(x)
    monkeypatch.setitem(lower.TABLE, aten.cos.default, specializing)


def _specializing_planner(monkeypatch):
    """A lowering step outside any decomposition (the linear fusions' planner) made to read a symbolic size as an
    int: the graph cannot be lowered."""
    from ember.codegen import lower
    plan = lower.plan_linear_fusions

    def specializing(gm):
        for n in gm.graph.nodes:
            v = n.meta.get("val")
            if n.op == "placeholder" and isinstance(v, torch.Tensor):
                int(v.shape[0])
        return plan(gm)
    monkeypatch.setattr(lower, "plan_linear_fusions", specializing)


def _shape_env_state(env):
    return list(env.guards), dict(env.replacements), dict(env.var_to_range)


def test_a_decomposition_that_specializes_keeps_its_op_and_no_guard(monkeypatch):
    """A decomposition that reads a symbolic size as an int would give code right at the example's size only: its
    op stays an ATen call (the rest compiled), and the capture's ShapeEnv keeps no guard or replacement from it
    (else the frame's entry would pin the size)."""
    _specializing_cos(monkeypatch)

    def f(s0, x):
        return aten.cos.default(aten.mul.Tensor(x, 2.0)), aten.add.Tensor(x, 1.0)
    gm, env = symbolic_graph(aten_fn(f), [5, torch.randn(5, 3)], {1: [0]})
    before = _shape_env_state(env)
    compiled = cpp_backend.compile_aten(gm, [5, torch.randn(5, 3)])
    assert compiled.compiled.sched.lowered.fallbacks == ["aten.cos.default"]
    assert _shape_env_state(env) == before
    for n in SIZES:
        check(compiled, f, [n, torch.randn(n, 3)])


def test_lowering_that_specializes_runs_the_aten_graph_and_adds_no_guard(monkeypatch, caplog):
    """A lowering step outside a decomposition that reads a symbolic size as an int: the graph runs as its ATen
    graph, logged, and the ShapeEnv is as it was."""
    _specializing_planner(monkeypatch)

    def f(s0, x):
        return aten.cos.default(x)
    gm, env = symbolic_graph(aten_fn(f), [5, torch.randn(5, 3)], {1: [0]})
    before = _shape_env_state(env)
    with caplog.at_level("WARNING", logger="ember.fallbacks"):
        compiled = cpp_backend.compile_aten(gm, [5, torch.randn(5, 3)])
    assert not hasattr(compiled, "compiled")
    assert any("symbolic graph runs as its ATen graph" in r.getMessage() and "decision on a symbolic size" in
               r.getMessage() for r in caplog.records), caplog.text
    assert _shape_env_state(env) == before
    for n in SIZES:
        check(compiled, f, [n, torch.randn(n, 3)])


def graphs_per_call(fn, calls, **compile_options) -> list[int]:
    """ember.compile(fn) (the ember backend) called on each argument tuple of `calls`, each call compared with
    eager: the number of graphs compiled after each call."""
    import ember
    from ember.backends import lookup_backend
    graphs = []

    def count(gm, ex):
        graphs.append(gm)
        return lookup_backend("ember")(gm, ex)
    compiled = ember.compile(fn, backend=count, **compile_options)
    counts = []
    for args in calls:
        torch.testing.assert_close(compiled(*args), fn(*args))
        counts.append(len(graphs))
    return counts


@pytest.mark.parametrize("where", ["decomposition", "planner"])
def test_a_graph_whose_lowering_specializes_serves_every_size(monkeypatch, where):
    """ember.compile, automatic dynamic: a symbolic graph whose lowering took a decision on a size (its op an
    ATen call, or the whole graph its ATen graph) is still the one graph of every later size, no recompile."""
    (_specializing_cos if where == "decomposition" else _specializing_planner)(monkeypatch)

    def f(x):
        return torch.cos(x * 2.0) + 1.0
    counts = graphs_per_call(f, [(torch.randn(n, 3),) for n in (4, 5, 6, 9, 17, 5)])
    assert counts == [1, 2, 2, 2, 2, 2], counts


def test_a_cache_mask_of_every_length():
    """transformers' sdpa mask over a key/value cache (symbolic_graphs.cache_mask): arange(s0 + 1) viewed through
    a whole slice, compared with arange(s0, s0 + 1): kernels at every length, no guard."""
    f = cache_mask("cpu")
    compiled, gm = compile_symbolic(f, [5, torch.randn(2, 5)], {1: [1]})
    env = next(n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder").node.shape_env
    assert not env.guards and not env.replacements
    for n in SIZES:
        check(compiled, f, [n, torch.randn(2, n)])


def test_a_mask_over_a_growing_cache_one_graph():
    """GPT-2's decoding step with transformers' sdpa mask built (transformers 5.17 under a compiler, as on the
    GPU): one graph for every cache length after the first two, no recompile (the mask's whole slice of
    arange(past + 1) once read the length as an int, a guard pinning it)."""
    import torch.nn.functional as F

    def step(k, q):
        n = k.shape[2]
        kv_idx = torch.arange(n + 1) + 0
        mask = kv_idx[None, None, None, :] <= (torch.arange(1) + n)[None, None, :, None]
        kv = torch.cat([k, q], 2)
        return F.scaled_dot_product_attention(q, kv, kv, attn_mask=mask.expand(1, -1, 1, n + 1))
    eager_graphs = cpp_backend.STATS["eager_graphs"]
    counts = graphs_per_call(step, [(torch.randn(1, 4, n, 16), torch.randn(1, 4, 1, 16)) for n in range(16, 24)])
    assert counts == [1, 2, 2, 2, 2, 2, 2, 2], counts
    assert cpp_backend.STATS["eager_graphs"] == eager_graphs   # (both compiled to kernels)


def test_batch_norm_training_over_a_symbolic_batch():
    """Training batch norm's statistics over N*H*W with N symbolic, and the running variance's unbiasing factor
    n / (n - 1) from the run-time count (a float of the sizes: computed in the kernel)."""
    def f(s0, x, w, b, rm, rv):
        r = aten._native_batch_norm_legit_functional.default(x, w, b, rm, rv, True, 0.1, 1e-5)
        return r[0], r[1], r[2], r[3], r[4]

    def inputs(n):
        return [n, torch.randn(n, 4, 5, 5), torch.randn(4), torch.randn(4), torch.randn(4), torch.rand(4) + 0.5]
    compiled, _ = compile_symbolic(f, inputs(6), {1: [0]})
    for n in (2, 3, 17):
        check(compiled, f, inputs(n), rtol=1e-5, atol=1e-5)


def test_inputs_written_in_place_at_every_size():
    """A symbolic graph's new values of its inputs are stored into them (no fresh buffer, no copy back) when the
    inputs do not overlap, checked at each call from the call's sizes (`_overlap(tensors, sizes)`)."""
    compiled, _ = compile_symbolic(sgd_momentum, [7, torch.randn(7), torch.randn(7), torch.randn(7)],
                                   {1: [0], 2: [0], 3: [0]}, meta=SGD_MUTATIONS)
    check_sgd_in_place(compiled, torch.randn)
    src = compiled.compiled.call.source
    assert src.count("# updated in place") == 2 and "_overlap((" in src, src


def test_an_optimizer_step_under_dynamic_true_writes_in_place():
    """ember.compile(dynamic=True) of an SGD-with-momentum step over tensors of run-time sizes: one symbolic graph
    for every size, its parameters and momenta written in place (no copy back), each call as eager's; inputs
    that share memory are still right."""
    from tests.codegen.recording import compiled_graphs

    def step(ps, gs, bufs):
        for p, g, b in zip(ps, gs, bufs):
            b.mul_(0.9).add_(g)
            p.add_(b, alpha=-0.1)

    def inputs(n):
        return [[torch.randn(n, 4), torch.randn(n), torch.randn(2, n)] for _ in range(3)]

    def both(f, args, aliased=lambda ts: ts):
        want = aliased([[t.clone() for t in ts] for ts in args])
        args = aliased(args)
        step(*want)
        f(*args)
        for got_ts, want_ts in zip(args, want):
            for got, w in zip(got_ts, want_ts):
                torch.testing.assert_close(got, w)
    f, graphs = compiled_graphs(step, inputs(5), run=lambda f, a: both(f, a), dynamic=True)
    for n in (3, 9, 17, 5):
        both(f, inputs(n))
    assert len(graphs) == 1
    src = graphs[0].call.source
    assert src.count("# updated in place") == 6 and "_overlap((" in src, src

    def overlapping(ts):   # a parameter and its gradient, views of one tensor (the last list), overlapping
        (ps, gs, bufs), base = ts[:3], ts[3][0]
        ps[1], gs[1] = base[:6], base[3:9]
        return [ps, gs, bufs]
    both(f, inputs(6) + [[torch.randn(40)]], overlapping)


def test_a_table_sliced_to_a_guarded_length_and_a_fused_linear():
    """What BERT's embeddings and feed-forward hold under dynamic=True: a position table sliced to the sequence
    length the program checked against the table's length (`s1 <= 64`: the guarded range decides the slice's
    clamping), and linear + gelu (a oneDNN product with a post-op, its result viewed back to [s0, s1, 512]), in
    kernels at every length."""
    from tests.codegen.recording import compiled_graphs
    torch.manual_seed(0)
    table = torch.randn(64, 256)
    lin = torch.nn.Linear(256, 512)   # (big enough for oneDNN: onednn.ONEDNN_MIN_WORK)

    def f(x):
        n = x.shape[1]
        if n > table.shape[0]:
            raise ValueError("too long")
        return torch.nn.functional.gelu(lin(x + table[:n]))
    with torch.no_grad():
        compiled, graphs = compiled_graphs(f, torch.randn(4, 9, 256), dynamic=True)
        for n in (9, 17, 64, 5):
            x = torch.randn(4, n, 256)
            torch.testing.assert_close(compiled(x), f(x))
    assert len(graphs) == 1 and not graphs[0].sched.lowered.fallbacks, graphs[0].sched.lowered.fallbacks


@pytest.mark.parametrize("other_dim_symbolic", [False, True])
def test_a_size_specialized_at_capture_compiles_as_a_constant(other_dim_symbolic, caplog):
    """A symbol the capture specialized (a list indexed by it: guarded equal) after its int input was made: the
    graph still takes the int, a constant of the trace (all sizes fixed: a static trace) or of the lowering (other
    dims symbolic), compiled to kernels, not run eagerly."""
    from tests.codegen.recording import compiled_graphs
    table = [10.0 * k for k in range(12)]

    def f(x):
        return (x.sin() * x.shape[0]) * table[x.shape[0]]

    def inputs(n):
        x = torch.randn(n, 5 + n)
        if not other_dim_symbolic:
            import ember
            ember.mark_dynamic(x, 0)
        return x
    kw = {"dynamic": True} if other_dim_symbolic else {"dynamic": False}
    with caplog.at_level("WARNING", logger="ember.fallbacks"):
        compiled, graphs = compiled_graphs(f, inputs(4), **kw)
        for n in (4, 6, 4):
            x = inputs(n)
            torch.testing.assert_close(compiled(x), f(x))
    assert len(graphs) == 1 and not [r for r in caplog.records if r.name == "ember.fallbacks"], caplog.text


def test_batched_matmul_attention_of_every_length_one_graph():
    """q @ k^T, softmax, @ v and a 3-D @ 2-D projection under dynamic=True, forward and backward: one graph for
    every sequence length (ir.meta.symbolic_matmul: no symbol pinned to its value), each call as eager's."""
    import ember
    torch.manual_seed(0)
    w = torch.randn(16, 16, requires_grad=True)

    def f(x):
        q = x @ w
        att = (q @ x.transpose(-2, -1)).softmax(-1)
        return (att @ x).sum()
    graphs = []

    def count(gm, ex):
        graphs.append(gm)
        from ember.backends import lookup_backend
        return lookup_backend("ember")(gm, ex)
    compiled = ember.compile(f, backend=count, dynamic=True)
    for n in (5, 9, 17, 5):
        x = torch.randn(2, 3, n, 16, requires_grad=True)
        xe = x.detach().clone().requires_grad_()
        out, want = compiled(x), f(xe)
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
        out.backward()
        gw = w.grad.clone()
        w.grad = None
        want.backward()
        torch.testing.assert_close(gw, w.grad, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(x.grad, xe.grad, rtol=1e-4, atol=1e-4)
        w.grad = None
    assert len(graphs) == 1, len(graphs)


def test_gpt2_decoding_with_the_sdpa_mask_three_graphs(monkeypatch):
    """transformers' GPT-2 decoding with its KV cache, the sdpa mask built at each step (transformers 5.17 builds
    it under any compiler, its is_tracing() being True; later versions skip it): the prompt's graph, the first
    step's, then one symbolic graph for every cache length, each step's logits as eager's."""
    transformers = pytest.importorskip("transformers", reason="the GPT-2 model is transformers'")
    from transformers import masking_utils
    monkeypatch.setattr(masking_utils, "_ignore_causal_mask_sdpa", lambda *a, **k: False)
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=64, vocab_size=100)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    import ember
    from ember.backends import lookup_backend
    graphs = []

    def count(gm, ex):
        graphs.append(gm)
        return lookup_backend("ember")(gm, ex)
    step = ember.compile(model, backend=count)
    eager_graphs = cpp_backend.STATS["eager_graphs"]

    def generate(f, tokens):
        out = f(input_ids=torch.arange(6).view(1, 6) * 7, use_cache=True)
        logits = [out.logits]
        for _ in range(tokens):
            out = f(input_ids=out.logits[:, -1].argmax(-1, keepdim=True), past_key_values=out.past_key_values,
                    use_cache=True)
            logits.append(out.logits)
        return logits
    with torch.no_grad():
        want = generate(model, 7)
        got = generate(step, 7)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    assert len(graphs) == 3, len(graphs)
    masks = [n.kwargs.get("attn_mask") for n in graphs[-1].graph.nodes if "scaled_dot_product" in str(n.target)]
    assert masks and all(isinstance(m, torch.fx.Node) for m in masks), masks   # (the mask was built)
    assert cpp_backend.STATS["eager_graphs"] == eager_graphs   # (every graph compiled to kernels)
