"""Shipped programs: the first call of a compiled model cold, warm from the on-disk cache, and loaded from a file
ember.save_cache wrote, next to torch.compile's cold and warm (its caches) first calls.

    PYTHONPATH=. .venv/bin/python bench/ship.py [--models resnet50,bert,gpt2] [--device cpu|cuda]

Every number is one fresh process's first call of the compiled model (inference, no_grad), model building and
imports not counted (eager: the model's own first call, oneDNN's first-call setup included):
  cold    an empty cache directory: capture, trace, code generation, C++/Triton build
  warm    the cache directory the cold run filled (ember: kernels and extensions on disk; it still captures,
          traces and generates code, finding the builds done; torch.compile: its FX graph and autotuning caches)
  loaded  ember.load_cache(file) of the file the cold run saved, in an empty cache directory, then the call:
          no capture and no code generation (asserted), the load's time included
  export  ember.export(model, inputs) and .save(file) (one whole graph, parameters saved with it), then
          "exported loaded": ember.load_exported(file) and its first call, in an empty cache directory
Each ember run checks its result against eager (assert_close, rtol=atol=1e-3: float32 sums in another order).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = ("resnet50", "bert", "gpt2")
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
            torch.testing.assert_close(_first(out), _first(model(*x)), rtol=1e-3, atol=1e-3)
    if phase == "ember loaded":
        assert convert.STATS["captures"] == 0 and cpp_backend.STATS["graphs"] == 0, (convert.STATS, cpp_backend.STATS)
    if phase == "ember cold":
        ember.save_cache(saved, strict=True)
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
        torch.testing.assert_close(_first(out), _first(model(*x)), rtol=1e-3, atol=1e-3)
    assert convert.STATS["captures"] == 0
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--phases", default=",".join(PHASES[:6]), help=f"a subset of {', '.join(PHASES)}")
    ap.add_argument("--one", nargs=3, metavar=("MODEL", "PHASE", "DIR"))
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.one[0], a.one[1], a.device, a.one[2])))
        return
    rows = []
    for name in a.models.split(","):
        with tempfile.TemporaryDirectory(prefix="ember-ship-") as d:
            caches = {"ember": os.path.join(d, "ember-cache"), "torch": os.path.join(d, "inductor-cache")}
            row = {"model": name}
            for phase in a.phases.split(","):
                fresh = phase in ("ember loaded", "exported loaded")
                env = {**os.environ, "PYTHONPATH": ROOT, "TORCHINDUCTOR_CACHE_DIR": caches["torch"],
                       "EMBER_CACHE_DIR": os.path.join(d, f"empty cache for {phase}") if fresh else caches["ember"]}
                r = subprocess.run([sys.executable, __file__, "--device", a.device, "--one", name, phase, d],
                                   capture_output=True, text=True, env=env)
                if r.returncode != 0:
                    print(r.stderr[-3000:], file=sys.stderr)
                    row[phase] = None
                    continue
                res = json.loads(r.stdout.strip().splitlines()[-1])
                row[phase] = res["s"]
                row.update({f"{phase} {k}": v for k, v in res.items() if k != "s"})
                print(name, phase, res, file=sys.stderr, flush=True)
            rows.append(row)
    cpu = platform.processor() or platform.machine()
    print(f"\n{a.device}, {os.cpu_count()} cores ({cpu}), torch {torch.__version__}, "
          f"{datetime.date.today().isoformat()}\n")
    phases = a.phases.split(",")
    print("| model | " + " | ".join(phases) + " | file |")
    print("|---" * (len(phases) + 2) + "|")

    def cell(r, p):
        v, load = r.get(p), r.get(f"{p} load_s")
        return "failed" if v is None else f"{v:.2f} s" + (f" (load {load:.2f} s)" if load is not None else "")
    for r in rows:
        mb = r.get("ember cold file_mb", r.get("ember export file_mb", 0))
        print(f"| {r['model']} | " + " | ".join(cell(r, p) for p in phases) + f" | {mb:.1f} MB |")


if __name__ == "__main__":
    main()
