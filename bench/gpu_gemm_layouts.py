"""The matrix products of one model step as the library sees them (device run): each mm/addmm/bmm call's shapes,
strides, storage offsets and pointer alignment, counted, with a flag where cuBLAS cannot use 16-byte vector
loads (an odd leading stride, a pointer off a 16-byte boundary): such calls run cuBLAS's slower align1 kernels.

    python bench/gpu_gemm_layouts.py [gpt2|bert]
"""
import collections
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(__file__))
import gpu  # noqa: E402

aten = torch.ops.aten
PRODUCTS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}


def layout(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)}/{tuple(t.stride())}+{t.storage_offset()}@{t.data_ptr() % 16}"


def misaligned(t: torch.Tensor) -> bool:
    if t.data_ptr() % 16:
        return True
    lead = [s for s, n in zip(t.stride(), t.shape) if s != 1 and n > 1]
    return any(s * t.element_size() % 16 for s in lead)


class Products(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in PRODUCTS:
            ts = [a for a in args if isinstance(a, torch.Tensor)]
            flag = "ALIGN1 " if any(misaligned(t) for t in ts[-2:]) else ""
            self.seen[f"{flag}{func.__name__}: " + "  ".join(layout(t) for t in ts)] += 1
        return func(*args, **(kwargs or {}))


def main():
    row = sys.argv[1] if len(sys.argv) > 1 else "gpt2"
    step = {"gpt2": gpu.gpt2_train, "bert": gpu.bert}[row](None, None)
    step()
    mode = Products()
    with mode:
        step()
    torch.cuda.synchronize()
    print(f"# {row} eager step, {torch.cuda.get_device_name()}: matrix products (shape/stride+offset@pointer%16)")
    for k, n in sorted(mode.seen.items(), key=lambda kv: (not kv[0].startswith("ALIGN1"), kv[0])):
        print(f"  {n:4d}x {k}")
    gpu.profile(step, f"{row} [eager]", top=10)


if __name__ == "__main__":
    main()
