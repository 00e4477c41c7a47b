"""mode="reduce-overhead" runtime: CUDA graph replay against eager, on fresh random inputs each step."""
import pytest
import torch
import torch.nn.functional as F

from ember.runtime.cudagraphs import CUDAGraphed, graphed_autograd_function

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="CUDA graphs need an NVIDIA GPU; none is visible to torch here")


def mlp(x, w1, b1, w2):
    return (torch.relu(x @ w1.t() + b1) @ w2.t()).tanh(), x.sum(0)


def params(d=64, h=128):
    g = torch.Generator(device="cuda").manual_seed(0)
    return [torch.randn(h, d, device="cuda", generator=g) / 8, torch.randn(h, device="cuda", generator=g),
            torch.randn(d, h, device="cuda", generator=g) / 8]


def test_replay_matches_eager_and_kept_outputs_stay_valid():
    ps = params()
    f = CUDAGraphed(mlp, static_input_indices=[1, 2, 3])
    kept = []
    for _ in range(4):
        x = torch.randn(32, 64, device="cuda")
        kept.append((f(x, *ps), mlp(x, *ps)))
    for got, want in kept:        # outputs of earlier steps were not overwritten by later replays
        torch.testing.assert_close(got, want)
    assert len(f.recordings) == 1


def test_new_shapes_and_replaced_parameters_record_again():
    ps = params()
    f = CUDAGraphed(mlp, static_input_indices=[1, 2, 3])
    for n in (8, 16, 8):
        x = torch.randn(n, 64, device="cuda")
        torch.testing.assert_close(f(x, *ps), mlp(x, *ps))
    assert len(f.recordings) == 2
    ps[0] = torch.randn_like(ps[0])           # a new parameter tensor: the old recording must not read it
    x = torch.randn(8, 64, device="cuda")
    torch.testing.assert_close(f(x, *ps), mlp(x, *ps))
    assert len(f.recordings) == 3
    with torch.no_grad():
        ps[1].mul_(2)                         # in-place update (an optimizer step) is seen by the replay
    torch.testing.assert_close(f(x, *ps), mlp(x, *ps))
    assert len(f.recordings) == 3


def test_input_already_in_static_buffer_is_not_copied(monkeypatch):
    ps = params()
    f = CUDAGraphed(mlp, static_input_indices=[1, 2, 3])
    x = torch.randn(8, 64, device="cuda")
    f(x, *ps)
    rec = f._last
    buf = rec.buffers[0]
    buf.copy_(torch.randn_like(buf))
    copies = []
    real_copy = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, src, *a, **k: copies.append(1) or real_copy(self, src, *a, **k))
    torch.testing.assert_close(f(buf, *ps), mlp(buf, *ps))
    assert copies == []
    y = torch.randn(8, 64, device="cuda")
    torch.testing.assert_close(f(y, *ps), mlp(y, *ps))
    assert copies == [1]


def test_clone_outputs_false_follows_torch_compile_rule():
    ps = params()
    f = CUDAGraphed(mlp, static_input_indices=[1, 2, 3], clone_outputs=False)
    x1, x2 = torch.randn(8, 64, device="cuda"), torch.randn(8, 64, device="cuda")
    out1 = f(x1, *ps)[0]
    want1 = mlp(x1, *ps)[0]
    torch.testing.assert_close(out1, want1)
    f(x2, *ps)                                # documented: out1 is the graph's memory, now overwritten
    torch.testing.assert_close(out1, mlp(x2, *ps)[0])


def mlp_forward(x, w1, b1, w2):
    pre = x @ w1.t() + b1
    h = torch.relu(pre)
    y = (h @ w2.t()).tanh()
    return y, x, w1, w2, pre, h, y                      # user output, then saved


def mlp_backward(x, w1, w2, pre, h, y, gy):
    gz = gy * (1 - y * y)
    gw2 = gz.t() @ h
    gh = gz @ w2
    gpre = gh * (pre > 0)
    return gpre @ w1, gpre.t() @ x, gpre.sum(0), gw2


def test_forward_backward_training_matches_eager_with_adam():
    ref = params()
    ps = [p.clone().requires_grad_() for p in ref]
    ref = [p.requires_grad_() for p in ref]
    f = graphed_autograd_function(mlp_forward, mlp_backward, num_user_outputs=1, static_input_indices=[1, 2, 3],
                                  inference=lambda *a: mlp_forward(*a)[:1])
    opt, ref_opt = torch.optim.Adam(ps, lr=1e-2), torch.optim.Adam(ref, lr=1e-2)
    for step in range(4):
        x = torch.randn(32, 64, device="cuda", requires_grad=True)
        xr = x.detach().clone().requires_grad_()
        target = torch.randn(32, 64, device="cuda")
        (y,) = f(x, *ps)
        F.mse_loss(y, target).backward()
        F.mse_loss(mlp(xr, *ref)[0], target).backward()
        # cuBLAS may pick another algorithm inside a capture (split-K sums in another order): 1 in 1,000
        # gradient elements differed by 1.4e-5 on the H100 once, above float32's default atol of 1e-5
        torch.testing.assert_close(x.grad, xr.grad, atol=1e-4, rtol=1e-4)
        for p, r in zip(ps, ref):
            torch.testing.assert_close(p.grad, r.grad, atol=1e-4, rtol=1e-4)
        opt.step(); ref_opt.step(); opt.zero_grad(); ref_opt.zero_grad()
    with torch.no_grad():
        x = torch.randn(32, 64, device="cuda")
        # four Adam steps scale each gradient by its running RMS: the capture's 1e-6 differences above, on
        # gradients near zero, move parameters by up to a few 1e-4 (at 1e-5 it failed in 1 of 4 H100 runs on 2026-11-23)
        torch.testing.assert_close(f(x, *ps)[0], mlp(x, *ref)[0], atol=1e-3, rtol=1e-3)


def test_two_forwards_before_backwards_evacuate_saved_tensors():
    ps = [p.requires_grad_() for p in params()]
    f = graphed_autograd_function(mlp_forward, mlp_backward, num_user_outputs=1, static_input_indices=[1, 2, 3])
    xs = [torch.randn(16, 64, device="cuda", requires_grad=True) for _ in range(3)]
    ys = [f(x, *ps)[0] for x in xs]           # three forwards pending: each replay overwrote the last one's memory
    grads = [torch.randn_like(y) for y in ys]
    for y, g in reversed(list(zip(ys, grads))):
        y.backward(g)
    want_x = []
    ref = [p.detach().clone().requires_grad_() for p in ps]
    for x, g in zip(xs, grads):
        xr = x.detach().clone().requires_grad_()
        mlp(xr, *ref)[0].backward(g)
        want_x.append(xr.grad)
    for x, w in zip(xs, want_x):
        torch.testing.assert_close(x.grad, w)
    for p, r in zip(ps, ref):
        torch.testing.assert_close(p.grad, r.grad)


def test_cpu_input_error_names_the_input():
    f = CUDAGraphed(lambda x: (x * 2,), static_input_indices=())
    with pytest.raises(TypeError, match="input 0"):
        f(torch.randn(3))


def test_auto_static_inputs_buffers_and_moved_inputs():
    ps = params()
    buf = torch.randn(128, device="cuda")             # a module buffer: same address every call
    f = CUDAGraphed(lambda x, b, *p: (mlp(x, *p)[0] + b[:64],))
    x = torch.randn(8, 64, device="cuda")
    for _ in range(3):
        torch.testing.assert_close(f(x, buf, *ps)[0], mlp(x, *ps)[0] + buf[:64])
    assert {0, 1} <= f.static                        # x and buf stayed put: read in place
    x2 = torch.randn(8, 64, device="cuda")           # x moves: copied from now on, never wrong
    torch.testing.assert_close(f(x2, buf, *ps)[0], mlp(x2, *ps)[0] + buf[:64])
    assert 0 not in f.static
    buf.mul_(3)                                      # in-place change of a static input is seen
    torch.testing.assert_close(f(x, buf, *ps)[0], mlp(x, *ps)[0] + buf[:64])


def test_aot_module_training_with_cuda_graphs_matches_eager():
    from ember.autograd import aot_module
    from ember.runtime.cudagraphs import aot_compilers
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64)).cuda()
    ref = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64)).cuda()
    ref.load_state_dict(model.state_dict())
    gm = torch.fx.symbolic_trace(model)
    for _ in range(2):          # the second time, graphs are recorded in a new pool with parameters trained
        fw_c, bw_c = aot_compilers(lambda g, ex: g.forward)
        compiled = aot_module(gm, [torch.randn(8, 64, device="cuda")], fw_c, bw_c)
        art = next(iter(compiled.artifacts.values()))
        # aot_module records how many outputs are the user's: saved tensors go to the backward uncloned
        assert art.forward.num_user_outputs == art.part.num_forward_outputs == 1
        opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
        kept = []
        for step in range(4):
            x = torch.randn(8, 64, device="cuda")
            out = compiled(x)
            out = out[0] if isinstance(out, (tuple, list)) else out
            want = ref(x)
            kept.append((out, want.detach()))
            out.square().mean().backward()
            want.square().mean().backward()
            for p, r in zip(model.parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad, r.grad)
            opt.step(); ref_opt.step(); opt.zero_grad(); ref_opt.zero_grad()
        # two forwards before their backwards: the second must not overwrite the first's saved tensors
        xs = [torch.randn(8, 64, device="cuda") for _ in range(2)]
        outs = [compiled(x) for x in xs]
        outs = [o[0] if isinstance(o, (tuple, list)) else o for o in outs]
        for o in reversed(outs):
            o.sum().backward()
        for x in xs:
            ref(x).sum().backward()
        for p, r in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, r.grad)
        opt.zero_grad(); ref_opt.zero_grad()
        for got, want in kept:
            torch.testing.assert_close(got, want)


def test_batch_norm_running_stats_are_copied_back_uncloned_and_match_eager():
    """A training forward's input mutations (batch norm's running statistics, its step counter) are copied into
    the buffers inside the CUDA graph (static inputs), not after it; gradients are cloned in one batch. Values,
    running statistics and gradients as eager over several steps."""
    from ember.autograd import aot_module
    from ember.runtime.cudagraphs import aot_compilers
    torch.manual_seed(0)

    def net():
        return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                   torch.nn.Conv2d(8, 4, 3), torch.nn.BatchNorm2d(4)).cuda()
    model, ref = net(), net()
    ref.load_state_dict(model.state_dict())
    fw_c, bw_c = aot_compilers(lambda g, ex: g.forward)
    compiled = aot_module(torch.fx.symbolic_trace(model), [torch.randn(4, 3, 12, 12, device="cuda")], fw_c, bw_c)
    art = next(iter(compiled.artifacts.values()))
    assert len(art.forward.copied_back) == 6           # two running means, two variances, two counters
    for _ in range(4):
        x = torch.randn(4, 3, 12, 12, device="cuda")
        out = compiled(x)
        out = out[0] if isinstance(out, (tuple, list)) else out
        want = ref(x)
        torch.testing.assert_close(out, want)
        out.square().mean().backward()
        want.square().mean().backward()
        for (name, p), r in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, r.grad, msg=name)
        for (name, b), r in zip(model.named_buffers(), ref.buffers()):
            torch.testing.assert_close(b, r, msg=name)
        model.zero_grad(set_to_none=False)   # gradients kept from one step to the next: they must be ours
        ref.zero_grad(set_to_none=False)
    assert art.forward.replays >= 2
    # the buffers are static inputs (same address on every call): the copies into them are in the graph, and
    # those outputs come back as the buffers themselves
    rec = art.forward._last
    assert {o for o, _ in rec.passed_through} == set(art.forward.copied_back)


def test_train_step_with_default_adam_under_reduce_overhead():
    """torch.optim's default Adam keeps its step counters on the CPU. The backward is in the step's graph
    (ember.autograd.backward), whose device part replays as one CUDA graph while the C++ backend advances the
    counters around it (host_scalars); every value as eager, the counters still on the CPU."""
    import ember
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64)).cuda()
    ref = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64)).cuda()
    ref.load_state_dict(model.state_dict())
    opt, ref_opt = torch.optim.Adam(model.parameters(), lr=1e-2), torch.optim.Adam(ref.parameters(), lr=1e-2)

    def train_step(m, o, x, t):
        o.zero_grad(set_to_none=True)
        loss = F.mse_loss(m(x), t)
        loss.backward()
        o.step()
        return loss

    ember.reset()
    step = ember.compile(train_step, mode="reduce-overhead")
    for _ in range(4):
        x, t = torch.randn(32, 64, device="cuda"), torch.randn(32, 64, device="cuda")
        torch.testing.assert_close(step(model, opt, x, t), train_step(ref, ref_opt, x, t))
    for p, r in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, r)
        torch.testing.assert_close(opt.state[p]["exp_avg_sq"], ref_opt.state[r]["exp_avg_sq"])
        assert opt.state[p]["step"].device.type == "cpu" and opt.state[p]["step"] == ref_opt.state[r]["step"]


def test_int_inputs_record_one_graph_per_size_least_recently_used_dropped(monkeypatch, caplog):
    """A symbolic graph's sizes come as ints: one recording per distinct size, at most MAX_RECORDINGS kept (the
    least recently used dropped, logged once); a dropped size records again when it returns."""
    from ember.runtime import cudagraphs
    monkeypatch.setattr(cudagraphs, "MAX_RECORDINGS", 2)

    def fn(n, x, w):
        return (x.view(n, -1) @ w).relu(), x.sum(0)
    w = torch.randn(16, 8, device="cuda")
    f = CUDAGraphed(fn, static_input_indices=[2])
    with caplog.at_level("WARNING", logger="ember.graph"):
        for n in (8, 16, 8, 24, 8, 16, 24):
            x = torch.randn(n, 16, device="cuda")
            for got, want in zip(f(n, x, w), fn(n, x, w)):
                torch.testing.assert_close(got, want)
            assert len(f.recordings) <= 2
    assert f.evicted == 3 and f.replays == 7
    assert sum("reached 2 recordings" in r.getMessage() for r in caplog.records) == 1


def test_reduce_overhead_with_a_symbolic_graph_matches_eager(monkeypatch):
    """mode="reduce-overhead" with dynamic=True: the symbolic forward and backward are compiled once and
    recorded once per distinct size, in one pool; results and gradients as eager's."""
    import ember
    from ember.backends import triton_backend
    from ember.runtime import cudagraphs
    recorded = []
    real = cudagraphs.CUDAGraphed._record
    monkeypatch.setattr(cudagraphs.CUDAGraphed, "_record", lambda self, inputs: recorded.append(
        [tuple(t.shape) if isinstance(t, torch.Tensor) else t for t in inputs]) or real(self, inputs))
    before = dict(triton_backend.STATS)
    ps = [p.requires_grad_() for p in params()]
    compiled = ember.compile(mlp, mode="reduce-overhead", dynamic=True)
    sizes = (8, 24, 8, 40, 24, 8)
    for n in sizes:
        x = torch.randn(n, 64, device="cuda")
        got = compiled(x, *ps)
        want = mlp(x, *ps)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w)
        gg = torch.autograd.grad(sum(o.square().sum() for o in got), ps)
        gw = torch.autograd.grad(sum(o.square().sum() for o in want), ps)
        for g, w in zip(gg, gw):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    assert triton_backend.STATS["graphs"] - before["graphs"] == 2   # one symbolic forward, one backward
    assert triton_backend.STATS["eager_graphs"] == before["eager_graphs"]
    assert 0 < len(recorded) <= 2 * len(set(sizes))   # (a first call per graph runs eagerly, unrecorded)
