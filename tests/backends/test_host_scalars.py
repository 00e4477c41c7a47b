"""CPU tensors in a CUDA graph (ember.backends.host_scalars): values made from no input folded once at compile
(the device reading a copy), CPU values that are not 0-d computed on the host and sent as tensors. On the CPU the
meta device stands in for CUDA (the split's plumbing); on CUDA, models that build positions, indices and masks on
the host compile (no graph runs eagerly) and equal eager."""
import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

from ember.backends import host_scalars

aten = torch.ops.aten
CUDA = torch.cuda.is_available()


def meta_packs(monkeypatch) -> None:
    """host_scalars' packs of CPU values sent to the meta device (standing in for CUDA), by a plain gather in
    place of the pinned-buffer transfer."""
    class Pack:
        def __init__(self, dtype, positions, device):
            self.positions = positions

        def send(self, host_args):
            return torch.stack([host_args[i] for i in self.positions]).to("meta")
    monkeypatch.setattr(host_scalars, "_Pack", Pack)


def _with_values(gm: fx.GraphModule, inputs: list) -> fx.GraphModule:
    """gm with each node's meta['val'] set by running it on `inputs` (meta tensors standing in for CUDA ones)."""
    env = {}
    it = iter(inputs)
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            env[n] = next(it)
        elif n.op == "get_attr":
            env[n] = getattr(gm, n.target)
        elif n.op == "call_function":
            args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: env[a])
            env[n] = n.target(*args, **kwargs)
        if n in env:
            n.meta["val"] = env[n]
    return gm


def _graph(f, inputs: list) -> fx.GraphModule:
    g = fx.Graph()
    names = f.__code__.co_varnames[:f.__code__.co_argcount - 1]   # (the last is the graph)
    out = f(*[g.placeholder(name) for name in names], g)
    g.output(out)
    return _with_values(fx.GraphModule(torch.nn.Module(), g), inputs)


def _relative_index(g: fx.Graph):
    """arange(8) on the CPU, pairwise differences + 7: an index built from no input (BEiT's, MPNet's)."""
    i = g.call_function(aten.arange.default, (8,))
    rel = g.call_function(aten.sub.Tensor, (g.call_function(aten.unsqueeze.default, (i, 0)),
                                            g.call_function(aten.unsqueeze.default, (i, 1))))
    return g.call_function(aten.add.Tensor, (rel, 7))


def test_cpu_values_made_from_no_input_are_folded_and_the_device_reads_its_copy():
    """The index is computed once, by the ATen ops eager runs; the device's index op reads a device constant and
    the CPU output (index * 3) keeps a CPU one: no CPU op is left in the graph, and the CPU output's values are
    eager's."""
    def f(table, g):
        idx = _relative_index(g)
        return (g.call_function(aten.index.Tensor, (table, [idx])), g.call_function(aten.mul.Tensor, (idx, 3)))
    table = torch.randn(15, 4, device="meta")
    gm = _graph(f, [table])
    assert host_scalars.fold_constants(gm) == 6
    cpu_ops = [n for n in gm.graph.nodes if n.op == "call_function" and host_scalars._device_type(n) == "cpu"]
    assert not cpu_ops, cpu_ops
    consts = {n.target: getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"}
    assert sorted(t.device.type for t in consts.values()) == ["cpu", "meta"]
    out = gm(table)
    i = torch.arange(8)
    torch.testing.assert_close(out[1], (i[None, :] - i[:, None] + 7) * 3)
    assert out[0].shape == (8, 8, 4) and out[0].device.type == "meta"


def test_random_cpu_values_are_not_folded():
    """A CPU value drawn at random is drawn anew each call: never folded."""
    def f(x, g):
        r = g.call_function(aten.rand.default, ([4],))
        return (g.call_function(aten.add.Tensor, (x, g.call_function(aten._to_copy.default, (r,),
                                                                      {"device": torch.device("meta")}))),)
    gm = _graph(f, [torch.randn(4, device="meta")])
    assert host_scalars.fold_constants(gm) == 0
    assert any(n.target is aten.rand.default for n in gm.graph.nodes)


def test_a_cpu_tensor_input_is_computed_on_the_host_and_sent_as_a_tensor():
    """positions (a CPU input, not 0-d) * 2 + 1, copied to the device and added there: the host graph computes
    it (never the device), the device graph takes it as an input of its own; every call sends the new values."""
    def f(x, pos, g):
        p = g.call_function(aten.add.Tensor, (g.call_function(aten.mul.Tensor, (pos, 2)), 1))
        moved = g.call_function(aten._to_copy.default, (p,), {"device": torch.device("meta")})
        return (g.call_function(aten.add.Tensor, (x, moved)), p)
    x = torch.randn(8, device="meta")
    gm = _graph(f, [x, torch.arange(8.0)])
    host_gm, dev_gm, plan = host_scalars.split(gm)
    assert [n.target for n in dev_gm.graph.nodes if n.op == "call_function"] == [aten._to_copy.default,
                                                                                  aten.add.Tensor]
    assert [(where, dt, size) for where, _, dt, size, _ in plan["tensors_sent"]] == [("host", torch.float32, (8,))]
    made = []

    def compile_host(h, ex):
        def run(*args):
            made.append(h(*args))
            return made[-1]
        return run
    run = host_scalars.compile_split(gm, [x, torch.arange(8.0)], compile_host, lambda d, ex: d.forward)
    for _ in range(2):
        pos = torch.randn(8)
        out = run(x, pos)
        torch.testing.assert_close(out[1], pos * 2 + 1)
        torch.testing.assert_close(made[-1][-1], pos * 2 + 1)   # the value sent
        assert out[0].device.type == "meta" and out[0].shape == (8,)


# ------------------------------------------------------------------------------------------------ on CUDA

class HostIndexedBias(torch.nn.Module):
    """A relative-position bias whose index is built on the host inside forward (torch.arange with no device,
    as BEiT's generate_relative_position_index), indexing a CUDA table."""

    def __init__(self):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(15, 4))
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        i = torch.arange(8)
        index = (i[None, :] - i[:, None] + 7).view(-1)
        bias = self.table[index].view(8, 8, 4).permute(2, 0, 1)
        return self.proj(torch.softmax(x @ x.transpose(-1, -2) + bias, -1) @ x)


class HostBuckets(torch.nn.Module):
    """MPNet's relative-position buckets as older transformers build them: on the CPU, with a float log, then
    moved to the input's device and looked up."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(32, 4)

    def forward(self, x):
        n = x.shape[-2]
        rel = torch.arange(n)[None, :] - torch.arange(n)[:, None]
        small = rel.abs() < 8
        large = 8 + (torch.log(rel.abs().float() / 8) / torch.log(torch.tensor(16.0)) * 8).to(torch.long)
        buckets = torch.where(small, rel.abs(), large.clamp(max=15)) + (rel > 0).long() * 16
        return x + self.emb(buckets.to(x.device)).sum(-1)


def _check_compiles_and_matches(model: torch.nn.Module, make_inputs, train: bool):
    import ember
    from ember.backends import triton_backend
    torch.manual_seed(0)
    model = model.cuda().train(train)
    compiled = ember.compile(model)
    before = dict(triton_backend.STATS)
    for _ in range(2):
        inputs = make_inputs()
        with torch.set_grad_enabled(train):
            got, want = compiled(*inputs), model(*inputs)
        torch.testing.assert_close(got, want)
        if train:
            got.sum().backward()
            grads = [p.grad.clone() for p in model.parameters()]
            model.zero_grad()
            want.sum().backward()
            for g, p in zip(grads, model.parameters()):
                torch.testing.assert_close(g, p.grad)
            model.zero_grad()
    made = {k: triton_backend.STATS[k] - before[k] for k in ("graphs", "eager_graphs")}
    assert made["eager_graphs"] == 0 and made["graphs"] >= 1, made


@pytest.mark.skipif(not CUDA, reason="a graph mixing CPU and CUDA tensors needs a GPU")
@pytest.mark.parametrize("train", [False, True])
def test_index_built_on_the_host_indexing_a_cuda_table_compiles_and_matches_eager(train):
    _check_compiles_and_matches(HostIndexedBias(), lambda: [torch.randn(2, 4, 8, 8, device="cuda")], train)


@pytest.mark.skipif(not CUDA, reason="a graph mixing CPU and CUDA tensors needs a GPU")
@pytest.mark.parametrize("train", [False, True])
def test_buckets_computed_on_the_host_with_a_float_log_compile_and_match_eager(train):
    _check_compiles_and_matches(HostBuckets(), lambda: [torch.randn(2, 12, 12, device="cuda")], train)


@pytest.mark.skipif(not CUDA, reason="a graph mixing CPU and CUDA tensors needs a GPU")
def test_cpu_tensor_input_and_cpu_scalar_constant_in_a_cuda_graph_compile_and_match_eager():
    """Positions passed on the CPU and moved inside the function, a CPU 0-d counter, and a CPU 0-d constant
    written by a masked fill (longformer's): fresh values each call."""
    import ember
    from ember.backends import triton_backend

    def f(x, pos, step):
        y = x + pos.to(x.device).float() * step
        return y.masked_fill(y > 1, torch.tensor(-1.0)), (pos * 2).sum()
    compiled = ember.compile(f)
    before = triton_backend.STATS["eager_graphs"]
    for k in range(3):
        x, pos, step = torch.randn(4, 6, device="cuda"), torch.randint(0, 5, (6,)), torch.tensor(float(k + 1))
        got, want = compiled(x, pos, step), f(x, pos, step)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)
    assert triton_backend.STATS["eager_graphs"] == before


def test_a_generated_kernel_that_would_read_a_cpu_tensor_is_refused():
    """The Triton backend's last check: a graph whose kernel would read a CPU input (a value passed through to
    library calls, read by a generated kernel after all) raises CannotLower, and the graph runs eagerly; the
    same kernels without the CPU input pass."""
    pytest.importorskip("triton", reason="the Triton backend needs the triton package")
    from ember.backends.triton_backend import _no_kernel_reads_cpu
    from ember.codegen import lower
    from ember.errors import CannotLower
    from tests.codegen.aten_trace import trace_aten
    x, idx = torch.randn(4, 8, device="meta"), torch.randint(0, 4, (3,))
    examples = [x, idx]
    gm, _ = trace_aten(lambda x, i: (x.sin(), i * 2), [x, torch.empty(3, dtype=torch.long, device="meta")])
    low, _, _ = lower.lower(gm, examples, target="gpu")
    with pytest.raises(CannotLower, match="CPU tensor arg1"):
        _no_kernel_reads_cpu(low, examples)
    gm, _ = trace_aten(lambda x: (x.sin(),), [x])
    low, _, _ = lower.lower(gm, [x], target="gpu")
    _no_kernel_reads_cpu(low, [x])


def test_foreach_ops_on_cpu_step_counters_are_unrolled_and_the_graph_splits(monkeypatch):
    """A whole training step's graph advances every optimizer step counter with one `_foreach_add(steps, 1)` on
    the CPU: unrolled into one `add` per counter, the graph splits (no eager fallback) and the new counters and the
    device update match eager. A foreach op whose per-tensor overload takes other arguments stays as it is."""
    meta_packs(monkeypatch)

    def f(w0, w1, s0, s1):
        n0, n1 = aten._foreach_add.Scalar([s0, s1], 1)
        return aten.mul.Tensor(w0, n0), aten.mul.Tensor(w1, n1), n0, n1
    w0, w1 = torch.randn(3, device="meta"), torch.randn(5, device="meta")
    s0, s1 = torch.rand(()) + 1, torch.rand(()) + 3
    gm = _with_values(fx.symbolic_trace(f), [w0, w1, s0, s1])
    assert isinstance(host_scalars.split(_with_values(fx.symbolic_trace(f), [w0, w1, s0, s1])), tuple)
    run = host_scalars.compile_split(gm, [w0, w1, s0, s1], lambda h, ex: h.forward, lambda d, ex: d.forward)
    assert not any(n.target is aten._foreach_add.Scalar for n in gm.graph.nodes)
    out = run(w0, w1, s0, s1)
    torch.testing.assert_close(out[2], s0 + 1)
    torch.testing.assert_close(out[3], s1 + 1)
    assert out[1].device.type == "meta" and out[1].shape == (5,)

    def g(w0, s0, s1):
        p0, p1 = aten._foreach_pow.Scalar([s0, s1], 2.0)
        return aten.mul.Tensor(w0, p0), p1
    gm = _with_values(fx.symbolic_trace(g), [w0, s0, s1])
    assert host_scalars.unroll_cpu_foreach(gm) == 0


@pytest.mark.skipif(not CUDA, reason="a CUDA training step with CPU step counters needs a GPU")
def test_whole_training_step_with_adamw_compiles_on_cuda_without_eager_graphs():
    """zero_grad, forward, loss, backward and AdamW(foreach) in one compiled function: its CPU step counters
    travel with the CUDA update, no graph runs eagerly, and parameters and counters match eager's for 3 steps."""
    import copy

    import ember
    from ember.backends import triton_backend
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)).cuda()
    x, y = torch.randn(16, 32, device="cuda"), torch.randint(0, 10, (16,), device="cuda")
    models, opts = [copy.deepcopy(base) for _ in range(2)], []
    for m in models:
        opts.append(torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True))

    def stepper(m, opt):
        def step():
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            opt.step()
            return loss.detach()
        return step
    eager, compiled = stepper(models[0], opts[0]), ember.compile(stepper(models[1], opts[1]))
    before = triton_backend.STATS["eager_graphs"]
    for _ in range(3):
        torch.testing.assert_close(compiled(), eager())
    assert triton_backend.STATS["eager_graphs"] == before
    for a, b in zip(models[1].parameters(), models[0].parameters()):
        torch.testing.assert_close(a, b)
        torch.testing.assert_close(opts[1].state[a]["step"], opts[0].state[b]["step"])
