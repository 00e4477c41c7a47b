"""Diagnostic (device run): one step's kernels in launch order with each launch's duration, Inductor's and ember's
side by side (the profiler's averages hide which launch of a kernel is slow and what ran before it).

    python bench/gpu_kernel_sequence.py [resnet50|densenet] [N]     # on the GPU machine (the device tool)
"""
import datetime
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import gpu  # noqa: E402


def sequence(step) -> list:
    from torch.profiler import ProfilerActivity, profile
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        step()
        torch.cuda.synchronize()
    evs = [e for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    evs.sort(key=lambda e: e.time_range.start)
    return [(e.name, e.time_range.elapsed_us()) for e in evs]


def main() -> None:
    row = sys.argv[1] if len(sys.argv) > 1 else "resnet50"
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 60
    build = {"resnet50": gpu.resnet50, "densenet": gpu.densenet_inference}[row]
    print(f"# bench/gpu_kernel_sequence.py {row}, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC (us per launch)")
    cols = {}
    for name, compiler in (("inductor", torch.compile), ("ember", gpu.ember_compile)):
        torch.manual_seed(0)
        cols[name] = sequence(build(compiler, None))
        print(f"{name}: {len(cols[name])} kernels, {sum(d for _, d in cols[name]):.1f} us")
    a, b = cols["inductor"], cols["ember"]
    for i in range(min(n, max(len(a), len(b)))):
        left = f"{a[i][1]:7.1f} {a[i][0][:48]:48}" if i < len(a) else " " * 56
        right = f"{b[i][1]:7.1f} {b[i][0][:48]}" if i < len(b) else ""
        print(f"{i:3d} {left} | {right}")


if __name__ == "__main__":
    main()
