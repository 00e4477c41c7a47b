"""Diagnostic (device run): resnet50's eval batch norm + relu after a convolution, Inductor's kernel against
ember's, per layer shape. In the resnet50 row (2026-11-26) ember's took 23.7 us a launch at 64x56x56 where
Inductor's took 13 (10.6 vs 6.1 at 128x28x28). Each block conv -> bn -> relu is compiled alone (channels-last
input), then one step's kernels are profiled; ember also under other flat block sizes / warps.

    python bench/gpu_bn_relu.py          # on the GPU machine (the device tool)
"""
import copy
import datetime
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import gpu  # noqa: E402, F401  (the bench's cache directories and TF32 settings)

import ember  # noqa: E402
from ember.codegen import triton as tr  # noqa: E402


def kernels(fn, x, steps=20) -> list:
    from torch.profiler import ProfilerActivity, profile
    with torch.no_grad():
        for _ in range(3):
            fn(x)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as p:
            for _ in range(steps):
                fn(x)
            torch.cuda.synchronize()
    evs = [e for e in p.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sorted(((e.self_device_time_total / steps, e.key) for e in evs), reverse=True)


def main() -> None:
    print(f"# bench/gpu_bn_relu.py, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC (us per launch)")
    default = tr.launch_config
    for c, hw in ((64, 56), (128, 28), (256, 14)):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Conv2d(c, c, 3, padding=1, bias=False), torch.nn.BatchNorm2d(c),
                                torch.nn.ReLU()).cuda().eval()
        bn = m[1]
        bn.running_mean.normal_()
        bn.running_var.uniform_(0.5, 2)
        x = torch.randn(32, c, hw, hw, device="cuda").to(memory_format=torch.channels_last)
        runs = [("inductor", torch.compile(copy.deepcopy(m)))]
        for block, warps in ((1024, 4), (2048, 8), (1024, 8), (4096, 8)):
            def config(shape, rows, rmax, expensive=0, _b=block, _w=warps):
                cfg = default(shape, rows, rmax, expensive)
                if shape == tr.FLAT and rows * rmax >= (1 << 20):
                    cfg = {"BLOCK": _b, "num_warps": _w}
                return cfg
            tr.launch_config = config
            f = ember.compile(copy.deepcopy(m))
            with torch.no_grad():
                f(x)
            tr.launch_config = default
            runs.append((f"ember {block}/{warps}", f))
        with torch.no_grad():
            ref = m(x)
        for name, f in runs:
            with torch.no_grad():
                torch.testing.assert_close(f(x), ref, rtol=1e-3, atol=1e-3)
            ks = kernels(f, x)
            print(f"{c}x{hw}x{hw} {name}: " + "; ".join(f"{t:.1f} {k[:60]}" for t, k in ks[:4]), flush=True)


if __name__ == "__main__":
    main()
