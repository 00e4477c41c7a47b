"""What a CPU kernel recomputes and what is stored once: a costly per-channel value read broadcast over the pixels of
a channels-last graph is stored first (ember.decomp.prims._stored_if_costly: a squeeze-excite gate's sigmoid, a
folded batch norm's shift), and a value of one exp (a silu) read by two nodes is stored once on the CPU
(lower.SHARED_STORE_COST). Results equal eager's on fresh inputs."""
import torch
import torch.nn.functional as F

from ember import config
from ember.backends.ember_backend import compile_graph
from ember.codegen import lower
from ember.ir import Pointwise


class SqueezeExcite(torch.nn.Module):
    """efficientnet's block: depthwise conv + bn + silu; its mean through two 1x1 convolutions to a sigmoid gate
    per (image, channel); the silu times the gate; a 1x1 projection."""

    def __init__(self, c=16):
        super().__init__()
        self.dw, self.bn = torch.nn.Conv2d(c, c, 3, 1, 1, groups=c, bias=False), torch.nn.BatchNorm2d(c)
        self.a, self.b = torch.nn.Conv2d(c, 4, 1), torch.nn.Conv2d(4, c, 1)
        self.p = torch.nn.Conv2d(c, 8, 1, bias=False)

    def forward(self, x):
        y = F.silu(self.bn(self.dw(x)))
        g = torch.sigmoid(self.b(F.silu(self.a(y.mean((2, 3), keepdim=True)))))
        return self.p(y * g)


def _compiled(m, x):
    m = m.eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, torch.nn.BatchNorm2d):
                mod.running_mean.uniform_(-0.5, 0.5)
                mod.running_var.uniform_(0.5, 2.0)
        run = compile_graph(torch.fx.symbolic_trace(m), [x])
        for inp in (x, torch.randn_like(x)):
            torch.testing.assert_close(run(inp), m(inp), rtol=2e-5, atol=2e-5)
    art = next(a for a in run.artifacts.values() if a is not None)
    compiled = art.forward.compiled
    bufs = [mb.buf for it in compiled.sched.items if hasattr(it, "members") for mb in it.members]
    return compiled, bufs


def _ops(buf) -> list:
    """The compute ops of a buffer's value at one element (a reduction's: of the value it reduces)."""
    import sympy
    idx = [sympy.Symbol(f"i{d}", integer=True, nonnegative=True) for d in range(len(buf.size))]
    if isinstance(buf, Pointwise):
        return [e.op for e in buf.fn(idx).walk()]
    ridx = [sympy.Symbol(f"r{d}", integer=True, nonnegative=True) for d in range(len(buf.rsize))]
    return [e.op for e in buf.fn(idx, ridx).walk()]


def _per_element(bufs, numel: int, op: str) -> int:
    """How many `op`s the kernels compute per element of a value of numel elements (over the buffers computed
    at each of its elements: pointwise ones of its size, reductions over it)."""
    def n(b):
        return int(torch.Size([int(d) for d in (*b.size, *getattr(b, "rsize", ()))]).numel())
    return sum(_ops(b).count(op) for b in bufs if n(b) == numel)


def test_gate_and_folded_shift_are_stored_once_per_channel():
    x = torch.randn(2, 16, 12, 10)
    _, bufs = _compiled(SqueezeExcite(), x)
    gate = [b for b in bufs if tuple(int(n) for n in b.size) == (2, 16, 1, 1) and "sigmoid" in _ops(b)]
    assert gate, [(b.name, b.size, _ops(b)) for b in bufs]
    # no full-size kernel computes a sigmoid of the gate or a square root of the batch norm's statistics
    full = [b for b in bufs if tuple(int(n) for n in b.size) == tuple(x.shape)]
    assert full and not [b.name for b in full if {"sqrt", "rsqrt"} & set(_ops(b)) or _ops(b).count("sigmoid") > 1]


def test_switch_off_recomputes_the_gate(monkeypatch):
    monkeypatch.setattr(config, "STORE_BROADCASTS", False)
    x = torch.randn(2, 16, 12, 10)
    _, bufs = _compiled(SqueezeExcite(), x)
    assert not [b for b in bufs if tuple(int(n) for n in b.size) == (2, 16, 1, 1) and "sigmoid" in _ops(b)]


def test_silu_read_twice_is_computed_once_on_the_cpu(monkeypatch):
    x = torch.randn(2, 16, 12, 10)
    _, bufs = _compiled(SqueezeExcite(), x)
    assert _per_element(bufs, x.numel(), "sigmoid") == 1   # the silu, stored; the gate's is per channel
    monkeypatch.setitem(lower.SHARED_STORE_COST, "cpu", 3)
    _, bufs = _compiled(SqueezeExcite(), x)
    assert _per_element(bufs, x.numel(), "sigmoid") == 2   # the silu again in its mean and in its product


def test_layer_norm_row_scale_is_not_stored_outside_channels_last_graphs():
    ln = torch.nn.LayerNorm(64)
    x = torch.randn(32, 64)
    with torch.no_grad():
        run = compile_graph(torch.fx.symbolic_trace(torch.nn.Sequential(ln, torch.nn.GELU())), [x])
        torch.testing.assert_close(run(x), torch.nn.functional.gelu(ln(x)), rtol=1e-5, atol=1e-5)
    art = next(a for a in run.artifacts.values() if a is not None)
    assert len(art.forward.compiled.kernels) == 1
