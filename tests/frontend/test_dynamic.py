"""Symbolic sizes: dynamic=None (automatic dynamic), True and False, mark_dynamic / mark_static /
maybe_mark_dynamic, 0/1 specialization, guards on size relations, ints computed from sizes as graph nodes, the
recompile and dynamic logs. Every call is compared with eager; graph counts are torch.compile's
(EMBER_TEST_BASELINE=torch runs the same tests through torch.compile)."""
import logging
import operator

import pytest
import torch
import torch.nn as nn

import ember
from tests.frontend.harness import (
    BASELINE, Recorder, assert_same, compile, mark_dynamic, mark_static, maybe_mark_dynamic, rand, reset,
)

ember_only = pytest.mark.skipif(BASELINE, reason="inspects ember's graphs, guards or logs")


def run_sizes(fn, make, sizes, **kw) -> Recorder:
    """Compile fn once (Recorder backend), call it on make(n) for each n, each call compared with eager."""
    reset()
    rec = Recorder()
    cf = compile(fn, rec, **kw)
    for n in sizes:
        args = make(n)
        assert_same(fn(*args), cf(*args), f"{fn.__name__} at size {n}")
    return rec


def graphs_after(fn, make, sizes, **kw) -> list[int]:
    """The number of graphs compiled after each call."""
    reset()
    rec = Recorder()
    cf = compile(fn, rec, **kw)
    counts = []
    for n in sizes:
        args = make(n)
        assert_same(fn(*args), cf(*args), f"{fn.__name__} at size {n}")
        counts.append(rec.graphs)
    return counts


def rows(n):
    return (rand(n, 3),)


def pointwise(x):
    return (x.sin() + 1).relu().sum(-1)


def symbol_placeholders(gm) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.SymInt)]


# ------------------------------------------------------------------ the three modes

def test_automatic_dynamic_second_size_recompiles_once_later_sizes_never():
    counts = graphs_after(pointwise, rows, [4, 5, 6, 7, 9, 12, 20, 33, 2, 64])
    assert counts == [1, 2, 2, 2, 2, 2, 2, 2, 2, 2], counts


def test_dynamic_true_one_graph_for_every_size():
    counts = graphs_after(pointwise, rows, [4, 5, 6, 7, 9, 12, 20, 33, 2, 64], dynamic=True)
    assert counts == [1] * 10, counts


def test_dynamic_false_recompiles_every_size():
    counts = graphs_after(pointwise, rows, [4, 5, 6, 4], dynamic=False)
    assert counts == [1, 2, 3, 3], counts


def test_same_size_does_not_recompile_after_dynamic():
    rec = run_sizes(pointwise, rows, [4, 4, 5, 5, 4, 6, 6])
    assert rec.graphs == 2, rec


@ember_only
def test_symbolic_graph_follows_the_contract():
    """One int placeholder per symbol, named after it, before the tensor that uses it; tensor placeholders with
    symbolic sizes; ints computed from sizes as operator nodes with SymInt values."""
    def f(x):
        n = x.shape[-1] // 2
        return x[:, :n] * x.shape[0], x.view(x.shape[0] * 2, -1)
    rec = run_sizes(f, lambda n: (rand(n, 2 * n + 2),), [3, 4, 5, 6], dynamic=True)
    assert rec.graphs == 1, rec
    gm = rec.gms[0]
    syms = symbol_placeholders(gm)
    assert len(syms) == 2, gm.code
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert placeholders[:2] == syms
    for s in syms:
        assert s.name == str(s.meta["val"].node.expr), (s.name, s.meta["val"])
    x = placeholders[2].meta["val"]
    assert all(isinstance(d, torch.SymInt) for d in x.shape), x.shape
    arith = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in (operator.floordiv, operator.mul)
             and not any(isinstance(a, torch.fx.Node) and isinstance(a.meta["val"], torch.Tensor) for a in n.args)]
    assert {n.target for n in arith} == {operator.floordiv, operator.mul}, gm.code
    assert all(isinstance(n.meta["val"], torch.SymInt) for n in arith)
    # example inputs: the real sizes at the symbols' positions
    ex = rec.example_inputs[0]
    assert ex[0] == 3 and ex[1] == 8 and ex[2].shape == (3, 8), ex[:2]


# ------------------------------------------------------------------ marks

def test_mark_dynamic_makes_one_graph_under_dynamic_false():
    def make(n):
        x = rand(n, 3)
        mark_dynamic(x, 0)
        return (x,)
    counts = graphs_after(pointwise, make, [4, 5, 6, 9], dynamic=False)
    assert counts == [1, 1, 1, 1], counts


@pytest.mark.skipif(BASELINE, reason="torch.compile raises ConstraintViolationError for a size outside the range")
def test_mark_dynamic_range_recompiles_outside_it():
    def make(n):
        x = rand(n, 3)
        mark_dynamic(x, 0, min=2, max=8)
        return (x,)
    counts = graphs_after(pointwise, make, [4, 5, 8, 9, 6], dynamic=False)
    assert counts[:3] == [1, 1, 1] and counts[3] == 2 and counts[4] == 2, counts


def test_maybe_mark_dynamic_makes_one_graph():
    def make(n):
        x = rand(n, 3)
        maybe_mark_dynamic(x, 0)
        return (x,)
    counts = graphs_after(pointwise, make, [4, 5, 6, 9])
    assert counts == [1, 1, 1, 1], counts


def test_mark_static_keeps_a_dim_static_under_dynamic_true():
    def make(n):
        x = rand(n, n + 1)
        mark_static(x, 0)
        return (x,)
    counts = graphs_after(pointwise, make, [4, 5, 6], dynamic=True)
    assert counts == [1, 2, 3], counts


def test_parameters_stay_static_under_dynamic_true():
    lin = nn.Linear(3, 5)

    def f(x):
        return lin(x).relu()
    rec = run_sizes(f, rows, [4, 6, 9], dynamic=True)
    assert rec.graphs == 1, rec
    if not BASELINE:
        params = [n for n in rec.gms[0].graph.nodes if n.op == "placeholder" and "_parameters" in n.meta["source"]]
        assert params and all(all(isinstance(d, int) for d in n.meta["val"].shape) for n in params), \
            [n.meta["val"].shape for n in params]


@pytest.mark.parametrize("guards", ["c++", "python"])
def test_symbolic_tensor_guards_check_strides_dtype_and_grad(guards, monkeypatch):
    """A tensor with symbolic dims keeps its other checks: strides (against their expressions), dtype,
    requires_grad; in the C++ checker (its sizes as ANY) and in Python."""
    if BASELINE:
        pytest.skip("ember's guard implementations")
    from tests.frontend.test_guards_fast import use_guards
    use_guards(guards, monkeypatch)

    def f(x):
        return x.reshape(-1)[: x.shape[1]] * 2

    reset()
    rec = Recorder()
    cf = compile(f, rec, dynamic=True)
    calls = [rand(4, 6), rand(5, 7), rand(6, 4).t(), rand(7, 5).t(), rand(4, 6, dtype=torch.float64),
             rand(5, 6, requires_grad=True), rand(4, 6, 2)[:, :, 0], rand(8, 9)]
    for x in calls:
        assert_same(f(x), cf(x), f"shape {tuple(x.shape)} stride {x.stride()}")
    assert rec.graphs == 5, rec   # contiguous; transposed; float64; requires_grad; a stride-2 slice


# ------------------------------------------------------------------ 0/1 specialization

def test_sizes_zero_and_one_are_specialized():
    counts = graphs_after(pointwise, rows, [4, 1, 6, 0, 9, 1, 0, 5], dynamic=True)
    assert counts == [1, 2, 2, 3, 3, 3, 3, 3], counts


def test_broadcast_against_size_one_is_correct():
    def f(x, y):
        return x * y + x.shape[0]
    sizes = [(5, 5), (5, 1), (1, 5), (6, 6), (7, 1), (2, 2), (1, 1)]
    for dynamic in (True, None):
        reset()
        rec = Recorder()
        cf = compile(f, rec, dynamic=dynamic)
        for a, b in sizes:
            x, y = rand(a, 3), rand(b, 3)
            assert_same(f(x, y), cf(x, y), f"sizes {a}, {b}")


# ------------------------------------------------------------------ relations, specializations, ints

def branchy(x):
    if x.shape[0] > 4:
        return x * 2
    return x - 1


def test_branch_on_a_size_guards_the_relation():
    """A size on the same side of the branch reuses the graph; one on the other side recompiles once."""
    counts = graphs_after(branchy, rows, [5, 6, 9, 4, 2, 7], dynamic=True)   # (not 3: x.shape[1] is 3)
    assert counts == [1, 1, 1, 2, 2, 2], counts


@ember_only
def test_branch_guard_is_a_relation_not_a_value():
    reset()
    cf = ember.compile(branchy, backend="eager", dynamic=True)
    cf(rand(6, 3))
    guards = cf._frame.entries[0].guards
    assert any("> 4" in g or "<= 4" in g or ">= 5" in g for g in guards), guards
    assert not any("== 6" in g for g in guards), guards


def test_int_of_a_size_stays_symbolic():
    """int() of an int is the int: no value is needed yet (as torch.compile)."""
    def f(x):
        return x * int(x.shape[0]), int(x.shape[1] // 2)
    counts = graphs_after(f, rows, [4, 5, 4, 6], dynamic=True)
    assert counts == [1, 1, 1, 1], counts


def test_range_over_a_size_specializes_it():
    """A Python loop over range(n) unrolls: its length is the value of n (guarded equal)."""
    def f(x):
        out = x
        for i in range(x.shape[0]):
            out = out + i
        return out
    counts = graphs_after(f, rows, [4, 5, 4, 6], dynamic=True)
    assert counts == [1, 2, 2, 3], counts


def test_range_loop_whose_body_ignores_the_index_specializes_it():
    """The loop unrolls whatever its body does with the index (a graph holds no loops): n is specialized, each
    length compiles once, a length seen before finds its graph (as torch.compile)."""
    def f(x):
        out = x
        for _ in range(x.shape[0]):
            out = out * 0.5 + x
        return out
    counts = graphs_after(f, rows, [3, 5, 3, 6, 5], dynamic=True)
    assert counts == [1, 2, 2, 3, 3], counts


@ember_only   # (torch.compile keeps such a float symbolic: one graph)
def test_floats_of_sizes_are_guarded_on_their_values():
    """A size turned float (`n / 2`, `(n - 1) ** 0.5`, math.sqrt(d)) and given to a tensor op is the float's value at
    capture, guarded exactly: right at every size, and a size seen before finds its graph (a guard that the entry
    can evaluate: float(), math.sqrt in its namespace)."""
    import math

    def f(x):
        n, d = x.shape
        return x * (n / 2) + x.sum(0) / (n - 1) ** 0.5 - x / math.sqrt(d)
    counts = graphs_after(f, lambda n: (rand(n, n + 1),), [4, 5, 4, 7, 5], dynamic=True)
    assert counts == [1, 2, 2, 3, 3], counts


def test_list_index_by_a_size_specializes_it():
    table = [10, 20, 30, 40, 50, 60, 70, 80]

    def f(x):
        return x * table[x.shape[0]]
    run_sizes(f, rows, [2, 3, 4, 3, 7], dynamic=True)


def test_size_arithmetic_stays_symbolic():
    def f(x):
        b, t = x.shape[:2]
        h = x.shape[-1] // 2
        y = x.reshape(b * t, -1)[:, :h]
        return y.view(b, t, h).sum(1) * max(t, 3), b * t, torch.zeros(b, h).shape
    counts = graphs_after(f, lambda n: (rand(n, n + 2, 2 * n),), [3, 4, 5, 7], dynamic=True)
    assert counts == [1, 1, 1, 1], counts


def test_formatting_a_size_gives_its_value():
    def f(x):
        return x + 1, f"{x.shape[0]}x{x.shape[1]}", str(x.shape)
    run_sizes(f, rows, [4, 5, 6], dynamic=True)


def test_sizes_live_across_a_graph_break():
    def f(x):
        n = x.shape[0]
        print("step")                     # a graph break: n reaches the resume function as an int
        return x * n, n // 2, x.shape
    counts = graphs_after(f, rows, [4, 5, 6, 7, 9])
    assert counts[1] == counts[-1], counts   # recompiles at the second size only
    assert BASELINE or counts == [1, 2, 2, 2, 2], counts


def test_size_written_to_an_attribute_and_returned():
    class Box:
        pass
    box = Box()

    def f(x):
        box.n = x.shape[0] * 3
        return x.sum(0)
    reset()
    cf = compile(f, Recorder(), dynamic=True)
    for n in (4, 5, 7):
        cf(rand(n, 3))
        assert box.n == 3 * n


# ------------------------------------------------------------------ data-dependent sizes

def test_boolean_mask_breaks_the_graph_and_stays_correct():
    def f(x):
        return x[x > 0].sum() + x.shape[0]
    run_sizes(f, rows, [4, 5, 6, 9], dynamic=True)


def test_nonzero_is_correct_under_dynamic():
    def f(x):
        return torch.nonzero(x > 0).float().sum(0) * 2
    run_sizes(f, rows, [4, 5, 6], dynamic=True)


# ------------------------------------------------------------------ logs

@ember_only
def test_recompile_and_dynamic_logs(caplog):
    caplog.set_level(logging.DEBUG, logger="ember")
    run_sizes(pointwise, rows, [4, 6])
    text = "\n".join(r.getMessage() for r in caplog.records if r.name in ("ember.recompiles", "ember.dynamic"))
    assert "guard failed" in text and "x.shape" in text, text
    assert "changed from 4 to 6" in text, text


@ember_only
def test_specialization_is_logged_with_the_user_line(caplog):
    caplog.set_level(logging.DEBUG, logger="ember.dynamic")

    table = list(range(10))

    def f(x):
        return x * table[x.shape[0]]
    run_sizes(f, rows, [4], dynamic=True)
    text = "\n".join(r.getMessage() for r in caplog.records if r.name == "ember.dynamic")
    assert "specialized" in text and f"{__file__}:{f.__code__.co_firstlineno + 1}" in text, text


@ember_only
def test_data_dependent_break_is_logged(caplog):
    caplog.set_level(logging.DEBUG, logger="ember.dynamic")

    def f(x):
        return x[x > 0].sum()
    run_sizes(f, rows, [4], dynamic=True)
    assert any("data-dependent" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


# ------------------------------------------------------------------ the ember backend on a symbolic graph

@ember_only
def test_ember_backend_runs_a_symbolic_graph_correctly():
    reset()
    cf = ember.compile(pointwise, dynamic=True)
    for n in (4, 5, 9):
        x = rand(n, 3)
        assert_same(pointwise(x), cf(x))
    assert len(cf._frame.entries) == 1


@ember_only
def test_reset_forgets_the_sizes_seen():
    reset()
    rec = Recorder()
    cf = compile(pointwise, rec)
    cf(rand(4, 3))
    cf(rand(5, 3))
    assert rec.graphs == 2 and symbol_placeholders(rec.gms[1]), rec
    reset()
    x = rand(6, 3)
    assert_same(pointwise(x), cf(x))
    assert rec.graphs == 3 and not symbol_placeholders(rec.gms[2]), rec   # static again, as a first capture


def test_a_module_buffer_read_beside_a_symbolic_input_stays_static():
    """A buffer sliced by a symbolic length (BERT's position_ids[:, :seq]) keeps its own sizes static: with a
    ShapeEnv, a fake made without saying so gave each of its dims a symbol no input's size gives, the symbolic
    capture failed, and every new length compiled again."""
    class WithPositions(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("position_ids", torch.arange(64).expand((1, -1)), persistent=False)
            self.emb = torch.nn.Embedding(64, 8)

        def forward(self, x):
            return x.unsqueeze(-1) * self.emb(self.position_ids[:, :x.shape[1]])

    torch.manual_seed(0)
    m = WithPositions()
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    f = ember.compile(m, backend=counting)
    with torch.no_grad():
        for n in (16, 28, 40, 52):
            x = torch.randn(2, n)
            torch.testing.assert_close(f(x), m(x))
    assert len(graphs) == 2
