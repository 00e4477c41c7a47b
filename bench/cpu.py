"""CPU benchmark: eager vs torch.compile (Inductor) vs ember, side by side in one run.

  .venv/bin/python bench/cpu.py [workload ...]     (default: all; names below)

Per workload: median run time of each (repeated calls after warm-up), the speedup over eager, and each
compiler's compile time = its first call, measured in a new process: cold (empty caches: a fresh
TORCHINDUCTOR_CACHE_DIR / EMBER_CACHE_DIR) and warm (the same process started again on the filled cache).
ember runs through ember.compile (the frontend) with its default backend. Inference workloads run under
torch.no_grad(); the Adam step compiles `opt.step()`.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def pointwise():
    x = torch.randn(4 * 1024 * 1024)
    return (lambda x: ((torch.sin(x) * 2 + torch.cos(x)).relu() * x - 1).sigmoid()), (x,)


def ln_gelu_softmax():
    ln = torch.nn.LayerNorm(1024)
    x = torch.randn(4096, 1024)
    return (lambda x: torch.softmax(torch.nn.functional.gelu(ln(x)), -1)), (x,)


def mlp():
    m = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512),
                            torch.nn.LayerNorm(512)).eval()
    return m, (torch.randn(256, 512),)


def resnet18():
    import torchvision
    return torchvision.models.resnet18().eval(), (torch.randn(8, 3, 224, 224),)


def bert():
    import transformers
    m = transformers.BertModel(transformers.BertConfig()).eval()
    return (lambda ids: m(input_ids=ids).last_hidden_state), (torch.randint(0, 30000, (8, 128)),)


def adam():
    layers = [torch.nn.Linear(512, 512) for _ in range(10)]
    params = [l.weight for l in layers]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.Adam(params, lr=1e-3, foreach=True)
    opt.step()  # create the state (eager), so compiled steps update existing state in place

    def step():
        opt.step()
    return step, ()


WORKLOADS = {"pointwise": pointwise, "ln_gelu_softmax": ln_gelu_softmax, "mlp": mlp, "resnet18": resnet18,
             "bert": bert, "adam": adam}
TRAINING = {"adam"}


def compiled(name, compiler):
    fn, args = WORKLOADS[name]()
    if compiler == "eager":
        return fn, args
    if compiler == "inductor":
        return torch.compile(fn), args
    import ember
    return ember.compile(fn), args


def time_call(fn, args, name, reps=None):
    ctx = torch.enable_grad() if name in TRAINING else torch.no_grad()
    with ctx:
        fn(*args)
        fn(*args)
        t0 = time.perf_counter()
        fn(*args)
        one = time.perf_counter() - t0
        reps = reps or max(5, min(50, int(2.0 / max(one, 1e-6))))
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn(*args)
            ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def compile_time_child(name, compiler):
    """In a new process: seconds of the first call (capture + compile + one run) minus one warm run."""
    fn, args = compiled(name, compiler)
    ctx = torch.enable_grad() if name in TRAINING else torch.no_grad()
    with ctx:
        t0 = time.perf_counter()
        fn(*args)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        fn(*args)
        run = time.perf_counter() - t0
    print(json.dumps({"compile": first - run}))


def compile_times(name, compiler) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(d, "inductor"), EMBER_CACHE_DIR=os.path.join(d, "ember"),
                   PYTHONPATH=ROOT)
        out = []
        for _ in ("cold", "warm"):
            r = subprocess.run([sys.executable, __file__, "--compile-time", name, compiler], env=env,
                               capture_output=True, text=True, timeout=900)
            line = [l for l in r.stdout.splitlines() if l.startswith("{")]
            out.append(json.loads(line[-1])["compile"] if line else float("nan"))
            if not line:
                print(f"  [{compiler} {name} compile failed: {r.stderr[-500:]}]", file=sys.stderr)
        return out[0], out[1]


def main(names):
    print(f"# bench/cpu.py  {datetime.datetime.now().isoformat(timespec='minutes')}  {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, torch {torch.__version__}, threads {torch.get_num_threads()}")
    print(f"{'workload':18s} {'eager ms':>9s} {'inductor ms':>12s} {'ember ms':>9s} {'inductor x':>11s} {'ember x':>8s}"
          f" {'ind cold s':>11s} {'ind warm s':>11s} {'ember cold s':>13s} {'ember warm s':>13s}")
    for name in names:
        row = {}
        for compiler in ("eager", "inductor", "ember"):
            torch.manual_seed(0)
            fn, args = compiled(name, compiler)
            try:
                row[compiler] = time_call(fn, args, name) * 1e3
            except Exception as e:  # a compiler that fails on a workload shows as nan, with the reason
                print(f"  [{compiler} {name}: {type(e).__name__}: {str(e)[:200]}]", file=sys.stderr)
                row[compiler] = float("nan")
        ic, iw = compile_times(name, "inductor")
        ec, ew = compile_times(name, "ember")
        print(f"{name:18s} {row['eager']:9.3f} {row['inductor']:12.3f} {row['ember']:9.3f} "
              f"{row['eager'] / row['inductor']:10.2f}x {row['eager'] / row['ember']:7.2f}x "
              f"{ic:11.2f} {iw:11.2f} {ec:13.2f} {ew:13.2f}", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--compile-time"]:
        compile_time_child(sys.argv[2], sys.argv[3])
    else:
        main(sys.argv[1:] or list(WORKLOADS))
