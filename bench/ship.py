"""Shipped programs: the first call of a compiled model cold, warm from the on-disk cache, and loaded from a file
ember.save_cache wrote, next to torch.compile's cold and warm (its caches) first calls.

    PYTHONPATH=. .venv/bin/python bench/ship.py [--models resnet50,bert,gpt2] [--device cpu|cuda] [--jobs N]

Every number is one fresh process's first call of the compiled model (inference, no_grad), model building and
imports not counted (eager: the model's own first call, oneDNN's or cuBLAS's first-call setup included; on cuda the
model is on the GPU, CUDA initialized, before the clock starts, and the call ends with a synchronize):
  cold    empty cache directories (ember's, Triton's): capture, trace, code generation, C++ build / Triton compile
  warm    the cache directories the cold run filled (ember: kernels and extensions on disk, Triton's binaries in
          its cache; it still captures, traces and generates code, finding the builds done; torch.compile: its
          FX graph, autotuning and Triton caches)
  loaded  ember.load_cache(file) of the file the cold run saved, with empty ember and Triton cache directories,
          then the call: no capture, no code generation and (cuda) no Triton compile of ember's kernels
          (asserted: Triton's compilation listener counts them), the load's time included
  export  ember.export(model, inputs) and .save(file) (one whole graph, parameters saved with it), then
          "exported loaded": ember.load_exported(file) and its first call, in an empty cache directory
Each ember run checks its result against eager (assert_close, rtol=atol=1e-3: float32 sums in another order; on
cuda 2e-2, bench/gpu.py's: eager's cuDNN convolutions run in TF32, and a random resnet50's logits differ by 1.4e-2
between TF32 computations in another order).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = ("resnet50", "bert", "gpt2")
TOLERANCE = {"cpu": {"rtol": 1e-3, "atol": 1e-3}, "cuda": {"rtol": 2e-2, "atol": 2e-2}}
PHASES = ("eager", "ember cold", "ember warm", "ember loaded", "torch.compile cold", "torch.compile warm",
          "ember export", "exported loaded")


def build(name: str, device: str):
    """(model, inputs): inference models, small configs of the transformers."""
    torch.manual_seed(0)
    if name == "resnet50":
        import torchvision
        model, x = torchvision.models.resnet50(), (torch.randn(2, 3, 224, 224),)
    elif name == "bert":
        from transformers import BertConfig, BertModel
        model = BertModel(BertConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                                     intermediate_size=1024, vocab_size=8000))
        x = (torch.randint(0, 8000, (2, 64)),)
    else:
        from transformers import GPT2Config, GPT2LMHeadModel
        model = GPT2LMHeadModel(GPT2Config(n_embd=256, n_layer=4, n_head=4, vocab_size=8000, bos_token_id=0,
                                           eos_token_id=0))
        x = (torch.randint(0, 8000, (2, 64)),)
    return model.eval().to(device), tuple(t.to(device) for t in x)


def _first(out):
    return out if isinstance(out, torch.Tensor) else out[0]


def one(name: str, phase: str, device: str, d: str) -> dict:
    """One process's measurement (run by main in a fresh process)."""
    model, x = build(name, device)
    saved = os.path.join(d, "saved.ember")
    result: dict = {}
    if phase in ("ember export", "exported loaded"):
        return _exported(model, x, phase, os.path.join(d, "exported.ember"))
    compiles: list[str] = []   # Triton compiles (cache misses), by module and kernel name
    if device == "cuda":
        from triton import knobs
        knobs.compilation.listener = lambda src=None, cache_hit=False, **_: cache_hit or compiles.append(
            f"{getattr(getattr(src, 'fn', None), '__module__', '?')}.{getattr(src, 'name', '?')}")
    if phase.startswith("ember"):
        import ember
        from ember.backends import cpp_backend
        from ember.frontend import convert
        t0 = time.perf_counter()
        if phase == "ember loaded":
            assert ember.load_cache(saved)
            result["load_s"] = time.perf_counter() - t0
        compiled = ember.compile(model)
    elif phase == "eager":
        t0 = time.perf_counter()
        compiled = model
    else:
        t0 = time.perf_counter()
        compiled = torch.compile(model)
    with torch.no_grad():
        out = compiled(*x)
        if device == "cuda":
            torch.cuda.synchronize()
        result["s"] = time.perf_counter() - t0
        if phase.startswith("ember"):
            # (float32 sums in another order than ATen's: the tolerance bench/dynamic.py uses)
            torch.testing.assert_close(_first(out), _first(model(*x)), **TOLERANCE[device])
    if phase == "ember loaded":
        triton = sys.modules.get("ember.backends.triton_backend")
        generated = cpp_backend.STATS["graphs"] + (triton.STATS["graphs"] if triton else 0)
        assert convert.STATS["captures"] == 0 and generated == 0, (convert.STATS, cpp_backend.STATS)
        assert not [c for c in compiles if c.startswith("ember_triton_")], compiles
    if device == "cuda" and phase.startswith("ember"):
        result["triton_compiles"] = len(compiles)
    if phase == "ember cold":
        result["left_out"] = ember.save_cache(saved)["left_out"]   # (named in a warning: they compile again)
        result["file_mb"] = os.path.getsize(saved) / 2 ** 20
    return result


def _exported(model, x, phase: str, path: str) -> dict:
    import ember
    from ember.frontend import convert
    t0 = time.perf_counter()
    if phase == "ember export":
        ember.export(model, x).save(path)
        return {"s": time.perf_counter() - t0, "file_mb": os.path.getsize(path) / 2 ** 20}
    program = ember.load_exported(path)
    out = program(*x)
    result = {"s": time.perf_counter() - t0}
    with torch.no_grad():
        torch.testing.assert_close(_first(out), _first(model(*x)), **TOLERANCE[x[0].device.type])
    assert convert.STATS["captures"] == 0
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--phases", default=",".join(PHASES[:6]), help=f"a subset of {', '.join(PHASES)}")
    ap.add_argument("--one", nargs=3, metavar=("MODEL", "PHASE", "DIR"))
    ap.add_argument("--timeout", type=float, default=600, help="seconds one phase's process may take")
    ap.add_argument("--json", help="the rows so far, written after each model")
    ap.add_argument("--jobs", type=int, default=1, help="models measured at once")
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.one[0], a.one[1], a.device, a.one[2])))
        return
    models = a.models.split(",")
    rows: dict = {}
    lock = threading.Lock()

    def measure(name: str, gpu: int | None) -> None:
        with tempfile.TemporaryDirectory(prefix="ember-ship-") as d:
            caches = {"ember": os.path.join(d, "ember-cache"), "torch": os.path.join(d, "inductor-cache")}
            row = {"model": name}
            for phase in a.phases.split(","):
                fresh = phase in ("ember loaded", "exported loaded")
                ember_cache = os.path.join(d, f"empty cache for {phase}") if fresh else caches["ember"]
                env = {**os.environ, "PYTHONPATH": ROOT, "TORCHINDUCTOR_CACHE_DIR": caches["torch"],
                       "EMBER_CACHE_DIR": ember_cache,
                       # Triton's own cache: ember's next to its cache directory, torch.compile's inside its own
                       "TRITON_CACHE_DIR": os.path.join(caches["torch"] if phase.startswith("torch") else ember_cache,
                                                        "triton-own")}
                if gpu is not None:
                    env["CUDA_VISIBLE_DEVICES"] = str(gpu)
                t0 = time.perf_counter()
                try:
                    r = subprocess.run([sys.executable, __file__, "--device", a.device, "--one", name, phase, d],
                                       capture_output=True, text=True, env=env, timeout=a.timeout)
                except subprocess.TimeoutExpired:
                    print(name, phase, f"over {a.timeout:.0f} s", file=sys.stderr, flush=True)
                    row[phase] = None
                    continue
                if r.returncode != 0:
                    print(name, phase, "failed:", r.stderr[-3000:], file=sys.stderr)
                    row[phase] = None
                    continue
                res = json.loads(r.stdout.strip().splitlines()[-1])
                row[phase] = res["s"]
                row.update({f"{phase} {k}": v for k, v in res.items() if k != "s"})
                print(name, phase, res, f"(process {time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
            with lock:
                rows[name] = row
                if a.json:
                    with open(a.json, "w") as f:
                        json.dump([rows[m] for m in models if m in rows], f, indent=1)

    # --jobs N: N models at once (each its phases in turn), on the GPUs in turn: the numbers then include the
    # other models' compiles competing for the CPU
    gpus = torch.cuda.device_count() if a.device == "cuda" and a.jobs > 1 else 0
    with concurrent.futures.ThreadPoolExecutor(a.jobs) as pool:
        list(pool.map(measure, models, [i % gpus if gpus else None for i in range(len(models))]))
    rows = [rows[m] for m in models if m in rows]
    cpu = platform.processor() or platform.machine()
    gpu = f", {torch.cuda.get_device_name()}" if a.device == "cuda" else ""
    print(f"\n{a.device}{gpu}, {os.cpu_count()} cores ({cpu}), torch {torch.__version__}, "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC\n")
    phases = a.phases.split(",")
    print("| model | " + " | ".join(phases) + " | file |")
    print("|---" * (len(phases) + 2) + "|")

    def cell(r, p):
        v, load = r.get(p), r.get(f"{p} load_s")
        n = r.get(f"{p} triton_compiles")
        return "failed" if v is None else f"{v:.2f} s" + (f" (load {load:.2f} s)" if load is not None else "") + \
            (f", {n} Triton compiles" if n is not None and p == "ember loaded" else "")
    for r in rows:
        mb = r.get("ember cold file_mb", r.get("ember export file_mb", 0))
        left = r.get("ember cold left_out")
        print(f"| {r['model']} | " + " | ".join(cell(r, p) for p in phases) + f" | {mb:.1f} MB" +
              (f" ({left} entries left out)" if left else "") + " |")


if __name__ == "__main__":
    main()
