"""GPU timing of reductions with few results (issues #5/#6): eager, torch.compile (Inductor), ember with its split
reductions and ember without (config.SPLIT_REDUCTIONS = False), A/B in one process on one GPU.

    python bench/tools/gpu_reductions.py                 # every case
    python bench/tools/gpu_reductions.py --only ln,sum0  # cases whose name contains one of these
    python bench/tools/gpu_reductions.py --device cpu --check-only --only 2048x768   # no GPU: Triton's interpreter,
                                                  # ember's results against eager only (the script's plumbing)

Per case and column: GPU time per call (the CUDA kernels' summed durations under torch.profiler, / calls: what
the kernels cost, no launch gaps) and wall time per call (CUDA events around `--iters` back-to-back calls:
launches included, ember's ~8 us of Python per kernel launch among them). ember's graphs are traced to ATen by
the codegen tests' tracer and compiled by the Triton backend directly (no frontend cache between the split and
unsplit variants). Each result is checked against eager (assert_close, the sums' tolerance loosened for float32
summation order).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor_cold_"))
if "--device" in sys.argv[:-1] and sys.argv[sys.argv.index("--device") + 1] == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"   # read on import (triton, ember.runtime.triton_launch)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository root

import torch  # noqa: E402
import torch.utils._pytree as pytree  # noqa: E402

from ember import config  # noqa: E402
from ember.backends import triton_backend  # noqa: E402
from tests.codegen.aten_trace import trace_aten  # noqa: E402

DEV = "cuda"


def ln_grads(g, x, mean, rstd):
    """A layer norm's weight and bias gradients (GPT-2's backward, per layer norm): two column sums of the
    same rows, which ember computes in one kernel sharing the loads of g."""
    xhat = (x - mean) * rstd
    return (g * xhat).sum(0), g.sum(0)


def cases():
    r = lambda *s, dtype=torch.float32: torch.randn(*s, device=DEV, dtype=dtype)  # noqa: E731
    p = lambda *s: torch.rand(*s, device=DEV) + 0.5  # noqa: E731
    bt, c = 8 * 256, 768   # GPT-2 small training, batch 8 x 256 tokens
    return [
        ("sum0 2048x768", lambda x: x.sum(0), lambda: [r(bt, c)]),
        ("ln weight+bias grads 2048x768", ln_grads, lambda: [r(bt, c), r(bt, c), r(bt, 1), p(bt, 1)]),
        ("sum0 2048x768 bf16", lambda x: x.sum(0), lambda: [r(bt, c, dtype=torch.bfloat16)]),
        ("bias grad 2048x3072 (no split)", lambda x: x.sum(0), lambda: [r(bt, 4 * c)]),
        ("var_mean dim0 2048x768", lambda x: torch.var_mean(x, 0), lambda: [r(bt, c)]),
        ("sum0 65536x64", lambda x: x.sum(0), lambda: [r(65536, 64)]),
        ("full sum 64M", lambda x: x.sum(), lambda: [p(64 * 2 ** 20)]),
        ("full mean 64M", lambda x: x.mean(), lambda: [p(64 * 2 ** 20)]),
        ("amax all 64M", lambda x: x.amax(), lambda: [r(64 * 2 ** 20)]),
        ("sum dim1 8x1M", lambda x: x.sum(1), lambda: [p(8, 2 ** 20)]),
    ]


def gpu_us(fn, iters: int) -> float:
    """Summed CUDA kernel time per call, in microseconds (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                fn()
            torch.cuda.synchronize()
    except Exception as e:   # (no CUPTI): the wall time still comes
        print(f"  profiler failed: {type(e).__name__}: {e}", file=sys.stderr)
        return float("nan")
    total = 0.0
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = getattr(e, "self_cuda_time_total", 0.0)
        total += t
    return total / iters


def wall_us(fn, iters: int) -> float:
    """Median over 5 rounds of CUDA-event time around `iters` back-to-back calls, per call (microseconds)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        torch.cuda.synchronize()
        rounds.append(a.elapsed_time(b) * 1000 / iters)
    return statistics.median(rounds)


def ember_compiled(fn, xs, switches: dict):
    """fn through ember's Triton backend, compiled and loaded, with module switches set while it compiles
    ({(module, name): value}, e.g. config.SPLIT_REDUCTIONS off); (the callable, its host program)."""
    before = {k: getattr(*k) for k in switches}
    for (mod, name), value in switches.items():
        setattr(mod, name, value)
    try:
        gm, _ = trace_aten(fn, xs)
        compiled = triton_backend.compile_aten(gm, xs)
        if not hasattr(compiled, "compiled"):
            raise RuntimeError("ember ran the graph eagerly")
        compiled(*xs)   # compile and load every kernel now
        return compiled, compiled.compiled
    finally:
        for (mod, name), value in before.items():
            setattr(mod, name, value)


def baseline_call(column: str, fn, xs):
    """The call a baseline column times: eager, or torch.compile (Inductor) of fn; None for other columns."""
    if column == "eager":
        return lambda: fn(*xs)
    if column == "inductor":
        torch._dynamo.reset()
        c = torch.compile(fn)
        return lambda: c(*xs)
    return None


def check(out, ref) -> None:
    for o, w in zip(pytree.tree_leaves(out), pytree.tree_leaves(ref)):
        tol = {"atol": 1e-3, "rtol": 1e-4} if w.dtype == torch.float32 else {}
        torch.testing.assert_close(o, w, equal_nan=True, **tol)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--device", default="cuda", help="cpu: Triton's interpreter (correctness of the plumbing)")
    ap.add_argument("--check-only", action="store_true", help="compile and compare with eager, no timing")
    args = ap.parse_args()
    global DEV
    DEV = args.device
    only = [s for s in args.only.split(",") if s]
    name = torch.cuda.get_device_name() if DEV == "cuda" else "CPU (Triton interpreter)"
    print(f"# {name}, torch {torch.__version__}; GPU us / wall us per call (wall includes launches); k = kernels")
    head = f"{'case':34s} {'eager':>15s} {'inductor':>15s} {'ember split':>19s} {'ember unsplit':>19s}"
    print(head)
    for name, fn, make in cases():
        if only and not any(o in name for o in only):
            continue
        xs = make()
        ref = fn(*xs)
        cells = []
        for column in ("eager", "inductor", "ember split", "ember unsplit"):
            if args.check_only and column in ("eager", "inductor"):
                cells.append("-")
                continue
            try:
                kernels = ""
                call = baseline_call(column, fn, xs)
                if call is None:
                    c, prog = ember_compiled(fn, xs, {(config, "SPLIT_REDUCTIONS"): column == "ember split"})
                    call, kernels = (lambda: c(*xs)), f" k={len(prog.kernels)}"
                check(call(), ref)
                if args.check_only:
                    cells.append(f"ok{kernels}")
                    continue
                cells.append(f"{gpu_us(call, args.iters):6.1f}/{wall_us(call, args.iters):6.1f}{kernels}")
            except Exception as e:  # one failing column does not stop the table
                cells.append(f"{type(e).__name__}")
                print(f"  {name} / {column}: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr)
        print(f"{name:34s} {cells[0]:>15s} {cells[1]:>15s} {cells[2]:>19s} {cells[3]:>19s}", flush=True)


if __name__ == "__main__":
    main()
