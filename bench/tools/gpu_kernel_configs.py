"""ember's launch heuristics against a search (device run): every Triton kernel of one model step timed under the
config launch_config/column_config chose and under the others of a grid, each alone in a CUDA graph of 20
launches (so host launch cost is not timed), with the arguments of its first launch.

    python bench/tools/gpu_kernel_configs.py [densenet_train|gpt2|bert|resnet50|ops:ROWS] [TOP] [--json FILE] [--cold]

ops:ROWS: bench/ops.py's rows named (comma-separated, whole names) at 64M elements, one call of each a step.

--cold: L2 emptied before each launch (a write of 128 MB): the time of a kernel whose inputs were made long
before it in the step.

Prints per kernel (the TOP heaviest searched): launches a step, shape, rows x row length, the chosen config and
its time, the best config and its time; then the step's Triton time under the chosen and the best configs. The
searched configs are the kernel's own source under another config (kernel_source with the heuristics patched),
so what a win needs is a better heuristic, not another kernel. In-place kernels run 20+ times on one state: the
model's values are garbage afterwards (this script only times).
"""
import collections
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository root
from bench import gpu  # noqa: E402
from bench.tools.gpu_top_kernels import STEPS  # noqa: E402

from ember.backends import triton_backend  # noqa: E402
from ember.codegen.triton import heuristics, kernels  # noqa: E402
from ember.codegen.triton.printer import PRELUDE  # noqa: E402
from ember.runtime.triton_launch import Launcher, load_module  # noqa: E402

REPEAT = 20


# --cold: "buffer", 128 MB (more than the GPU's L2 cache) written before each launch; "us", that write's time
COLD: dict = {}


def _graph_us(body) -> float:
    """Mean GPU time (us) of `body`'s launches, from a CUDA graph of REPEAT calls replayed 5 times."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(REPEAT):
            body()
    g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(5):
        g.replay()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) * 1e3 / (5 * REPEAT)


def graph_us(launch, args) -> float:
    """Mean GPU time (us) of one launch. With --cold, each launch follows the write of COLD's buffer (its inputs
    come from memory, as those made long before in a step do), whose own time is subtracted."""
    launch(*args)
    torch.cuda.synchronize()
    if "buffer" not in COLD:
        return _graph_us(lambda: launch(*args))
    if "us" not in COLD:
        COLD["us"] = _graph_us(COLD["buffer"].zero_)
    return _graph_us(lambda: (COLD["buffer"].zero_(), launch(*args))) - COLD["us"]


def candidates(shape: str, cfg: dict, rows: int, rmax: int, column: bool) -> list[dict]:
    """The grid searched for one kernel (the chosen config among them)."""
    out = []
    if "YBLOCK" in cfg:   # a flat kernel in 2-D tiles (kernels.transposed_split)
        return [{"YBLOCK": y, "XBLOCK": x, "num_warps": w} for y in (16, 32, 64, 128) for x in (16, 32, 64, 128)
                for w in (2, 4, 8) if 256 <= x * y <= 8192 and 1 <= x * y // (32 * w) <= 32]
    if shape in (heuristics.FLAT, heuristics.FOREACH):
        for b in (128, 256, 512, 1024, 2048, 4096):
            for w in (1, 2, 4, 8, 16):
                if 1 <= b // (32 * w) <= 16:
                    out.append({"BLOCK": b, "num_warps": w})
        return out
    if rmax <= 1:
        return [{"XBLOCK": x, "RBLOCK": 1, "num_warps": w, "persistent": True}
                for x in (64, 128, 256, 512, 1024) for w in (1, 2, 4, 8) if 1 <= x // (32 * w) <= 16]
    p2 = heuristics.triton_next_pow2
    if column:
        for x in (8, 16, 32, 64, 128):
            for r in (16, 32, 64, 128, 256, 512):
                if x * r <= 8192 and x <= p2(rows):
                    for w in (2, 4, 8):
                        out.append({"XBLOCK": x, "RBLOCK": min(r, p2(rmax)), "num_warps": w, "persistent": rmax <= r})
        return [dict(t) for t in {tuple(sorted(c.items())) for c in out}]
    r_whole = p2(rmax)
    for r in {256, 512, 1024, 2048, 4096, r_whole}:
        if r > min(r_whole, heuristics.PERSISTENT_MAX_R):
            continue
        persistent = r >= rmax
        for x in (1, 2, 4, 8, 16, 32, 64):
            if x > p2(rows) or x * r > 16384:
                continue
            for w in (1, 2, 4, 8, 16):
                if 1 <= x * r // (32 * w) <= 64:
                    out.append({"XBLOCK": x, "RBLOCK": r, "num_warps": w, "persistent": persistent})
    return [dict(t) for t in {tuple(sorted(c.items())) for c in out}]


def ops_step(names: str):
    """A STEPS entry: one call of each of bench/ops.py's rows `names` at 64M elements (its --scale 4)."""
    from bench import ops

    def build(compile_fn, _):
        rows = []
        for name in names.split(","):
            fn, specs = ops.PATTERNS[name](64 * ops.M)
            rows.append((compile_fn(fn), ops.make_inputs(specs, "cuda")))

        def step():
            with torch.no_grad():
                for f, args in rows:
                    f(*args)
        return step
    return build


def variant(group, sched, cfg: dict):
    """(kernel name, module source, args, grid) of `group` under `cfg`."""
    saved = kernels.launch_config, kernels.column_config, kernels.TILE_META   # (kernel_source reads them there)
    kernels.launch_config = kernels.column_config = lambda *a, **k: dict(cfg)
    if "YBLOCK" in cfg:
        kernels.TILE_META = dict(cfg)
    try:
        src, args, c, grid = kernels.kernel_source(group, sched, "KERNEL")
    finally:
        kernels.launch_config, kernels.column_config, kernels.TILE_META = saved
    name, text = kernels.canonical(src, args + [m.buf.name for m in group.members])
    return name, PRELUDE + "\n\n\n" + text + "\n", args, grid


def main() -> None:
    argv = sys.argv[1:]
    out_json = None
    if "--json" in argv:
        k = argv.index("--json")
        out_json = argv[k + 1]
        del argv[k:k + 2]
    if "--cold" in argv:
        argv.remove("--cold")
        COLD["buffer"] = torch.empty(32 << 20, device="cuda")
    row = argv[0] if argv else "densenet_train"
    top = int(argv[1]) if len(argv) > 1 else 40
    build = ops_step(row[4:]) if row.startswith("ops:") else STEPS[row]
    calls = []
    orig_compile = triton_backend.compile_schedule

    def keep(*a, **k):
        call = orig_compile(*a, **k)
        calls.append(call)
        return call
    triton_backend.compile_schedule = keep
    first_args = {}
    orig_launch = Launcher.__call__

    def record(self, *args):   # each launcher's first launch outside a capture: the arguments it is timed with
        if id(self) not in first_args and not torch.cuda.is_current_stream_capturing():
            first_args[id(self)] = (self, args)
        return orig_launch(self, *args)
    Launcher.__call__ = record
    step = build(gpu.ember_compile, None)
    for _ in range(3):   # (a training step's first call runs Adam's lazy state set-up: the graph comes later)
        step()
    torch.cuda.synchronize()
    print(f"{len(calls)} compiled programs, {len(first_args)} kernels launched outside a capture", flush=True)
    Launcher.__call__ = orig_launch
    triton_backend.compile_schedule = orig_compile

    by_name = collections.OrderedDict()   # kernel name -> [group, sched, cfg, launcher, args, launches]
    for call in calls:
        for group, name, args, cfg, grid in call.kernels:
            launcher = call.namespace.get(f"_launch_{group.name}")
            if launcher is None or id(launcher) not in first_args or "fixup" in cfg or "BM" in cfg:
                continue
            if name in by_name:
                by_name[name][5] += 1
            else:
                by_name[name] = [group, call.sched, cfg, launcher, first_args[id(launcher)][1], 1]
    chosen = {}
    for name, (group, sched, cfg, launcher, args, n) in by_name.items():
        chosen[name] = graph_us(launcher, args)
    order = sorted(by_name, key=lambda k: -chosen[k] * by_name[k][5])
    searched = order[:top]
    device = torch.device("cuda")

    # every variant's source, compiled concurrently (worker processes), then each timed
    jobs = {}
    for name in searched:
        group, sched, cfg, launcher, args, n = by_name[name]
        shape = heuristics.group_shape(group)
        rows = max(int(group.numel), 1)
        rmax = max(heuristics.inner_size(m) for m in group.members)
        column = shape == heuristics.ROWS and rmax > 1 and heuristics.is_columnwise(group)
        for c in candidates(shape, cfg, rows, rmax, column):
            if all(c.get(k) == v for k, v in cfg.items()):
                continue
            try:
                vname, source, vargs, grid = variant(group, sched, c)
            except Exception as e:   # a config the printer cannot take
                print(f"  {name} {c}: {type(e).__name__} {e}")
                continue
            mod = load_module(source)
            fn = getattr(mod, vname)
            dtypes = [sched.buffers[a].dtype for a in vargs]
            jobs[(name, tuple(sorted(c.items())))] = (
                triton_backend._COMPILE_POOL.submit(triton_backend._compile_and_load, fn, dtypes,
                                                    heuristics.launch_meta(c), device, mod.__file__),
                fn, grid, c)
    results = collections.defaultdict(list)
    for (name, _), (job, fn, grid, c) in jobs.items():
        try:
            loaded = job.result()
        except Exception as e:
            print(f"  {name} {c}: compile failed: {type(e).__name__}")
            continue
        lau = Launcher(fn, grid, heuristics.launch_meta(c), device)
        lau.preloaded(loaded)
        try:
            results[name].append((graph_us(lau, by_name[name][4]), c))
        except Exception as e:
            print(f"  {name} {c}: launch failed: {type(e).__name__} {e}")

    now = datetime.datetime.now(datetime.timezone.utc)
    total = sum(chosen[k] * by_name[k][5] for k in by_name)
    best_total = total
    rows_json = []
    print(f"# bench/tools/gpu_kernel_configs.py {row}, {torch.cuda.get_device_name()}, {now:%Y-%m-%d %H:%M} UTC: "
          f"{len(by_name)} kernels, {sum(v[5] for v in by_name.values())} launches a step, {total / 1e3:.3f} ms of "
          f"Triton time a step (each kernel alone in a CUDA graph{', L2 emptied before each launch' if COLD else ''}); "
          f"the {len(searched)} heaviest searched over {len(jobs)} configs")
    print(f"{'kernel':20} {'n':>3} {'shape':>5} {'rows x r':>14} {'chosen':>28} {'us':>7} {'best':>28} {'us':>7}"
          f" {'gain us/step':>12} {'MB':>6} {'GB/s':>6}")

    def short(c):
        return "/".join(str(c[k]) for k in ("BLOCK", "XBLOCK", "RBLOCK", "num_warps") if k in c) + \
            ("" if c.get("persistent", True) else " loop")
    for name in searched:
        group, sched, cfg, launcher, args, n = by_name[name]
        rows = max(int(group.numel), 1)
        rmax = max(heuristics.inner_size(m) for m in group.members)
        shape = heuristics.group_shape(group)
        column = shape == heuristics.ROWS and rmax > 1 and heuristics.is_columnwise(group)
        best_us, best_c = min(results[name] + [(chosen[name], cfg)], key=lambda t: t[0])
        # the arguments' bytes (each storage once): what one launch moves at most, for its bandwidth
        mb = sum({a.untyped_storage().data_ptr(): a.untyped_storage().nbytes() for a in args
                  if isinstance(a, torch.Tensor)}.values()) / 1e6
        gain = (chosen[name] - best_us) * n
        best_total -= gain
        print(f"{name:20} {n:3d} {shape + ('/col' if column else ''):>5} {f'{rows}x{rmax}':>14} {short(cfg):>28} "
              f"{chosen[name]:7.2f} {short(best_c):>28} {best_us:7.2f} {gain:12.2f} {mb:6.2f} "
              f"{mb * 1e3 / chosen[name]:6.0f}")
        rows_json.append({"kernel": name, "launches": n, "shape": shape, "column": column, "rows": rows,
                          "rmax": rmax, "members": len(group.members),
                          "reductions": sum(m.is_reduction for m in group.members),
                          "chosen": cfg, "chosen_us": chosen[name],
                          "tried": [(us, c) for us, c in sorted(results[name], key=lambda t: t[0])]})
    print(f"Triton time a step: chosen configs {total / 1e3:.3f} ms, best found {best_total / 1e3:.3f} ms")
    if out_json:
        with open(out_json, "w") as f:
            json.dump({"row": row, "device": torch.cuda.get_device_name(), "utc": f"{now:%Y-%m-%d %H:%M}",
                       "total_us": total, "kernels": rows_json}, f)


if __name__ == "__main__":
    main()
