"""GPU benchmark: eager vs torch.compile (Inductor) vs ember, one table, one run (issue 6's workloads).

    python bench/gpu.py                      # every workload, every column
    python bench/gpu.py --only adam,resnet   # a subset (names are matched as substrings)
    python bench/gpu.py --json out.json      # also write every number

Times are medians of per-step CUDA-event times after warm-up (events bracket each step as the CPU issues it,
so launch gaps count). A row's columns are built and timed one after the other, then timed again in turns
(--rounds, 5 by default, each round starting at the next column); the table shows the median of those
timings: timed only once each, a later column would meet a warmer card (a slower one, docs/evidence.md).
"compile" is the cold cost: the wall time of the first calls (until the compiled code
and any CUDA graphs are recorded) minus as many steady steps, not counting the model's construction, timed once
the machine is quiet (under half a core busy, waited for up to 5 s: a compiler's leftover work slowed the next
column's compile);
Inductor's, Triton's and ember's on-disk caches are pointed at fresh directories for each row, so each compiles
from nothing (what each keeps in memory stays: both compilers alike). A failing column prints the error class and the run goes on.
"""
from __future__ import annotations

import argparse
import functools
import dataclasses
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from typing import Callable

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor_cold_"))
os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")
os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="triton_cold_"))
os.environ["EMBER_CACHE_DIR"] = tempfile.mkdtemp(prefix="ember_cold_")   # (bench/device.sh points tests at its own)

import torch  # noqa: E402


def fresh_caches() -> None:
    """New, empty on-disk caches for Inductor, Triton and ember: each row compiles cold (a row after another
    compiles faster from what the earlier row left on disk, docs/evidence.md)."""
    for var, prefix in [("TORCHINDUCTOR_CACHE_DIR", "inductor_cold_"), ("TRITON_CACHE_DIR", "triton_cold_"),
                        ("EMBER_CACHE_DIR", "ember_cold_")]:
        os.environ[var] = tempfile.mkdtemp(prefix=prefix)

import ember  # noqa: E402

DEV = "cuda"


@dataclasses.dataclass
class Workload:
    name: str
    build: Callable[[Callable | None, str | None], Callable[[], object]]  # (compiler, mode) -> step
    mode: str | None = None          # compile mode for the compiled columns
    bytes_moved: int | None = None   # fewest bytes one step must move (memory-bound rows)
    iters: int = 50
    columns: tuple = ("eager", "inductor", "ember")   # columns this row runs in (where asked for)


def ember_compile(fn, mode=None):
    return ember.compile(fn, mode=mode)


def compilers():
    return {"eager": None, "inductor": torch.compile, "inductor-train": torch.compile, "ember": ember_compile}


# ---- workloads ---------------------------------------------------------------------------------------------

N_POINTWISE = 64 * 2**20


def pointwise(compiler, mode):
    x = torch.randn(N_POINTWISE, device=DEV)

    def chain(x):
        y = x * 1.5 + 0.5
        y = torch.sin(y) * torch.cos(y)
        y = torch.relu(y) + torch.sigmoid(x)
        return torch.tanh(y * y - x)

    fn = chain if compiler is None else compiler(chain, mode=mode)
    return lambda: fn(x)


def affine(compiler, mode):
    """Diagnostic row: the memory side of the pointwise row alone (one multiply-add per element): what a flat
    kernel's loads and stores reach, where the chain above adds sin, cos, sigmoid and tanh (libdevice's
    precise versions, as eager's kernels compute them)."""
    x = torch.randn(N_POINTWISE, device=DEV)

    def scale(x):
        return x * 1.5 + 0.5

    fn = scale if compiler is None else compiler(scale, mode=mode)
    return lambda: fn(x)


def adam(compiler, mode, fused=False, capturable=False):
    params = [torch.nn.Linear(1024, 1024, bias=False, device=DEV).weight for _ in range(10)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.Adam(params, lr=1e-3, fused=True) if fused else \
        torch.optim.Adam(params, lr=1e-3, capturable=capturable)

    def step():
        opt.step()

    return step if compiler is None else compiler(step, mode=mode)


def densenet_inference(compiler, mode):
    import torchvision
    model = torchvision.models.densenet121().to(DEV).eval()
    x = torch.randn(16, 3, 128, 128, device=DEV)
    fn = model if compiler is None else compiler(model, mode=mode)

    def step():
        with torch.no_grad():
            return fn(x)
    return step


def densenet_train(compiler, mode):
    import torchvision
    model = torchvision.models.densenet121().to(DEV)
    opt = torch.optim.Adam(model.parameters())
    data = (torch.randn(16, 3, 128, 128, device=DEV), torch.randint(1000, (16,), device=DEV))
    loss_fn = torch.nn.CrossEntropyLoss()

    def train(mod, data):  # the torch.compile tutorial's training step
        opt.zero_grad(True)
        pred = mod(data[0])
        loss = loss_fn(pred, data[1])
        loss.backward()
        opt.step()

    fn = train if compiler is None else compiler(train, mode=mode)
    return lambda: fn(model, data)


def resnet50(compiler, mode):
    import torchvision
    model = torchvision.models.resnet50().to(DEV).eval()
    x = torch.randn(32, 3, 224, 224, device=DEV)
    fn = model if compiler is None else compiler(model, mode=mode)

    def step():
        with torch.no_grad():
            return fn(x)
    return step


def bert(compiler, mode):
    from transformers import BertConfig, BertModel
    model = BertModel(BertConfig()).to(DEV).eval()
    ids = torch.randint(0, 30522, (8, 128), device=DEV)
    fn = model if compiler is None else compiler(model, mode=mode)

    def step():
        with torch.no_grad():
            return fn(input_ids=ids).last_hidden_state
    return step


def gpt2_train(compiler, mode):
    from transformers import GPT2Config, GPT2LMHeadModel
    model = GPT2LMHeadModel(GPT2Config()).to(DEV).train()
    ids = torch.randint(0, 50257, (8, 256), device=DEV)
    fn = model if compiler is None else compiler(model, mode=mode)

    def step():  # forward with the LM loss, backward; no optimizer
        model.zero_grad(set_to_none=True)
        loss = fn(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach()
    return step


def densenet_cudagraphs_only(compiler, mode):
    """Diagnostic row: ember.runtime.cudagraphs around the eager module (no fusion), vs eager."""
    import torchvision
    from ember.runtime.cudagraphs import CUDAGraphed
    model = torchvision.models.densenet121().to(DEV).eval()
    x = torch.randn(16, 3, 128, 128, device=DEV)
    if compiler is None:
        def step():
            with torch.no_grad():
                return model(x)
        return step
    if compiler is not ember_compile:
        return None                      # ember-only row
    state = list(model.parameters()) + list(model.buffers())

    def run(x, *state):
        return (model(x),)
    g = CUDAGraphed(run, static_input_indices=range(1, 1 + len(state)))

    def step():
        with torch.no_grad():
            return g(x, *state)[0]
    return step


WORKLOADS = [
    Workload("pointwise chain, 64M float32", pointwise, bytes_moved=2 * 4 * N_POINTWISE, iters=100),
    Workload("affine x*1.5+0.5, 64M float32 (diag)", affine, bytes_moved=2 * 4 * N_POINTWISE, iters=100),
    Workload("Adam step, 10x Linear(1024,1024)", adam, bytes_moved=7 * 4 * 10 * 1024 * 1024, iters=100),
    # the step counters on the GPU (torch keeps them on the CPU by default): the whole step can be one kernel
    Workload("Adam step, capturable=True", functools.partial(adam, capturable=True),
             bytes_moved=7 * 4 * 10 * 1024 * 1024, iters=100),
    Workload("densenet121 b16 128px infer, reduce-overhead", densenet_inference, mode="reduce-overhead"),
    Workload("densenet121 b16 128px infer, default", densenet_inference),
    # Inductor's cold compile of this row alone takes ~3.5 minutes: its column runs
    # only when asked for by name (--columns inductor-train), so that a whole run fits in one 10-minute command
    Workload("densenet121 b16 train step+Adam, reduce-overhead", densenet_train, mode="reduce-overhead", iters=20,
             columns=("eager", "inductor-train", "ember")),
    Workload("resnet50 b32 224px inference", resnet50, iters=30),
    Workload("BertModel b8 s128 inference", bert, iters=30),
    # Inductor's max-autotune compile takes minutes here: that column is left to the default-mode row above
    Workload("BertModel b8 s128 inference, max-autotune", bert, mode="max-autotune", iters=30,
             columns=("eager", "ember")),
    Workload("GPT2LMHeadModel b8 s256 train (fwd+bwd)", gpt2_train, iters=20),
    Workload("densenet121 infer, ember cudagraphs only (diag)", densenet_cudagraphs_only, mode="reduce-overhead"),
]


# ---- measurement -------------------------------------------------------------------------------------------

def synced_walls(step: Callable, n: int) -> list[float]:
    """Each step's wall time (ms) with a wait after it: a median of events hides a step that re-records a CUDA
    graph, runs eagerly or meets a full garbage collection."""
    walls = []
    for _ in range(n):
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t) * 1e3)
    return walls


def steady_ms(step: Callable, iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        times.append((a, b))
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in times)


def in_turns(steps: dict, iters: int, rounds: int) -> dict:
    """{key: [ms of each round]}: the steps timed `rounds` times in turns, each round starting at the next step,
    so the order of the steps is not the order of the card's warmth."""
    keys = list(steps)
    times: dict = {k: [] for k in keys}
    for r in range(rounds if keys else 0):
        for k in keys[r % len(keys):] + keys[:r % len(keys)]:
            times[k].append(steady_ms(steps[k], iters))
    return times


def sweep_flat_blocks() -> None:
    """Diagnostic: the pointwise chain's one Triton kernel under other flat block sizes (for launch_config)."""
    from ember.autograd import trace_forward
    from ember.backends.triton_backend import compile_aten
    from ember.codegen.triton import heuristics, kernels
    x = torch.randn(N_POINTWISE, device=DEV)

    def chain(x):
        y = x * 1.5 + 0.5
        y = torch.sin(y) * torch.cos(y)
        y = torch.relu(y) + torch.sigmoid(x)
        return (torch.tanh(y * y - x),)
    gm = torch.fx.symbolic_trace(chain)
    aten_gm, _ = trace_forward(gm, [x])
    default = kernels.launch_config   # (kernel_source looks it up in kernels)
    for block, warps in ((1024, 4), (512, 4), (1024, 8), (2048, 16), (512, 2), (256, 2), (2048, 8)):
        kernels.launch_config = lambda shape, rows, rmax, b=block, w=warps: (
            {"BLOCK": b, "num_warps": w} if shape == heuristics.FLAT else default(shape, rows, rmax))
        try:
            f = compile_aten(aten_gm, [x])
            ms = steady_ms(lambda: f(x), 100)
            print(f"  flat BLOCK={block:5d} num_warps={warps:2d}: {ms:.4f} ms, {2 * 4 * N_POINTWISE / ms / 1e6:.0f} GB/s")
        finally:
            kernels.launch_config = default


PROFILE: list[str] = []
COMPILE_PROFILE: list[str] = []

# the pipeline's stages, timed (wall seconds) in ember's cold compiles: where they go without cProfile's overhead;
# and when (a timeline: the C++ builds and Triton's compiles run in pool threads beside the main thread)
PHASES = ("ember.frontend.convert:FrameCompiler.capture", "ember.autograd.trace:trace_joint",
          "ember.autograd.trace:trace_forward", "ember.autograd.partition:partition", "ember.codegen.lower:lower",
          "ember.codegen.schedule:schedule", "ember.backends.host_scalars:split",
          "ember.codegen.triton.kernels:generate", "ember.backends.triton_backend:_precompile",
          "ember.runtime.cudagraphs:CUDAGraphed._record", "ember.runtime.cache:_build",
          "ember.backends.triton_backend:_compile_and_load", "ember.runtime.triton_launch:load_module",
          "ember.frontend.convert:FrameCompiler.make_entry",
          "ember.backends.ember_backend:compile_graph")
PHASE_S: dict[str, float] = {}
PHASE_SPANS: list[tuple[float, float, str, str]] = []   # (start, end, phase, thread), perf_counter seconds


def time_phases() -> None:
    """Wrap each of PHASES (where every ember module holds it) with a timer adding to PHASE_S and PHASE_SPANS;
    nested calls of one phase (in one thread) count once. Triton's own stages of each compile are spans too
    (its compilation listener)."""
    import importlib
    import threading
    for spec in PHASES:
        mod_name, qual = spec.split(":")
        owner = importlib.import_module(mod_name)
        *cls, name = qual.split(".")
        if cls:
            owner = getattr(owner, cls[0])
        original = getattr(owner, name, None)
        if original is None:
            continue
        depth = threading.local()

        def timed(*a, __f=original, __k=qual, __d=depth, **k):
            __d.n = getattr(__d, "n", 0) + 1
            t0 = time.perf_counter()
            try:
                return __f(*a, **k)
            finally:
                __d.n -= 1
                if __d.n == 0:
                    t1 = time.perf_counter()
                    PHASE_S[__k] = PHASE_S.get(__k, 0.0) + t1 - t0
                    PHASE_SPANS.append((t0, t1, __k, threading.current_thread().name))
        if cls:
            setattr(owner, name, timed)
        else:
            for m in [m for n, m in sys.modules.items() if n.startswith("ember") and m is not None]:
                for attr, v in list(vars(m).items()):
                    if v is original:
                        setattr(m, attr, timed)
    import gc
    gc_start = {}

    def gc_span(phase, info):   # the garbage collector's passes (a full one walks every live object)
        if phase == "start":
            gc_start["t"] = time.perf_counter()
        elif "t" in gc_start:
            PHASE_SPANS.append((gc_start.pop("t"), time.perf_counter(), f"gc generation {info['generation']}",
                                threading.current_thread().name))
    gc.callbacks.append(gc_span)
    try:
        import triton

        def listener(*, src, times, cache_hit, **_):
            t1 = time.perf_counter()
            stages = [("ir", times.ir_initialization), *times.lowering_stages, ("store", times.store_results)]
            name = getattr(getattr(src, "fn", None), "__name__", "?")
            PHASE_SPANS.append((t1 - times.total / 1e6, t1, f"triton {name} " + " ".join(
                f"{k} {v / 1e3:.0f}" for k, v in stages) + (" (cache hit)" if cache_hit else ""),
                threading.current_thread().name))
        triton.knobs.compilation.listener = listener
    except (ImportError, AttributeError):
        pass


def busy_cores(window: float = 0.3) -> float:
    """How many of the machine's cores were busy over `window` seconds (/proc/stat): processes left running
    by an earlier column (a compiler's worker pool starting up) slow the next cold compile."""
    def sample():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + v[4]   # all, idle + iowait
    (a0, i0), _ = sample(), time.sleep(window)
    a1, i1 = sample()
    return (1 - (i1 - i0) / max(1, a1 - a0)) * (os.cpu_count() or 1)


def settle(limit_s: float = 5.0) -> tuple[float, float]:
    """Wait (at most limit_s) until under half a core is busy, so that a cold compile is not timed beside work
    the previous column left running (Inductor's compile leaves a core busy for seconds after it returns,
    docs/evidence.md): (seconds waited, cores busy at the end)."""
    t0 = time.perf_counter()
    busy = busy_cores()
    while busy > 0.5 and time.perf_counter() - t0 < limit_s:
        busy = busy_cores()
    return time.perf_counter() - t0, busy


def print_timeline(t0: float) -> None:
    """PHASE_SPANS since t0, in order of start (ms from t0), then cleared; a phase of many spans (the kernels of
    a big graph) is one line: how many, the first start, the last end and their sum."""
    spans = sorted(s for s in PHASE_SPANS if s[1] >= t0)
    PHASE_SPANS.clear()
    def kind(what: str) -> str:   # a phase's name; Triton's compiles all as one
        return what.split()[0] + (" " + what.split()[1][:2] if what.startswith("triton") else "")
    counts: dict = {}
    for _, _, what, _ in spans:
        counts[kind(what)] = counts.get(kind(what), 0) + 1
    grouped: dict = {}
    for start, end, what, thread in spans:
        k = kind(what)
        if counts[k] <= 12:
            print(f"      {(start - t0) * 1e3:7.1f} {(end - t0) * 1e3:7.1f} ms  {what}  [{thread}]")
        elif k not in grouped:
            grouped[k] = [start, end, 0.0]
            print(f"      {(start - t0) * 1e3:7.1f}      ..    {k}: {counts[k]} spans, below")
        g = grouped.get(k)
        if g is not None:
            g[1], g[2] = max(g[1], end), g[2] + end - start
    for k, (start, end, total) in grouped.items():
        print(f"      {(start - t0) * 1e3:7.1f} {(end - t0) * 1e3:7.1f} ms  {k}: {counts[k]} spans, {total:.1f} s in all")


def measure(w: Workload, column: str, compiler) -> dict:
    torch.manual_seed(0)
    step = w.build(compiler, w.mode)   # the model's construction is not the compile's (nor is it timed)
    if step is None:
        return None
    torch.cuda.synchronize()
    from ember.backends import triton_backend
    from ember.runtime import triton_workers
    triton_s, in_workers = triton_backend.STATS["compile_s"], triton_workers.STATS["compiled"]
    settled_s, load_before = settle() if compiler is not None else (0.0, 0.0)
    t0 = time.perf_counter()
    first = 3 if compiler is not None else 0     # reduce-overhead records CUDA graphs on the first calls
    pr = None
    if column == "ember" and any(k in w.name.lower() for k in COMPILE_PROFILE):
        import cProfile
        pr = cProfile.Profile()
        pr.enable()
    for _ in range(first):
        step()
    torch.cuda.synchronize()
    cold_s = time.perf_counter() - t0
    if column == "ember":   # of the cold compile: Triton's compile and load of the kernels (_precompile)
        print(f"  {w.name} [ember]: {cold_s:.1f} s cold, of which Triton "
              f"{triton_backend.STATS['compile_s'] - triton_s:.1f} s "
              f"({triton_workers.STATS['compiled'] - in_workers} kernels compiled in worker processes, "
              f"{triton_workers.STATS['worker_s']:.1f} s of theirs in all; "
              f"cores busy before it {load_before:.1f}, after waiting {settled_s:.1f} s for quiet)", flush=True)
        if PHASE_S:
            print("    phases (s): " + ", ".join(f"{k} {v:.2f}" for k, v in PHASE_S.items()), flush=True)
            print("    timeline (start, end):")
            print_timeline(t0)
            print("    slowest kernels in workers (s): " + ", ".join(f"{n} {t:.1f}" for t, n, _ in triton_workers.SLOWEST))
            if triton_workers.SLOWEST:   # the slowest one's source, to its first 80 lines
                _, name, path = triton_workers.SLOWEST[0]
                src = open(path).read()
                body = src[src.index(f"def {name}("):].split("\n@triton.jit")[0].splitlines()
                print(f"    {name} ({len(body)} lines):\n" + "\n".join(body[:80]))
            PHASE_S.clear()
    if pr is not None:   # where a cold compile's time goes (the build before this was eager module set-up)
        import pstats
        pr.disable()
        print(f"  compile profile {w.name} [{column}] ({cold_s:.1f} s):")
        pstats.Stats(pr).sort_stats("cumulative").print_stats(r"ember|triton|sympy|fake|_subclasses", 45)
        pstats.Stats(pr).sort_stats("tottime").print_stats(25)
    ms = steady_ms(step, w.iters)
    cold_s = max(0.0, cold_s - first * ms / 1e3)
    out = step()
    host_ms = None
    if any(k in w.name.lower() for k in PROFILE):   # host time per step: steps queued without a wait
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        for _ in range(20):
            step()
        host_ms = (time.perf_counter() - t1) / 20 * 1e3
        torch.cuda.synchronize()
        print(f"  host {w.name} [{column}]: {host_ms:.3f} ms per step queued (GPU-step {ms:.3f} ms)", flush=True)
    if any(k in w.name.lower() for k in PROFILE):
        profile(step, f"{w.name} [{column}]")
        if column == "ember":   # where the host time of a step goes
            import cProfile
            import pstats
            pr = cProfile.Profile()
            pr.runcall(lambda: [step() for _ in range(30)])
            torch.cuda.synchronize()
            print("  (30 steps)")
            pstats.Stats(pr).sort_stats("tottime").print_stats(14)
            pstats.Stats(pr).sort_stats("cumulative").print_stats(r"ember|triton", 20)
            # who makes the many small host calls (allocations, copies, views) of a step
            pstats.Stats(pr).sort_stats("tottime").print_callers(r"empty_strided|copy_|unflatten_dense|narrow", 6)
    return {"ms": ms, "compile_s": cold_s if compiler is not None else None, "out": out, "step": step,
            "quiet_wait_s": round(settled_s, 1), "busy_cores": round(load_before, 1)}


def cuda_kernels(step: Callable, steps: int = 5) -> tuple[list, float]:
    """The CUDA kernels `steps` steps ran (torch.profiler's key_averages: totals over the steps) and their GPU
    time a step (ms)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof
    with prof(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    evs = [e for e in p.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    return evs, sum(e.self_device_time_total for e in evs) / steps / 1e3


def profile(step: Callable, label: str, steps: int = 5, top: int = int(os.environ.get("PROFILE_TOP", "16"))) -> None:
    """Print the kernels one step runs, heaviest first (where the GPU time of a column goes)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof
    step()
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as p:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    if "[ember]" in label:   # where the host time goes, by ATen op (self time, so nested ops are not counted twice)
        cpu = [e for e in p.key_averages() if e.device_type == torch.autograd.DeviceType.CPU]
        print(f"  host ops {label}:", flush=True)
        for e in sorted(cpu, key=lambda e: -e.self_cpu_time_total)[:12]:
            print(f"    {e.self_cpu_time_total / steps / 1e3:8.3f} ms {e.count // steps:6d}x  {e.key[:80]}")
    evs = [e for e in p.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in evs) / steps
    launches = sum(e.count for e in evs) / steps
    print(f"  profile {label}: {total / 1e3:.3f} ms GPU time, {launches:.0f} kernels per step", flush=True)
    for e in sorted(evs, key=lambda e: -e.self_device_time_total)[:top]:
        print(f"    {e.self_device_time_total / steps / 1e3:8.3f} ms {e.count // steps:5d}x  {e.key[:90]}")


def check(out, ref) -> str:
    if out is None or ref is None or not isinstance(out, torch.Tensor):
        return ""
    try:
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
        return "ok"
    except AssertionError:
        return "MISMATCH"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="", help="comma-separated parts of row names; a part ending in $ is a whole name")
    ap.add_argument("--columns", default="eager,inductor,ember")
    ap.add_argument("--json", default="")
    ap.add_argument("--profile", default="", help="workloads (substrings) whose columns get a kernel profile")
    ap.add_argument("--compile-profile", default="", help="workloads (substrings) whose ember cold compile is profiled")
    ap.add_argument("--sweep-blocks", action="store_true", help="time the pointwise chain under other BLOCKs")
    ap.add_argument("--phases", action="store_true", help="time the pipeline's stages in ember's cold compiles")
    ap.add_argument("--rounds", type=int, default=5, help="after a row's columns are built and timed, time them "
                    "again this many rounds in turns (each round starting at the next column) and report the "
                    "median: a column timed later in the run (on a warmer card) is not at a disadvantage")
    args = ap.parse_args()
    PROFILE.extend(k.rstrip("$") for k in args.profile.lower().split(",") if k)
    COMPILE_PROFILE.extend(k.rstrip("$") for k in args.compile_profile.lower().split(",") if k)
    if args.phases:
        time_phases()
    cols = [c for c in args.columns.split(",") if c]
    # ember's C++ guards build in the background at the first capture (~11 s on a fresh machine); a row captured
    # before they are loaded keeps Python guards: wait, to measure what an installation with its cache runs. So
    # for its kernel launcher (~0.5 s, once per machine as Triton's own C utilities are)
    from ember.runtime import native_guards
    from ember.runtime import cuda_launch
    native_guards.checker(wait=True)
    if torch.cuda.is_available():
        cuda_launch.EXTENSION.get(wait=True)
    def picked(name: str, part: str) -> bool:   # a substring of the row's name; "...$": the whole name
        return name == part[:-1] if part.endswith("$") else part in name
    parts = args.only.lower().split(",")
    wanted = [w for w in WORKLOADS if not args.only or any(picked(w.name.lower(), s) for s in parts)]
    if args.only:   # in the order asked for (a run cut by its time limit loses the last rows asked for)
        wanted.sort(key=lambda w: min(i for i, s in enumerate(parts) if picked(w.name.lower(), s)))
    dev = torch.cuda.get_device_name()
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"# bench/gpu.py on {dev}, torch {torch.__version__}, Python {platform.python_version()}, {when}",
          flush=True)
    if args.sweep_blocks:
        sweep_flat_blocks()
    rows = []
    for w in wanted:
        row = {"workload": w.name}
        ref = None
        fresh_caches()
        for col in cols:
            if col not in w.columns:
                continue
            comp = compilers()[col]
            try:
                r = measure(w, col, comp)
                if r is None:
                    continue
                if col == "eager":
                    ref = r["out"]
                r["check"] = check(r.pop("out"), ref) if col != "eager" else ""
            except Exception as e:  # a failing column is reported, the run goes on
                r = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"}
                traceback.print_exc(limit=3, file=sys.stdout)
            row[col] = r
            print(f"  {w.name} [{col}] {dict((k, v) for k, v in r.items() if k not in ('out', 'step'))}", flush=True)
            if args.rounds <= 0:
                r.pop("step", None)
                if col.startswith("inductor"):
                    torch._dynamo.reset()
                torch.cuda.empty_cache()
        timed = [c for c in cols if isinstance(row.get(c), dict) and "step" in row[c]]
        more = in_turns({c: row[c]["step"] for c in timed}, w.iters, args.rounds)
        for c in timed:
            r = row[c]
            del r["step"]
            if more[c]:
                ts = [r["ms"], *more[c]]
                r["ms"] = statistics.median(ts)
                print(f"  {w.name} [{c}] rounds (ms): {' '.join(f'{t:.3f}' for t in ts)} -> median {r['ms']:.3f}",
                      flush=True)
        if args.rounds > 0:
            torch._dynamo.reset()
            torch.cuda.empty_cache()
        if w.name.startswith("Adam step, 10x") and "eager" in cols:
            try:
                row["eager fused=True"] = {"ms": steady_ms(adam(None, None, fused=True), w.iters)}
            except Exception as e:
                row["eager fused=True"] = {"error": type(e).__name__}
        rows.append(row)
        if args.json:  # after every row, so a run cut short still leaves its numbers
            with open(args.json, "w") as f:
                json.dump({"device": dev, "torch": torch.__version__, "when": when, "rows": rows}, f, indent=1,
                          default=str)

    try:
        from ember.codegen import lower
        if lower.FALLBACK_COUNTS:
            print("ember: ATen ops kept as library/ATen calls (fallbacks), all workloads:",
                  dict(lower.FALLBACK_COUNTS.most_common(15)))
    except ImportError:
        pass

    def cell(r, base):
        if r is None:
            return "-"
        if "error" in r:
            return "ERR " + r["error"].split(":")[0]
        s = f"{r['ms']:.3f} ms"
        if base and r is not base:
            s += f" ({base['ms'] / r['ms']:.2f}x)"
        if r.get("compile_s") is not None:
            s += f" c={r['compile_s']:.1f}s"
        if r.get("check"):
            s += f" {r['check']}"
        return s

    print(f"\n## {dev}, torch {torch.__version__}, {when}")
    print("| workload | " + " | ".join(cols) + " | GB/s (" + "/".join(cols) + ") |")
    print("|---" * (len(cols) + 2) + "|")
    for row, w in zip(rows, wanted):
        base = row.get("eager") if row.get("eager", {}).get("ms") else None
        cells = [cell(row.get(c), base) for c in cols]
        gbs = "-"
        if w.bytes_moved:
            gbs = "/".join(f"{w.bytes_moved / row[c]['ms'] / 1e6:.0f}" if row.get(c, {}).get("ms") else "-"
                           for c in cols)
        print(f"| {w.name} | " + " | ".join(cells) + f" | {gbs} |")
        if "eager fused=True" in row:
            print(f"| ↳ eager Adam(fused=True) | {cell(row['eager fused=True'], base)} |" + " |" * len(cols))


if __name__ == "__main__":
    main()
