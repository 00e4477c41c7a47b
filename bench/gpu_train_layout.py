"""Whether densenet121's training convolutions are faster channels-last on the GPU (device run): eager's forward
and backward (the bench/gpu.py training row's model and batch, no optimizer) with the model and input in
torch.contiguous_format and in torch.channels_last, GPU time per step by kernel class from torch.profiler.

    python bench/gpu_train_layout.py
"""
import datetime
import os
import sys

import torch
import torchvision

sys.path.insert(0, os.path.dirname(__file__))
import gpu  # noqa: E402  (its step timing: events around each step, the median)


TOP: list = []


def kernel_classes(step, steps: int = 5) -> tuple:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    classes: dict = {}
    for e in prof.key_averages():
        if e.device_type != torch.autograd.DeviceType.CUDA or e.device_time_total <= 0:
            continue
        name = e.key.lower()
        kind = ("layout transpose" if "nchwtonhwc" in name or "nhwctonchw" in name else
                "batch norm" if "batch_norm" in name or "bn_" in name or "batchnorm" in name else
                "convolution" if any(k in name for k in ("conv", "xmma", "cutlass", "cudnn", "winograd", "wgrad",
                                                          "dgrad", "implicit_gemm", "engine")) else "other")
        TOP.append((e.device_time_total / 1e3 / steps, e.count // steps, e.key[:100]))
        classes[kind] = classes.get(kind, 0.0) + e.device_time_total / 1e3 / steps
    return classes


def main() -> None:
    torch.manual_seed(0)
    print(f"# bench/gpu_train_layout.py on {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC: densenet121 b16 3x128x128, "
          "forward + loss + backward, eager")
    for fmt in (torch.contiguous_format, torch.channels_last):
        model = torchvision.models.densenet121().cuda().to(memory_format=fmt)
        x = torch.randn(16, 3, 128, 128, device="cuda").to(memory_format=fmt)
        y = torch.randint(1000, (16,), device="cuda")

        def step():
            model.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(x), y).backward()
        ms = gpu.steady_ms(step, 20, warmup=5)
        TOP.clear()
        classes = kernel_classes(step)
        print(f"{str(fmt):28s} step {ms:.3f} ms; GPU ms by class: "
              + ", ".join(f"{k} {v:.3f}" for k, v in sorted(classes.items(), key=lambda kv: -kv[1])))
        for t, n, name in sorted(TOP, reverse=True)[:22]:
            print(f"  {t:7.3f} ms {n:4d}x {name}")


if __name__ == "__main__":
    main()
