"""The seed tutorial (Introduction to torch.compile), its examples exactly as written there:
foo, opt_foo2, MyModule, f2 (issue 2); custom_backend, bar, f1, f3 (issues 2 and 3)."""
import warnings
from typing import List

import pytest
import scipy
import scipy.fft
import torch

import ember
from tests.frontend.harness import BASELINE, Recorder, assert_same, compile, has_target


def foo(x, y):
    a = torch.sin(x)
    b = torch.cos(y)
    return a + b


class MyModule(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(100, 10)

    def forward(self, x):
        return torch.nn.functional.relu(self.lin(x))


def f1(x, y):
    if x.sum() < 0:
        return -y
    return y


def f2(x, y):
    return x + y


def f3(x):
    x = x * 2
    x = scipy.fft.dct(x.numpy())
    x = torch.from_numpy(x)
    x = x * 2
    return x


def bar(a, b):
    x = a / (torch.abs(a) + 1)
    if b.sum() < 0:
        b = b * -1
    return x * b


def custom_backend(gm: torch.fx.GraphModule, example_inputs: List[torch.Tensor]):
    print("custom backend called with FX graph:")
    gm.graph.print_tabular()
    return gm.forward


def test_fns(fn1, fn2, args):  # the tutorial's helper (also collected as a test: it needs arguments, see below)
    out1 = fn1(*args)
    out2 = fn2(*args)
    return torch.allclose(out1, out2)


test_fns.__test__ = False


# ------------------------------------------------------------------ issue 2

def test_foo_compiled():
    rec = Recorder()
    opt_foo1 = compile(foo, rec)
    x, y = torch.randn(10, 10), torch.randn(10, 10)
    assert_same(foo(x, y), opt_foo1(x, y))
    assert rec.graphs == 1 and rec.ops == [3]


def test_foo_with_default_backend():
    """ember.compile(foo) with the default backend ("ember"), as the tutorial writes it."""
    opt_foo1 = ember.compile(foo)
    x, y = torch.randn(10, 10), torch.randn(10, 10)
    assert_same(foo(x, y), opt_foo1(x, y), rtol=1e-5, atol=1e-5)


def test_foo_as_decorator():
    rec = Recorder()

    @compile(recorder=rec)
    def opt_foo2(x, y):
        a = torch.sin(x)
        b = torch.cos(y)
        return a + b

    x, y = torch.randn(10, 10), torch.randn(10, 10)
    assert_same(foo(x, y), opt_foo2(x, y))
    assert rec.graphs == 1 and rec.ops == [3]


def test_foo_as_ember_decorator():
    @ember.compile
    def opt_foo2(x, y):
        a = torch.sin(x)
        b = torch.cos(y)
        return a + b

    x, y = torch.randn(10, 10), torch.randn(10, 10)
    assert_same(foo(x, y), opt_foo2(x, y), rtol=1e-5, atol=1e-5)


def test_my_module():
    mod = MyModule()
    rec = Recorder()
    opt_mod = compile(mod, rec)
    x = torch.randn(10, 100)
    assert_same(mod(x), opt_mod(x))
    assert rec.graphs == 1 and rec.ops == [2]


def test_f2_with_python_int():
    """f2(x, 3): torch.jit.script fails on it (y is not annotated), compile handles it."""
    inp1, inp2 = torch.randn(5, 5), 3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        script_f2 = torch.jit.script(f2)
        with pytest.raises(Exception):
            script_f2(inp1, inp2)
    rec = Recorder()
    compile_f2 = compile(f2, rec)
    assert test_fns(f2, compile_f2, (inp1, inp2))
    assert_same(f2(inp1, inp2), compile_f2(inp1, inp2))
    assert rec.graphs == 1 and rec.ops == [1]


def test_custom_backend_prints_tabular(capsys):
    opt_foo = compile(foo, backend=custom_backend)
    x, y = torch.randn(10, 10), torch.randn(10, 10)
    assert_same(foo(x, y), opt_foo(x, y))
    out = capsys.readouterr().out
    assert out.count("custom backend called with FX graph:") == 1
    assert "placeholder" in out and "call_function" in out and "output" in out
    assert "sin" in out and "cos" in out


# ------------------------------------------------------------------ issue 3

def test_bar_three_distinct_graphs(capsys):
    """bar(a, b) then bar(a, -b) with the tutorial's custom_backend: exactly 3 graphs, results equal eager."""
    rec = Recorder()

    def recording_custom_backend(gm, example_inputs):
        rec(gm, example_inputs)
        return custom_backend(gm, example_inputs)

    opt_bar = compile(bar, backend=recording_custom_backend)
    inp1, inp2 = torch.randn(10), torch.randn(10)
    if inp2.sum() < 0:
        inp2 = -inp2        # call order as the tutorial: first the branch not taken, then taken
    assert_same(bar(inp1, inp2), opt_bar(inp1, inp2))
    assert_same(bar(inp1, -inp2), opt_bar(inp1, -inp2))
    assert rec.graphs == 3, rec
    assert capsys.readouterr().out.count("custom backend called with FX graph:") == 3
    # graph 1: x = a / (abs(a) + 1) and b.sum() < 0;  graph 2: b * -1; x * b;  graph 3: x * b
    assert sorted(rec.ops) == [1, 2, 5], rec
    # further calls in both directions reuse the three graphs
    for sign in (1, -1, 1, -1):
        assert_same(bar(inp1, sign * inp2), opt_bar(inp1, sign * inp2))
    assert rec.graphs == 3


def test_f1_both_signs():
    rec = Recorder()
    compile_f1 = compile(f1, rec)
    inp1, inp2 = torch.randn(5, 5), torch.randn(5, 5)
    for x in (inp1, -inp1, inp1, -inp1):
        assert_same(f1(x, inp2), compile_f1(x, inp2))
        assert test_fns(f1, compile_f1, (x, inp2))
    assert 1 <= rec.graphs <= 3, rec  # the sum, then a resume graph for `-y` (returning y needs none)


def test_f1_jit_trace_is_silently_wrong():
    """The tutorial's point: torch.jit.trace records one branch, so the other sign gives a wrong result."""
    inp1, inp2 = torch.randn(5, 5), torch.randn(5, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced_f1 = torch.jit.trace(f1, (inp1, inp2))
    assert test_fns(f1, traced_f1, (inp1, inp2))
    assert not test_fns(f1, traced_f1, (-inp1, inp2))
    compile_f1 = compile(f1, Recorder())
    assert test_fns(f1, compile_f1, (-inp1, inp2))


def test_f3_scipy_dct_in_the_middle():
    rec = Recorder()
    compile_f3 = compile(f3, rec)
    inp = torch.randn(5, 5)
    assert_same(f3(inp), compile_f3(inp))
    assert test_fns(f3, compile_f3, (torch.randn(5, 5),))
    # a graph before the call (x * 2) and one after (x * 2 on the result); .numpy()/from_numpy run in Python
    assert has_target(rec.gms[0], "mul") and has_target(rec.gms[-1], "mul"), rec
    if not BASELINE:  # torch.compile also traces numpy interop inside scipy's Python wrappers: 4 graphs, [2, 1, 1, 2]
        assert rec.graphs == 2 and rec.ops == [1, 1], rec


def test_f3_jit_trace_treats_scipy_as_constant():
    inp1, inp2 = torch.randn(5, 5), torch.randn(5, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced_f3 = torch.jit.trace(f3, (inp1,))
    assert not test_fns(f3, traced_f3, (inp2,))
    assert test_fns(f3, compile(f3, Recorder()), (inp2,))


@pytest.mark.skipif(BASELINE, reason="ember.explain is ember's; torch's explain is exercised in test_breaks_api")
def test_bar_explain_matches():
    inp1, inp2 = torch.randn(10), torch.randn(10)
    ex = ember.explain(bar)(inp1, inp2)
    assert ex.graph_count == 2 and ex.graph_break_count == 1
