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
