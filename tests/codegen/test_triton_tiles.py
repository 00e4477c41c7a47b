"""Triton kernels whose memory accesses run along different dims: flat kernels whose loads are transposed to
their stores take 2-D tiles (each access contiguous along its own dim). On a GPU the kernels run there; without
one in Triton's interpreter. Each test checks eager's values at several sizes (odd ones included) and the
kernel's structure."""
import pytest
import torch

from tests.codegen.triton_interpreter import import_triton
from tests.codegen.test_triton import compile_and_check, rand

CUDA, DEV, triton = import_triton()


@pytest.fixture(autouse=True)
def _fresh_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))


def _tiled(call) -> bool:
    return "YBLOCK: tl.constexpr" in call.kernel_source and "tl.arange(0, YBLOCK)[:, None]" in call.kernel_source


@pytest.mark.parametrize("shape", [(64, 96), (37, 1000), (100, 17), (33, 65)])
def test_transposed_copy_is_a_2d_tiled_kernel(shape):
    call = compile_and_check(lambda x: x.transpose(0, 1).contiguous() + 1, rand(*shape))
    assert _tiled(call), call.kernel_source[-1500:]
    assert len(call.kernels) == 1


@pytest.mark.parametrize("shape,perm", [((5, 48, 40), (0, 2, 1)), ((3, 20, 7, 33), (0, 2, 3, 1)),
                                        ((2, 24, 5, 32), (0, 3, 1, 2)), ((40, 3, 50), (2, 1, 0))])
def test_permuted_copies_are_tiled(shape, perm):
    call = compile_and_check(lambda x: x.permute(*perm).contiguous() * 2, rand(*shape))
    assert _tiled(call), call.kernel_source[-1500:]


def test_transposed_and_contiguous_inputs_and_a_broadcast_in_one_tile():
    # x + y.t() + b: one load along the stores, one across them, one broadcast over the tile's rows
    call = compile_and_check(lambda x, y, b: (x + y.t()) * b, rand(48, 80), rand(80, 48), rand(80))
    assert _tiled(call)


def test_sixteen_bit_transposed_copy():
    for dt in (torch.float16, torch.bfloat16):
        call = compile_and_check(lambda x: x.t().contiguous() * 3, rand(40, 72, dtype=dt))
        assert _tiled(call)


def test_contiguous_and_narrow_ranges_stay_flat():
    # no load across the stores: the plain flat kernel
    call = compile_and_check(lambda x: x * 2 + 1, rand(64, 96))
    assert not _tiled(call)
    # the transposed side is 3 long: too narrow to tile (no whole lines to gain)
    call = compile_and_check(lambda x: x.t().contiguous() + 1, rand(500, 3))
    assert not _tiled(call)


def _configs(call) -> list:
    return [cfg for _, _, _, cfg, _ in call.kernels]


@pytest.mark.parametrize("shape", [(50, 2500), (37, 3001)])
def test_softmax_over_dim0_is_a_persistent_column_strip(shape):
    """Statistics and output of a softmax over a non-contiguous dim in one kernel: a program owns a strip of
    contiguous columns, whole in registers, so each row's piece of the strip is one coalesced load, read once."""
    call = compile_and_check(lambda x: (torch.log_softmax(x, 0), torch.softmax(x * 2, 0)), rand(*shape))
    assert len(call.kernels) <= 2
    assert "for roff" not in call.kernel_source
    assert all(cfg["XBLOCK"] >= 8 and cfg["persistent"] for cfg in _configs(call)), _configs(call)


def test_softmax_over_long_columns_loops_down_a_strip():
    call = compile_and_check(lambda x: torch.log_softmax(x, 0), rand(1100, 2200))
    assert "for roff" in call.kernel_source
    assert all(cfg["XBLOCK"] >= 8 for cfg in _configs(call)), _configs(call)


def test_middle_dim_softmax_and_normalization_down_columns():
    x = rand(3, 40, 1200)
    call = compile_and_check(lambda x: (torch.softmax(x, 1), x - x.mean(1, keepdim=True)), x)
    assert all(cfg["XBLOCK"] >= 8 for cfg in _configs(call) if "RBLOCK" in cfg), _configs(call)


@pytest.mark.parametrize("shape", [(40, 256), (7, 1000), (3, 5000)])
def test_masked_scaled_softmax_stores_only_its_output(shape):
    """exp(x - max) of a masked softmax is materialized by the decomposition (too costly to compute twice); its
    readers are all in the row kernel, so it stays in registers (or is computed again in a looped kernel), never
    stored."""
    x, m = rand(*shape), torch.rand(*shape, device=DEV) < 0.2
    m[:, 0] = False   # (a fully masked row is NaN in both)
    call = compile_and_check(lambda x, m: torch.softmax(x.masked_fill(m, float("-inf")) * 0.125, -1), x, m)
    kernel = call.kernel_source[call.kernel_source.index("# fused fx nodes"):]
    assert kernel.count("tl.store(") == 1, kernel


def ember_triton(monkeypatch, fn, *xs, **tol):
    """fn compiled by ember.compile (its ATen graphs functionalized, as a user's are) on the Triton backend (the CPU
    routed there without a GPU), under no_grad, checked against eager; returns the host programs it compiled."""
    import ember
    from ember.backends import ember_backend, triton_backend
    if not CUDA:
        monkeypatch.setitem(ember_backend.DEVICE_BACKENDS, "cpu", "ember.backends.triton_backend")
    calls, compile_schedule = [], triton_backend.compile_schedule

    def spy(*a, **k):
        calls.append(compile_schedule(*a, **k))
        return calls[-1]
    monkeypatch.setattr(triton_backend, "compile_schedule", spy)
    with torch.no_grad():
        torch.testing.assert_close(ember.compile(fn)(*xs), fn(*xs), **tol)
    assert calls, "no graph compiled by the Triton backend"
    return calls


@pytest.mark.parametrize("n,c", [(70, 1000), (131, 517), (700, 100)])
def test_smoothed_cross_entropy_never_stores_the_log_softmax(monkeypatch, n, c):
    """log_softmax read by the smoothing's row sum and by nll_loss's gather of one element a row: computed again
    by each (one big input), not stored whole."""
    x, t = rand(n, c), torch.randint(0, c, (n,), device=DEV)
    t[3] = -100   # an ignored target
    calls = ember_triton(monkeypatch, lambda x, t: torch.nn.functional.cross_entropy(x, t, label_smoothing=0.1), x, t)
    for call in calls:
        assert f"_empty(({n}, {c})" not in call.source, call.source


def _calls_scan(call) -> bool:
    from ember.runtime import triton_scan
    return any(v is triton_scan.cumsum for v in call.namespace.values())


@pytest.mark.parametrize("shape", [(64, 1024), (5, 7), (3, 5000), (2, 3, 100), (1000,)])
def test_cumsum_along_the_last_dim_is_a_triton_scan(shape):
    x = rand(*shape)
    call = compile_and_check(lambda x: (x.cumsum(-1) * 2, torch.cumsum(x + 1, dim=x.ndim - 1)), x,
                             atol=1e-4, rtol=1e-5)
    assert _calls_scan(call), call.source


def test_cumsum_sixteen_bit_and_other_dims():
    from ember.backends.triton_backend import compile_aten
    from tests.codegen.aten_trace import trace_aten
    for dt in (torch.float16, torch.bfloat16):
        # ember's scan rounds float32 sums once; eager's 16-bit cumsum does not (on the GPU its results were up to
        # 2 units in the last place away from them at 300 elements), so the rule is error analysis: ember's error
        # against a float64 run at most eager's, plus one unit in the last place of the largest result
        x = rand(9, 300, dtype=dt)
        gm, _ = trace_aten(lambda x: x.cumsum(1), [x])
        compiled = compile_aten(gm, [x])
        assert _calls_scan(compiled.compiled)
        exact = x.double().cumsum(1)
        (ours,), eager = compiled(x), x.cumsum(1)
        assert ours.dtype == eager.dtype == dt
        ulp = exact.abs().max().item() * torch.finfo(dt).eps
        assert (ours.double() - exact).abs().max() <= (eager.double() - exact).abs().max() + ulp
    # along dim 0 and for integers: ATen's cumsum
    call = compile_and_check(lambda x: x.cumsum(0), rand(50, 40))
    assert not _calls_scan(call)
    call = compile_and_check(lambda a: a.cumsum(-1), torch.randint(-5, 5, (6, 70), device=DEV))
    assert not _calls_scan(call)


def test_cumsum_in_a_symbolic_graph_serves_every_size(monkeypatch):
    import ember
    from ember.backends import ember_backend, triton_backend
    if not CUDA:
        monkeypatch.setitem(ember_backend.DEVICE_BACKENDS, "cpu", "ember.backends.triton_backend")
    before = dict(triton_backend.STATS)
    f = lambda x: x.cumsum(-1) * 2 + x   # noqa: E731
    compiled = ember.compile(f, dynamic=True)
    for n in (3, 7, 20, 64):
        x = rand(n, 33)
        torch.testing.assert_close(compiled(x), f(x), atol=1e-5, rtol=1e-5)
    assert triton_backend.STATS["graphs"] - before["graphs"] == 1
    assert triton_backend.STATS["eager_graphs"] == before["eager_graphs"]


@pytest.mark.parametrize("n,c", [(64, 1000), (100, 333)])
def test_pointwise_over_everything_after_a_scalar_reduction_is_not_one_program(n, c):
    """A loss's backward divides every logit's gradient by the count of its targets, a one-element reduction:
    fused into that reduction's group of one row, the whole pointwise ran in one program. It is a kernel of its
    own, over every program."""
    def f(x, t):
        count = (t != -100).sum()
        return torch.where(t[:, None] != -100, x.exp() / count, 0.0)
    t = torch.randint(0, c, (n,), device=DEV)
    t[1] = -100
    call = compile_and_check(f, rand(n, c), t)
    assert len(call.kernels) == 2, call.source
    assert "[(1,)]" in call.source and call.source.count("[(1,)]") == 1, call.source
