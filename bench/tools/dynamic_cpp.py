"""Is a symbolic C++ kernel as fast as the static one at the same size? (issue 27, item 4: within 10%)

  PYTHONPATH=. .venv/bin/python bench/tools/dynamic_cpp.py [--rounds 5] [--graphs pointwise,softmax,...]

Each graph is an ATen graph built by tests/codegen/symbolic_graphs.py: once with its batch-like dim symbolic
(compiled once, docs/dynamic.md), once with every size a constant, both through cpp_backend.compile_aten, run on the
same inputs. Rounds alternate the two (a noisy shared machine: compare the ratio within a run); each round's time
is the median of a batch of calls (wall time, or with --cpu-time the process's CPU time, which other jobs on a
shared machine do not inflate: use it with OMP_NUM_THREADS=1). Prints per graph the median times and
symbolic/static.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from ember.backends import cpp_backend
from tests.codegen.symbolic_graphs import aten_fn, symbolic_graph

aten = torch.ops.aten


def pointwise(s0, x, y):
    return aten.relu.default(aten.add.Tensor(aten.mul.Tensor(aten.sin.default(x), y), 1.0))


def softmax(s0, x):
    return aten._softmax.default(x, -1, False)


def layer_norm(s0, x, w, b):
    return aten.native_layer_norm.default(x, [768], w, b, 1e-5)[0]


def row_sum(s0, x):
    return aten.sum.dim_IntList(aten.exp.default(x), [1])


def column_sum(s0, x):
    return aten.sum.dim_IntList(x, [0])


def linear_gelu(s0, x, w, b):
    return aten.gelu.default(aten.addmm.default(b, x, aten.t.default(w)))


def conv_relu(s0, x, w, b):
    y = aten.convolution.default(x, w, b, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    return aten.relu.default(y)


def view_mean(s0, x):   # a reshape by the symbol and a mean over the symbolic dim
    v = aten.view.default(x, [s0 * 16, 64])
    return aten.mean.dim(aten.mul.Tensor(v, v), [0])


def softmax_seq(s0, x):   # rows of a run-time width (attention's softmax over a sequence length)
    return aten._softmax.default(x, -1, False)


DYNAMIC = {"softmax_seq": {1: [1]}}   # the symbolic dims of the inputs (else dim 0 of the first tensor)
GRAPHS = {   # name: (fn, example size, run size, inputs(n) after the size)
    "pointwise": (pointwise, 64, 4093, lambda n: [torch.randn(n, 1024), torch.randn(1024)]),
    "softmax": (softmax, 64, 2047, lambda n: [torch.randn(n, 1000)]),
    "layer_norm": (layer_norm, 64, 4093, lambda n: [torch.randn(n, 768), torch.randn(768), torch.randn(768)]),
    "row_sum": (row_sum, 64, 4093, lambda n: [torch.randn(n, 1000)]),
    "column_sum": (column_sum, 64, 4093, lambda n: [torch.randn(n, 1024)]),
    "view_mean": (view_mean, 64, 4093, lambda n: [torch.randn(n, 16, 64)]),
    "softmax_seq": (softmax_seq, 64, 1023, lambda n: [torch.randn(512, n)]),
    "linear_gelu": (linear_gelu, 64, 509, lambda n: [torch.randn(n, 768), torch.randn(3072, 768), torch.randn(3072)]),
    "conv_relu": (conv_relu, 4, 7, lambda n: [torch.randn(n, 64, 56, 56), torch.randn(64, 64, 3, 3), torch.randn(64)]),
}


def compile_both(name):
    fn, example, n, inputs = GRAPHS[name]
    ex = inputs(example)
    gm, _ = symbolic_graph(aten_fn(fn), [example, *ex], DYNAMIC.get(name, {1: [0]}))
    sym = cpp_backend.compile_aten(gm, [example, *ex])
    assert hasattr(sym, "compiled"), f"{name}: the symbolic graph fell back"
    args = inputs(n)
    names = ", ".join(f"a{i}" for i in range(len(args)))
    ns = {"fn": fn, "n": n}
    exec(f"def static({names}):\n    return fn(n, {names})", ns)
    sgm, _ = symbolic_graph(aten_fn(ns["static"]), args, {})
    stat = cpp_backend.compile_aten(sgm, args)
    return sym, stat, [n, *args], args


CLOCK = [time.perf_counter]


def bench(f, args, calls):
    f(*args)
    ts = []
    for _ in range(calls):
        t = CLOCK[0]()
        f(*args)
        ts.append(CLOCK[0]() - t)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--graphs", default=",".join(GRAPHS))
    ap.add_argument("--cpu-time", action="store_true",
                    help="time the process's CPU time (with OMP_NUM_THREADS=1: robust to other jobs on the machine)")
    ns = ap.parse_args()
    if ns.cpu_time:
        CLOCK[0] = time.process_time
    print(f"{'graph':12s} {'size':>5s} {'static ms':>10s} {'symbolic ms':>12s} {'sym/static':>10s}   threads={torch.get_num_threads()}")
    for name in ns.graphs.split(","):
        sym, stat, sargs, args = compile_both(name)
        for a, b in zip(sym(*sargs), stat(*args)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)   # (two float32 products may differ in order)
        ts, tt = [], []
        for _ in range(ns.rounds):
            tt.append(bench(stat, args, ns.calls))
            ts.append(bench(sym, sargs, ns.calls))
        a, b = statistics.median(tt), statistics.median(ts)
        ratios = [y / x for x, y in zip(tt, ts)]
        print(f"{name:12s} {sargs[0]:5d} {a * 1e3:10.3f} {b * 1e3:12.3f} {b / a:10.2f}   per round: "
              + " ".join(f"{r:.2f}" for r in ratios), flush=True)


if __name__ == "__main__":
    main()
