"""Is a symbolic Triton kernel as fast as the static one at the same size? (issue 27, item 4: within 10%)

  PYTHONPATH=. python bench/tools/dynamic_triton.py [--rounds 5] [--graphs pointwise,softmax,...]

The graphs of bench/tools/dynamic_cpp.py on CUDA tensors: each built once with its batch-like dim symbolic
(compiled once at the example size, docs/dynamic.md) and once with every size a constant, both through
triton_backend.compile_aten, run on the same inputs at the run size and at the run size rounded up to a multiple
of 16 (Triton specializes size arguments on divisibility by 16, as the static kernel knows its sizes). Each
round times a batch of calls between CUDA events (host program and kernels: what a call costs); rounds alternate
the two. Prints per graph and size the median times and symbolic/static.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from bench.tools.dynamic_cpp import DYNAMIC, GRAPHS
from ember.backends import triton_backend
from tests.codegen.symbolic_graphs import aten_fn, symbolic_graph


def cuda_inputs(inputs, n):
    return [t.cuda() for t in inputs(n)]


def compile_symbolic(name):
    fn, example, _, inputs = GRAPHS[name]
    ex = cuda_inputs(inputs, example)
    gm, _ = symbolic_graph(aten_fn(fn), [example, *ex], DYNAMIC.get(name, {1: [0]}))
    sym = triton_backend.compile_aten(gm, [example, *ex])
    assert hasattr(sym, "compiled"), f"{name}: the symbolic graph fell back"
    return sym


def compile_static(name, n):
    fn, _, _, inputs = GRAPHS[name]
    args = cuda_inputs(inputs, n)
    names = ", ".join(f"a{i}" for i in range(len(args)))
    ns = {"fn": fn, "n": n}
    exec(f"def static({names}):\n    return fn(n, {names})", ns)
    sgm, _ = symbolic_graph(aten_fn(ns["static"]), args, {})
    return triton_backend.compile_aten(sgm, args), args


def bench(f, args, calls):
    f(*args)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        f(*args)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--graphs", default=",".join(g for g in GRAPHS if g != "conv_relu"))
    ns = ap.parse_args()
    print(f"{'graph':12s} {'size':>5s} {'static ms':>10s} {'symbolic ms':>12s} {'sym/static':>10s}   "
          f"{torch.cuda.get_device_name()}")
    for name in ns.graphs.split(","):
        sym = compile_symbolic(name)
        run = GRAPHS[name][2]
        for n in (run, run + (-run) % 16):
            stat, args = compile_static(name, n)
            sargs = [n, *args]
            for a, b in zip(sym(*sargs), stat(*args)):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)   # (two float32 products may differ in order)
            ts, tt = [], []
            for _ in range(ns.rounds):
                tt.append(bench(stat, args, ns.calls))
                ts.append(bench(sym, sargs, ns.calls))
            a, b = statistics.median(tt), statistics.median(ts)
            print(f"{name:12s} {n:5d} {a:10.4f} {b:12.4f} {b / a:10.2f}   per round: "
                  + " ".join(f"{y / x:.2f}" for x, y in zip(tt, ts)), flush=True)


if __name__ == "__main__":
    main()
