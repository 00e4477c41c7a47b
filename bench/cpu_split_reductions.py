"""CPU A/B of split reductions (lower.SPLIT_REDUCTIONS) in one process: eager, ember unsplit, ember split; the
median of 15 rounds of 10 calls, the best of 3 interleaved passes (ms). The split depends on os.cpu_count().

    PYTHONPATH=. python bench/cpu_split_reductions.py
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from ember.backends.cpp_backend import compile_aten  # noqa: E402
from ember.codegen import lower  # noqa: E402
from tests.codegen.aten_trace import trace_aten  # noqa: E402

CASES = [("sum0 2Mx3", lambda x: x.sum(0), (2_000_000, 3)), ("sum0 1Mx8", lambda x: x.sum(0), (1_000_000, 8)),
         ("sum0 500Kx16", lambda x: x.sum(0), (500_000, 16)), ("var0 100Kx4", lambda x: x.var(0), (100_000, 4)),
         ("tanh.mean0 500Kx16", lambda x: x.tanh().mean(0), (500_000, 16)),
         ("sum0 2048x768", lambda x: x.sum(0), (2048, 768))]


def ms(f, x, rounds=15, inner=10):
    f(x)
    ts = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(inner):
            f(x)
        ts.append((time.perf_counter() - t) / inner)
    return sorted(ts)[len(ts) // 2] * 1e3


def main():
    print(f"# {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; ms per call; k = kernels")
    for name, fn, shape in CASES:
        x = torch.rand(*shape) + 0.5
        fs = {"eager": fn}
        for split in (False, True):
            lower.SPLIT_REDUCTIONS = split
            gm, ref = trace_aten(fn, [x])
            c = compile_aten(gm, [x])
            torch.testing.assert_close(c(x)[0], ref, rtol=1e-5, atol=1e-5)
            kernels = c.compiled.source.count('// fused fx nodes')
            fs[f"{'split' if split else 'unsplit'} k={kernels}"] = c
        lower.SPLIT_REDUCTIONS = True
        best = {k: min(ms(f, x) for _ in range(1)) for k, f in fs.items()}
        for _ in range(2):
            for k, f in fs.items():
                best[k] = min(best[k], ms(f, x))
        print(f"{name:20s}", "  ".join(f"{k}: {v:.3f}" for k, v in best.items()), flush=True)


if __name__ == "__main__":
    main()
