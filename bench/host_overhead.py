"""Host time of a cached compiled call: what a call costs in Python when its kernels cost (almost) nothing.

    PYTHONPATH=. .venv/bin/python bench/host_overhead.py [--profile ROW] [--calls N] [--size S]

Rows (per-call µs, median over blocks of calls, all in one process):
  (a) a cached 10-op function on 8-element tensors;
  (b) torch.optim.Adam(foreach=True).step() over 10 weights;
  (c) the same over 160 weights (densenet121's step has ~360 parameters);
  (d) torchvision resnet50().eval() on a 1x3x64x64 input under no_grad (1,415 guards over 267 parameters and
      buffers: the guards are those of the GPU's b32 224x224 row, but for the device checks);
  (e) transformers BertModel(BertConfig()).eval() on 1x16 token ids under no_grad.
Weights are S x S (default 16), so the C++ kernels of the "ember" column take a few µs: on the GPU the
same host path runs 10 x Linear(1024, 1024) weights (issue #6's Adam row), whose kernels take ~0.10 ms.

Columns: "eager" is the uncompiled call; "nothing" is ember's frontend (guards, graph inputs by source, side
effects) with a backend that returns the first call's outputs and runs nothing: frontend cost alone;
"aot_eager" adds ember's autograd runtime with ATen graphs run eagerly; "ember" is the whole pipeline with the
C++ backend (host program + kernels). --profile ROW prints cProfile's top functions of that row's ember call
(and of its "nothing" call). --against DIR adds "nothing" and "ember" columns of the ember package in another
checkout (e.g. a `git worktree` of an older commit), imported in this process as `ember_against` (its imports
rewritten): an A/B in one process, where separate runs on a shared machine differ by more than the change.
--torch adds "torch nothing": torch.compile with the same backend (the baseline of the frontend's cost).
"""
from __future__ import annotations

import argparse
import cProfile
import pathlib
import pstats
import re
import shutil
import statistics
import sys
import tempfile
import time
from typing import Callable

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import ember  # noqa: E402
from frontend import machine, table, ten_ops  # noqa: E402


def nothing(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
    """A backend that runs the graph once (the capture's own call needs its effects) and afterwards returns
    those outputs without running anything."""
    state = {}

    def run(*args):
        if "out" not in state:
            state["out"] = gm.forward(*args)
        return state["out"]
    return run


def adam_row(n: int, size: int, capturable: bool = False) -> Callable[[Callable], Callable[[], object]]:
    """make(compile) -> step(): an Adam step over n size x size weights with gradients set."""
    def make(compile_fn: Callable) -> Callable[[], object]:
        torch.manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(size, size)) for _ in range(n)]
        for p in ps:
            p.grad = torch.randn_like(p)
        opt = torch.optim.Adam(ps, lr=1e-3, foreach=True, capturable=capturable)
        return compile_fn(lambda: opt.step())
    return make


def model_row(name: str) -> Callable[[Callable], Callable[[], object]]:
    """make(compile) -> call(): an inference call of a model whose cached call reads hundreds of parameters."""
    def make(compile_fn: Callable) -> Callable[[], object]:
        torch.manual_seed(0)
        if name == "resnet50":
            import torchvision
            model, x = torchvision.models.resnet50().eval(), torch.randn(1, 3, 64, 64)
        else:
            from transformers import BertConfig, BertModel
            model, x = BertModel(BertConfig()).eval(), torch.randint(0, 30522, (1, 16))
        f = compile_fn(model)

        def call():
            with torch.no_grad():
                return f(x)
        return call
    return make


def ten_op_row() -> Callable[[Callable], Callable[[], object]]:
    def make(compile_fn: Callable) -> Callable[[], object]:
        x, y = torch.randn(8), torch.randn(8)
        f = compile_fn(ten_ops)
        return lambda: f(x, y)
    return make


SHARE = {"(c)": 4, "(d)": 20, "(e)": 20}   # a row's calls per measurement: --calls divided by this

CLOCK = time.process_time   # --clock: CPU time of this process (a shared machine's waits left out) or wall time


def per_call(f: Callable[[], object], calls: int, block: int = 20) -> float:
    """Median seconds per call over blocks of `block` calls (one call is near the clock's resolution)."""
    samples = []
    clock = CLOCK
    for _ in range(max(1, calls // block)):
        t = clock()
        for _ in range(block):
            f()
        samples.append((clock() - t) / block)
    return statistics.median(samples)


COMPILERS = {
    "eager": lambda fn: fn,
    "nothing": lambda fn: ember.compile(fn, backend=nothing),
    "aot_eager": lambda fn: ember.compile(fn, backend="aot_eager"),
    "ember": lambda fn: ember.compile(fn, backend="ember"),
}


def load_against(checkout: str):
    """The ember package of another checkout, importable next to this one as `ember_against`."""
    dest = pathlib.Path(tempfile.mkdtemp(prefix="ember_against_"))
    shutil.copytree(pathlib.Path(checkout) / "ember", dest / "ember_against")
    for f in (dest / "ember_against").rglob("*.py"):
        text = re.sub(r"^(\s*)(from|import) ember\b", r"\1\2 ember_against", f.read_text(), flags=re.M)
        f.write_text(text.replace("import ember_against\n", "import ember_against as ember\n"))
    sys.path.insert(0, str(dest))
    import ember_against
    return ember_against


def build(rows: dict, warm: int = 3) -> dict:
    """(row, compiler) -> a warmed-up call."""
    calls = {}
    for rname, make in rows.items():
        for cname, comp in COMPILERS.items():
            f = make(comp)
            try:
                for _ in range(warm):   # the first Adam call creates the state (a break), the second captures
                    f()
            except Exception as e:  # reported in the table, not hidden
                print(f"{rname}, {cname}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
                continue
            calls[rname, cname] = f
    return calls


def profile(f: Callable[[], object], calls: int, top: int = 25) -> None:
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(calls):
        f()
    pr.disable()
    st = pstats.Stats(pr)
    st.sort_stats("tottime").print_stats(top)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=2000,
                   help="calls per measurement of rows (a)/(b); (c) a quarter, (d)/(e) a twentieth")
    p.add_argument("--size", type=int, default=16, help="weights are size x size")
    p.add_argument("--repeats", type=int, default=3, help="measurements per cell, interleaved (median)")
    p.add_argument("--profile", choices=list("abcde"), help="cProfile of this row's ember and nothing calls")
    p.add_argument("--rows", default="abc", help="which rows to run, e.g. 'bde'")
    p.add_argument("--against", metavar="DIR", help="also time the ember package of this checkout (A/B)")
    p.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                   help="cpu: this process's CPU time (default; other processes' load does not count), wall: elapsed")
    p.add_argument("--no-aot-eager", action="store_true", help="leave out the (slow) aot_eager column")
    p.add_argument("--torch", action="store_true",
                   help='add a "torch nothing" column: torch.compile with the same backend (its guards and cache '
                        'lookup alone)')
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (1: no OpenMP waits)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    # ember's C++ guards build in the background at the first capture (~11 s on a fresh machine); a row captured
    # before they are loaded keeps Python guards: wait, to measure what an installation with its cache runs
    from ember.runtime import native_guards
    native_guards.checker(wait=True)
    global CLOCK
    CLOCK = time.process_time if a.clock == "cpu" else time.perf_counter
    rows = {"(a) 10-op function, 8 elements": ten_op_row(),
            f"(b) Adam.step, 10 x {a.size}x{a.size}": adam_row(10, a.size),
            f"(c) Adam.step, 160 x {a.size}x{a.size}": adam_row(160, a.size),
            "(d) resnet50 b1 64x64 inference": model_row("resnet50"),
            "(e) BertModel b1 s16 inference": model_row("bert")}
    rows = {k: v for k, v in rows.items() if k[1] in a.rows}
    if a.no_aot_eager:
        del COMPILERS["aot_eager"]
    if a.torch:
        COMPILERS["torch nothing"] = lambda fn: torch.compile(fn, backend=nothing)
    if a.against:
        other = load_against(a.against)
        COMPILERS["nothing (against)"] = lambda fn: other.compile(fn, backend=nothing)
        COMPILERS["ember (against)"] = lambda fn: other.compile(fn, backend="ember")
    calls = build(rows)
    print(machine())
    if a.profile:
        rname = next(r for r in rows if r.startswith(f"({a.profile})"))
        for cname in ("nothing", "ember"):
            print(f"\n=== cProfile: {rname}, {cname} ===")
            profile(calls[rname, cname], a.calls // SHARE.get(rname[:3], 1))
        return 0
    times: dict = {k: [] for k in calls}
    for _ in range(a.repeats):   # interleaved: a burst of load on a shared machine hits every cell alike
        for (rname, cname), f in calls.items():
            n = a.calls // SHARE.get(rname[:3], 1)
            times[rname, cname].append(per_call(f, n))
    med = {k: min(v) * 1e6 for k, v in times.items()}   # the least disturbed of the repeats (a shared machine)
    print(f"per-call time, µs (best of {a.repeats} interleaved measurements, each the median over blocks "
          f"of 20 calls, {a.clock} clock); torch threads {a.threads}")
    header = ["row", *COMPILERS, "ember - nothing"]
    if a.against:
        print(f"against: {a.against}")
    body = []
    for rname in rows:
        cell = lambda c: f"{med[rname, c]:.1f}" if (rname, c) in med else "failed"  # noqa: E731
        diff = f"{med[rname, 'ember'] - med[rname, 'nothing']:.1f}" if (rname, "ember") in med else "-"
        body.append([rname, *[cell(c) for c in COMPILERS], diff])
    print(table(header, body))
    return 0


if __name__ == "__main__":
    sys.exit(main())
