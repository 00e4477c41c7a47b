"""Diagnostic: host cost of one kernel launch on the GPU machine, the floor under every compiled graph's call.

    python bench/tools/gpu_launch.py

Times (µs per launch, median of 5 runs of 2000 launches, no synchronisation inside): a torch op on a small
tensor; a Triton kernel launched through `kernel[grid](...)` (Triton's binder and cache lookup); the same
compiled kernel launched through its CompiledKernel.run (what ember.runtime.triton_launch's Launcher does).
"""
import datetime
import statistics
import time

import torch
import triton
import triton.language as tl


@triton.jit
def add_one(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)


def per_launch_us(fn, n=2000) -> float:
    fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(runs)


def main():
    x = torch.randn(1024, device="cuda")
    y = torch.empty_like(x)
    k = add_one[(1,)](x, y, 1024, BLOCK=1024)
    stream = torch.cuda.current_stream().cuda_stream
    rows = {
        "torch x.add(1)": per_launch_us(lambda: x.add(1)),
        "triton kernel[grid](...)": per_launch_us(lambda: add_one[(1,)](x, y, 1024, BLOCK=1024)),
    }
    for args in ((x, y, 1024, 1024), (x, y, 1024)):  # whether the launcher takes constexprs differs by version
        try:
            rows["triton CompiledKernel.run"] = per_launch_us(
                lambda: k.run(1, 1, 1, stream, k.function, k.packed_metadata, None, None, None, *args))
            y.zero_()
            k.run(1, 1, 1, stream, k.function, k.packed_metadata, None, None, None, *args)
            print("CompiledKernel.run with", len(args), "args: correct =", bool((y == x + 1).all()))
            break
        except Exception as e:
            print("CompiledKernel.run with", len(args), "args failed:", type(e).__name__, e)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"# launch cost on {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, {when}")
    for name, us in rows.items():
        print(f"  {name:30s} {us:7.2f} µs")


if __name__ == "__main__":
    main()
