"""Symbolic ATen graphs through the Triton backend (docs/dynamic.md): compiled once, run at many sizes (2, sizes
that are not multiples of a block, large ones) against eager. On a GPU the kernels run there; without one they
run in Triton's interpreter (TRITON_INTERPRET=1, numpy on the CPU), which checks the printed code's meaning: the
size arguments, masks and grids computed from the sizes."""

import pytest
import torch

from tests.codegen.triton_interpreter import import_triton
from tests.codegen.symbolic_graphs import (
    SGD_MUTATIONS, aten_fn, cache_mask, cat_and_slices_by_symbolic_bounds, check, check_sgd_in_place, sgd_momentum,
    symbolic_graph, views_by_symbolic_sizes,
)

CUDA, DEV, triton = import_triton()

from ember.backends import triton_backend  # noqa: E402  (after TRITON_INTERPRET is set)
from ember.codegen.triton import kernels as triton_kernels  # noqa: E402

aten = torch.ops.aten
SIZES = (2, 3, 7, 16, 17, 33, 100, 257)


@pytest.fixture(autouse=True)
def _fresh_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))


def rand(*shape):
    return torch.randn(*shape, device=DEV)


def compile_symbolic(fn, args, dynamic, aten_calls=(), meta=None):
    """fn's symbolic ATen graph compiled once by the Triton backend; asserts it compiled to kernels (not the ATen
    graph's fallback), with no op kept as an ATen call but those in aten_calls. meta: gm.meta entries (what
    ember.autograd says of the graph)."""
    gm, _ = symbolic_graph(aten_fn(fn), args, dynamic)
    gm.meta.update(meta or {})
    compiled = triton_backend.compile_aten(gm, list(args))
    assert hasattr(compiled, "compiled"), "the symbolic graph fell back to its ATen graph"
    call = compiled.compiled
    assert set(call.sched.lowered.fallbacks) <= set(aten_calls), call.sched.lowered.fallbacks
    return compiled


def test_pointwise_chain_broadcast_is_one_flat_kernel():
    def f(s0, x, y):
        return aten.relu.default(aten.add.Tensor(aten.mul.Tensor(aten.sin.default(x), y), 1.0))
    compiled = compile_symbolic(f, [5, rand(5, 7), rand(7)], {1: [0]})
    assert len(compiled.compiled.kernels) == 1 and ": tl.int64, BLOCK: tl.constexpr" in compiled.compiled.kernel_source
    for n in SIZES:
        check(compiled, f, [n, rand(n, 7), rand(7)])


def test_full_block_mask_where_the_block_divides_every_size():
    """s0 * 1024 elements in blocks dividing 1024: every lane is in range at every size (a mask of constants);
    s0 * 1000 elements: masked."""
    def f(s0, x, y):
        return aten.exp.default(aten.mul.Tensor(x, 0.5)), aten.exp.default(aten.mul.Tensor(y, 0.5))
    compiled = compile_symbolic(f, [3, rand(3, 1024), rand(3, 1000)], {1: [0], 2: [0]})
    src = compiled.compiled.kernel_source
    assert "tl.full([BLOCK], True, tl.int1)" in src and "xmask = xindex < (1000 * p" in src
    for n in (2, 5, 9, 64):
        check(compiled, f, [n, rand(n, 1024), rand(n, 1000)])


def test_view_of_computed_size_and_row_sum():
    def f(s0, x, y):
        a = aten.add.Tensor(aten.sin.default(x), y)
        b = aten.view.default(a, [s0 * 4, 8])
        return aten.sum.dim_IntList(b, [1])
    compiled = compile_symbolic(f, [5, rand(5, 4, 8), rand(8)], {1: [0]})
    for n in SIZES:
        check(compiled, f, [n, rand(n, 4, 8), rand(8)])


def test_reductions_over_symbolic_dims():
    def f(s0, s1, x):
        a = aten.sum.dim_IntList(x, [1], True)           # over s1 (a run-time row length), keepdim
        b = aten.amax.default(x, [0])                    # over s0: down the columns
        c = aten.sum.dim_IntList(aten.exp.default(x), [0, 1])
        return aten.sub.Tensor(x, a), b, c
    compiled = compile_symbolic(f, [6, 10, rand(6, 10)], {2: [0, 1]})
    for n, m in [(2, 3), (7, 17), (33, 5), (100, 257), (3, 1000)]:
        # (float32 sums of up to 25,700 values in another order than eager's: x - a row sum of 1,000 to 1e-4)
        check(compiled, f, [n, m, rand(n, m)], rtol=1e-5, atol=1e-4)


def test_softmax_and_layer_norm_over_a_symbolic_row_length():
    """Rows of a run-time length (attention's softmax over a sequence length): looped over the row in blocks
    chosen at the example's length, right at longer and shorter ones."""
    def f(s0, s1, x, w):
        a = aten._softmax.default(x, -1, False)
        b = aten._log_softmax.default(x, 1, False)
        c = aten.native_layer_norm.default(x, [s1], w, None, 1e-5)[0]
        return a, b, c
    compiled = compile_symbolic(f, [6, 10, rand(6, 10), rand(10)], {2: [0, 1], 3: [0]})
    assert "for roff in range(0, " in compiled.compiled.kernel_source
    for n, m in [(2, 3), (7, 17), (33, 5), (64, 257), (3, 4099)]:
        check(compiled, f, [n, m, rand(n, m), rand(m)], rtol=1e-5, atol=1e-5)


def test_layer_norm_rows_of_static_length_stay_persistent():
    def f(s0, x, w, b):
        return aten.native_layer_norm.default(x, [32], w, b, 1e-5)[0]
    compiled = compile_symbolic(f, [6, rand(6, 32), rand(32), rand(32)], {1: [0]})
    assert "for roff" not in compiled.compiled.kernel_source
    for n in SIZES:
        check(compiled, f, [n, rand(n, 32), rand(32), rand(32)])


def test_views_by_symbolic_sizes():
    f = views_by_symbolic_sizes
    compiled = compile_symbolic(f, [5, 6, rand(5, 6, 4)], {2: [0, 1]})
    for n, m in [(2, 3), (7, 17), (33, 5), (16, 16)]:
        check(compiled, f, [n, m, rand(n, m, 4)])


def test_cat_and_slices_with_symbolic_bounds():
    """Loads that may fall outside their buffer (cat, slices) are masked to its symbolic extent."""
    f = cat_and_slices_by_symbolic_bounds
    compiled = compile_symbolic(f, [5, rand(5, 8), rand(5, 8)], {1: [0], 2: [0]})
    for n in SIZES:
        check(compiled, f, [n, rand(n, 8), rand(n, 8)])


def test_index_and_gather():
    def f(s0, s1, x, idx, g):
        a = aten.index.Tensor(x, [idx])
        b = aten.gather.default(x, 1, g)
        return aten.mul.Tensor(a, 2.0), b

    def inputs(n, m):
        return [n, m, rand(n, 8), torch.randint(0, n, (m,), device=DEV), torch.randint(0, 8, (n, 3), device=DEV)]
    compiled = compile_symbolic(f, inputs(5, 6), {2: [0], 3: [0], 4: [0]})
    for n, m in [(2, 3), (7, 17), (33, 5), (100, 257)]:
        check(compiled, f, inputs(n, m))


def test_matmul_epilogues_and_symbols_returned():
    """Library products over a symbolic row count with kernels around them; a size the graph returns (a
    backward's saved symbol) is the call's int."""
    def f(s0, x, w, b, w2):
        a = aten.addmm.default(b, x, aten.t.default(w))
        c = aten.mm.default(aten.relu.default(a), w2)
        return aten.add.Tensor(c, 1.0), s0 * 2

    def inputs(n):
        return [n, rand(n, 16), rand(32, 16), rand(32), rand(32, 8)]
    compiled = compile_symbolic(f, inputs(5), {1: [0]}, aten_calls=("aten.addmm.default", "aten.mm.default"))
    for n in (3, 9, 3, 40, 9):
        args = inputs(n)
        out = compiled(*args)
        torch.testing.assert_close(out[0], f(*args)[0], rtol=1e-4, atol=1e-4)
        assert out[1] == 2 * n and isinstance(out[1], int)


def test_backward_ops():
    """A backward graph's ops over a symbolic batch: layer norm, softmax, threshold and gelu backward, a bias
    gradient (a column sum)."""
    def f(s0, x, g, w, mean, rstd, y):
        a = aten.native_layer_norm_backward.default(g, x, [32], mean, rstd, w, w, [True, True, True])
        sb = aten._softmax_backward_data.default(g, y, -1, torch.float32)
        tb = aten.threshold_backward.default(g, y, 0.0)
        gb = aten.gelu_backward.default(g, x)
        v = aten.view.default(aten.sum.dim_IntList(g, [0], True), [32])
        return a[0], a[1], a[2], sb, tb, gb, v

    def inputs(n):
        x = rand(n, 32)
        return [n, x, rand(n, 32), rand(32), x.mean(1, keepdim=True), torch.rand(n, 1, device=DEV) + 0.5,
                rand(n, 32).softmax(-1)]
    compiled = compile_symbolic(f, inputs(5), {1: [0], 2: [0], 4: [0], 5: [0], 6: [0]})
    for n in (2, 3, 17, 100):
        args = inputs(n)
        for o, w in zip(compiled(*args), f(*args)):
            torch.testing.assert_close(o, w, rtol=1e-4, atol=1e-4)   # (sums of 100 products, another order)


def test_one_module_serves_every_size(monkeypatch):
    """The printed kernels name the symbols, never the example's sizes: one module (cached on disk by its
    source) runs every size."""
    def f(s0, x):
        return aten.exp.default(aten.mul.Tensor(x, 2.0)), aten.sum.dim_IntList(x, [1])
    loads = []
    real = triton_backend.load_module
    monkeypatch.setattr(triton_backend, "load_module", lambda src: loads.append(src) or real(src))
    compiled = compile_symbolic(f, [5, rand(5, 3)], {1: [0]})
    for n in SIZES:
        check(compiled, f, [n, rand(n, 3)])
    assert len(loads) == 1 and loads[0].count(": tl.int64, BLOCK") == 1 and "xmask = xindex < (3 * p" in loads[0]


def test_cannot_lower_runs_the_aten_graph(monkeypatch, caplog):
    """A symbolic graph the Triton code generator cannot do runs as its ATen graph, correct at every size,
    logged with the reason."""
    def refuse(*args, **kwargs):
        raise NotImplementedError("no symbolic code for this test")
    monkeypatch.setattr(triton_kernels, "rows_kernel", refuse)

    def f(s0, x):
        return aten.sum.dim_IntList(aten.cos.default(x), [1])
    gm, _ = symbolic_graph(aten_fn(f), [5, rand(5, 3)], {1: [0]})
    with caplog.at_level("WARNING", logger="ember.fallbacks"):
        compiled = triton_backend.compile_aten(gm, [5, rand(5, 3)])
    assert not hasattr(compiled, "compiled")
    assert sum("symbolic graph runs as its ATen graph" in r.getMessage() and "no symbolic code for this test" in
               r.getMessage() for r in caplog.records) == 1
    for n in SIZES:
        check(compiled, f, [n, rand(n, 3)])


def test_ember_compile_dynamic_compiles_one_triton_graph(monkeypatch):
    """ember.compile(dynamic=True) end to end: the symbolic graph goes to the Triton backend (SYMBOLIC = True),
    one compile serves every size. Without a GPU the CPU tensors are routed to the Triton backend, whose
    kernels the interpreter runs."""
    import ember
    from ember.backends import ember_backend
    if not CUDA:
        monkeypatch.setitem(ember_backend.DEVICE_BACKENDS, "cpu", "ember.backends.triton_backend")
    before = dict(triton_backend.STATS)

    def fn(x, w):
        return torch.softmax(x @ w, -1) * x.sum(-1, keepdim=True)
    compiled = ember.compile(fn, dynamic=True)
    w = rand(8, 8)
    for n in (3, 7, 20, 3, 64):
        x = rand(n, 8)
        torch.testing.assert_close(compiled(x, w), fn(x, w), rtol=1e-5, atol=1e-5)
    assert triton_backend.STATS["graphs"] - before["graphs"] == 1
    assert triton_backend.STATS["eager_graphs"] == before["eager_graphs"]


def test_ranges_empty_at_the_smallest_size():
    """A slice [2:s0] is empty at s0 = 2: its kernels launch no program there, a sum over it is 0."""
    def f(s0, x):
        a = aten.slice.Tensor(x, 0, 2, s0)                       # [s0 - 2, 5]
        b = aten.slice.Tensor(x, 1, 0, 5)
        return aten.exp.default(a), aten.sum.dim_IntList(aten.permute.default(a, [1, 0]), [1]), \
            aten.mul.Tensor(b, 2.0)
    compiled = compile_symbolic(f, [6, rand(6, 5)], {1: [0]})
    for n in (2, 3, 6, 40):
        check(compiled, f, [n, rand(n, 5)])


def test_reductions_down_a_symbolic_count_split_in_parts():
    """A reduction of few results over a symbolic count (a mean down s0*16 rows of 64 columns, batch norm's
    per-channel sums over N*H*W) splits in a number of parts that divides the count at every size (a divisor of
    its coefficient): partial reductions, then their reduction."""
    def f(s0, x, y):
        v = aten.view.default(x, [s0 * 16, 64])
        return aten.mean.dim(aten.mul.Tensor(v, v), [0]), aten.sum.dim_IntList(y, [0, 2, 3])
    compiled = compile_symbolic(f, [40, rand(40, 16, 64), rand(40, 4, 32, 32)], {1: [0], 2: [0]})
    partials = [b for b in compiled.compiled.sched.buffers.values()
                if type(b).__name__ == "Reduction" and len(b.size) == 2]
    assert len(partials) == 2, [(b.name, b.size) for b in partials]
    for n in (2, 3, 17, 64):
        check(compiled, f, [n, rand(n, 16, 64), rand(n, 4, 32, 32)], rtol=1e-5, atol=1e-4)


def test_batch_norm_training_over_a_symbolic_batch():
    """Training batch norm over N*H*W with N symbolic: statistics, the running variance's unbiasing factor
    n / (n - 1) from the run-time count."""
    def f(s0, x, w, b, rm, rv):
        r = aten._native_batch_norm_legit_functional.default(x, w, b, rm, rv, True, 0.1, 1e-5)
        return r[0], r[1], r[2], r[3], r[4]

    def inputs(n):
        return [n, rand(n, 4, 5, 5), rand(4), rand(4), rand(4), torch.rand(4, device=DEV) + 0.5]
    compiled = compile_symbolic(f, inputs(6), {1: [0]})
    for n in (2, 3, 17):
        check(compiled, f, inputs(n), rtol=1e-5, atol=1e-5)


def test_inputs_written_in_place_at_every_size():
    """A symbolic graph's new values of its inputs are stored into them (no fresh buffer, no copy back) when the
    inputs do not overlap, checked at each call from the call's sizes (`_overlap(tensors, sizes)`)."""
    compiled = compile_symbolic(sgd_momentum, [7, rand(7), rand(7), rand(7)], {1: [0], 2: [0], 3: [0]},
                                meta=SGD_MUTATIONS)
    check_sgd_in_place(compiled, rand)
    src = compiled.compiled.source
    assert src.count("# updated in place") == 2 and "_overlap((" in src, src


def test_element_at_a_size_dependent_offset_is_a_scalar_load():
    """x[n - 1] of a dim of symbolic size n: an offset over size arguments only is the same for every lane, so a
    scalar load (Triton refuses a block mask on a scalar pointer: the graph would not compile)."""
    def f(s0, x, y):
        return aten.add.Tensor(y, aten.select.int(x, 0, -1)), aten.mul.Tensor(aten.select.int(x, 0, 0), 2.0)
    compiled = compile_symbolic(f, [5, rand(5), rand(3, 4)], {1: [0]})
    for n in SIZES:
        check(compiled, f, [n, rand(n), rand(3, 4)])


def test_a_cache_mask_of_every_length():
    """transformers' sdpa mask over a key/value cache (symbolic_graphs.cache_mask, the GPU's GPT-2 decoding under
    transformers 5.17): kernels at every length, the capture's ShapeEnv without a guard."""
    f = cache_mask(DEV)
    gm, env = symbolic_graph(aten_fn(f), [5, rand(2, 5)], {1: [1]})
    compiled = triton_backend.compile_aten(gm, [5, rand(2, 5)])
    assert hasattr(compiled, "compiled") and not compiled.compiled.sched.lowered.fallbacks
    assert not env.guards and not env.replacements
    for n in SIZES:
        check(compiled, f, [n, rand(2, n)])


def test_lowering_that_specializes_keeps_no_guard(monkeypatch):
    """A decomposition that reads a symbolic size as an int keeps its op an ATen call; a lowering step outside one
    that does runs the graph as its ATen graph; either way the ShapeEnv keeps no guard (the frame's entry would
    pin the size), and ember.compile compiles one graph for every later size (automatic dynamic)."""
    import ember
    from ember import ir
    from ember.backends import ember_backend
    from ember.codegen import lower
    decomp, plan = lower.TABLE[aten.cos.default], lower.plan_linear_fusions

    def specializing(x):
        int(ir.GRAPH.val.shape[0])
        return decomp(x)

    def f(s0, x):
        return aten.cos.default(aten.mul.Tensor(x, 2.0)), aten.add.Tensor(x, 1.0)
    monkeypatch.setitem(lower.TABLE, aten.cos.default, specializing)
    gm, env = symbolic_graph(aten_fn(f), [5, rand(5, 3)], {1: [0]})
    compiled = triton_backend.compile_aten(gm, [5, rand(5, 3)])
    assert compiled.compiled.sched.lowered.fallbacks == ["aten.cos.default"]
    assert not env.guards and not env.replacements
    for n in SIZES:
        check(compiled, f, [n, rand(n, 3)])

    def planner(gm):
        for n in gm.graph.nodes:
            if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor):
                int(n.meta["val"].shape[0])
        return plan(gm)
    monkeypatch.setattr(lower, "plan_linear_fusions", planner)
    if not CUDA:
        monkeypatch.setitem(ember_backend.DEVICE_BACKENDS, "cpu", "ember.backends.triton_backend")
    before = dict(triton_backend.STATS)

    def g(x):
        return torch.cos(x * 2.0) + 1.0
    compiled = ember.compile(g)
    for n in (4, 5, 6, 9, 17, 5):
        x = rand(n, 3)
        torch.testing.assert_close(compiled(x), g(x))
    # (the static graph of the first size compiled, the symbolic one of every later size its ATen graph)
    assert (triton_backend.STATS["graphs"] - before["graphs"], triton_backend.STATS["eager_graphs"] -
            before["eager_graphs"]) == (1, 1), triton_backend.STATS
