"""Where a decode step's time goes: bench/dynamic.py's GPT-2 generation (KV cache growing one token a step) under
eager, torch.compile and ember, after two warm generations: wall ms per token, then over 32 tokens under
torch.profiler the device time of the kernels per token, the kernels launched per token, and the top kernels and
host ops. Wall well above the kernels' time means the step is host-bound (guards, dispatch, launches).

    PYTHONPATH=. python bench/tools/gpu_decode_profile.py [--device cuda] [--compilers eager,torch.compile,ember]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import dynamic  # noqa: E402


def profile(compiler: str, device: str, tokens: int = 32, top: int = 12) -> None:
    big = device == "cuda"
    generate = dynamic.gpt2_generator(device, dynamic._compiler(compiler, [0]))

    with torch.no_grad():
        generate(128), generate(128)
        dynamic._sync(device)
        t0 = time.perf_counter()
        generate(128)
        dynamic._sync(device)
        wall = 1e3 * (time.perf_counter() - t0) / 128
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if big else [])
        with torch.profiler.profile(activities=acts) as prof:
            generate(64 + tokens)
            dynamic._sync(device)
    events = prof.key_averages()
    kernels = [e for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    dev_us = sum(e.self_device_time_total for e in kernels)
    launches = sum(e.count for e in kernels)
    steps = 64 + tokens
    print(f"== {compiler} on {device}: wall {wall:.3f} ms/token; profiled {steps} tokens: kernels "
          f"{dev_us / steps / 1e3:.3f} ms/token, {launches / steps:.1f} launches/token")
    if kernels:
        print("  top kernels (us/token, calls/token):")
        for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:top]:
            print(f"    {e.self_device_time_total / steps:8.1f} {e.count / steps:6.1f}  {e.key[:110]}")
    print("  top host ops (self CPU us/token, calls/token):")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]:
        print(f"    {e.self_cpu_time_total / steps:8.1f} {e.count / steps:6.1f}  {e.key[:110]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--compilers", default="eager,torch.compile,ember")
    a = ap.parse_args()
    for c in a.compilers.split(","):
        profile(c, a.device)


if __name__ == "__main__":
    main()
