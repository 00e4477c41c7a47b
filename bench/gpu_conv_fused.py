"""Diagnostic (device run): would cuDNN's fused convolutions (aten.cudnn_convolution_relu, ..._add_relu: the bias,
the residual and the relu in the convolution's epilogue) save resnet50's batch-norm + relu kernels? Each distinct
convolution of resnet50 b32 224px (channels-last, float32, TF32 as cuDNN allows by default) timed alone: the
plain convolution, the fused ones, and the pointwise pass they would replace (an eager add + relu over the
output). Also the largest difference of the fused result from conv + bias (+ z) + relu.

    python bench/gpu_conv_fused.py          # on the GPU machine (the device tool)
"""
import collections
import datetime
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from gpu import steady_ms  # noqa: E402


def ms(fn) -> float:
    return steady_ms(fn, 30)

aten = torch.ops.aten


def shapes():
    import torchvision
    model = torchvision.models.resnet50().cuda().eval()
    seen = collections.Counter()

    def hook(mod, inp, out):
        seen[(tuple(inp[0].shape), tuple(mod.weight.shape), mod.stride, mod.padding, mod.dilation, mod.groups)] += 1
    for m in model.modules():
        if isinstance(m, torch.nn.Conv2d):
            m.register_forward_hook(hook)
    with torch.no_grad():
        model(torch.randn(32, 3, 224, 224, device="cuda"))
    return seen


def main() -> None:
    print(f"# bench/gpu_conv_fused.py, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"cudnn {torch.backends.cudnn.version()}, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC")
    totals = collections.Counter()
    for benchmark in (False, True):
        torch.backends.cudnn.benchmark = benchmark
        print(f"cudnn.benchmark={benchmark}")
        print(f"{'n':>2} {'input':>18} {'weight':>18} s  conv   +pw    fused  add_fused  max|diff|")
        for (xs, ws, stride, padding, dilation, groups), n in shapes().items():
            x = torch.randn(xs, device="cuda").to(memory_format=torch.channels_last)
            w = torch.randn(ws, device="cuda").to(memory_format=torch.channels_last) * (2.0 / (ws[1] * ws[2] * ws[3])) ** 0.5
            b = torch.randn(ws[0], device="cuda")
            args = (list(stride), list(padding), list(dilation), groups)
            y = F.conv2d(x, w, None, stride, padding, dilation, groups)
            z = torch.randn_like(y)
            t_conv = ms(lambda: F.conv2d(x, w, None, stride, padding, dilation, groups))
            t_pw = ms(lambda: torch.relu_(y.add(b.view(1, -1, 1, 1))))
            try:
                t_fused = ms(lambda: aten.cudnn_convolution_relu(x, w, b, *args))
                t_add = ms(lambda: aten.cudnn_convolution_add_relu(x, w, z, 1.0, b, *args))
                ref = torch.relu(F.conv2d(x, w, b, stride, padding, dilation, groups))
                got = aten.cudnn_convolution_relu(x, w, b, *args)
                ref2 = torch.relu(F.conv2d(x, w, b, stride, padding, dilation, groups) + z)
                got2 = aten.cudnn_convolution_add_relu(x, w, z, 1.0, b, *args)
                diff = max(float((got - ref).abs().max()), float((got2 - ref2).abs().max()))
                scale = float(ref.abs().max())
            except RuntimeError as e:
                print("  error:", str(e).splitlines()[0][:120])
                continue
            totals[(benchmark, "conv")] += n * t_conv
            totals[(benchmark, "conv+pw")] += n * (t_conv + t_pw)
            totals[(benchmark, "fused")] += n * t_fused
            totals[(benchmark, "add_fused")] += n * t_add
            print(f"{n:>2} {str(xs):>18} {str(ws):>18} {stride[0]} {t_conv:.4f} {t_pw:.4f} {t_fused:.4f} {t_add:.4f}"
                  f"  {diff:.2e} (of {scale:.1f}) {str(got.stride()) if got.is_contiguous(memory_format=torch.channels_last) else 'not channels-last'}")
        print("totals (ms, each convolution as often as resnet50 runs it):",
              {k[1]: round(v, 3) for k, v in totals.items() if k[0] == benchmark})


if __name__ == "__main__":
    main()
