"""ember.autograd.fake_dispatch: SymbolicFakeMode's direct results on symbolic sizes against FakeTensorMode's own
dispatch (same shapes, strides and dtypes, no guard added), the ops it does not take falling through, and a
training step through it compared with eager."""
import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

import ember
from ember.autograd.fake_dispatch import _SYMBOLIC_DIRECT, SymbolicFakeMode
from ember.frontend.symbolic import SizeSource

aten = torch.ops.aten


def _fakes(mode, se, n, specs):
    """Fakes of `mode` with the batch dim the symbol of size n (one symbol for all), others static."""
    sym = se.create_symbol(n, SizeSource("n"), dynamic_dim=DimDynamic.DUCK)
    s = se.create_symintnode(sym, hint=n, source=SizeSource("n"))
    out = []
    with mode:
        for shape, dtype in specs:
            shape = [s if d == "n" else d for d in shape]
            if dtype == torch.int64:
                out.append(torch.empty(shape, dtype=dtype))
            else:
                out.append(torch.empty(shape, dtype=dtype, requires_grad=False))
    return out


_CASES = [
    (aten.relu.default, [(("n", 5), torch.float32)], ()),
    (aten._log_softmax.default, [(("n", 10), torch.float32)], (1, False)),
    (aten.nll_loss_forward.default, [(("n", 10), torch.float32), (("n",), torch.int64)], (None, 1, -100)),
    (aten.nll_loss_forward.default, [(("n", 10), torch.float64), (("n",), torch.int64)], (None, 2, -100)),
    (aten.threshold_backward.default, [(("n", 4, 3), torch.float32), (("n", 4, 3), torch.float32)], (0,)),
    (aten._log_softmax_backward_data.default, [(("n", 10), torch.float32), (("n", 10), torch.float32)],
     (1, torch.float32)),
    (aten.native_batch_norm.default, [(("n", 4, 5, 5), torch.float32)] + [((4,), torch.float32)] * 4,
     (True, 0.1, 1e-5)),
    (aten.native_batch_norm.default, [(("n", 3), torch.float64)] + [((3,), torch.float64)] * 4, (True, 0.1, 1e-5)),
    (aten._native_batch_norm_legit_functional.default, [(("n", 4, 5, 5), torch.float32)] +
     [((4,), torch.float32)] * 4, (True, 0.1, 1e-5)),
    (aten.native_batch_norm_backward.default, [(("n", 4, 5, 5), torch.float32), (("n", 4, 5, 5), torch.float32)] +
     [((4,), torch.float32)] * 5, (True, 1e-5, [True, True, True])),
]


def _meta(x):
    if isinstance(x, (tuple, list)):
        return [_meta(y) for y in x]
    return (tuple(str(d) for d in x.shape), tuple(str(d) for d in x.stride()), x.dtype, x.device)


@pytest.mark.parametrize("case", range(len(_CASES)))
def test_symbolic_rule_matches_fake_tensor_mode(case):
    func, specs, rest = _CASES[case]
    results = []
    for cls in (FakeTensorMode, SymbolicFakeMode):
        se = ShapeEnv()
        mode = cls(shape_env=se)
        args = _fakes(mode, se, 6, specs)
        direct = cls is SymbolicFakeMode and _SYMBOLIC_DIRECT[func](mode, (*args, *rest), {}) is not None
        guards = len(se.guards)
        with mode:
            out = func(*args, *rest)
        results.append(_meta(out))
        assert len(se.guards) == guards
    assert direct   # (the rule took these inputs)
    assert results[0] == results[1]


def test_nll_loss_backward_rule_matches_fake_tensor_mode():
    results = []
    for cls in (FakeTensorMode, SymbolicFakeMode):
        se = ShapeEnv()
        mode = cls(shape_env=se)
        x, t, g, total = _fakes(mode, se, 7, [(("n", 10), torch.float32), (("n",), torch.int64),
                                              ((), torch.float32), ((), torch.float32)])
        with mode:
            out = aten.nll_loss_backward.default(g, x, t, None, 1, -100, total)
        results.append(_meta(out))
    assert results[0] == results[1]


def test_symbolic_rule_falls_through():
    """A rule that does not take its inputs (a transposed input, half_to_float) leaves the op to FakeTensorMode."""
    se = ShapeEnv()
    mode = SymbolicFakeMode(shape_env=se)
    (x,) = _fakes(mode, se, 6, [(("n", 5), torch.float32)])
    with mode:
        xt = x.t()
        assert _SYMBOLIC_DIRECT[aten.relu.default](mode, (xt,), {}) is None
        assert aten.relu.default(xt).stride() == xt.stride()
        assert _SYMBOLIC_DIRECT[aten._log_softmax.default](mode, (x, 1, True), {}) is None


def test_training_step_symbolic_batch_equal_to_eager():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.ReLU(), torch.nn.Linear(12, 4))
    ref = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.ReLU(), torch.nn.Linear(12, 4))
    ref.load_state_dict(model.state_dict())

    def step(m, x, y):
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        return loss

    ember.reset()
    cstep = ember.compile(step, dynamic=True)
    for n in (5, 8, 3):
        x, y = torch.randn(n, 6), torch.randint(0, 4, (n,))
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        torch.testing.assert_close(cstep(model, x, y), step(ref, x, y))
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
    ember.reset()


def test_batch_norm_training_symbolic_batch_equal_to_eager():
    """Conv, training batch norm, relu and cross-entropy with an optimizer step, the batch size changing: the
    symbolic graph's losses and parameters equal eager's."""
    torch.manual_seed(0)

    def make():
        torch.manual_seed(1)
        return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                                   torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(4, 5))
    model, ref = make(), make()
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref))

    def step(m, o, x, y):
        o.zero_grad(set_to_none=True)
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        o.step()
        return loss

    ember.reset()
    cstep = ember.compile(step)
    for n in (6, 6, 4, 7, 3):
        x, y = torch.randn(n, 3, 8, 8), torch.randint(0, 5, (n,))
        torch.testing.assert_close(cstep(model, opt, x, y), step(ref, ref_opt, x, y))
    for a, b in zip([*model.parameters(), *model.buffers()], [*ref.parameters(), *ref.buffers()]):
        torch.testing.assert_close(a, b)
    ember.reset()
