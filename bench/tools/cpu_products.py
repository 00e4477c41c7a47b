"""CPU float32 products of a linear layer's layout, per shape: oneDNN's inner product (ember's cpu_matmul) against
ATen's mm / addmm (MKL sgemm, eager's and Inductor's), at a given instruction-set cap and thread count.

    .venv/bin/python bench/tools/cpu_products.py [--isa native|avx2|avx512] [--threads N] [--reps R] [--shapes M,K,N;...]

Each shape runs its columns in turns (one call per column per round), median ms over the rounds, in the process's
CPU time (--threads 1; wall time for more): on a machine others share, what the call costs. Columns:
- onednn:      _linear_pointwise(x, w, bias)        (ember's product with its bias inside)
- onednn_nb:   _linear_pointwise(x, w, None)
- mm:          aten.mm(x, w.t())                     (ember's other path: the bias added by the reader's kernel)
- addmm:       aten.addmm(bias, x, w.t())            (eager's)
The ISA cap is set for the whole process (a child process per --isa), as bench/suite.py's --cpu-target does.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

ISA_ENV = {"avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
           "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
                      "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
           "native": {}}

# (M, K, N) of the suite's CPU rows' linear layers: bert/distilbert/t5 (512 tokens, 256 wide, 1024 inner), llama
# (256 -> 128 k/v, 688 MLP, 8000 vocab), hf_vit (788 tokens, 384/1536), vit_b_16 (394 tokens, 768/2304/3072), the
# CNN classifier heads (8 rows)
SHAPES = [(512, 256, 256), (512, 256, 128), (512, 256, 688), (512, 688, 256), (512, 256, 1024), (512, 1024, 256),
          (512, 256, 8000), (788, 384, 384), (788, 384, 1536), (788, 1536, 384), (394, 768, 2304), (394, 768, 3072),
          (394, 3072, 768), (8, 1280, 1000), (8, 960, 1280), (8, 512, 1000), (4, 384, 1000), (2048, 256, 256),
          (128, 256, 256), (64, 1024, 1024)]


def clock(threads: int):
    return time.process_time if threads == 1 else time.perf_counter


def run(shapes, reps: int, threads: int) -> None:
    import torch
    torch.set_num_threads(threads)
    lin = torch.ops.mkldnn._linear_pointwise
    now = clock(threads)
    print(f"torch {torch.__version__} threads {threads} capability {torch.backends.cpu.get_cpu_capability()} "
          f"ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', '-')} "
          f"MKL_ENABLE_INSTRUCTIONS={os.environ.get('MKL_ENABLE_INSTRUCTIONS', '-')}", flush=True)
    print(f"{'M':>5} {'K':>5} {'N':>5} | {'onednn':>8} {'onednn_nb':>9} {'mm':>8} {'addmm':>8} | mm/onednn addmm/onednn")
    for m, k, n in shapes:
        torch.manual_seed(0)
        x, w, b = torch.randn(m, k), torch.randn(n, k), torch.randn(n)
        cols = {"onednn": lambda: lin(x, w, b, "none", [], ""), "onednn_nb": lambda: lin(x, w, None, "none", [], ""),
                "mm": lambda: torch.mm(x, w.t()), "addmm": lambda: torch.addmm(b, x, w.t())}
        ref = torch.addmm(b, x, w.t())
        torch.testing.assert_close(cols["onednn"](), ref, rtol=1e-4, atol=1e-3 * ref.abs().max().item())
        for f in cols.values():   # warm: oneDNN's primitive cache, MKL's buffers
            f(), f()
        # rounds sized to ~reps calls of the slowest, at least 5
        t0 = now()
        cols["mm"]()
        one = max(now() - t0, 1e-5)
        rounds = max(5, min(reps, int(2.0 / one)))
        times = {c: [] for c in cols}
        names = list(cols)
        for r in range(rounds):
            for i in range(len(names)):
                c = names[(r + i) % len(names)]
                t0 = now()
                cols[c]()
                times[c].append(now() - t0)
        med = {c: statistics.median(v) * 1e3 for c, v in times.items()}
        print(f"{m:>5} {k:>5} {n:>5} | {med['onednn']:8.3f} {med['onednn_nb']:9.3f} {med['mm']:8.3f} "
              f"{med['addmm']:8.3f} | {med['mm'] / med['onednn']:9.2f} {med['addmm'] / med['onednn']:11.2f}",
              flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--isa", default="native", choices=list(ISA_ENV))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--shapes", default="")
    p.add_argument("--child", action="store_true")
    a = p.parse_args()
    shapes = [tuple(int(v) for v in s.split(",")) for s in a.shapes.split(";") if s] or SHAPES
    if a.child:
        return run(shapes, a.reps, a.threads)
    env = {**os.environ, **ISA_ENV[a.isa], "OMP_NUM_THREADS": str(a.threads)}
    subprocess.run([sys.executable, __file__, "--child", "--threads", str(a.threads), "--reps", str(a.reps),
                    "--shapes", ";".join(",".join(map(str, s)) for s in shapes)], env=env, check=True)


if __name__ == "__main__":
    main()
