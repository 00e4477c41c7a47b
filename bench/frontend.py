"""Frontend benchmark: ember vs torch.compile(backend="eager"), side by side in one run.

    PYTHONPATH=. .venv/bin/python bench/frontend.py [--device cpu|cuda] [--models resnet18,bert,...]

1. Capture time = first call of a freshly compiled model minus a plain (uncompiled) call, each model in a fresh
   state (ember.reset(), torch._dynamo.reset()). Both compilers get the same backend: a recording wrapper around
   "run the graph as captured" (what backend="eager" does), which also counts graphs and ops.
   Graph breaks come from ember.explain / torch._dynamo.explain. Cold means: torch._dynamo.reset() runs before
   every capture of either compiler and clears FakeTensorMode's process-wide dispatch cache (which both use);
   ember.reset() forgets ember's graphs, guards, decoded bytecode and resume code. Process-wide one-time costs
   (imports, torch's lazy op registrations) are paid before anything is timed.
2. Per-call overhead of a cached 10-op function on small tensors: median per-call time minus the uncompiled call's.
Goals (issues 2 and 3): capture time at most 1/5 of torch.compile's; per-call overhead no more than torch.compile's.

This file is also where the torch.compile baselines of `python -m ember demo` live: ember/ itself may not touch
torch.compile (tests/test_rules.py), bench/ may, as a baseline.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time
from typing import Callable

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- torch.compile baselines (also used by the demo)

def torch_compiled(fn: Callable, **kwargs) -> Callable:
    """torch.compile(fn, **kwargs): the baseline every ember number is compared with."""
    return torch.compile(fn, **kwargs)


def torch_reset() -> None:
    import torch._dynamo
    torch._dynamo.reset()


def torch_break_count(fn: Callable, *args) -> int:
    import torch._dynamo
    torch._dynamo.reset()
    return torch._dynamo.explain(fn)(*args).graph_break_count


def ember_break_count(fn: Callable, *args):
    import ember
    ember.reset()
    try:
        return ember.explain(fn)(*args).graph_break_count
    except Exception as e:  # explain may not exist yet in a partial frontend: say so, do not guess
        return f"error ({type(e).__name__})"


# ---------------------------------------------------------------- machine and timing

def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = f", GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True, timeout=5).stdout.strip()
    except Exception:
        commit = "?"
    return (f"{platform.node()}: {cpu}, {os.cpu_count()} CPUs{gpu}; Python {platform.python_version()}, "
            f"torch {torch.__version__}; ember commit {commit or '?'}; "
            f"{datetime.datetime.now().astimezone().strftime('%Y-%m-%d %H:%M %Z')}")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable) -> tuple[object, float]:
    """(result, seconds) of one call, device work included."""
    sync()
    t = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t


def median_time(fn: Callable, runs: int) -> float:
    return statistics.median(timed(fn)[1] for _ in range(runs))


# ---------------------------------------------------------------- what is measured

def ten_ops(x, y):
    a = x + y
    b = a * 2
    c = torch.sin(b)
    d = c - x
    e = d.relu()
    f = e * y
    g = torch.cos(f)
    h = g + 1
    i = h / 3
    return i.exp()


def _models(device: str):
    """name -> builder() -> (model, args): default configs (BertConfig(), GPT2Config()), random weights.

    Inputs are small (batch 1, 64x64 images, 16 tokens): capture does not depend on them (shapes only), and a
    short plain call keeps "first call - plain call" from drowning in the plain call's noise.
    """
    sys.path.insert(0, str(ROOT / "tests" / "models"))
    import model_zoo as z
    dev = lambda build: lambda: _to(build(), device)  # noqa: E731
    return {
        "10-op function": lambda: (ten_ops, (torch.randn(8, device=device), torch.randn(8, device=device))),
        "resnet18": dev(lambda: z.resnet18(batch=1, size=64)),
        "densenet121": dev(lambda: z.densenet121(batch=1, size=64)),
        "BertModel(BertConfig())": dev(lambda: z.bert(small=False, batch=1, seq=16)),
        "GPT-2 (GPT2LMHeadModel)": dev(lambda: z.gpt2(small=False, batch=1, seq=16)),
    }


def _to(model_args, device):
    model, args = model_args
    return model.eval().to(device), tuple(a.to(device) for a in args)


def capture_row(name: str, build: Callable, repeats: int) -> dict:
    """Capture time of each compiler: median over `repeats` fresh captures of (first call) - (plain call)."""
    import ember
    sys.path.insert(0, str(ROOT / "tests" / "models"))
    from model_zoo import Recorder
    torch.manual_seed(0)
    model, args = build()
    compilers = {"torch": lambda m, b: torch_compiled(m, backend=b), "ember": lambda m, b: ember.compile(m, backend=b)}
    with torch.no_grad():
        timed(lambda: model(*args))  # warm the eager path (allocator, kernels' first use)
        plain = median_time(lambda: model(*args), 5)
        row = {"name": name, "plain": plain}
        firsts: dict[str, list[float]] = {"torch": [], "ember": []}
        for _ in range(repeats):
            for who, compile_ in compilers.items():
                if "error" in row.get(who, {}):
                    continue
                torch_reset()
                ember.reset()
                gc.collect()    # neither compiler pays for collecting the other's garbage inside its timing
                rec = Recorder()
                try:
                    compiled = compile_(model, rec)
                    firsts[who].append(timed(lambda: compiled(*args))[1])
                    row[who] = dict(graphs=len(rec.graphs), ops=rec.ops)
                except Exception as e:
                    row[who] = dict(error=f"{type(e).__name__}: {e}"[:80])
        for who in compilers:
            if "error" not in row[who]:
                row[who]["capture"] = statistics.median(firsts[who]) - plain
                row[who]["breaks"] = (torch_break_count if who == "torch" else ember_break_count)(model, *args)
    return row


def overhead_row(device: str, calls: int = 2000) -> dict:
    """Median per-call time of a cached 10-op function on 8-element tensors (compiled minus uncompiled)."""
    import ember
    x, y = torch.randn(8, device=device), torch.randn(8, device=device)
    torch_reset()
    ember.reset()
    fns = {"plain": ten_ops, "torch": torch_compiled(ten_ops, backend="eager"),
           "ember": ember.compile(ten_ops, backend="eager")}
    for f in fns.values():
        for _ in range(3):
            f(x, y)  # compile and warm up
    block = 20  # time blocks of calls: a single call is near perf_counter's resolution
    out = {}
    for name, f in fns.items():
        samples = []
        for _ in range(calls // block):
            t = time.perf_counter()
            for _ in range(block):
                f(x, y)
            samples.append((time.perf_counter() - t) / block)
        out[name] = statistics.median(samples)
    return out


# ---------------------------------------------------------------- the table

def table(header: list[str], rows: list[list]) -> str:
    """Plain-text table, columns as wide as their widest cell; first column left-aligned."""
    cells = [header] + [[str(c) for c in r] for r in rows]
    w = [max(len(r[i]) for r in cells) for i in range(len(header))]
    fmt = lambda r: "  ".join(c.ljust(w[i]) if i == 0 else c.rjust(w[i]) for i, c in enumerate(r))  # noqa: E731
    return "\n".join([fmt(cells[0]), "-" * (sum(w) + 2 * len(w) - 2)] + [fmt(r) for r in cells[1:]])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--repeats", type=int, default=3, help="fresh captures per model and compiler (median)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads: 1 keeps a shared machine's "
                   "OpenMP waits out of the plain calls")
    p.add_argument("--models", default="", help="comma-separated subset of the model names (prefix match)")
    a = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(a.threads)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"ember frontend benchmark on {a.device}, torch threads {a.threads}, load average {load:.1f} at start\n"
          f"{machine()}\n")
    # One-time costs (imports, first-use initialisation) of both compilers are paid before anything is timed.
    import ember
    warm = torch.randn(4, device=a.device)
    torch_compiled(lambda t: t + 1, backend="eager")(warm)
    ember.compile(lambda t: t + 1, backend="eager")(warm)

    models = _models(a.device)
    wanted = [w for w in a.models.split(",") if w]
    names = [n for n in models if not wanted or any(n.lower().startswith(w.lower()) for w in wanted)]
    rows = []
    for n in names:
        r = capture_row(n, models[n], a.repeats)
        t, e = r["torch"], r["ember"]
        if "error" in t or "error" in e:
            rows.append([n, f"{r['plain'] * 1e3:.2f}", t.get("error", "-"), e.get("error", "-"), "", "", "", ""])
            continue
        if e["graphs"] == 0:  # nothing captured: a "capture time" would be meaningless
            cap, ratio = "n/a", "n/a (0 graphs: ran eagerly)"
        else:
            cap, ratio = f"{e['capture'] * 1e3:.1f}", f"{e['capture'] / t['capture']:.3f}"
        rows.append([n, f"{r['plain'] * 1e3:.2f}", f"{t['capture'] * 1e3:.1f}", cap, ratio,
                     f"{t['graphs']} / {e['graphs']}", f"{t['breaks']} / {e['breaks']}", f"{t['ops']} / {e['ops']}"])
        print(f"  measured {n}", file=sys.stderr, flush=True)
    print(f"capture time = median over {a.repeats} fresh captures of (first call) - (plain call), ms; "
          f"graphs, breaks, ops: torch.compile / ember")
    print(table(["model", "plain", "capture torch.compile", "capture ember", "ember/torch", "graphs", "breaks",
                 "ops"], rows))
    print("goal: ember/torch <= 0.200 (capture at most 1/5 of torch.compile's); graphs and breaks ember <= torch\n")

    o = overhead_row(a.device)
    us = lambda k: f"{o[k] * 1e6:.1f}"  # noqa: E731
    print("per-call time of a cached 10-op function on 8-element tensors, us (median over blocks of 20 calls)")
    print(table(["uncompiled", "torch.compile", "ember", "overhead torch.compile", "overhead ember"],
                [[us("plain"), us("torch"), us("ember"), f"{(o['torch'] - o['plain']) * 1e6:.1f}",
                  f"{(o['ember'] - o['plain']) * 1e6:.1f}"]]))
    print("goal: ember overhead <= torch.compile overhead")
    return 0


if __name__ == "__main__":
    sys.exit(main())
