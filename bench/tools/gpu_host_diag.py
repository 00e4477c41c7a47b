"""Where a host-bound compiled model's host time goes, on a GPU (one device run):

    python bench/tools/gpu_host_diag.py [resnet50|densenet|bert|adam ...] [--no-inductor] [--no-conv] [--cprofile]

Per column (eager, Inductor, ember): host time per step with steps queued (no wait), the GPU-step time, and the
CPU ATen ops' self time per step. For ember also: the guards + frontend alone (the graph call replaced by a
call that returns the last outputs) and the host program alone. Then the host cost of one small convolution
call in the forms a host program may issue (the `aten.convolution.default` OpOverload, `torch.convolution`,
F.conv2d; channels-last input with NCHW or channels-last weight).
"""
from __future__ import annotations

import os
import sys
import tempfile
import time

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor_cold_"))
os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="triton_cold_"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import ember  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository root
from bench import gpu  # noqa: E402
from bench.gpu import steady_ms  # noqa: E402


def queued_ms(step, n: int = 30) -> float:
    """Host time per step, steps issued back to back (the GPU may still be busy)."""
    step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        step()
    ms = (time.perf_counter() - t) / n * 1e3
    torch.cuda.synchronize()
    return ms


def host_ops(step, label: str, steps: int = 5, top: int = 14) -> None:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as p:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    evs = sorted(p.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
    print(f"  host ops {label} (self time per step):")
    for e in evs:
        print(f"    {e.self_cpu_time_total / steps / 1e3:8.3f} ms {e.count // steps:5d}x  {e.key[:80]}")


BUILDERS = {"resnet50": gpu.resnet50, "densenet": gpu.densenet_inference, "bert": gpu.bert, "adam": gpu.adam}


def main() -> None:
    names = [a for a in sys.argv[1:] if not a.startswith("--")] or ["resnet50"]
    cols = {"eager": None, "inductor": torch.compile, "ember": gpu.ember_compile}
    if "--no-inductor" in sys.argv:
        del cols["inductor"]
    for name in names:
        print(f"# {name}: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
              f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
        for col, compiler in cols.items():
            torch.manual_seed(0)
            step = BUILDERS[name](compiler, None)
            for _ in range(3):
                step()
            print(f"{col:9s} host {queued_ms(step):7.3f} ms/step queued, GPU-step {steady_ms(step, 30):7.3f} ms")
            host_ops(step, col)
            if col == "ember":
                ember_split(step)
    if "--no-conv" not in sys.argv:
        conv_forms()


def ember_split(step) -> None:
    """The frontend (guards, inputs) and the host program timed apart: the entry's `___graph` is swapped for
    a stand-in that returns the last outputs, then the real graph call is timed on the recorded inputs."""
    import gc
    from ember.frontend import convert
    def is_compiler(o) -> bool:
        try:
            return isinstance(o, convert.FrameCompiler) and bool(o.entries)
        except ReferenceError:   # a dead weakref.proxy among the objects
            return False
    fcs = [o for o in gc.get_objects() if is_compiler(o)]
    for fc in fcs:
        for entry in fc.entries:
            ns = entry.fn.__globals__
            if "___graph" not in ns:
                continue
            real, seen = ns["___graph"], {}

            def spy(*args, real=real, seen=seen):
                seen["args"] = args
                seen["out"] = real(*args)
                return seen["out"]
            ns["___graph"] = spy
            step()
            ns["___graph"] = lambda *args, seen=seen: seen["out"]
            print(f"  ember frontend alone ({fc.name}, {len(entry.guards)} guards, {len(seen['args'])} graph inputs): "
                  f"{queued_ms(step, 200):.3f} ms/call")

            def graph_only(real=real, seen=seen):
                with torch.no_grad():
                    return real(*seen["args"])

            print(f"  ember graph call alone: {queued_ms(graph_only):.3f} ms/call")
            host_ops(graph_only, "ember graph call alone")
            if "--cprofile" in sys.argv:   # the graph call's Python, function by function
                import cProfile
                import pstats
                pr = cProfile.Profile()
                pr.runcall(lambda: [graph_only() for _ in range(50)])
                torch.cuda.synchronize()
                print("  cProfile of 50 graph calls:")
                pstats.Stats(pr).sort_stats("tottime").print_stats(18)
            ns["___graph"] = real


def conv_forms() -> None:
    """Host µs of one small convolution call (GPU work ~ nothing) in each form."""
    x = torch.randn(1, 64, 14, 14, device="cuda").to(memory_format=torch.channels_last)
    w = torch.randn(64, 64, 3, 3, device="cuda")
    wcl = w.to(memory_format=torch.channels_last)
    aten = torch.ops.aten.convolution.default
    forms = {
        "aten.convolution.default, NCHW weight": lambda: aten(x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1),
        "aten.convolution.default, NHWC weight": lambda: aten(x, wcl, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1),
        "torch.convolution, NCHW weight": lambda: torch.convolution(x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1),
        "F.conv2d, NCHW weight": lambda: F.conv2d(x, w, None, 1, 1),
        "F.conv2d, NHWC weight": lambda: F.conv2d(x, wcl, None, 1, 1),
        "torch.empty_strided (cuda)": lambda: torch.empty_strided((1, 64, 14, 14), (12544, 1, 896, 64), device="cuda"),
    }
    print("  one call's host time:")
    for k, f in forms.items():
        for _ in range(20):
            f()
        print(f"    {queued_ms(f, 500) * 1e3:8.1f} us  {k}")


if __name__ == "__main__":
    main()
