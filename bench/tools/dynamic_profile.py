"""Where a bench/dynamic.py loop's total time goes under ember (issue 27: the total against torch.compile's):
the loop once under cProfile, then the functions with the most cumulative and own time, and the number and total
time of Triton compiles (each a kernel compiled for a new specialization).

    PYTHONPATH=. python bench/tools/dynamic_profile.py [--loop bert] [--device cuda] [--top 30]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import dynamic  # noqa: E402


def count_triton_compiles() -> dict:
    """Wraps triton.compile: how many kernels were compiled and the seconds spent (0 without Triton)."""
    stats = {"n": 0, "s": 0.0}
    try:
        import triton
        import triton.compiler.compiler as cc
    except ImportError:
        return stats
    inner = cc.compile

    def counted(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            stats["n"] += 1
            stats["s"] += time.perf_counter() - t0
    cc.compile = counted
    triton.compile = counted
    return stats


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--loop", default="bert")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--top", type=int, default=30)
    a = ap.parse_args()
    stats = count_triton_compiles()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    out = dynamic.child(a.loop, "ember", a.device)
    prof.disable()
    print(f"{a.loop} on {a.device}: {time.perf_counter() - t0:.2f} s under the profiler, result {out}; "
          f"Triton compiles in this process: {stats['n']} taking {stats['s']:.2f} s")
    for key in ("cumulative", "tottime"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(a.top)
        print("\n".join(line[:200] for line in s.getvalue().splitlines() if line.strip())[:12000])


if __name__ == "__main__":
    main()
