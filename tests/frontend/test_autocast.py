"""torch.autocast inside and around compiled code: the casts autocast makes are the graph's, and a graph
captured under one autocast state is never reused under another."""
import pytest
import torch

import ember
from tests.frontend.harness import check, rand, reset


def _mm_relu_add(x, w):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = torch.relu(x @ w)
        z = y + 1
    return z.float() * 2, y.dtype


def test_autocast_block_is_captured_in_one_graph():
    rec = check(_mm_relu_add, rand(8, 16), rand(16, 4))
    assert rec.graphs == 1
    names = [getattr(t, "__name__", str(t)) for t in rec.targets()]
    assert "_enter_autocast" in names and "_exit_autocast" in names, names


def test_autocast_disabled_block_and_nested_dtypes():
    def f(x, w):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            a = x @ w
            with torch.autocast("cpu", enabled=False):
                b = x @ w
        return a, b, (a.float() + b).sum()
    rec = check(f, rand(8, 16), rand(16, 16))
    assert rec.graphs == 1


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "ember"])
def test_autocast_through_each_backend(backend):
    def f(x, w):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = torch.nn.functional.gelu(x @ w)
        return y * 2
    reset()
    cf = ember.compile(f, backend=backend)
    for _ in range(2):
        x, w = rand(8, 16), rand(16, 8)
        torch.testing.assert_close(cf(x, w), f(x, w))


@pytest.mark.parametrize("backend", ["eager", "ember"])
def test_compiled_call_inside_and_outside_user_autocast_recompiles(backend):
    def f(x, w):
        return torch.relu(x @ w) + 1
    reset()
    cf = ember.compile(f, backend=backend)
    x, w = rand(8, 16), rand(16, 8)
    torch.testing.assert_close(cf(x, w), f(x, w))                  # float32, captured outside autocast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, ref = cf(x, w), f(x, w)
    assert out.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(cf(x, w), f(x, w))                  # float32 again
    assert not torch.is_autocast_enabled("cpu")


def test_graph_break_inside_autocast_block_stays_correct():
    def f(x, w):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = x @ w
            print("inside")
            z = y @ w.t()
        return z
    check(f, rand(8, 16), rand(16, 16), _recompiles=True)
    assert not torch.is_autocast_enabled("cpu")


def test_autocast_training_step_gradients_match_eager():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    twin = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    twin.load_state_dict(model.state_dict())

    def step(m, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(x).float().pow(2).mean()
        loss.backward()
        return loss
    reset()
    cstep = ember.compile(step, backend="aot_eager")
    for _ in range(2):
        x = rand(8, 16)
        torch.testing.assert_close(cstep(model, x), step(twin, x))
        for p, q in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(p.grad, q.grad)


class _AutocastProbe:
    """Printed at a graph break: whether autocast is on where the break's instruction runs."""

    def __str__(self):
        return f"autocast {torch.is_autocast_enabled('cpu')} {torch.get_autocast_dtype('cpu')}"


def test_graph_break_inside_autocast_block_resumes_compiled_under_the_block():
    """The code after a break inside an autocast block is compiled (not run uncompiled: the block's __exit__ is
    rebuilt for the resume function), the break's instruction runs under the block, and the block ends where
    its code does."""
    probe = _AutocastProbe()

    def f(x, w):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = x @ w
            print(probe)
            z = torch.relu(y @ w.t()) + 1
        return z, z.dtype, (z.float() @ w).dtype, torch.is_autocast_enabled("cpu")
    rec = check(f, rand(8, 16), rand(16, 16), _recompiles=True)
    assert rec.graphs >= 2 and sum(rec.ops[1:]) >= 3, rec   # (the block's end breaks once more: a graph of none)
    assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("backend", ["aot_eager", "ember"])
def test_graph_entered_under_autocast_keeps_its_float32_block(backend):
    """The ATen graph holds autocast's casts: run under the caller's autocast, its float32 matmul (a block
    that turns autocast off) must not be cast again."""
    def f(x, w):
        a = torch.relu(x @ w)
        with torch.autocast("cpu", enabled=False):
            b = x.float() @ w.float()
        return a, b, (a.float() * b).sum(-1)
    reset()
    cf = ember.compile(f, backend=backend)
    for _ in range(2):
        x, w = rand(8, 16), rand(16, 16)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, ref = cf(x, w), f(x, w)
        assert [o.dtype for o in out] == [r.dtype for r in ref] == [torch.bfloat16, torch.float32, torch.float32]
        torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("backend", ["aot_eager", "ember"])
def test_loss_compiled_under_autocast_backward_outside_matches_eager(backend):
    """A loss graph entered under autocast, its backward run after the block (where eager's runs): the
    gradient's dtype and value are eager's, with the log_softmax over the graph's input split by the
    partition."""
    def loss_fn(logits, labels, w):
        h = logits @ w
        return torch.nn.functional.cross_entropy(h, labels) + torch.exp(h.float()).mean() * 1e-3
    reset()
    cf = ember.compile(loss_fn, backend=backend)
    for _ in range(2):
        x, w, y = rand(32, 64), rand(64, 100), torch.randint(0, 100, (32,))
        xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
        ws = [w.clone().requires_grad_(), w.clone().requires_grad_()]
        losses = []
        for fn, xi, wi in ((cf, xs[0], ws[0]), (loss_fn, xs[1], ws[1])):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = fn(xi, y, wi)
            loss.backward()
            losses.append(loss)
        # (the mean of 3,200 float32 exponentials: another summation order alone moves it by ~1e-6 of itself)
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(xs[0].grad, xs[1].grad)
        torch.testing.assert_close(ws[0].grad, ws[1].grad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA autocast's float32 list (exp, log): the CPU's "
                    "casts neither, so a partition that ran under it made no other dtype there")
@pytest.mark.parametrize("backend", ["aot_eager", "ember"])
def test_cross_entropy_of_bfloat16_logits_under_cuda_autocast_matches_eager(backend):
    """The partition splits the log_softmax over the graph's input into parts: computed under the caller's CUDA
    autocast, their exp and log were float32 where the backward, run without it, made bfloat16."""
    def loss_fn(logits, labels):
        return torch.nn.functional.cross_entropy(logits, labels)
    reset()
    cf = ember.compile(loss_fn, backend=backend)
    for _ in range(2):
        x = torch.randn(64, 1000, device="cuda", dtype=torch.bfloat16)
        y = torch.randint(0, 1000, (64,), device="cuda")
        xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
        losses = []
        for fn, xi in ((cf, xs[0]), (loss_fn, xs[1])):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = fn(xi, y)
            loss.backward()
            losses.append(loss)
        # (a mean of bfloat16 log-probabilities: one rounded the other way moves it by up to 4e-3 / 64)
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(xs[0].grad, xs[1].grad)
