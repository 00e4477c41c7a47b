"""How much of a cold compile is Triton's, and how well the compile pool spreads it (one device run):

    python bench/tools/gpu_compile_pool.py [row ...]      # rows: resnet50, bert, densenet, adam (bench/gpu.py builders)

Each (row, pool) runs in a fresh process with empty Triton and ember caches: the wall time of the first call
(the cold compile), the time spent in `triton_backend._precompile` (waiting for the pool), the number of kernels, and
the number of threads compiling (ember.backends.triton_backend's pool is replaced by one of that size).
Its measurements are in docs/evidence.md.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

CHILD = r'''
import os, sys, time, concurrent.futures as cf
import torch
from bench import gpu
from ember.backends import triton_backend
threads = int(os.environ["POOL_THREADS"])
triton_backend._COMPILE_POOL = cf.ThreadPoolExecutor(max_workers=threads)
how = f"threads={threads}"
spent = {"precompile": 0.0, "kernels": 0}
real = triton_backend._precompile
def timed(mod, kernels, sched, device):
    t = time.perf_counter()
    out = real(mod, kernels, sched, device)
    spent["precompile"] += time.perf_counter() - t
    spent["kernels"] += len({k[1] for k in kernels})
    return out
triton_backend._precompile = timed
torch.manual_seed(0)
build = {"resnet50": gpu.resnet50, "bert": gpu.bert, "densenet": gpu.densenet_inference, "adam": gpu.adam}[sys.argv[1]]
torch.zeros(1, device="cuda"); torch.cuda.synchronize()   # CUDA's start-up is not the compile's
t = time.perf_counter()
step = build(gpu.ember_compile, None)
step(); torch.cuda.synchronize()
first = time.perf_counter() - t
print(f"{sys.argv[1]:9s} {how:10s}: first call {first:6.2f} s, waiting for Triton {spent['precompile']:5.2f} s, "
      f"{spent['kernels']} kernels", flush=True)
'''


def main() -> None:
    rows = sys.argv[1:] or ["resnet50", "bert"]
    print(f"# bench/tools/gpu_compile_pool.py {' '.join(rows)}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"{os.cpu_count()} CPUs")
    for row in rows:
        for threads in (1, 8, 16):
            # (ember's cache: bench/gpu.py, imported by the child, points it at a fresh directory)
            env = dict(os.environ, POOL_THREADS=str(threads), TRITON_CACHE_DIR=tempfile.mkdtemp())
            r = subprocess.run([sys.executable, "-c", CHILD, row], env=env, capture_output=True, text=True, timeout=300)
            print(r.stdout.strip() or r.stderr.strip()[-800:], flush=True)


if __name__ == "__main__":
    main()
