"""torch.optim's step() compiled: one graph from the second call on, results bit for bit equal to eager.

Each test runs a compiled optimizer and an eager twin (same model copy, same hyperparameters, same gradients)
and compares parameters and optimizer state exactly (rtol=0, atol=0) after every step. The first call creates
the optimizer's state lazily (a defaultdict write): it breaks and runs as Python; the second call captures the
whole step. The seed tutorial's train(mod, data) with opt.step() inside is tests/autograd/test_training.py.

Not run under EMBER_TEST_BASELINE=torch: torch.compile breaks the graph on purpose inside step()
(torch._dynamo.graph_break() in _use_grad_for_differentiable) and computes Adam's bias corrections in float32
where eager uses Python floats, so neither the counts nor the exactness hold there.
"""
from __future__ import annotations

import copy
import sys

import pytest
import torch

import ember
from tests.frontend.harness import BASELINE, Recorder, compile, has_target

pytestmark = pytest.mark.skipif(BASELINE, reason="torch.compile: other graph counts, not bit-exact (docstring)")

EXACT = dict(rtol=0, atol=0)
OPTIMIZERS = {
    "adam": lambda params, foreach, lr=0.1: torch.optim.Adam(params, lr=lr, foreach=foreach),
    "adamw": lambda params, foreach, lr=0.1: torch.optim.AdamW(params, lr=lr, foreach=foreach),
    "sgd": lambda params, foreach, lr=0.1: torch.optim.SGD(params, lr=lr, momentum=0.9, foreach=foreach),
}


def mlp() -> torch.nn.Module:
    """Four parameters of three shapes."""
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))


class Twins:
    """A model and optimizer to compile, and their eager copies; `grads()` gives both the same gradients."""

    def __init__(self, kind: str, foreach: bool | None, **kw):
        torch.manual_seed(0)
        self.model = mlp()
        self.ref = copy.deepcopy(self.model)
        self.opt = OPTIMIZERS[kind](self.model.parameters(), foreach, **kw)
        self.ref_opt = OPTIMIZERS[kind](self.ref.parameters(), foreach, **kw)

    def grads(self) -> None:
        x = torch.randn(5, 6)
        for m in (self.model, self.ref):
            m.zero_grad(set_to_none=True)
            m(x).square().sum().backward()

    def set_lr(self, lr: float) -> None:
        for o in (self.opt, self.ref_opt):
            o.param_groups[0]["lr"] = lr

    def assert_equal(self, where: str) -> None:
        """Parameters and every state tensor (step, exp_avg, exp_avg_sq, momentum_buffer) equal bit for bit."""
        for (name, p), q in zip(self.model.named_parameters(), self.ref.parameters()):
            torch.testing.assert_close(p, q, **EXACT, msg=lambda m: f"{where}: {name}: {m}")
            state, ref_state = self.opt.state[p], self.ref_opt.state[q]
            assert list(state) == list(ref_state), f"{where}: {name}: state keys {list(state)} != {list(ref_state)}"
            assert ref_state, f"{where}: {name}: the eager optimizer has no state"
            for k in ref_state:
                torch.testing.assert_close(state[k], ref_state[k], **EXACT, msg=lambda m: f"{where}: {name}.{k}: {m}")


def three_compiled_steps(t: Twins, rec: Recorder) -> list[int]:
    """Three steps of t's optimizer compiled (recorded by rec) and of its eager twin, equal after each; the
    number of graphs captured after each call."""
    step = compile(lambda: t.opt.step(), rec)
    graphs = []
    for i in range(3):
        t.grads()
        step()
        t.ref_opt.step()
        t.assert_equal(f"step {i + 1}")
        graphs.append(rec.graphs)
    return graphs


@pytest.mark.parametrize("foreach", [False, True], ids=["for-loop", "foreach"])
@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_step_is_one_graph_and_exact(kind, foreach):
    t, rec = Twins(kind, foreach), Recorder()
    graphs = three_compiled_steps(t, rec)
    # call 1 creates the state in Python; call 2 captures the whole step; call 3 reuses it
    assert graphs == [0, 1, 1], f"{kind}: graphs after each call {graphs}: {rec.describe()}"
    targets = {getattr(x, "__name__", x) for x in rec.targets(0)}
    in_place = {"_foreach_add_", "add_"} if kind == "sgd" else {"_foreach_add_", "add_", "addcdiv_"}
    assert targets & in_place, f"the step's in-place updates are missing from the graph: {sorted(map(str, targets))}"


@pytest.mark.parametrize("foreach", [False, True], ids=["for-loop", "foreach"])
@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_steady_state_step_under_fullgraph(kind, foreach):
    """Once the state exists, fullgraph=True compiles step() without a break (GraphBreakError otherwise)."""
    t = Twins(kind, foreach)
    t.grads()
    t.opt.step()
    t.ref_opt.step()
    step = compile(lambda: t.opt.step(), Recorder(), fullgraph=True)
    for i in range(2):
        t.grads()
        step()
        t.ref_opt.step()
        t.assert_equal(f"step {i + 2}")


def test_default_foreach_choice():
    """foreach=None (the default): torch.optim picks the implementation from the parameters' devices."""
    t = Twins("adam", None)
    rec = Recorder()
    step = compile(lambda: t.opt.step(), rec)
    for i in range(3):
        t.grads()
        step()
        t.ref_opt.step()
        t.assert_equal(f"step {i + 1}")
    assert rec.graphs == 1, rec.describe()


@pytest.mark.parametrize("foreach", [False, True], ids=["for-loop", "foreach"])
def test_learning_rate_changed_between_calls(foreach):
    """lr is a guarded constant, as under torch.compile: a new value recompiles once, with the new value."""
    t = Twins("adam", foreach)
    rec = Recorder()
    step = compile(lambda: t.opt.step(), rec)
    for i, lr in enumerate([0.1, 0.1, 0.01, 0.01, 0.1]):
        t.set_lr(lr)
        t.grads()
        step()
        t.ref_opt.step()
        t.assert_equal(f"step {i + 1} (lr={lr})")
    assert rec.graphs == 2, f"one graph per lr value: {rec.describe()}"


@pytest.mark.parametrize("backend", ["eager", "ember"])
@pytest.mark.parametrize("foreach", [False, True], ids=["for-loop", "foreach"])
def test_adam_step_through_backends(backend, foreach):
    """The captured step through a real backend. The graph starts with grad mode off (the optimizer's
    no_grad): the parameters are written back under it and stay leaves."""
    t = Twins("adam", foreach)
    step = ember.compile(lambda: t.opt.step(), backend=backend)
    exact = backend == "eager"   # ember: the update is one fused kernel (foreach ops decomposed), see below
    for i in range(3):
        t.grads()
        step()
        t.ref_opt.step()
        if exact:
            t.assert_equal(f"step {i + 1}")
        else:
            # ember's kernels compute lerp and addcmul as separate multiplies and adds where ATen's CPU
            # kernels use fused multiply-adds: a few ulps apart
            for p, q in zip(t.model.parameters(), t.ref.parameters()):
                torch.testing.assert_close(p, q)
    for p in t.model.parameters():
        assert p.is_leaf and p.grad_fn is None and p.requires_grad


# ---------------------------------------------------------------------------------------------------------
# The pieces: Python floats computed in the graph, dicts keyed by tensors, record_function.

def test_python_float_from_get_value_is_exact_and_unspecialized():
    """torch.optim's _get_value(step) is step.item() in eager: the float and what Python computes from it match
    eager bit for bit, and a new step value reuses the graph."""
    from torch.optim.optimizer import _get_value

    def f(step, t):
        s = _get_value(step)
        bc1 = 1 - 0.9 ** s
        bc2 = 1 - 0.999 ** s
        size = (0.1 / bc1) * -1
        return t / bc2 ** 0.5 + 1e-8, s / t, t - s, 2 * s, -size

    rec = Recorder()
    cf = compile(f, rec)
    for k in (1.0, 2.0, 7.0, 1000.0):
        step, t = torch.tensor(k), torch.randn(4, 3)
        want, got = f(step, t), cf(step, t)
        for w, g in zip(want, got):
            assert type(g) is type(w)
            if isinstance(w, float):
                assert g == w, (g, w)
            else:
                torch.testing.assert_close(g, w, **EXACT)
    assert rec.graphs == 1, rec.describe()


def test_python_float_from_get_value_in_a_branch_breaks():
    """Python control flow on such a float needs its value: a graph break, the rest runs on the real float."""
    from torch.optim.optimizer import _get_value

    def f(step, t):
        s = _get_value(step)
        if s > 2:
            return t * s
        return t - s

    cf = compile(f, Recorder())
    for k in (1.0, 3.0):
        step, t = torch.tensor(k), torch.randn(3)
        torch.testing.assert_close(cf(step, t), f(step, t), **EXACT)


def test_python_float_with_a_0d_tensor_breaks_and_stays_exact():
    """A 0-d tensor and a Python float keep the tensor's dtype; a float64 0-d tensor would promote: not recorded."""
    from torch.optim.optimizer import _get_value

    def f(step, t):
        return t * _get_value(step)

    cf = compile(f, Recorder())
    step, t = torch.tensor(3.0), torch.tensor(1.7)
    got, want = cf(step, t), f(step, t)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, **EXACT)


STATE: dict = {}


def test_dict_keyed_by_an_input_tensor():
    """d[t] with t a graph input: looked up with the tensor found at t's source on every call, so a new value
    under the same key is read without recompiling; a missing key raises KeyError as in eager."""
    w, other = torch.randn(3), torch.randn(3)
    STATE.clear()
    STATE[w] = {"m": torch.randn(3)}

    def f(x):
        return STATE[x]["m"] * x

    rec = Recorder()
    cf = compile(f, rec)
    torch.testing.assert_close(cf(w), f(w), **EXACT)
    STATE[w] = {"m": torch.randn(3)}
    torch.testing.assert_close(cf(w), f(w), **EXACT)
    assert rec.graphs == 1, rec.describe()
    with pytest.raises(KeyError):
        cf(other)


def test_record_function_is_left_out():
    """torch.autograd.profiler.record_function around ops: no effect on values, not in the graph."""
    def f(x):
        with torch.autograd.profiler.record_function("my range"):
            y = x.sin() * 2
        return y + 1

    rec = Recorder()
    cf = compile(f, rec)
    x = torch.randn(4)
    torch.testing.assert_close(cf(x), f(x), **EXACT)
    assert rec.graphs == 1 and rec.ops == [3], rec.describe()


def test_train_step_graphs_are_stable_and_exact():
    """The seed tutorial's train(mod, data) (zero_grad, forward, loss, backward, step) through the recording
    backend: exact, and from the second call on no new graph (backward and zero_grad are breaks; the step after
    backward is one graph). tests/autograd/test_training.py runs the same program through aot_eager."""
    t = Twins("adam", None)
    opts = {id(t.model): t.opt, id(t.ref): t.ref_opt}

    def train(mod, data):
        opt = opts[id(mod)]
        opt.zero_grad(True)
        pred = mod(data[0])
        loss = torch.nn.CrossEntropyLoss()(pred, data[1])
        loss.backward()
        opt.step()
        return loss

    rec = Recorder()
    ctrain = compile(train, rec)
    graphs = []
    for i in range(3):
        data = (torch.randn(8, 6), torch.randint(0, 3, (8,)))
        torch.testing.assert_close(ctrain(t.model, data), train(t.ref, data), **EXACT)
        t.assert_equal(f"step {i + 1}")
        graphs.append(rec.graphs)
    assert graphs[1] == graphs[2], f"call 3 compiled again: {rec.describe()}"
    assert any(has_target(gm, "lerp_") for gm in rec.gms), f"no graph updates exp_avg: {rec.describe()}"



def test_record_function_as_a_decorator_inside():
    """record_function(...)(fn) made inside the compiled function decorates fn (not an __exit__): it breaks."""
    def f(x):
        g = torch.autograd.profiler.record_function("decorated")(torch.cos)
        return g(x) + 1

    cf = compile(f, Recorder())
    x = torch.randn(4)
    torch.testing.assert_close(cf(x), f(x), **EXACT)


def test_break_inside_record_function():
    """A break inside the block: the rest of the frame runs as Python, with the block's (no-op) exit."""
    def f(x):
        with torch.autograd.profiler.record_function("outer"):
            y = x.sin()
            print("inside")
            y = y * 2
        return y + 1

    cf = compile(f, Recorder())
    x = torch.randn(4)
    torch.testing.assert_close(cf(x), f(x), **EXACT)


def test_step_captured_after_torch_compile_wrapped_torch_optim():
    """torch.compile's first use wraps some torch.optim methods for its own tracer (Adam._init_group, in
    torch/_dynamo/eval_frame.py); ember runs the wrapped function itself, so the step is still one graph (it
    broke into Python before, and bench/cpu.py's Adam row, which runs Inductor first, timed eager)."""
    torch.compile(lambda x: x + 1, backend="eager")(torch.randn(2))
    assert torch.optim.Adam._init_group.__code__.co_filename.endswith("eval_frame.py")
    t, rec = Twins("adam", True), Recorder()
    graphs = three_compiled_steps(t, rec)
    assert graphs == [0, 1, 1], f"graphs after each call {graphs}: {rec.describe()}"


def test_state_is_looked_up_once_per_parameter_and_call():
    """`opt.state[p]` is read by the type and keys guards, three tensor guards and three graph inputs; the entry
    looks it up once per parameter (a replaced Tensor.__hash__ runs once per lookup). The steady-state entry is
    the newest, tried first: the break entry's `p not in opt.state` guard is not evaluated. With torch's own
    Tensor.__hash__ (`id(self)`, a Python function), the C++ checker's dict_get computes the hash itself: no
    Python call at all."""
    t = Twins("adam", True)
    step = compile(lambda: t.opt.step(), Recorder())
    for _ in range(2):
        t.grads()
        step()
    t.grads()
    hashes = 0
    orig = torch.Tensor.__hash__

    def counting(self):
        nonlocal hashes
        hashes += 1
        return orig(self)
    torch.Tensor.__hash__ = counting
    try:
        step()
    finally:
        torch.Tensor.__hash__ = orig
    assert hashes == len(list(t.model.parameters()))
    from ember.runtime import native_guards
    if BASELINE or native_guards.checker() is None:
        return
    calls = []

    def profiler(frame, event, arg):
        if event == "call" and frame.f_code is orig.__code__:
            calls.append(1)
    t.grads()
    sys.setprofile(profiler)
    try:
        step()
    finally:
        sys.setprofile(None)
    assert calls == []


@pytest.mark.parametrize("backend", ["eager", "ember"])
@pytest.mark.parametrize("change", ["new tensor", "new state dict", "strides", "dtype", "missing key"])
def test_state_replaced_between_steps(change, backend):
    """The state tensors are graph inputs found by source on every call, behind guards on each: a state tensor
    or state dict replaced between steps is what the next step reads, and one that no longer matches the capture
    (other strides or dtype, a missing key) recompiles or runs in Python, never reusing the old graph's assumptions.
    Through the ember backend the kernels were generated for the captured strides and dtypes."""
    t = Twins("adam", True)
    step = ember.compile(lambda: t.opt.step(), backend=backend)
    for i in range(3):
        t.grads()
        step()
        t.ref_opt.step()
    p, q = next(iter(t.model.parameters())), next(iter(t.ref.parameters()))
    for opt, x in ((t.opt, p), (t.ref_opt, q)):
        torch.manual_seed(1)
        st = opt.state[x]
        if change == "new tensor":
            st["exp_avg"] = torch.randn_like(st["exp_avg"])
        elif change == "new state dict":
            opt.state[x] = {k: v.clone() * 0.5 for k, v in st.items()}
        elif change == "strides":    # the same values in a transposed layout
            st["exp_avg_sq"] = st["exp_avg_sq"].t().contiguous().t()
        elif change == "dtype":      # a float64 step counter
            st["step"] = st["step"].double()
        else:
            del st["exp_avg_sq"]
    t.grads()
    if change == "missing key":
        with pytest.raises(KeyError):
            t.ref_opt.step()
        with pytest.raises(KeyError):
            step()
        return
    step()
    t.ref_opt.step()
    if backend == "eager":
        t.assert_equal(f"after replacing the state ({change})")
        return
    for p, q in zip(t.model.parameters(), t.ref.parameters()):   # (fused multiply-adds: a few ulps apart)
        torch.testing.assert_close(p, q)
        for k, v in t.ref_opt.state[q].items():
            torch.testing.assert_close(t.opt.state[p][k], v, msg=lambda m: f"{change}: state {k}: {m}")
