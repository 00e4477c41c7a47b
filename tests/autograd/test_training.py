"""Training through aot_eager equals eager: 3 steps of the tutorial loop (Adam, CrossEntropyLoss), then gradients,
parameters and buffers (BatchNorm running stats) compared with assert_close.

Graphs come from torch.fx.symbolic_trace where it works (MLP, resnet18, densenet121), from ember's frontend
(ember.compile(..., backend="aot_eager")) for the MLP, and for GPT-2 (which symbolic_trace cannot trace, and
transformers 5 no longer ships its own fx tracer) from the module itself: aot_module traces any nn.Module by running
its forward on fake tensors, which is what it does with a GraphModule too.
"""
import copy

import pytest
import torch
import torch.fx

import ember
from ember.autograd import aot_eager


def _train(model, call, x, y, steps=3, loss_fn=torch.nn.CrossEntropyLoss()):
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses, grads = [], []
    for step in range(steps):
        torch.manual_seed(100 + step)     # dropout draws the same masks in both runs
        opt.zero_grad()
        out = call(x, y)
        loss = out if y is None or out.dim() == 0 else loss_fn(out, y)
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        losses.append(loss.detach())
    return losses, grads


def check_training(model, compile_fn, x, y, steps=3, rtol=None, atol=None):
    """compile_fn(model, x, y) -> call(x, y) giving the model's output; compared with eager model(x)."""
    ref = copy.deepcopy(model)
    compiled = compile_fn(model, x, y)
    got = _train(model, compiled, x, y, steps)
    want = _train(ref, lambda a, b: ref(a), x, y, steps)
    torch.testing.assert_close(got[0], want[0], rtol=rtol, atol=atol)
    for g, w in zip(got[1], want[1]):
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
    for (name, b), c in zip(model.named_buffers(), ref.buffers()):
        torch.testing.assert_close(b, c, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
    return compiled


def via_symbolic_trace(model, x, y):
    gm = torch.fx.symbolic_trace(model)
    f = aot_eager(gm, [x])
    return lambda a, b: f(a)


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.GELU(), torch.nn.Dropout(0.1),
                               torch.nn.Linear(64, 64), torch.nn.LayerNorm(64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 10))


def data(shape, classes=10):
    torch.manual_seed(1)
    return torch.randn(shape), torch.randint(0, classes, (shape[0],))


def test_mlp_symbolic_trace():
    x, y = data((16, 20))
    check_training(mlp(), via_symbolic_trace, x, y)


def test_mlp_builds_one_training_graph_and_saves_no_random_recompute():
    x, y = data((16, 20))
    model = mlp()
    f = aot_eager(torch.fx.symbolic_trace(model), [x])
    _train(model, lambda a, b: f(a), x, y)
    (art,) = f.artifacts.values()
    assert art.training
    # the dropout mask is drawn once, in the forward graph; the backward only reads it
    rand = [n for n in art.part.backward.graph.nodes
            if n.op == "call_function" and torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())]
    assert rand == []


def test_mlp_through_ember_compile_frontend():
    x, y = data((16, 20))
    def compile_fn(model, a, b):
        cm = ember.compile(model, backend="aot_eager")
        return lambda p, q: cm(p)
    check_training(mlp(), compile_fn, x, y)


def test_resnet18_train_mode_batchnorm_stats():
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).train()
    x, y = data((2, 3, 32, 32))
    check_training(model, via_symbolic_trace, x, y)


@pytest.mark.slow
def test_densenet121_small_input():
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.densenet121(num_classes=10).train()
    x, y = data((2, 3, 32, 32))
    check_training(model, via_symbolic_trace, x, y)


class LMLoss(torch.nn.Module):
    """GPT2LMHeadModel's loss from labels=, as a module taking tensors (the captured program)."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, ids, labels):
        return self.lm(input_ids=ids, labels=labels).loss


def test_gpt2_lm_head_loss_from_labels():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=32,
                                  bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    lm = transformers.GPT2LMHeadModel(cfg).train()        # dropout on: masks must match eager's
    ref = copy.deepcopy(lm)
    ids = torch.randint(0, 100, (2, 16))
    f = aot_eager(LMLoss(lm), [ids, ids])
    got = _train(lm, lambda a, b: f(a, b), ids, ids, loss_fn=None)
    want = _train(ref, lambda a, b: ref(input_ids=a, labels=b).loss, ids, ids, loss_fn=None)
    torch.testing.assert_close(got[0], want[0])
    for g, w in zip(got[1], want[1]):
        torch.testing.assert_close(g, w)
    for (name, p), q in zip(lm.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, msg=lambda m: f"{name}: {m}")
    (art,) = f.artifacts.values()
    assert art.training


def test_train_function_with_optimizer_step_inside():
    """The tutorial's whole train(mod, data) (forward, loss, backward, opt.step()) compiled with aot_eager."""
    # loss.backward() inside the function is a graph break: needs the frontend's resume functions
    pytest.importorskip("ember.frontend.bytecode_gen", reason="frontend graph breaks (resume functions) not on main yet")
    x, y = data((16, 20))
    model = mlp()
    ref = copy.deepcopy(model)
    opts = {id(model): torch.optim.Adam(model.parameters(), lr=1e-3),
            id(ref): torch.optim.Adam(ref.parameters(), lr=1e-3)}

    def train(mod, data):
        opt = opts[id(mod)]
        opt.zero_grad(True)
        pred = mod(data[0])
        loss = torch.nn.CrossEntropyLoss()(pred, data[1])
        loss.backward()
        opt.step()
        return loss

    compiled = ember.compile(train, backend="aot_eager")
    for step in range(3):
        torch.manual_seed(step)
        l1 = compiled(model, (x, y))
        torch.manual_seed(step)
        l2 = train(ref, (x, y))
        torch.testing.assert_close(l1, l2)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)
