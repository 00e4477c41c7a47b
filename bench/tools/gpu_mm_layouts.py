"""Which library products (mm, addmm, bmm, baddbmm...) Inductor and ember call in GPT-2's training step, with
what layouts, and what each costs: one step of each column is recorded under a dispatch mode (op, shapes and
strides of every tensor argument), then every distinct call is timed alone on fresh random tensors of those
layouts. Prints the calls one column makes and the other does not, and each column's total.

    python bench/tools/gpu_mm_layouts.py            # on the GPU machine (bench/device.sh run)
"""
import collections
import datetime
import os
import statistics
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository root
from bench import gpu  # noqa: E402

PRODUCTS = {"mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_efficient_attention_backward", "convolution", "convolution_backward"}


def layout(a):
    if isinstance(a, torch.Tensor):
        return ("T", tuple(a.shape), tuple(a.stride()), str(a.dtype).replace("torch.", ""))
    if isinstance(a, (list, tuple)):
        return tuple(layout(x) for x in a)
    return a


class Record(TorchDispatchMode):
    """Every ATen call of a step (`all`) and the products' layouts (`calls`). For Inductor the mode must stay out
    of Dynamo's way: Dynamo runs a frame eagerly while a dispatch mode is active unless the mode ignores compile
    internals (torch 2.9+); `all` tells (an eager step makes hundreds of pointwise calls, a compiled one few)."""
    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()
        self.all = 0

    @classmethod
    def ignore_compile_internals(cls):
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.all += 1
        if func.__name__.split(".")[0] in PRODUCTS:
            self.calls[(func, layout(args), layout(tuple(sorted(kwargs.items()))))] += 1
        return func(*args, **kwargs)


def make(spec):
    if isinstance(spec, tuple) and spec and spec[0] == "T":
        _, shape, stride, dtype = spec
        t = torch.empty_strided(shape, stride, dtype=getattr(torch, dtype), device="cuda")
        return t.normal_() if t.is_floating_point() else t.zero_()
    if isinstance(spec, tuple):
        return tuple(make(x) for x in spec)
    return spec


def time_call(key) -> float:
    op, args, kwargs = key
    a = [make(x) for x in args]
    kw = {k: make(v) for k, v in kwargs}
    for _ in range(3):
        op(*a, **kw)
    ts = []
    for _ in range(20):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        op(*a, **kw)
        e.record()
        ts.append((s, e))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in ts)


def main() -> None:
    print(f"# bench/tools/gpu_mm_layouts.py, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
    build = {"gpt2": gpu.gpt2_train, "resnet50": gpu.resnet50, "bert": gpu.bert}[sys.argv[1] if len(sys.argv) > 1 else "gpt2"]
    recorded = {}
    for col in ("inductor", "ember"):
        torch.manual_seed(0)
        step = build(gpu.compilers()[col], None)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with Record() as rec:
            step()
        torch.cuda.synchronize()
        recorded[col] = rec.calls
        print(f"{col}: {rec.all} ATen calls in one step", flush=True)
        del step
        torch.cuda.empty_cache()
    times = {}
    for k in set(recorded["inductor"]) | set(recorded["ember"]):
        try:
            times[k] = time_call(k)
        except Exception as e:   # (a call that needs real values, e.g. attention's RNG state): not timed
            print(f"   not timed: {k[0]}: {type(e).__name__}: {str(e)[:100]}")
            times[k] = float("nan")
    for col, other in (("inductor", "ember"), ("ember", "inductor")):
        total = sum(times[k] * n for k, n in recorded[col].items() if times[k] == times[k])
        print(f"{col}: {sum(recorded[col].values())} product calls, {total:.3f} ms timed alone")
        for k, n in sorted(recorded[col].items(), key=lambda kv: -(times[kv[0]] if times[kv[0]] == times[kv[0]] else 0) * kv[1]):
            if recorded[other].get(k, 0) != n:
                print(f"   only {col} ({n}x, other {recorded[other].get(k, 0)}x) {times[k] * n:7.3f} ms  {str(k[0])} "
                      f"{k[1]} {dict(k[2]) if k[2] else ''}"[:400])


if __name__ == "__main__":
    main()
