"""Training through aot_eager equals eager: 3 steps of the tutorial loop (Adam, CrossEntropyLoss), then gradients,
parameters and buffers (BatchNorm running stats) compared with assert_close.

The CNNs run in float64: the partitioner recomputes BatchNorm outputs in the backward (partition.py), which can
round differently from the fused kernel by one ulp, and Adam turns the sign of a gradient that is rounding noise
(BatchNorm over a handful of values makes some) into a full lr-sized step; in float64 that noise is far below the
tolerance.

Graphs come from ember's frontend (ember.compile(..., backend="aot_eager")) and, to test this package alone,
from torch.fx.symbolic_trace where it works (MLP, resnet18, densenet121) or, for GPT-2 (which symbolic_trace cannot
trace, and transformers 5 no longer ships its own fx tracer), from the module itself: aot_module traces any
nn.Module by running its forward on fake tensors, which is what it does with a GraphModule too.
"""
import copy

import pytest
import torch
import torch.fx

import ember
from ember.autograd import aot_eager
from tests.optim_steps import step_both


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


class RecordingAotEager:
    """The aot_eager backend, keeping what it built, so a test can check that training ran through it."""

    def __init__(self):
        self.built = []

    def __call__(self, gm, example_inputs):
        self.built.append(aot_eager(gm, example_inputs))
        return self.built[-1]

    def trained(self) -> bool:
        return any(a is not None and a.training for f in self.built for a in f.artifacts.values())


def via_ember_compile(model, x, y):
    """ember's frontend captures the graph, the "aot_eager" backend builds forward and backward."""
    backend = RecordingAotEager()
    cm = ember.compile(model, backend=backend)

    def call(a, b):
        out = cm(a)
        assert backend.trained(), "no training graph was built: the frontend ran the model without aot_eager"
        return out
    return call


CAPTURES = {"symbolic_trace": via_symbolic_trace, "ember.compile": via_ember_compile}


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
    check_training(mlp(), via_ember_compile, x, y)


@pytest.mark.parametrize("capture", CAPTURES)
def test_resnet18_train_mode_batchnorm_stats(capture):
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).train().double()
    x, y = data((4, 3, 32, 32))
    check_training(model, CAPTURES[capture], x.double(), y)


@pytest.mark.slow
@pytest.mark.parametrize("capture", CAPTURES)
def test_densenet121_small_input(capture):
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = torchvision.models.densenet121(num_classes=10).train().double()
    x, y = data((4, 3, 32, 32))
    check_training(model, CAPTURES[capture], x.double(), y)


class LMLoss(torch.nn.Module):
    """GPT2LMHeadModel's loss from labels=, as a module taking tensors (the captured program)."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, ids, labels):
        return self.lm(input_ids=ids, labels=labels).loss


@pytest.mark.parametrize("capture", ["module", "ember.compile"])
def test_gpt2_lm_head_loss_from_labels(capture):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=32,
                                  bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    lm = transformers.GPT2LMHeadModel(cfg).train()        # dropout on: masks must match eager's
    ref = copy.deepcopy(lm)
    ids = torch.randint(0, 100, (2, 16))
    if capture == "module":
        f = aot_eager(LMLoss(lm), [ids, ids])
    else:
        backend = RecordingAotEager()
        f = ember.compile(lm, backend=backend)
    got = _train(lm, (lambda a, b: f(a, b)) if capture == "module" else (lambda a, b: f(input_ids=a, labels=b).loss),
                 ids, ids, loss_fn=None)
    want = _train(ref, lambda a, b: ref(input_ids=a, labels=b).loss, ids, ids, loss_fn=None)
    torch.testing.assert_close(got[0], want[0])
    for g, w in zip(got[1], want[1]):
        torch.testing.assert_close(g, w)
    for (name, p), q in zip(lm.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, msg=lambda m: f"{name}: {m}")
    if capture == "module":
        (art,) = f.artifacts.values()
        assert art.training
    else:
        assert backend.trained()


def test_train_function_with_optimizer_step_inside():
    """The tutorial's whole train(mod, data) (forward, loss, backward, opt.step()) compiled with aot_eager."""
    # loss.backward() inside the function is a graph break: the frontend resumes after it
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

    backend = RecordingAotEager()
    compiled = ember.compile(train, backend=backend)
    for step in range(3):
        torch.manual_seed(step)
        l1 = compiled(model, (x, y))
        torch.manual_seed(step)
        l2 = train(ref, (x, y))
        torch.testing.assert_close(l1, l2)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)
    assert backend.trained()


def test_optimizer_step_is_an_inference_graph_written_in_place():
    """An optimizer writes its parameters under no_grad: no output needs a gradient, so the step is an inference
    graph whose kernels write the parameters and state in place (no copies back)."""
    from ember.autograd import trace_joint
    w = torch.nn.Parameter(torch.randn(8, 4))
    m = torch.randn(8, 4)

    def step(w, m, g):
        with torch.no_grad():
            m.mul_(0.9).add_(g)
            w.add_(m, alpha=-0.1)
        return None
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    g = torch.randn(8, 4)
    ember.compile(step, backend=keep)(w, m, g)   # the frontend records the no_grad (symbolic_trace cannot)
    _, meta = trace_joint(graphs[0], [w, m, g])
    assert meta.tangent_of == [] and len(meta.mutations) == 2
    params, state = [torch.nn.Parameter(torch.randn(16, 8)) for _ in range(3)], None
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt, ref_opt = torch.optim.Adam(params, lr=0.01), torch.optim.Adam(ref, lr=0.01)
    compiled = ember.compile(lambda: opt.step())
    for _ in range(3):
        step_both(compiled, ref_opt.step, params, ref)
        state = [opt.state[p]["exp_avg"].data_ptr() for p in params]
    for p, r in zip(params, ref):
        torch.testing.assert_close(p, r)
        assert p.is_leaf and p.grad_fn is None
    assert state == [opt.state[p]["exp_avg"].data_ptr() for p in params]


def test_in_place_kernel_writes_are_seen_by_autograd():
    """A parameter saved for a backward and then changed by a compiled optimizer step: eager's backward raises
    (the version counter moved); so must the compiled one's, though its kernel wrote the memory directly."""
    def run(compile):
        w = torch.nn.Parameter(torch.randn(4, 4))
        x = torch.randn(3, 4, requires_grad=True)
        opt = torch.optim.SGD([w], lr=0.1)
        step = compile(lambda: opt.step())
        for _ in range(2):
            w.grad = torch.randn(4, 4)
            step()
        y = (x @ w).sum()
        step()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.backward()
    run(lambda f: f)
    run(ember.compile)


def test_differentiable_output_without_a_gradient_gets_zeros():
    """Of two differentiable outputs, backward through one: the other's gradient is zeros (autograd no longer
    materializes them, so the compiled Function's backward makes them); a batch norm's statistics ride along."""
    torch.manual_seed(0)
    w = torch.randn(6, 6, requires_grad=True)

    def make(bn):
        def fn(x):
            h = bn(x @ w)
            return h.relu(), h.sigmoid()
        return fn
    bn = torch.nn.BatchNorm1d(6)
    ref_bn = copy.deepcopy(bn)
    compiled, eager = ember.compile(make(bn)), make(ref_bn)
    for _ in range(2):
        x = torch.randn(8, 6)
        a, b = compiled(x)
        ra, rb = eager(x)
        (ga,) = torch.autograd.grad(b.sum(), [w])
        (gr,) = torch.autograd.grad(rb.sum(), [w])
        torch.testing.assert_close(a, ra)
        torch.testing.assert_close(ga, gr)
        torch.testing.assert_close(bn.running_mean, ref_bn.running_mean)
