"""CPU float32 products as oneDNN inner products (ember.codegen.onednn.cpu_matmul) and linear layers with their
activation as a oneDNN post-op (plan_linear_fusions). Compared with eager on fresh random inputs, also after the
weights change between calls (nothing is cached across calls)."""
import pytest
import torch
import torch.nn.functional as F

from ember import config
from ember.codegen import onednn
from ember.ir import ExternBuffer
from tests.codegen.recording import compiled_graphs

pytestmark = pytest.mark.skipif(onednn._LINEAR is None, reason="this torch has no oneDNN linear (mkldnn._linear_pointwise)")
LINEAR = "mkldnn._linear_pointwise.default"


@pytest.fixture(autouse=True)
def _onednn_products(monkeypatch):
    """These tests are of the oneDNN path, which an Intel CPU's default (MKL's mm) does not take."""
    monkeypatch.setattr(config, "ONEDNN_MATMULS", True)


@pytest.mark.parametrize("intel,mkl,want", [(True, True, "aten.mm.default"), (False, True, LINEAR),
                                            (True, False, LINEAR)])
def test_auto_products_are_mkl_on_an_intel_cpu_and_onednn_elsewhere(monkeypatch, intel, mkl, want):
    monkeypatch.setattr(config, "ONEDNN_MATMULS", "auto")
    monkeypatch.setattr(onednn, "_intel_cpu", lambda: intel)
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: mkl)
    torch.manual_seed(0)
    m = MLP().eval()
    x = torch.randn(200, 96)
    with torch.no_grad():
        f, targets, _ = _externs(m, x)
        assert targets == [want, want], targets
        torch.testing.assert_close(f(x), m(x))


def test_auto_products_of_a_symbolic_graph_are_onednn_on_an_intel_cpu(monkeypatch):
    """Under dynamic=True the products stay oneDNN's with their bias fused, on an Intel CPU too, and equal eager
    at every size."""
    import ember
    monkeypatch.setattr(config, "ONEDNN_MATMULS", "auto")
    monkeypatch.setattr(onednn, "_intel_cpu", lambda: True)
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: True)
    assert not onednn.onednn_products() and onednn.onednn_products(symbolic=True)
    torch.manual_seed(0)
    m = MLP().eval()
    seen = []
    real = onednn.onednn_products

    def spy(symbolic=False):
        seen.append(symbolic)
        return real(symbolic)
    monkeypatch.setattr(onednn, "onednn_products", spy)
    f = ember.compile(m, dynamic=True)
    with torch.no_grad():
        for n in (200, 333, 517):
            x = torch.randn(n, 96)
            torch.testing.assert_close(f(x), m(x))
    assert seen and all(seen)


def test_switch_given_as_text_from_the_environment(monkeypatch):
    for text, on in (("0", False), ("off", False), ("1", True), ("true", True)):
        monkeypatch.setattr(config, "ONEDNN_MATMULS", text)
        assert onednn.onednn_products() is on, text


def _compiled(fn, *args, inference=True):
    """Compile fn with the ember backend (through ember.compile) and call it; return (compiled fn, its graphs)."""
    def run(f, *args):
        with torch.set_grad_enabled(not inference):
            f(*args)
    return compiled_graphs(fn, *args, run=run)


def _externs(fn, *args, inference=True):
    """(compiled fn, the extern call targets of its graphs, the post-op attr of each oneDNN call)."""
    f, graphs = _compiled(fn, *args, inference=inference)
    items = [it for g in graphs for it in g.sched.items if isinstance(it, ExternBuffer)]
    return f, [str(it.target) for it in items], [it.args[3] for it in items if str(it.target) == LINEAR]


class MLP(torch.nn.Module):
    def __init__(self, act=torch.nn.GELU(), d=96, h=384):
        super().__init__()
        self.fc1, self.act, self.fc2, self.ln = torch.nn.Linear(d, h), act, torch.nn.Linear(h, d), torch.nn.LayerNorm(d)

    def forward(self, x):
        return self.ln(self.fc2(self.act(self.fc1(x))) + x)


@pytest.mark.parametrize("act,attr", [(torch.nn.GELU(), "gelu"), (torch.nn.GELU("tanh"), "gelu"),
                                      (torch.nn.ReLU(), "relu"), (torch.nn.SiLU(), "swish"), (torch.nn.Tanh(), None)])
def test_mlp_activation_fused_into_the_product(act, attr):
    """3-D input: the linear runs on a [200, 96] view, the activation reads it through a view."""
    torch.manual_seed(0)
    m = MLP(act).eval()
    with torch.no_grad():
        f, targets, attrs = _externs(m, torch.randn(4, 50, 96))
        assert targets == [LINEAR, LINEAR], targets
        assert attrs == [attr or "none", "none"], attrs
        for _ in range(2):
            x = torch.randn(4, 50, 96)
            torch.testing.assert_close(f(x), m(x))


def test_linear_without_bias():
    torch.manual_seed(0)
    w = torch.randn(256, 128)
    fn = lambda x: F.silu(F.linear(x, w)) * 2
    with torch.no_grad():
        f, targets, attrs = _externs(fn, torch.randn(2, 40, 128))
        assert targets == [LINEAR] and attrs == ["swish"], (targets, attrs)
        x = torch.randn(2, 40, 128)
        torch.testing.assert_close(f(x), fn(x))


def test_weight_and_bias_changes_between_calls_are_seen():
    """In place through .data (no version bump), by copy_, and by replacing the Parameter."""
    torch.manual_seed(0)
    m = MLP().eval()
    x = torch.randn(200, 96)
    with torch.no_grad():
        f, targets, _ = _externs(m, x)
        assert LINEAR in targets
        torch.testing.assert_close(f(x), m(x))
        m.fc1.weight.data.mul_(1.5)
        m.fc1.bias.data.add_(0.25)
        torch.testing.assert_close(f(x), m(x))
        m.fc2.weight.copy_(torch.randn_like(m.fc2.weight) * 0.05)
        torch.testing.assert_close(f(x), m(x))
        m.fc1.weight = torch.nn.Parameter(torch.randn_like(m.fc1.weight) * 0.1)
        torch.testing.assert_close(f(x), m(x))


def test_activation_read_elsewhere_or_pre_activation_returned():
    """A product whose result something else reads too keeps the activation as a kernel (not fused)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(128, 256)

    def fn(x):
        y = lin(x)
        return F.gelu(y), y.sum(-1)
    with torch.no_grad():
        f, targets, attrs = _externs(fn, torch.randn(64, 128))
        assert targets == [LINEAR] and attrs == ["none"], (targets, attrs)
        x = torch.randn(64, 128)
        for got, want in zip(f(x), fn(x)):
            torch.testing.assert_close(got, want)


def test_layouts_that_stay_with_aten_mm():
    """x @ W of a row-major [K, N] weight and small products stay ATen's mm; a transposed input is copied
    row-major for oneDNN."""
    torch.manual_seed(0)
    w_kn, w_nk = torch.randn(128, 256), torch.randn(256, 128)
    with torch.no_grad():
        fn = lambda x: (x @ w_kn).relu()
        f, targets, _ = _externs(fn, torch.randn(96, 128))
        assert targets == ["aten.mm.default"], targets
        x = torch.randn(96, 128)
        torch.testing.assert_close(f(x), fn(x))

        fn = lambda x: F.linear(x.t(), w_nk)  # x [128, 96] -> its transpose, read as a lazy copy
        f, targets, _ = _externs(fn, torch.randn(128, 96))
        assert targets == [LINEAR], targets
        x = torch.randn(128, 96)
        torch.testing.assert_close(f(x), fn(x))

        small = torch.nn.Linear(16, 16)
        fn = lambda x: F.gelu(small(x))
        f, targets, _ = _externs(fn, torch.randn(8, 16))
        assert targets == ["aten.mm.default"], targets
        x = torch.randn(8, 16)
        torch.testing.assert_close(f(x), fn(x))


def test_float64_and_training_graphs():
    """float64 stays with ATen's mm; a training forward's products may use oneDNN, its activation stays a
    kernel (its input is saved for the backward), and gradients match eager."""
    torch.manual_seed(0)
    m64 = MLP().double().eval()
    with torch.no_grad():
        f, targets, _ = _externs(m64, torch.randn(200, 96, dtype=torch.float64))
        assert LINEAR not in targets, targets
        x = torch.randn(200, 96, dtype=torch.float64)
        torch.testing.assert_close(f(x), m64(x))

    m, ref = MLP(), MLP()
    ref.load_state_dict(m.state_dict())
    x = torch.randn(200, 96)
    f, targets, attrs = _externs(lambda x: m(x).square().mean(), x, inference=False)
    assert targets.count(LINEAR) == 2 and set(attrs) == {"none"}, (targets, attrs)
    for _ in range(2):
        m.zero_grad()
        ref.zero_grad()
        x = torch.randn(200, 96)
        got, want = f(x), ref(x).square().mean()
        got.backward()
        want.backward()
        torch.testing.assert_close(got, want)
        for p, q in zip(m.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)


def test_flags_off_give_aten_mm_and_unfused_activations(monkeypatch):
    torch.manual_seed(0)
    m = MLP().eval()
    x = torch.randn(200, 96)
    with torch.no_grad():
        monkeypatch.setattr(config, "FUSE_LINEARS", False)
        f, targets, attrs = _externs(m, x)
        assert attrs == ["none", "none"], attrs
        torch.testing.assert_close(f(x), m(x))
        monkeypatch.setattr(config, "ONEDNN_MATMULS", False)
        f, targets, attrs = _externs(lambda x: m(x), x)
        assert targets == ["aten.mm.default", "aten.mm.default"], targets
        torch.testing.assert_close(f(x), m(x))


def test_computed_weight_is_copied_into_the_inner_product_layout():
    """A fused linear whose weight is a computed value (not a window onto a [N, K] buffer): copied row-major."""
    torch.manual_seed(0)
    w, b = torch.randn(256, 128), torch.randn(256)

    def fn(x, s):
        return F.gelu(torch.addmm(b, x, (w * s).t()))
    with torch.no_grad():
        f, targets, attrs = _externs(fn, torch.randn(64, 128), torch.rand(256, 1))
        assert targets == [LINEAR] and attrs == ["gelu"], (targets, attrs)
        x, s = torch.randn(64, 128), torch.rand(256, 1)
        torch.testing.assert_close(f(x, s), fn(x, s))


def test_bias_inside_the_product_for_attention_inputs():
    """Q, K, V linears read by attention: the bias is added by oneDNN, and no kernel runs between the products
    and the attention call; a 2-D bias (addmm's other broadcast) stays a lazy add in a kernel."""
    torch.manual_seed(0)
    q, k, v = (torch.nn.Linear(128, 128) for _ in range(3))

    def fn(x):
        b, s, _ = x.shape
        heads = [p(x).view(b, s, 4, 32).transpose(1, 2) for p in (q, k, v)]
        return F.scaled_dot_product_attention(*heads)
    with torch.no_grad():
        f, graphs = _compiled(fn, torch.randn(2, 64, 128))
        items = [str(it.target) if isinstance(it, ExternBuffer) else "kernel" for it in graphs[0].sched.items]
        assert items[:4] == [LINEAR] * 3 + ["aten._scaled_dot_product_flash_attention_for_cpu.default"], items
        x = torch.randn(2, 64, 128)
        torch.testing.assert_close(f(x), fn(x))

    bias2d, w = torch.randn(64, 256), torch.randn(256, 128)
    fn = lambda x: torch.addmm(bias2d, x, w.t()).tanh()
    with torch.no_grad():
        f, targets, attrs = _externs(fn, torch.randn(64, 128))
        assert targets == [LINEAR] and attrs == ["none"], (targets, attrs)
        x = torch.randn(64, 128)
        torch.testing.assert_close(f(x), fn(x))


@pytest.mark.parametrize("batch_first", [True, False])
def test_product_of_a_weight_broadcast_over_a_batch_is_one_product(batch_first):
    """nn.MultiheadAttention's in-projection under no_grad: torch.matmul of a transposed 3-D input makes a bmm
    with the weight expanded over the batch (stride 0); it runs as one product of all the rows (vit_b_16)."""
    torch.manual_seed(0)
    m = torch.nn.MultiheadAttention(64, 4, batch_first=batch_first).eval()
    fn = lambda x: m(x, x, x, need_weights=False)[0]
    with torch.no_grad():
        f, targets, _ = _externs(fn, torch.randn(3, 17, 64))
        assert "aten.bmm.default" not in targets, targets
        assert sum(t in (LINEAR, "aten.mm.default") for t in targets) == 2, targets
        for _ in range(2):
            x = torch.randn(3, 17, 64)
            torch.testing.assert_close(f(x), fn(x))


@pytest.mark.parametrize("stored_transposed", [True, False])
def test_bmm_of_an_expanded_weight(stored_transposed):
    """The product of a 3-D value (a computed one, and a stored one read along its middle dim first) and a
    weight expanded over the batch, in float32 and float64 (no oneDNN: ATen's mm), equals eager's bmm."""
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        w = torch.randn(24, 40, dtype=dtype)

        def fn(x):
            a = x.transpose(0, 1) if stored_transposed else (x * 2).transpose(0, 1)
            return torch.bmm(a, w.expand(a.shape[0], 24, 40)).relu()
        with torch.no_grad():
            f, targets, _ = _externs(fn, torch.randn(5, 9, 24, dtype=dtype))
            assert "aten.bmm.default" not in targets, targets
            x = torch.randn(5, 9, 24, dtype=dtype)
            torch.testing.assert_close(f(x), fn(x))
