"""Diagnostic (device run): the first convolution of resnet50 and densenet121 reads 3 channels, for which cuDNN
picks a slow kernel (resnet50 b32: ~0.19 ms of a 3.15-ms step, for 7.5 GFLOP). Timed alone in the layouts a
compiler could hand it: eager's NCHW, channels-last, and channels-last with the channels zero-padded to 4, 8 or
16 (input and weight; the padded result is the same sum plus zeros), with the pad's own cost.

    python bench/gpu_first_conv.py          # on the GPU machine (the device tool)
"""
import datetime
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from gpu import steady_ms  # noqa: E402


def ms(fn) -> float:
    return steady_ms(fn, 30)


def main() -> None:
    print(f"# bench/gpu_first_conv.py, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"cudnn {torch.backends.cudnn.version()}, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC")
    cl = torch.channels_last
    for name, xs in (("resnet50 b32", (32, 3, 224, 224)), ("densenet121 b16", (16, 3, 128, 128))):
        for benchmark in (False, True):
            torch.backends.cudnn.benchmark = benchmark
            x = torch.randn(xs, device="cuda")
            w = torch.randn(64, 3, 7, 7, device="cuda") * 0.1
            conv = lambda x, w: F.conv2d(x, w, None, 2, 3)
            ref = conv(x, w)
            row = {"nchw": ms(lambda: conv(x, w))}
            xc, wc = x.to(memory_format=cl), w.to(memory_format=cl)
            row["cl"] = ms(lambda: conv(xc, wc))
            for c in (4, 8, 16):
                xp = torch.zeros(xs[0], c, *xs[2:], device="cuda").to(memory_format=cl)
                xp[:, :3] = x
                wp = torch.zeros(64, c, 7, 7, device="cuda").to(memory_format=cl)
                wp[:, :3] = w
                got = conv(xp, wp)
                err = float((got - ref).abs().max())
                row[f"cl pad{c}"] = ms(lambda: conv(xp, wp))
                row[f"pad{c} copy"] = ms(lambda: xp[:, :3].copy_(x))
                row[f"pad{c} err"] = err
            print(f"{name} benchmark={benchmark}: " + ", ".join(f"{k} {v:.4f}" if "err" not in k else f"{k} {v:.1e}"
                                                               for k, v in row.items()))


if __name__ == "__main__":
    main()
