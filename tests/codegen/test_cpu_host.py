"""The C++ backend's host program: buffers kept from call to call, matmuls writing into them, linear layers as
a matrix product whose bias add fuses into the next kernel. Compared with eager on fresh random inputs."""
import threading

import pytest
import torch

from ember import config
import ember
from tests.numerics import assert_as_close_as_eager
from ember.backends import cpp_backend
from tests.codegen.recording import compiled_graphs as _compiled_graphs
from tests.optim_steps import step_both


def test_kept_buffers_do_not_leak_into_earlier_results():
    """Intermediates (an mm written through aten.mm.out, a fused row) live in buffers kept across calls; the
    outputs must still be fresh tensors: a second call must not change what the first returned."""
    torch.manual_seed(0)
    w1, w2 = torch.randn(64, 96), torch.randn(96, 32)

    def fn(x):
        h = torch.relu(x @ w1)
        return torch.softmax(h @ w2, -1), (h * 2).sum(-1)
    with torch.no_grad():
        x1, x2 = torch.randn(128, 64), torch.randn(128, 64)
        f, graphs = _compiled_graphs(fn, x1)
        src = graphs[0].call.source
        assert "_S[" in src and "out=" in src, src  # something is kept, and a matmul writes into it
        a = f(x1)
        a_copy = [t.clone() for t in a]
        b = f(x2)
        for got, want in zip(a, a_copy):
            torch.testing.assert_close(got, want)
        for got, want in zip(b, fn(x2)):
            torch.testing.assert_close(got, want)
        assert a[0].data_ptr() != b[0].data_ptr()


def test_a_matmul_output_that_is_returned_is_fresh_each_call():
    torch.manual_seed(0)
    w = torch.randn(48, 40)
    with torch.no_grad():
        x1, x2 = torch.randn(30, 48), torch.randn(30, 48)
        f, _ = _compiled_graphs(lambda x: (x @ w, (x @ w).tanh()), x1)
        a = f(x1)
        b = f(x2)
        torch.testing.assert_close(a[0], x1 @ w)
        torch.testing.assert_close(b[0], x2 @ w)
        torch.testing.assert_close(b[1], (x2 @ w).tanh())


def test_threads_calling_one_graph_at_once_get_their_own_results():
    """The kept buffers serve one call at a time (the C++ kernels release the GIL): a call that finds them in
    use allocates its own. The threads run with grad mode on (it is per thread), so each misses the no-grad
    entry and compiles at the same time as the others: lowering takes turns (its state is module-global)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 256)
    fn = lambda x: torch.nn.functional.gelu(lin(x)).softmax(-1)
    xs = [torch.randn(512, 256) for _ in range(4)]
    with torch.no_grad():
        f, _ = _compiled_graphs(fn, xs[0])
        results: dict = {}

        def worker(i):
            for _ in range(20):
                results[i] = f(xs[i])
        ts = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        for i, x in enumerate(xs):
            torch.testing.assert_close(results[i], fn(x))


def test_training_step_with_kept_buffers_matches_eager_twice():
    """Forward intermediates saved for the backward are graph outputs (fresh per call); the rest is kept.
    float64: in float32 the layer norm's backward puts a few gradient elements 1e-5 apart in summation order."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 16), torch.nn.LayerNorm(16))
    ref = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 16), torch.nn.LayerNorm(16))
    m.double()
    ref.double()
    ref.load_state_dict(m.state_dict())
    f = ember.compile(lambda mod, x: mod(x).pow(2).sum())
    for _ in range(2):
        x = torch.randn(20, 32, dtype=torch.float64)
        m.zero_grad()
        ref.zero_grad()
        got, want = f(m, x), ref(x).pow(2).sum()
        got.backward()
        want.backward()
        torch.testing.assert_close(got, want)
        for p, q in zip(m.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad)


def _items(graph):
    from ember.codegen.schedule import FusedGroup
    groups = [it for it in graph.sched.items if isinstance(it, FusedGroup)]
    externs = [str(it.target) for it in graph.sched.items if not isinstance(it, FusedGroup)]
    return groups, externs


def test_linear_bias_fuses_into_gelu_and_layer_norm(monkeypatch):
    """addmm on CPU is mm + a bias add that the reading kernel does (no separate pass over the result). With ATen's
    mm: float32 products of this size go to oneDNN with the bias and gelu inside (tests/codegen/test_onednn_linear.py)."""
    from ember.codegen import lower
    monkeypatch.setattr(config, "ONEDNN_MATMULS", False)
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(96, 384), torch.nn.GELU(), torch.nn.Linear(384, 96), torch.nn.LayerNorm(96)).eval()
    with torch.no_grad():
        x = torch.randn(4, 50, 96)  # 3-D: the linear runs on a [200, 96] view
        f, graphs = _compiled_graphs(m, x)
        groups, externs = _items(graphs[0])
        assert externs == ["aten.mm.default", "aten.mm.default"], externs
        assert len(groups) == 2, groups  # bias + gelu; bias + layer_norm
        for _ in range(2):
            x = torch.randn(4, 50, 96)
            torch.testing.assert_close(f(x), m(x))


def test_linear_outputs_returned_and_read_by_attention():
    """Bias adds whose readers are library calls (attention) or the caller are kernels of their own."""
    torch.manual_seed(0)
    q, k, v = (torch.nn.Linear(64, 64) for _ in range(3))

    def fn(x):
        b, s, _ = x.shape
        heads = [p(x).view(b, s, 4, 16).transpose(1, 2) for p in (q, k, v)]
        return torch.nn.functional.scaled_dot_product_attention(*heads), q(x)
    with torch.no_grad():
        x = torch.randn(2, 24, 64)
        f, _ = _compiled_graphs(fn, x)
        x = torch.randn(2, 24, 64)
        for got, want in zip(f(x), fn(x)):
            torch.testing.assert_close(got, want)


def test_attention_reads_query_key_value_as_views_of_one_projection():
    """GPT-2's attention: one projection split into query, key and value, each viewed as heads. The parts are
    not dense, so the projection is ATen's addmm (bias inside) and attention reads its result through views, as
    eager does; ember copied each part (adding the bias) before."""
    torch.manual_seed(0)
    qkv = torch.nn.Linear(64, 3 * 64)

    def fn(x):
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, 4, 16).transpose(1, 2) for t in qkv(x).split(64, dim=2))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)
    with torch.no_grad():
        x = torch.randn(2, 24, 64)
        f, graphs = _compiled_graphs(fn, x)
        groups, externs = _items(graphs[0])
        assert externs[0] == "aten.addmm.default" and "attention" in externs[1] and not groups, (externs, groups)
        for _ in range(2):
            x = torch.randn(2, 24, 64)
            torch.testing.assert_close(f(x), fn(x))


def test_a_value_returned_and_read_by_a_library_call_is_stored_once():
    """A cheap value (a concatenation that is one copy: GPT-2's key/value cache) that the graph returns and a
    library call reads is stored once where it is computed (lower.stores_whole), not once for each reader."""
    from ember.codegen import lower
    from ember.ir import Pointwise
    from tests.codegen.aten_trace import trace_aten

    def fn(x):
        c = torch.cat([torch.empty(4, 0, 8), x.transpose(1, 2)], 1)
        return c, torch.bmm(c, x)
    torch.manual_seed(0)
    x = torch.randn(4, 8, 16)
    gm, _ = trace_aten(fn, [x])
    low, _, _ = lower.lower(gm, [x])
    assert sum(isinstance(b, Pointwise) for b in low.buffers) == 1
    f = ember.compile(fn)
    for _ in range(2):
        x = torch.randn(4, 8, 16)
        for got, want in zip(f(x), fn(x)):
            torch.testing.assert_close(got, want)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the Triton backend's case needs a GPU (device runs)"))])
@pytest.mark.parametrize("padding_idx", [None, 3])
def test_tied_embedding_gradient_adds_its_rows_into_the_head_gradient(padding_idx, device):
    """GPT-2's tied token embedding: the weight's gradient is the LM head's product plus the embedding's scattered
    rows, added by index_put (accumulate) into the product, with no table of zeros and no pass adding two tables
    (decomp/views.py's embedding gradient). A padding index keeps ATen's embedding backward."""
    from ember.codegen import lower
    from ember.ir import ExternBuffer
    torch.manual_seed(0)
    emb = torch.nn.Embedding(50, 16, padding_idx=padding_idx, device=device)

    def f(idx):
        return (emb(idx) @ emb.weight.t()).logsumexp(-1).sum()
    externs, orig = [], lower.lower

    def rec(gm, ex, target="cpu"):
        r = orig(gm, ex, target)
        externs.extend(str(b.target) for b in r[0].buffers if isinstance(b, ExternBuffer))
        return r
    cf = ember.compile(f)
    lower.lower = rec
    try:
        for _ in range(2):
            idx = torch.randint(0, 50, (4, 7), device=device)
            idx[0, :3] = idx[1, 0]    # repeated tokens: rows added to one row
            emb.weight.grad = None
            cf(idx).backward()
            got = emb.weight.grad.clone()
            emb.weight.grad = None
            f(idx).backward()
            torch.testing.assert_close(got, emb.weight.grad)
    finally:
        lower.lower = orig
    assert ("aten.index_put.default" in externs) == (padding_idx is None), externs
    assert ("aten.embedding_dense_backward.default" in externs) == (padding_idx is not None), externs


def test_view_strides_match_torch_view():
    """prims.view_strides: the strides torch's view gives a window, or None where view would raise."""
    import random

    from ember.decomp.prims import view_strides
    rng = random.Random(0)
    for _ in range(500):
        x = torch.empty([rng.randint(1, 4) for _ in range(rng.randint(2, 5))])
        x = x.permute(*rng.sample(range(x.ndim), x.ndim))
        d = rng.randrange(x.ndim)
        if x.shape[d] > 1 and rng.random() < 0.5:
            x = x.narrow(d, 1, x.shape[d] - 1)
        n, shape = x.numel(), []
        while n > 1 and len(shape) < 4:
            f = rng.choice([k for k in range(2, n + 1) if n % k == 0])
            shape.append(f)
            n //= f
        shape = shape + [n] if n > 1 else shape or [1]
        try:
            want = x.view(shape).stride()
        except RuntimeError:
            want = None
        got = view_strides(x.shape, x.stride(), shape)
        if want is None or got is None:
            assert got is None and want is None, (x.shape, x.stride(), shape, want, got)
        else:
            assert [int(g) for g, s in zip(got, shape) if s != 1] == [w for w, s in zip(want, shape) if s != 1]


def test_addmm_with_scaling_or_integers_stays_a_library_call():
    torch.manual_seed(0)
    with torch.no_grad():
        b, x, w = torch.randn(20), torch.randn(10, 30), torch.randn(30, 20)
        fn = lambda b, x, w: torch.addmm(b, x, w, beta=0.5, alpha=2.0).relu()
        f, graphs = _compiled_graphs(fn, b, x, w)
        assert "aten.addmm.default" in _items(graphs[0])[1]
        torch.testing.assert_close(f(b, x, w), fn(b, x, w))
        bi, xi, wi = torch.randint(-5, 5, (20,)), torch.randint(-5, 5, (10, 30)), torch.randint(-5, 5, (30, 20))
        fi = lambda b, x, w: torch.addmm(b, x, w) * 2
        torch.testing.assert_close(ember.compile(fi)(bi, xi, wi), fi(bi, xi, wi))


def test_layer_norm_read_by_three_matmuls_is_stored_once():
    """A layer_norm result read by several extern calls is one buffer (each extern had stored its own copy)."""
    torch.manual_seed(0)
    ln = torch.nn.LayerNorm(128)
    ws = [torch.randn(128, 128) for _ in range(3)]

    def fn(x):
        y = ln(x)
        return [y @ w for w in ws]
    with torch.no_grad():
        x = torch.randn(64, 128)
        f, graphs = _compiled_graphs(fn, x)
        groups, externs = _items(graphs[0])
        stored = [m.buf.name for g in groups for m in g.members if not m.local]
        assert len(stored) == 1, stored
        x = torch.randn(64, 128)
        for got, want in zip(f(x), fn(x)):
            torch.testing.assert_close(got, want)


def test_softmax_row_computes_exp_once():
    """A softmax over the innermost dim keeps exp(x - max) in the per-thread row buffer for the row sum and the
    output; softmax over another dim, or over rows too long for the buffer, still matches eager."""
    torch.manual_seed(0)
    with torch.no_grad():
        x = torch.randn(64, 1000) * 4
        f, graphs = _compiled_graphs(lambda t: torch.softmax(torch.nn.functional.gelu(t), -1), x)
        assert graphs[0].source.count("= ember_expf(") == 1, graphs[0].source
        torch.testing.assert_close(f(x), torch.softmax(torch.nn.functional.gelu(x), -1))
        for t, dim in [(torch.randn(300, 70) * 4, 0), (torch.randn(3, 40000) * 4, -1), (torch.randn(5, 6, 7), 1)]:
            fn = lambda t: torch.softmax(t * 2, dim)
            torch.testing.assert_close(ember.compile(fn)(t), fn(t))


def test_row_reductions_calling_libm_use_wide_vectors_and_match_eager():
    """Groups with reductions that call libm (exp, erf) are compiled for 512-bit vectors too."""
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        x = torch.randn(200, 999, dtype=dtype) * 3
        fn = lambda t: (torch.log_softmax(t, -1), torch.special.erf(t).sum(-1), torch.logsumexp(t, -1))
        with torch.no_grad():
            f, graphs = _compiled_graphs(fn, x)
            assert 'EMBER_WIDE void' in graphs[0].source
            for got, want, exact in zip(f(x), fn(x), fn(x.double())):
                if dtype == torch.float32:   # (eager's float32 libm differs by instruction set)
                    assert_as_close_as_eager(got, want, exact)
                else:
                    torch.testing.assert_close(got, want)


def test_input_with_other_strides_is_copied_into_the_compiled_layout():
    """A backward graph is traced with its saved tensors' layouts as the trace saw them (a view), but the compiled
    forward may return them dense: such an input is copied into the layout the graph was compiled for, instead
    of the whole graph running eagerly on every call."""
    from tests.codegen.aten_trace import trace_aten

    def fn(x, y):
        return (x * 2 + y).sum(-1), torch.exp(x) @ y.t()
    torch.manual_seed(0)
    gm, _ = trace_aten(fn, [torch.randn(32, 48).t(), torch.randn(48, 32)])   # traced: x a transposed view
    x, y = torch.randn(48, 32), torch.randn(48, 32)                           # real: x dense
    compiled = cpp_backend.compile_aten(gm, [x, y])
    eager_calls = []
    traced_forward = gm.forward
    gm.forward = lambda *a: eager_calls.append(1) or traced_forward(*a)
    for _ in range(2):
        x, y = torch.randn(48, 32), torch.randn(48, 32)
        for got, want in zip(compiled(x, y), fn(x, y)):
            torch.testing.assert_close(got, want)
    assert not eager_calls


def test_host_scalars_split_assembles_outputs_in_order(monkeypatch):
    """host_scalars.compile_split on a graph mixing 0-d CPU values with "device" values (the meta device stands
    in for CUDA; the pinned-buffer transfer for a plain gather): every output leaf comes back where the graph
    returns it (device, host, constants, a host value returned twice), inputs passed to the right part."""
    import torch.fx as fx

    from ember.backends import host_scalars
    from tests.backends.test_host_scalars import meta_packs
    meta_packs(monkeypatch)

    def f(w, step, g, step2):
        s1 = step + 1
        s2 = step2 * 2
        w2 = w - g * s1
        return (w2, s1, None, (s2, w2, 3), s1)
    gm = fx.symbolic_trace(f)
    cpu_nodes = {"step", "step2", "add", "mul"}   # step + 1, step2 * 2
    w, g = torch.randn(3, device="meta"), torch.randn(3, device="meta")
    step, step2 = torch.rand(()) + 1, torch.rand(()) + 1
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "call_function"):
            n.meta["val"] = torch.empty((), device="cpu") if n.name in cpu_nodes else torch.empty(3, device="meta")
    run = host_scalars.compile_split(gm, [w, step, g, step2], lambda h, ex: h.forward, lambda d, ex: d.forward)
    out, expected = run(w, step, g, step2), f(w, step, g, step2)
    assert [type(x) for x in out] == [type(x) for x in expected] and out[2] is None and out[3][2] == 3
    for got, want in [(out[1], expected[1]), (out[4], expected[4]), (out[3][0], expected[3][0])]:
        torch.testing.assert_close(got, want)
    assert out[0].device.type == out[3][1].device.type == "meta" and out[0].shape == (3,)


def _recording_packs(monkeypatch) -> list:
    """host_scalars' packs made to record the values each send carries (the meta device standing in for CUDA),
    with the host computing the values the device reads that need libdevice (as in a training step's graph)."""
    from ember.backends import host_scalars
    sent = []

    class Pack:
        def __init__(self, dtype, positions, device):
            self.positions = positions

        def send(self, values):
            sent.append([values[i].clone() for i in self.positions])
            return torch.stack([values[i] for i in self.positions]).to("meta")
    monkeypatch.setattr(host_scalars, "_Pack", Pack)
    monkeypatch.setattr(host_scalars, "SENT_FROM_HOST_ABOVE", 0)
    return sent


def _bias_correction_graph():
    """An Adam-like update: the CPU step counter, its `+ 1` and the bias correction `1 - 0.9 ** (step + 1)` on
    the host; the parameter ("device": meta) divided by it. Returns (new parameter, new counter, 7)."""
    import torch.fx as fx
    aten = torch.ops.aten

    def f(w, step, g):
        s1 = aten.add.Tensor(step, 1)
        bc = aten.rsub.Scalar(aten.pow.Scalar(0.9, s1), 1)
        return (aten.sub.Tensor(w, aten.div.Tensor(aten.mul.Tensor(g, s1), bc)), s1, 7)
    gm = fx.symbolic_trace(f)
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "call_function"):
            cpu = n.name in ("step", "add_tensor", "pow_scalar", "rsub_scalar")
            n.meta["val"] = torch.empty((), device="cpu") if cpu else torch.empty(3, device="meta")
    return gm


def test_host_scalars_computes_libdevice_values_on_the_host_and_sends_them(monkeypatch):
    """In a big graph, a CPU value the device reads that would need libdevice there (`1 - 0.9 ** (step + 1)`,
    Adam's bias correction) is an output of the host graph, which runs first, and reaches the device graph in a
    pack of its own; the device graph has no pow, and still recomputes the cheap `step + 1` it reads."""
    from ember.backends import host_scalars
    aten = torch.ops.aten
    sent = _recording_packs(monkeypatch)
    gm = _bias_correction_graph()
    host_gm, dev_gm, plan = host_scalars.split(gm)
    assert not any(n.target is aten.pow.Scalar for n in dev_gm.graph.nodes)
    assert any(n.target is aten.add.Tensor for n in dev_gm.graph.nodes)   # step + 1, recomputed on the device
    assert [len(pos) for _, pos in plan["sent_packs"]] == [1]
    w, g, step = torch.randn(3, device="meta"), torch.randn(3, device="meta"), torch.rand(()) + 1
    run = host_scalars.compile_split(gm, [w, step, g], lambda h, ex: h.forward, lambda d, ex: d.forward)
    out = run(w, step, g)
    torch.testing.assert_close(out[1], step + 1)
    assert out[2] == 7 and out[0].device.type == "meta" and out[0].shape == (3,)
    torch.testing.assert_close(sent[-1][0], 1 - 0.9 ** (step + 1))   # the value sent: computed on the host


def test_host_scalars_values_sent_live_in_kept_buffers_and_results_stay_fresh(monkeypatch):
    """The values the host part computes only to send them (a training step's ~1,100 bias corrections) are
    written into buffers kept from call to call (not allocated on every call): each call still sends its own
    values, and the host results returned to the caller (the new step counter) are fresh tensors."""
    from ember.backends import host_scalars
    sent = _recording_packs(monkeypatch)
    gm = _bias_correction_graph()
    programs = []

    def compile_host(h, ex):
        run = cpp_backend.compile_aten(h, ex)
        programs.append(run.compiled)
        return run
    w, g = torch.randn(3, device="meta"), torch.randn(3, device="meta")
    run = host_scalars.compile_split(gm, [w, torch.rand(()) + 1, g], compile_host, lambda d, ex: d.forward)
    programs[0].build.result()   # (while it builds, the host part runs eagerly: the next test)
    steps = [torch.rand(()) * 5 + 1 for _ in range(3)]
    outs = [run(w, s, g)[1] for s in steps]
    assert "_S[" in programs[0].call.source, programs[0].call.source
    assert len(sent) == 2 * len(steps)   # per call: the step counter packed for the device, then the values sent
    for s, out, values in zip(steps, outs, sent[1::2]):
        torch.testing.assert_close(out, s + 1)   # each call's counter, fresh: later calls did not change it
        torch.testing.assert_close(values[0], 1 - 0.9 ** (s + 1))
    assert len({o.data_ptr() for o in outs}) == len(outs)


def test_host_scalars_host_part_runs_eagerly_until_its_build_is_done(monkeypatch):
    """While the host part's C++ build runs, calls compute its CPU values with ATen (the first call does not
    wait for g++); the calls after the build is done run the C++ program. Values as eager's throughout."""
    import concurrent.futures
    from ember.backends import host_scalars
    sent = _recording_packs(monkeypatch)
    gm = _bias_correction_graph()
    programs, gate = [], concurrent.futures.Future()

    def compile_host(h, ex):
        run = cpp_backend.compile_aten(h, ex)
        programs.append((run.compiled, run.compiled.build))
        run.compiled.build = gate   # a build that ends when the test says so
        return run
    w, g = torch.randn(3, device="meta"), torch.randn(3, device="meta")
    run = host_scalars.compile_split(gm, [w, torch.rand(()) + 1, g], compile_host, lambda d, ex: d.forward)
    program, real_build = programs[0]

    def check_calls(n):
        for _ in range(n):
            s = torch.rand(()) * 5 + 1
            torch.testing.assert_close(run(w, s, g)[1], s + 1)
            torch.testing.assert_close(sent[-1][0], 1 - 0.9 ** (s + 1))
    import threading
    late = threading.Timer(20, lambda: gate.done() or gate.set_result(real_build.result()))
    late.start()   # (a host part waiting for its build would wait for this, then fail the assert below)
    check_calls(2)
    assert program.call is None   # the C++ program was not loaded: ATen ran the host part
    late.cancel()
    gate.set_result(real_build.result())
    check_calls(2)
    assert program.call is not None


def test_adam_over_many_parameters_splits_kernels_under_the_ctypes_argument_limit():
    """An Adam step over 160 parameters fuses horizontally into one group of ~1,100 pointers, above the 1,024
    arguments one ctypes call passes (it raised ArgumentError at the first call): the group is cut between
    parameters. Values and state as eager's."""
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(4, 3)) for _ in range(160)]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    opt, ref = torch.optim.Adam(ps, lr=1e-2), torch.optim.Adam(qs, lr=1e-2)
    step = ember.compile(lambda: opt.step())
    _steps_against_eager(step, ref, ps, qs, 3)
    for p, q in zip(ps, qs):
        torch.testing.assert_close(opt.state[p]["exp_avg_sq"], ref.state[q]["exp_avg_sq"])


def _steps_against_eager(step, ref, ps, qs, n: int) -> None:
    """n compiled steps and n eager steps of `ref` on the same fresh gradients; parameters compared."""
    for _ in range(n):
        step_both(step, ref.step, ps, qs)
    for p, q in zip(ps, qs):
        torch.testing.assert_close(p, q)


def test_host_scalars_device_graph_returns_the_next_step_counters():
    """Step counters that advance by a constant (`step + 1`, written back in place) are computed on the device
    too: the device graph returns them stacked (the next call's pack, no transfer while the CPU values match);
    a counter changed by something else (`step * 2`) keeps its pack transferred every call."""
    import torch.fx as fx

    from ember.backends import host_scalars

    def f(w, step, g, scale):
        s1 = torch.ops.aten.add.Tensor(step, 1, alpha=1)
        s2 = scale * 2
        return (w - g * s1 * s2, s1, s2)

    def split(double_scale_is_mutation: bool):
        gm = fx.symbolic_trace(f)
        cpu_nodes = {"step", "scale", "add_tensor", "mul"}
        for n in gm.graph.nodes:
            if n.op in ("placeholder", "call_function"):
                n.meta["val"] = torch.empty((), device="cpu") if n.name in cpu_nodes else torch.empty(3, device="meta")
        # outputs 1 and 2 written back into inputs 1 (step) and 3 (scale)
        gm.meta["ember_input_mutations"] = [(1, 1)] + ([(3, 2)] if double_scale_is_mutation else [])
        return host_scalars.split(gm)

    _, dev, plan = split(False)
    assert plan["next_packs"] == [plan["device_outputs"]] and plan["device_outputs"] == 1
    stack = list(dev.graph.nodes)[-1].args[0][-1]
    assert stack.target is torch.ops.aten.stack.default and len(stack.args[0]) == 2
    _, _, plan = split(True)
    assert plan["next_packs"] == [None], plan


@pytest.mark.parametrize("n, written", [(8, (0, 3, 5)), (40, tuple(range(0, 40, 2)))])
def test_overlap_check_rechecks_only_inputs_whose_address_changed(n, written):
    """wrapper._Overlap against the all-pairs answer over calls where some inputs move (views into one storage,
    so moved inputs may land on others): it remembers the last passing addresses and checks only pairs with a
    moved input, which must give the same answer; with many written inputs moving at once (40 inputs) it
    sweeps all inputs in address order instead, again the same answer."""
    import random

    from ember.codegen.wrapper import _Overlap
    rng = random.Random(0)
    base = torch.zeros(4096 * (n // 8))
    width = 16
    extents = [width * 4] * n
    check = _Overlap(written, extents)

    def brute(ptrs):
        return any(j != i and ptrs[j] < ptrs[i] + extents[i] and ptrs[i] < ptrs[j] + extents[j]
                   for i in written for j in range(n))
    starts = [k * 256 for k in range(n)]
    sweeps = 0
    for _ in range(300):
        moving = rng.sample(range(n), rng.choice([1, 1, 2, n]))
        sweeps += len(moving) * len(written) > 8 * n
        for k in moving:
            starts[k] = rng.randrange(0, len(base) - width) if rng.random() < 0.3 else rng.randrange(0, 2 * n) * 256
        args = [base[s:s + width] for s in starts]
        assert check(args) == brute([a.data_ptr() for a in args]), starts
    assert sweeps > 0 if n == 40 else sweeps == 0


def test_a_large_generated_file_is_compiled_in_parts_and_linked_into_one_library(monkeypatch, tmp_path):
    """cache._build splits a generated file at its kernel marks into one part per core, compiles the parts side
    by side and links them into one library exporting every kernel; a compiler error still names the file."""
    import ctypes

    from ember.runtime import cache
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cache, "PART_CHARS", 50)
    monkeypatch.setattr(cache.os, "cpu_count", lambda: 3)
    prelude = 'static inline int twice(int x) { return 2 * x; }'
    kernels = [f'extern "C" int k{i}(int x) {{ return twice(x) + {i}; }}' for i in range(7)]
    lib = ctypes.CDLL(str(cache.build_cpp(cache.KERNEL_MARK.join([prelude, *kernels]) + "\n").result()))
    assert [getattr(lib, f"k{i}")(5) for i in range(7)] == [10 + i for i in range(7)]
    bad = cache.KERNEL_MARK.join([prelude, *kernels, 'extern "C" int broken( { }'])
    with pytest.raises(cache.BuildError, match="part"):
        cache.build_cpp(bad).result()


def test_a_shared_prelude_is_precompiled_from_the_second_file_on(monkeypatch, tmp_path):
    """Files starting with a shared prelude (cpp.PRELUDE): the first is built with it inline; the second starts
    its precompiling (a g++ precompiled header); files built after that include the header. Every library
    works, and a new cache directory (a removed one) gets its own header."""
    import ctypes

    from ember.runtime import cache
    monkeypatch.setattr(cache, "SHARED_PRELUDES", {"#include <cmath>\nstatic inline double half(double x) { return x / 2; }"})
    monkeypatch.setattr(cache, "_PCH", {})
    monkeypatch.setattr(cache, "_PCH_SEEN", set())
    prelude = next(iter(cache.SHARED_PRELUDES))

    def build(i: int):
        src = cache.KERNEL_MARK.join([prelude, f'extern "C" double k(double x) {{ return half(x) + std::sqrt({i}.0); }}'])
        so = cache.build_cpp(src + "\n").result()
        f = ctypes.CDLL(str(so)).k
        f.restype, f.argtypes = ctypes.c_double, [ctypes.c_double]
        assert f(6.0) == 3.0 + i ** 0.5
        return so.with_suffix(".cpp").read_text().startswith("#include \"")
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "a"))
    included = [build(i) for i in range(2)]
    cache._PCH[prelude].result()   # (the second file started it: done, for the files after)
    included += [build(i) for i in range(2, 4)]
    assert included == [False, False, True, True], included
    import shutil
    shutil.rmtree(tmp_path / "a")   # its header gone: the next file starts precompiling in the new directory
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "b"))
    assert not build(4)
    cache._PCH[prelude].result()
    assert build(5) and len(list((tmp_path / "b" / "cpp").glob("prelude_*.h.gch"))) == 1


def test_wide_horizontal_groups_are_cut_into_kernels_of_at_most_64_members(monkeypatch):
    """An elementwise group of many members (densenet121's 120 folded convolution weights, an optimizer over many
    parameters) becomes several C++ functions, each quick to compile; values as eager's."""
    from ember.codegen import cpp
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(100)]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    opt, ref = torch.optim.SGD(ps, lr=0.1, momentum=0.9), torch.optim.SGD(qs, lr=0.1, momentum=0.9)
    ember.reset()
    step = ember.compile(lambda: opt.step())
    graphs, orig = [], cpp_backend.compile_aten
    monkeypatch.setattr(cpp_backend, "compile_aten", lambda gm, ex, options=None: graphs.append(
        orig(gm, ex, options)) or graphs[-1])
    _steps_against_eager(step, ref, ps, qs, 3)
    kernels = [k for g in graphs if hasattr(g, "compiled") for k in g.compiled.kernels]
    assert len(kernels) >= 200 // cpp.MAX_MEMBERS_PER_KERNEL, kernels   # two updates per parameter


def test_library_calls_go_through_torch_bindings_and_match_eager():
    """Matmuls and convolutions are called through their torch.* bindings (cheaper per call than the
    OpOverload), including the `out=` form of a matmul into a kept buffer; results equal eager's."""
    from ember.codegen.wrapper import BOUND_OPS
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 8, 3, padding=1)
    w1, b1 = torch.randn(8 * 6 * 6, 16), torch.randn(16)

    def fn(x, y):
        h = torch.nn.functional.max_pool2d(conv(x), 2)
        return torch.addmm(b1, h.flatten(1), w1).sin(), torch.bmm(y, y.transpose(1, 2))
    with torch.no_grad():
        x, y = torch.randn(4, 3, 12, 12), torch.randn(2, 5, 7)
        f, graphs = _compiled_graphs(fn, x, y)
        x, y = torch.randn(4, 3, 12, 12), torch.randn(2, 5, 7)
        for got, want in zip(f(x, y), fn(x, y)):
            torch.testing.assert_close(got, want)
    called = set(map(id, graphs[0].call.namespace.values()))
    assert {id(torch._C._VariableFunctions.bmm)} <= called
    assert not called & {id(op) for op in BOUND_OPS}, graphs[0].call.source


def test_gelu_tanh_recomputed_in_the_gradient_kernel_after_the_matmul():
    """GPT-2's MLP backward: the GELU's tanh, recomputed from the saved input, is computed inside the kernel that
    reads it after the projection's matmul, not in a kernel of its own before it (written out, read back)."""
    torch.manual_seed(0)
    fc, proj = torch.nn.Linear(32, 128), torch.nn.Linear(128, 32)

    def gelu_new(x):
        return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * (x + 0.044715 * torch.pow(x, 3.0))))

    def fn(x):
        return proj(gelu_new(fc(torch.relu(x) * 2))).square().sum()
    x = torch.randn(64, 32)
    _, graphs = _compiled_graphs(fn, x, run=lambda f, x: f(x).backward())
    grads = [p.grad.clone() for p in (*fc.parameters(), *proj.parameters())]
    for p in (*fc.parameters(), *proj.parameters()):
        p.grad = None
    fn(x).backward()
    for g, p in zip(grads, (*fc.parameters(), *proj.parameters())):
        torch.testing.assert_close(g, p.grad)
    kernels = [ln for g in graphs for ln in g.source.splitlines() if ln.startswith("// fused fx nodes:")]
    gradient = [k for k in kernels if "tanh_backward_default" in k]
    assert len(gradient) == 1 and "tanh_default," in gradient[0], kernels


def test_graph_compiled_for_an_expanded_input_runs_a_dense_one_eagerly():
    """An input traced as an expanded view (stride 0) and then given as a dense tensor of the same shape: the
    compiled code assumed repeated values, and the tensor cannot be copied into the expanded layout, so that call
    runs the graph as it is (it was a RuntimeError from copy_)."""
    from tests.codegen.aten_trace import trace_aten

    def f(x):
        return (x * 2).sum(1)
    x = torch.randn(1, 16).expand(8, 16)
    gm, _ = trace_aten(f, [x])
    compiled = cpp_backend.compile_aten(gm, [x])
    x = torch.randn(1, 16).expand(8, 16)
    torch.testing.assert_close(compiled(x)[0], f(x))
    y = torch.randn(8, 16)
    torch.testing.assert_close(compiled(y)[0], f(y))
