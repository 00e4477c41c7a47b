"""loss.backward() inside a compiled function (ember.autograd.backward): the same gradients, optimizer state and
autograd behaviour as eager, and a training step in one graph."""
import copy

import pytest
import torch

import ember
from ember.autograd.backward import grads_of


@pytest.fixture(autouse=True)
def _backward_in_graph_on_the_cpu(monkeypatch):
    """The mechanism is device-independent; by default only CUDA losses use it (BACKWARD_IN_GRAPH_DEVICES)."""
    from ember.frontend import policy
    monkeypatch.setattr(policy, "BACKWARD_IN_GRAPH_DEVICES", {"cpu", "cuda"})


def _model():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _assert_same_training_state(m1, o1, m2, o2):
    for p, q in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(p, q)
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad)
    for s1, s2 in zip(o1.state.values(), o2.state.values()):
        for k in s1:
            torch.testing.assert_close(s1[k], s2[k])


def _step(model, opt, x, y):
    opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()


def _steps_match(compiled, m1, o1, m2, o2, steps: int) -> None:
    """`steps` steps of eager _step on (m1, o1) and of `compiled` on (m2, o2), the same state after each."""
    for _ in range(steps):
        x, y = torch.randn(5, 8), torch.randint(0, 4, (5,))
        _step(m1, o1, x, y)
        compiled(m2, o2, x, y)
        _assert_same_training_state(m1, o1, m2, o2)


@pytest.mark.parametrize("backend", ["ember", "aot_eager"])
@pytest.mark.parametrize("make_opt", [lambda ps: torch.optim.Adam(ps, lr=0.01),
                                      lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)], ids=["adam", "sgd"])
def test_training_step_matches_eager_and_is_one_graph(backend, make_opt):
    torch.manual_seed(0)
    m1 = _model()
    m2 = copy.deepcopy(m1)
    o1, o2 = make_opt(m1.parameters()), make_opt(m2.parameters())
    compiled = ember.compile(_step, backend=backend)
    _steps_match(compiled, m1, o1, m2, o2, 3)
    # with the optimizer's state made, the step after zero_grad (which runs in Python) is one graph
    explained = ember.explain(_step)(copy.deepcopy(m1), copy.deepcopy(o1), torch.randn(5, 8), torch.randint(0, 4, (5,)))
    with_backward = [ops for ops in explained.ops_per_graph if grads_of in ops]
    assert len(with_backward) == 1 and explained.graph_count == 1


def test_gradients_accumulate_in_place_into_existing_grads():
    torch.manual_seed(0)
    m1 = _model()
    m2 = copy.deepcopy(m1)

    def accumulate(model, x):
        model(x).square().mean().backward()

    compiled = ember.compile(accumulate)
    x = torch.randn(3, 8)
    accumulate(m1, x)
    compiled(m2, x)               # grads None: assigned
    grads = [p.grad for p in m2.parameters()]
    for _ in range(2):
        x = torch.randn(3, 8)
        accumulate(m1, x)
        compiled(m2, x)           # grads exist: added in place, the same tensors as before (as AccumulateGrad)
    for p, q, g in zip(m1.parameters(), m2.parameters(), grads):
        torch.testing.assert_close(q.grad, p.grad)
        assert q.grad is g


def test_an_unused_parameter_keeps_grad_none_and_layouts_follow_the_parameters():
    w = torch.randn(6, 4).t().requires_grad_()     # a transposed leaf: its grad takes its strides
    unused = torch.randn(3, requires_grad=True)
    b = torch.randn(6, requires_grad=True)

    def f(x):
        (x @ w + b).sum().backward()

    x = torch.randn(2, 4)
    ember.compile(f)(x)
    w_ref, b_ref = w.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    (x @ w_ref + b_ref).sum().backward()
    torch.testing.assert_close(w.grad, w_ref.grad)
    torch.testing.assert_close(b.grad, b_ref.grad)
    assert w.grad.stride() == w.stride() and unused.grad is None


def test_a_returned_loss_requires_grad_and_a_second_backward_raises_as_in_eager():
    torch.manual_seed(0)
    m1 = _model()
    m2 = copy.deepcopy(m1)

    def step(model, x):
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    x = torch.randn(4, 8)
    want, got = step(m1, x), ember.compile(step)(m2, x)
    torch.testing.assert_close(got, want)
    assert got.requires_grad and not got.is_leaf
    for p, q in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(q.grad, p.grad)
    for loss in (want, got):
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            loss.backward()


def test_graph_break_after_backward_and_a_value_needing_its_own_backward():
    torch.manual_seed(0)
    m1 = _model()
    m2 = copy.deepcopy(m1)
    printed = []

    def step(model, x):
        loss = model(x).abs().mean()
        loss.backward()
        printed.append(loss.item())     # a graph break after the backward
        return model(x).sum()           # autograd history of its own: the graph breaks at the backward instead

    x = torch.randn(4, 8)
    want = step(m1, x)
    got = ember.compile(step)(m2, x)
    torch.testing.assert_close(got, want)
    assert printed[0] == pytest.approx(printed[1], rel=1e-6)
    want.backward()
    got.backward()
    for p, q in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(q.grad, p.grad)


def test_hooks_and_arguments_run_the_backward_eagerly():
    torch.manual_seed(0)
    w = torch.randn(5, requires_grad=True)
    seen = []

    def f(x, **kw):
        (w * x).sum().backward(**kw)

    compiled = ember.compile(f)
    x = torch.randn(5)
    compiled(x)
    torch.testing.assert_close(w.grad, x)
    handle = w.register_hook(lambda g: seen.append(g.clone()))   # after the capture: the guard sees it
    compiled(x)
    torch.testing.assert_close(w.grad, 2 * x)
    torch.testing.assert_close(seen[0], x)
    handle.remove()
    compiled(x, retain_graph=True)
    torch.testing.assert_close(w.grad, 3 * x)


def test_backward_into_a_tensor_computed_outside_reaches_its_leaves():
    w = torch.randn(4, requires_grad=True)
    h = w * 3                       # made before the compiled function: backward continues into w

    def f(t):
        (t.sin() * 2).sum().backward()

    ember.compile(f)(h)
    torch.testing.assert_close(w.grad, 6 * torch.cos(3 * w.detach()))


def test_gradient_clipping_between_backward_and_step():
    """clip_grad_norm_ reads the gradients the graph's backward made (p.grad within the capture) and scales them
    in place before the optimizer reads them; every value as eager's."""
    torch.manual_seed(0)
    m1 = _model()
    m2 = copy.deepcopy(m1)
    o1, o2 = torch.optim.SGD(m1.parameters(), lr=0.1), torch.optim.SGD(m2.parameters(), lr=0.1)

    def step(model, opt, x):
        opt.zero_grad()
        (model(x) * 10).square().sum().backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        return norm

    compiled = ember.compile(step)
    for _ in range(3):
        x = torch.randn(6, 8)
        torch.testing.assert_close(compiled(m2, o2, x), step(m1, o1, x))
        _assert_same_training_state(m1, o1, m2, o2)


def test_a_process_group_keeps_the_backward_in_autograd(monkeypatch):
    """With torch.distributed initialized (DDP's gradient-accumulator hooks, which no API lists), backward()
    breaks the graph; the entry made without one is guarded on it."""
    w = torch.randn(4, requires_grad=True)

    def f(x):
        (w * x).sum().backward()

    compiled = ember.compile(f)
    explained = ember.explain(f)(torch.randn(4))
    assert explained.graph_break_count == 0
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    explained = ember.explain(f)(torch.randn(4))
    assert any("distributed" in b.reason for b in explained.break_reasons)
    x = torch.randn(4)
    w.grad = None          # (explain ran f twice)
    compiled(x)
    torch.testing.assert_close(w.grad, x)


def test_a_cpu_loss_keeps_its_backward_in_autograd_by_default(monkeypatch):
    """On the CPU the backward stays a separate graph by default (it measured faster so): a break at backward()."""
    from ember.frontend import policy
    monkeypatch.setattr(policy, "BACKWARD_IN_GRAPH_DEVICES", {"cuda"})
    w = torch.randn(4, requires_grad=True)

    def f(x):
        (w * x).sum().backward()

    explained = ember.explain(f)(torch.randn(4))
    assert any("backward" in b.reason for b in explained.break_reasons)
    w.grad = None
    x = torch.randn(4)
    ember.compile(f)(x)
    torch.testing.assert_close(w.grad, x)


class _SlicedLayers(torch.nn.Module):
    """A decoder's loop over a slice of its layers (transformers: `self.layers[: config.num_hidden_layers]`): the
    slice is a new ModuleList, made while capturing."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(8, 16)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(16, 16) for _ in range(3)])
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers[:2]:
            x = torch.tanh(layer(x)) + x
        return self.head(x)


@pytest.mark.parametrize("backend", ["ember", "aot_eager"])
def test_parameters_of_a_sliced_module_list_get_their_gradients(backend):
    torch.manual_seed(0)
    m1 = _SlicedLayers()
    m2 = copy.deepcopy(m1)
    o1, o2 = torch.optim.Adam(m1.parameters(), lr=0.01), torch.optim.Adam(m2.parameters(), lr=0.01)
    compiled = ember.compile(_step, backend=backend)
    _steps_match(compiled, m1, o1, m2, o2, 3)
    # a layer swapped in after the compile is the one the next call uses (the slice's layers are guarded inputs)
    m1.layers[1] = torch.nn.Linear(16, 16)
    m2.layers[1] = copy.deepcopy(m1.layers[1])
    o1.add_param_group({"params": m1.layers[1].parameters()})
    o2.add_param_group({"params": m2.layers[1].parameters()})
    _steps_match(compiled, m1, o1, m2, o2, 1)
