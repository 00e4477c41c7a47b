"""Host cost of one convolution call on a GPU by weight layout (channels-last input), and the kernels it runs:

    python bench/tools/gpu_conv_host.py

For each weight shape: the NCHW weight as given, the weight converted to channels-last in the same call
(`w.contiguous(memory_format=torch.channels_last)` then the convolution), and a channels-last weight made once.
"""
import os
import sys

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository root
from bench.tools.gpu_host_diag import queued_ms  # noqa: E402


def queued_us(f, n=500):
    for _ in range(20):
        f()
    return queued_ms(f, n) * 1e3


def kernels(f):
    f()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        f()
        torch.cuda.synchronize()
    return [e.key[:60] for e in p.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]


def main() -> None:
    aten = torch.ops.aten.convolution.default
    print(torch.cuda.get_device_name(), torch.__version__, "cudnn", torch.backends.cudnn.version())
    for k, c, r, hw, pad in ((64, 64, 3, 14, 1), (256, 64, 1, 14, 0), (64, 3, 7, 56, 3), (128, 128, 3, 28, 1)):
        x = torch.randn(1, c, hw, hw, device="cuda").to(memory_format=torch.channels_last)
        w = torch.randn(k, c, r, r, device="cuda")
        wcl = w.to(memory_format=torch.channels_last)
        print(f"weight {k}x{c}x{r}x{r} (NCHW is channels-last-contiguous: "
              f"{w.is_contiguous(memory_format=torch.channels_last)}), input 1x{c}x{hw}x{hw} NHWC")
        forms = {
            "aten op, NCHW weight": lambda: aten(x, w, None, [1, 1], [pad, pad], [1, 1], False, [0, 0], 1),
            "aten op, converted per call": lambda: aten(x, w.contiguous(memory_format=torch.channels_last), None,
                                                        [1, 1], [pad, pad], [1, 1], False, [0, 0], 1),
            "aten op, NHWC weight made once": lambda: aten(x, wcl, None, [1, 1], [pad, pad], [1, 1], False, [0, 0], 1),
            "F.conv2d, NCHW weight": lambda: F.conv2d(x, w, None, 1, pad),
            "F.conv2d, NHWC weight made once": lambda: F.conv2d(x, wcl, None, 1, pad),
        }
        for name, f in forms.items():
            print(f"  {queued_us(f):7.1f} us  {name:34s} kernels: {kernels(f)}")
        torch.testing.assert_close(forms["aten op, NCHW weight"](), forms["aten op, NHWC weight made once"]())


if __name__ == "__main__":
    main()
