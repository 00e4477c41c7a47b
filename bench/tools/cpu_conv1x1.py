"""1x1 convolutions (stride 1, no padding, one group) of channels-last float32 CPU tensors: ATen's convolution (as a
channels-last graph calls it: oneDNN, or ATen's slow path im2col + MKL where ATen's heuristic sends a 1x1 at a
small batch and one thread) against the same product as one matrix product of the pixels [N*H*W, Cin] and the
weight [Cin, Cout] (ATen's mm: MKL), whose result is the channels-last output; and ATen's convolution of the
same values stored NCHW (eager's and Inductor's call on the CPU, which keep NCHW).

    .venv/bin/python bench/tools/cpu_conv1x1.py [--isa native|avx2|avx512] [--threads N] [--rounds R]

Median ms over rounds in turns (process CPU time at one thread, wall time for more).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cpu_products import ISA_ENV  # noqa: E402

# (N, Cin, Cout, H=W) of efficientnet_b0 / mobilenet_v3_large / resnet50 1x1 convolutions at the suite's batches
SHAPES = [(8, 32, 16, 112), (8, 16, 96, 112), (8, 96, 24, 56), (8, 24, 144, 56), (8, 144, 40, 28), (8, 240, 80, 14),
          (8, 480, 112, 14), (8, 672, 192, 7), (8, 1152, 320, 7), (8, 320, 1280, 7), (8, 72, 24, 56),
          (8, 160, 960, 7), (4, 64, 256, 56), (4, 256, 64, 56), (4, 1024, 256, 14), (4, 2048, 512, 7),
          (8, 32, 8, 1), (8, 960, 240, 1),
          # mobilenet_v3_large
          (8, 16, 16, 112), (8, 16, 64, 112), (8, 64, 24, 56), (8, 24, 72, 56), (8, 72, 24, 56), (8, 72, 40, 28),
          (8, 40, 120, 28), (8, 120, 40, 28), (8, 240, 80, 14), (8, 80, 200, 14), (8, 200, 80, 14),
          (8, 80, 184, 14), (8, 184, 80, 14), (8, 80, 480, 14), (8, 480, 112, 14), (8, 112, 672, 14),
          (8, 672, 112, 14), (8, 672, 160, 7), (8, 160, 960, 7), (8, 960, 160, 7)]


def run(rounds: int, threads: int) -> None:
    import torch
    torch.set_num_threads(threads)
    now = time.process_time if threads == 1 else time.perf_counter
    print(f"threads {threads} capability {torch.backends.cpu.get_cpu_capability()}", flush=True)
    print(f"{'N':>3} {'Cin':>5} {'Cout':>5} {'HW':>4} | {'conv':>8} {'nchw':>8} {'mm':>8} | conv/mm nchw/mm")
    for n, ci, co, hw in SHAPES:
        torch.manual_seed(0)
        x = torch.randn(n, ci, hw, hw).to(memory_format=torch.channels_last)
        w = torch.randn(co, ci, 1, 1).to(memory_format=torch.channels_last)
        b = torch.randn(co)
        flat = x.permute(0, 2, 3, 1).reshape(n * hw * hw, ci)
        w2 = w.reshape(co, ci).t()
        xc, wc = x.contiguous(), w.contiguous()
        cols = {"conv": lambda: torch.ops.aten.convolution(x, w, b, [1, 1], [0, 0], [1, 1], False, [0, 0], 1),
                "conv_nchw": lambda: torch.ops.aten.convolution(xc, wc, b, [1, 1], [0, 0], [1, 1], False, [0, 0], 1),
                "mm": lambda: torch.mm(flat, w2)}
        ref = cols["conv"]()
        got = (cols["mm"]() + b).reshape(n, hw, hw, co).permute(0, 3, 1, 2)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
        times = {c: [] for c in cols}
        for f in cols.values():
            f()
        for r in range(rounds):
            names = list(cols)
            for c in names[r % 3:] + names[:r % 3]:
                t0 = now()
                cols[c]()
                times[c].append(now() - t0)
        med = {c: statistics.median(v) * 1e3 for c, v in times.items()}
        print(f"{n:>3} {ci:>5} {co:>5} {hw:>4} | {med['conv']:8.3f} {med['conv_nchw']:8.3f} {med['mm']:8.3f} | "
              f"{med['conv'] / med['mm']:7.2f} {med['conv_nchw'] / med['mm']:7.2f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--isa", default="native", choices=list(ISA_ENV))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--child", action="store_true")
    a = p.parse_args()
    if a.child:
        return run(a.rounds, a.threads)
    env = {**os.environ, **ISA_ENV[a.isa], "OMP_NUM_THREADS": str(a.threads)}
    subprocess.run([sys.executable, __file__, "--child", "--threads", str(a.threads), "--rounds", str(a.rounds)],
                   env=env, check=True)


if __name__ == "__main__":
    main()
