"""Where the host time of densenet121's compiled training step goes (device run; ember only, no Inductor):

    python bench/gpu_train_host.py [--bn-aten]

Each named piece is wrapped by a timer (inclusive wall time, calls); printed per step, beside the step's
wall time with a wait after it, host time with steps queued, and the GPU time of a step from the profiler.
--bn-aten: train-mode batch norm as ATen's (cuDNN's) kernels on CUDA, not decomposed (decomp/table.py).
"""
from __future__ import annotations

import collections
import functools
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import gpu  # noqa: E402

from ember.autograd import function  # noqa: E402
from ember.runtime import cudagraphs  # noqa: E402

SPENT: dict[str, float] = collections.defaultdict(float)
CALLS: dict[str, int] = collections.defaultdict(int)


def timed(owner, attr: str, label: str, static: bool = False) -> None:
    fn = getattr(owner, attr)

    @functools.wraps(fn)
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            SPENT[label] += time.perf_counter() - t
            CALLS[label] += 1
    setattr(owner, attr, staticmethod(wrapper) if static else wrapper)


def main() -> None:
    if "--bn-aten" in sys.argv:
        from ember.decomp import table
        table.TRAIN_BATCH_NORM_DECOMPOSED.discard("cuda")
    step = gpu.densenet_train(gpu.ember_compile, "reduce-overhead")
    for _ in range(4):
        step()
    torch.cuda.synchronize()
    walls = gpu.synced_walls(step, 10)
    t = time.perf_counter()
    for _ in range(20):
        step()
    queued = (time.perf_counter() - t) / 20 * 1e3
    torch.cuda.synchronize()
    gpu_ms = gpu.steady_ms(step, 20)
    print(f"# densenet121 train step, reduce-overhead, ember, {torch.cuda.get_device_name()}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"step wall (synchronized) min {min(walls):.2f} median {sorted(walls)[5]:.2f} ms; host queued "
          f"{queued:.2f} ms; event-timed step {gpu_ms:.2f} ms")

    from ember.autograd import trace
    seen = []
    orig_finish = function.finish

    def finish_once(meta, inputs, outs):     # which mutated inputs the graph did not write in place, once
        if not seen:
            seen.append(1)
            kinds = collections.Counter()
            for m in meta.mutations:
                d, s = inputs[m.input_index], outs[m.output_index]
                kinds[("in place" if d is s else "copied back", d.device.type, d.dtype, d.ndim,
                       type(d).__name__)] += 1
            print("mutations of the step's graph:", dict(kinds))
            print("graph outputs:", collections.Counter((type(o).__name__, o.device.type, o.requires_grad)
                                                        for o in outs if isinstance(o, torch.Tensor)))
        return orig_finish(meta, inputs, outs)
    function.finish = finish_once
    step()
    torch.cuda.synchronize()
    function.finish = orig_finish
    del trace
    import gc
    for g in (o for o in gc.get_objects() if isinstance(o, cudagraphs.CUDAGraphed)):
        print(f"CUDA graph {g.name}: {g.replays} replays, {g.eager_runs} eager runs, {len(g.recordings)} recordings")
        for r in g.recordings.values():   # outputs cloned on each replay (graph memory the caller may keep), by size
            sizes = collections.Counter(tuple(t.shape) for t in r.cloned_sources)
            mb = sum(t.numel() * t.element_size() for t in r.cloned_sources) / 2**20
            print(f"  recording: {len(r.cloned_sources)} outputs cloned per replay, {mb:.1f} MiB; most common "
                  f"shapes {sizes.most_common(6)}; largest "
                  f"{sorted((tuple(t.shape) for t in r.cloned_sources), key=lambda s: -torch.Size(s).numel())[:6]}")

    timed(function.CompiledGraphFunction, "apply", "CompiledGraphFunction.apply (forward, autograd node)")
    timed(function.CompiledGraphFunction, "backward", "CompiledGraphFunction.backward", static=True)
    timed(cudagraphs.CUDAGraphed, "__call__", "  CUDAGraphed.__call__")
    timed(cudagraphs.GraphPool, "before_replay", "    GraphPool.before_replay")
    timed(cudagraphs._Recording, "matches", "    _Recording.matches")
    timed(torch.cuda.CUDAGraph, "replay", "    CUDAGraph.replay")
    timed(cudagraphs.FreshLike, "__call__", "    FreshLike (gradient buffers)")
    timed(torch.autograd, "backward", "torch.autograd.backward (engine, AccumulateGrad)")
    timed(function, "finish", "trace.finish (copy-backs, outputs)")
    timed(torch.optim.Optimizer, "zero_grad", "Optimizer.zero_grad")
    steps = 20
    SPENT.clear()
    CALLS.clear()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    total = (time.perf_counter() - t) / steps * 1e3
    torch.cuda.synchronize()
    print(f"host per step with timers: {total:.2f} ms")
    for label in SPENT:
        print(f"  {SPENT[label] / steps * 1e3:7.3f} ms {CALLS[label] // steps:4d}x  {label}")

    import cProfile
    import pstats
    pr = cProfile.Profile()
    pr.runcall(lambda: [step() for _ in range(steps)])
    torch.cuda.synchronize()
    print(f"cProfile of {steps} steps (the timers above still on):")
    pstats.Stats(pr).sort_stats("tottime").print_stats(25)

    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    evs = p.key_averages()
    on_gpu = [e for e in evs if e.device_type == torch.autograd.DeviceType.CUDA]
    print(f"GPU time per step (kernels, profiler on): {sum(e.self_device_time_total for e in on_gpu) / 5 / 1e3:.3f} ms, "
          f"{sum(e.count for e in on_gpu) // 5} kernels")
    for e in sorted(on_gpu, key=lambda e: -e.self_device_time_total)[:12]:
        print(f"  {e.self_device_time_total / 5 / 1e3:8.3f} ms {e.count // 5:5d}x  {e.key[:90]}")
    kinds = collections.defaultdict(lambda: [0.0, 0])   # GPU time by kind of kernel
    for e in on_gpu:
        k = e.key
        kind = ("ember Triton" if k.startswith("k_") else "Triton (other)" if k.startswith("triton_") else
                "ATen native" if "at::native" in k else "memcpy/memset" if "Memcpy" in k or "Memset" in k else
                "cuDNN/cuBLAS/CUTLASS")
        kinds[kind][0] += e.self_device_time_total / 5 / 1e3
        kinds[kind][1] += e.count // 5
    print("GPU time by kind: " + ", ".join(f"{k} {v[0]:.3f} ms ({v[1]} kernels)" for k, v in kinds.items()))
    for e in sorted((e for e in on_gpu if "at::native" in e.key), key=lambda e: -e.self_device_time_total)[:8]:
        print(f"  ATen native {e.self_device_time_total / 5 / 1e3:8.3f} ms {e.count // 5:5d}x  {e.key[:110]}")
    print("host ops (self time per step, profiler on):")
    for e in sorted((e for e in evs if e.device_type != torch.autograd.DeviceType.CUDA),
                    key=lambda e: -e.self_cpu_time_total)[:16]:
        print(f"  {e.self_cpu_time_total / 5 / 1e3:8.3f} ms {e.count // 5:5d}x  {e.key[:90]}")


if __name__ == "__main__":
    main()
