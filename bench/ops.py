"""Op sweep: the ops and small op patterns ember lowers, eager vs torch.compile (Inductor) vs ember, side by side.

    .venv/bin/python bench/ops.py [--device cpu|cuda] [--only a,b] [--no-inductor] [--scale S] [--shard i/n] [--json FILE]
                                  [--cpu-target native|avx2|avx512] [--threads N] [--clock wall|process]

Each row is one pattern at a realistic size (about 4M elements on the CPU, 16M on the GPU; --scale multiplies them), checked
against eager first (assert_close; float16/bfloat16 rows at their dtype's tolerance), then timed: the compilers'
calls interleaved one per round so all see the same load, median of the rounds. Columns: ms per call, and
eager/compiler ratios (above 1: faster than eager). The summary gives the geomean of ember against Inductor and lists
every row where ember is more than 5% slower than eager. Inference only (torch.no_grad): the patterns, not autograd.
--cpu-target runs the sweep as on a CPU that has only that instruction set (bench/suite.py's ISA_ENV: ember's C++,
ATen's kernels, Inductor's C++ and oneDNN all capped); --threads sets every column's threads; --clock process times
the calls in this process's CPU time (a shared machine's other work does not add to it; with --threads 1 the wall
time of an idle machine).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

M = 1 << 20   # elements in a "1M" tensor
ISA_ENV = {"avx2": {"EMBER_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                    "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
           "avx512": {"EMBER_CPU_ISA": "avx512", "ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
                      "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
           "native": {}}


def _pointwise_chain(n):
    return (lambda x: ((x.sin() * 2 + x.cos()).relu() * x - 1).sigmoid()), [("randn", (n,))]


def _broadcast_add_mul(n):
    return (lambda x, b, c: (x + b) * c), [("randn", (n // 1024, 1024)), ("randn", (1024,)), ("randn", (n // 1024, 1))]


def _sum_last(n):
    return (lambda x: x.sum(-1)), [("randn", (n // 1024, 1024))]


def _sum_first(n):
    return (lambda x: x.sum(0)), [("randn", (n // 1024, 1024))]


def _sum_middle(n):
    return (lambda x: x.sum(1)), [("randn", (n // (64 * 256), 64, 256))]


def _amax_all(n):
    return (lambda x: x.amax()), [("randn", (n,))]


def _mean_var(n):
    return (lambda x: torch.var_mean(x, -1)), [("randn", (n // 512, 512))]


def _softmax(n):
    return (lambda x: torch.softmax(x, -1)), [("randn", (n // 1024, 1024))]


def _log_softmax_dim0(n):
    return (lambda x: torch.log_softmax(x, 0)), [("randn", (512, n // 512))]


def _softmax_masked_scaled(n):
    return (lambda x, m: torch.softmax(x.masked_fill(m, float("-inf")) * 0.125, -1)), \
        [("randn", (n // 256, 256)), ("mask", (n // 256, 256))]


def _layer_norm(n):
    return (lambda x, w, b: F.layer_norm(x, (768,), w, b)), [("randn", (n // 768, 768)), ("randn", (768,)), ("randn", (768,))]


def _rms_norm(n):
    return (lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w), \
        [("randn", (n // 1024, 1024)), ("randn", (1024,))]


def _group_norm_fp16(n):
    return (lambda x, w, b: F.silu(F.group_norm(x, 32, w, b))), \
        [("randn16", (n // (128 * 32 * 32), 128, 32, 32)), ("randn16", (128,)), ("randn16", (128,))]


def _slice_cat_last(n):
    return (lambda x: torch.cat([x[..., 1::2], x[..., ::2] * -1], -1)), [("randn", (n // 128, 128))]


def _rotary(n):
    def f(x, cos, sin):
        x1, x2 = x[..., :32], x[..., 32:]
        return x * cos + torch.cat([-x2, x1], -1) * sin
    return f, [("randn", (n // 64, 64)), ("randn", (n // 64, 64)), ("randn", (n // 64, 64))]


def _transpose_copy(n):
    return (lambda x: x.transpose(0, 1).contiguous() + 1), [("randn", (n // 1024, 1024))]


def _gather_rows(n):
    return (lambda w, i: w[i] * 2), [("randn", (32000, 256)), ("index", (n // 256,), 32000)]


def _index_select_sum(n):
    return (lambda x, i: x.index_select(0, i).sum(-1)), [("randn", (n // 128, 128)), ("index", (n // 256,), n // 128)]


def _scatter_add(n):
    return (lambda x, i, src: x.scatter_add(0, i, src)), \
        [("randn", (1024, 128)), ("index", (n // 128, 128), 1024), ("randn", (n // 128, 128))]


def _cross_entropy_smooth(n):
    return (lambda x, y: F.cross_entropy(x, y, label_smoothing=0.1)), [("randn", (n // 1000, 1000)), ("index", (n // 1000,), 1000)]


def _mse_loss(n):
    return (lambda x, y: F.mse_loss(x, y)), [("randn", (n,)), ("randn", (n,))]


def _gelu_bf16(n):
    return (lambda x: F.gelu(x * 1.5 + 0.5)), [("randnbf", (n,))]


def _where_clamp(n):
    return (lambda x, y: torch.where(x > 0, x, y).clamp(-1, 1)), [("randn", (n,)), ("randn", (n,))]


def _cumsum(n):
    return (lambda x: x.cumsum(-1)), [("randn", (n // 1024, 1024))]


PATTERNS = {"pointwise chain": _pointwise_chain, "broadcast add mul": _broadcast_add_mul, "sum last dim": _sum_last,
            "sum first dim": _sum_first, "sum middle dim": _sum_middle, "amax all": _amax_all,
            "var_mean": _mean_var, "softmax": _softmax, "log_softmax dim0": _log_softmax_dim0,
            "masked scaled softmax": _softmax_masked_scaled, "layer_norm": _layer_norm, "rms_norm": _rms_norm,
            "group_norm silu fp16": _group_norm_fp16, "slice cat last dim": _slice_cat_last, "rotary": _rotary,
            "transpose copy": _transpose_copy, "gather rows": _gather_rows, "index_select sum": _index_select_sum,
            "scatter_add": _scatter_add, "cross_entropy smoothing": _cross_entropy_smooth, "mse_loss": _mse_loss,
            "gelu bf16": _gelu_bf16, "where clamp": _where_clamp, "cumsum": _cumsum}


def make_inputs(specs, device):
    out = []
    for kind, shape, *rest in specs:
        if kind == "randn":
            out.append(torch.randn(shape, device=device))
        elif kind == "randn16":
            out.append(torch.randn(shape, device=device, dtype=torch.float16))
        elif kind == "randnbf":
            out.append(torch.randn(shape, device=device, dtype=torch.bfloat16))
        elif kind == "mask":
            out.append(torch.rand(shape, device=device) < 0.1)
        elif kind == "index":
            out.append(torch.randint(0, rest[0], shape, device=device))
    return out


def median_ms(fns: dict, args, device: str, budget_s: float = 1.5, clock=time.perf_counter) -> dict:
    """Median ms per call of each compiler, one call of each per round (the same load for all)."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    one = 0.0
    for fn in fns.values():
        fn(*args)
        sync()
        t0 = time.perf_counter()
        fn(*args)
        sync()
        one += time.perf_counter() - t0
    rounds = max(5, min(200, int(budget_s / max(one, 1e-6))))
    ts: dict = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            sync()
            t0 = clock()
            fn(*args)
            sync()
            ts[k].append(clock() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in ts.items()}


def run_row(name: str, device: str, scale: float, inductor: bool, clock=time.perf_counter) -> dict:
    import ember
    n = int(M * (4 if device == "cuda" else 1) * scale)
    n = max(1 << 16, n // (1 << 16) * (1 << 16))   # a multiple of every row's inner sizes
    fn, specs = PATTERNS[name](n * 4)
    torch.manual_seed(0)
    args = make_inputs(specs, device)
    fns = {"eager": fn}
    if inductor:
        torch._dynamo.reset()
        fns["inductor"] = torch.compile(fn)
    fns["ember"] = ember.compile(fn)
    row = {"row": name, "elements": args[0].numel(), "dtype": str(args[0].dtype).replace("torch.", "")}
    with torch.no_grad():
        expected = fn(*args)
        for k in list(fns):
            if k == "eager":
                continue
            t0 = time.perf_counter()
            try:
                got = fns[k](*args)
                if device == "cuda":
                    torch.cuda.synchronize()
                row[f"{k} compile s"] = time.perf_counter() - t0
                # float32: 1e-4 of the result's scale (a sum in another order is off by its rounding, relative to
                # the largest value, not to each element); 16-bit rows at their dtype's precision
                tol = 2e-2 if args[0].dtype != torch.float32 else 1e-4
                scale = max((t.abs().max().item() for t in torch.utils._pytree.tree_leaves(expected)
                             if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()), default=1.0)
                torch.testing.assert_close(got, expected, rtol=tol, atol=tol * max(scale, 1.0))
            except Exception as e:   # a failure is a row, not an abort
                row[f"{k} error"] = f"{type(e).__name__}: {str(e)[:160]}"
                del fns[k]
        row.update({f"{k} ms": v for k, v in median_ms(fns, args, device, clock=clock).items()})
    return row


def geomean(xs):
    xs = [x for x in xs if x == x and x > 0]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--only", default="", help="comma-separated parts of row names")
    p.add_argument("--no-inductor", action="store_true")
    p.add_argument("--scale", type=float, default=1.0, help="multiplies every row's size")
    p.add_argument("--shard", default="1/1", help="i/n: the i-th of n interleaved slices of the rows (1-based)")
    p.add_argument("--json")
    p.add_argument("--cpu-target", default="native", choices=sorted(ISA_ENV), help="CPU instruction set (module doc)")
    p.add_argument("--threads", type=int, default=0, help="threads of every column (default: torch's)")
    p.add_argument("--clock", default="wall", choices=["wall", "process"], help="the timed calls' clock (module doc)")
    a = p.parse_args()
    env = {**ISA_ENV[a.cpu_target], **({"OMP_NUM_THREADS": str(a.threads)} if a.threads else {})}
    if any(os.environ.get(k) != v for k, v in env.items()):   # the caps are read at library load: a fresh process
        # Inductor's cache would serve kernels built for another target (wrong results): its own directory
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix=f"ops_inductor_{a.cpu_target}_"))
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **env})
    if a.threads:
        torch.set_num_threads(a.threads)
    names = [k for k in PATTERNS if not a.only or any(s in k for s in a.only.split(","))]
    i, n = map(int, a.shard.split("/"))
    names = names[i - 1::n]
    dev = torch.cuda.get_device_name() if a.device == "cuda" else (platform.processor() or platform.machine())
    print(f"# bench/ops.py  {datetime.datetime.now().isoformat(timespec='minutes')}  {a.device}: {dev}, "
          f"{os.cpu_count()} cores, torch {torch.__version__}, load {os.getloadavg()[0]:.2f}, target {a.cpu_target}, "
          f"threads {torch.get_num_threads()}, clock {a.clock}")
    print(f"| {'pattern':24s} | {'elements':>9s} | {'dtype':8s} | {'eager ms':>9s} | {'inductor ms':>11s} | {'ember ms':>9s} "
          f"| {'ind x':>6s} | {'ember x':>7s} | {'ember/ind':>9s} |")
    print("|" + "|".join("-" * (w + 2) for w in (24, 9, 8, 9, 11, 9, 6, 7, 9)) + "|")
    rows = []
    for name in names:
        r = run_row(name, a.device, a.scale, not a.no_inductor,
                    time.process_time if a.clock == "process" else time.perf_counter)
        rows.append(r)
        e, i, m = (r.get(f"{k} ms", float("nan")) for k in ("eager", "inductor", "ember"))
        print(f"| {name:24s} | {r['elements']:9d} | {r['dtype']:8s} | {e:9.3f} | {i:11.3f} | {m:9.3f} | {e / i:5.2f}x "
              f"| {e / m:6.2f}x | {i / m:8.2f}x |" + "".join(f"  {k}: {v}" for k, v in r.items() if "error" in k),
              flush=True)
    slower = [r["row"] for r in rows if r.get("ember ms", float("inf")) > 1.05 * r["eager ms"]]
    print(f"\nember vs Inductor geomean: {geomean([r.get('inductor ms', float('nan')) / r.get('ember ms', float('nan')) for r in rows]):.2f}x"
          f"; ember vs eager geomean: {geomean([r['eager ms'] / r.get('ember ms', float('nan')) for r in rows]):.2f}x"
          f"; rows where ember is >5% slower than eager: {', '.join(slower) or 'none'}"
          f"; rows that failed: {', '.join(r['row'] for r in rows if any('error' in k for k in r)) or 'none'}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
