"""A/B of the warps given to persistent row kernels with fewer rows than the GPU has SMs (device run):
densenet121's training step (reduce-overhead), batch norm's per-channel kernels mostly, as ember prints them
(triton.launch_config) and with `WARPS` warps for those kernels; each in its own process.

    python bench/gpu_row_warps.py            # both, one after the other
    python bench/gpu_row_warps.py 16 --one   # one variant in this process (what the first form runs)
"""
import datetime
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import gpu  # noqa: E402

from ember.codegen import triton as tr  # noqa: E402


def one(warps: int) -> None:
    if warps:
        base = tr.launch_config

        def config(shape, rows, rmax, expensive=0):
            cfg = base(shape, rows, rmax, expensive)
            if shape == tr.ROWS and cfg.get("persistent") and rows < tr._sm_count() and cfg["RBLOCK"] >= 512:
                cfg = dict(cfg, num_warps=max(cfg["num_warps"], min(warps, cfg["RBLOCK"] // 64)))
            return cfg
        tr.launch_config = config
    step = gpu.densenet_train(gpu.ember_compile, "reduce-overhead")
    for _ in range(4):
        step()
    torch.cuda.synchronize()
    ms = gpu.steady_ms(step, 30)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    evs = [e for e in p.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in evs) / 5 / 1e3
    triton = sum(e.self_device_time_total for e in evs if e.key.startswith("k_")) / 5 / 1e3
    print(f"warps={warps or 'default'}: step {ms:.3f} ms (events), GPU {total:.3f} ms, ember's Triton kernels "
          f"{triton:.3f} ms", flush=True)


def main() -> None:
    if "--one" in sys.argv:
        one(int(sys.argv[1]))
        return
    print(f"# bench/gpu_row_warps.py, densenet121 train step, {torch.cuda.get_device_name()}, "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC", flush=True)
    for warps in ("0", "16"):
        subprocess.run([sys.executable, __file__, warps, "--one"], check=False)


if __name__ == "__main__":
    main()
