"""CPU benchmark: eager vs torch.compile (Inductor) vs ember, side by side in one run.

  .venv/bin/python bench/cpu.py [--no-inductor] [--no-compile-time] [workload ...]   (default: all; names below)

--no-inductor leaves the Inductor columns out (its cold compile takes minutes on 2 cores); --no-compile-time
leaves out the compile-time columns (each a new process per compiler).

Per workload: median run time of each (repeated calls after warm-up, one call of each compiler per round, so
that all see the same load on a shared machine), the speedup over eager, and each
compiler's compile time = its first call, measured in a new process: cold (empty caches: a fresh
TORCHINDUCTOR_CACHE_DIR / EMBER_CACHE_DIR) and warm (the same process started again on the filled cache).
ember runs through ember.compile (the frontend) with its default backend. Inference workloads run under
torch.no_grad(). Adam: every compiler runs torch.optim.Adam(foreach=True).step() (ember's frontend captures it
from the second call on, as one graph).
The machine is shared: numbers are ratios from one run, and they move a lot between runs.
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


def densenet121():
    import torchvision
    return torchvision.models.densenet121().eval(), (torch.randn(16, 3, 128, 128),)


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


def resnet18_train():
    """The torch.compile tutorial's training step (zero_grad, forward, loss, backward, Adam) on resnet18, batch 8
    of 3 x 64 x 64 (kept small for a 2-core machine)."""
    import torchvision
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    opt = torch.optim.Adam(model.parameters())
    x, y = torch.randn(8, 3, 64, 64), torch.randint(0, 10, (8,))

    def step(x, y):
        opt.zero_grad(True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    return step, (x, y)


WORKLOADS = {"pointwise": pointwise, "ln_gelu_softmax": ln_gelu_softmax, "mlp": mlp, "resnet18": resnet18,
             "densenet121": densenet121, "bert": bert, "adam": adam, "resnet18_train": resnet18_train}
TRAINING = {"adam", "resnet18_train"}


def compiled(name, compiler):
    fn, args = WORKLOADS[name]()
    if compiler == "eager":
        return fn, args
    if compiler == "inductor":
        return torch.compile(fn), args
    import ember
    return ember.compile(fn), args


def time_calls(fns: dict, name: str) -> dict:
    """Median seconds per call of each {compiler: (fn, args)}, the compilers' calls interleaved (one call of
    each per round), so that each sees the same load on a shared machine."""
    ctx = torch.enable_grad() if name in TRAINING else torch.no_grad()
    with ctx:
        one = 0.0
        for fn, args in fns.values():
            fn(*args)
            fn(*args)
            t0 = time.perf_counter()
            fn(*args)
            one += time.perf_counter() - t0
        reps = max(5, min(50, int(2.0 * len(fns) / max(one, 1e-6))))
        ts: dict = {k: [] for k in fns}
        for _ in range(reps):
            for k, (fn, args) in fns.items():
                t0 = time.perf_counter()
                fn(*args)
                ts[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in ts.items()}


def compile_time_child(name, compiler):
    """In a new process: seconds of the first call (capture + compile + one run) minus a run (median of 3)."""
    fn, args = compiled(name, compiler)
    ctx = torch.enable_grad() if name in TRAINING else torch.no_grad()
    with ctx:
        t0 = time.perf_counter()
        fn(*args)
        first = time.perf_counter() - t0
        runs = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn(*args)
            runs.append(time.perf_counter() - t0)
    print(json.dumps({"compile": first - statistics.median(runs)}))


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


def main(names, compilers=("eager", "inductor", "ember"), compile_time=True):
    print(f"# bench/cpu.py  {datetime.datetime.now().isoformat(timespec='minutes')}  {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    import ember   # the tree measured (installed in editable mode: another commit's copy needs PYTHONPATH=<copy>)
    print(f"# ember from {os.path.dirname(os.path.dirname(ember.__file__))}")
    print(f"{'workload':18s} {'eager ms':>9s} {'inductor ms':>12s} {'ember ms':>9s} {'inductor x':>11s} {'ember x':>8s}"
          f" {'ind cold s':>11s} {'ind warm s':>11s} {'ember cold s':>13s} {'ember warm s':>13s}")
    for name in names:
        row = dict.fromkeys(("eager", "inductor", "ember"), float("nan"))
        fns = {}
        ctx = torch.enable_grad() if name in TRAINING else torch.no_grad()
        for compiler in compilers:
            torch.manual_seed(0)
            fn, args = compiled(name, compiler)
            try:
                with ctx:
                    fn(*args)  # compiles here
                fns[compiler] = (fn, args)
            except Exception as e:  # a compiler that fails on a workload shows as nan, with the reason
                print(f"  [{compiler} {name}: {type(e).__name__}: {str(e)[:200]}]", file=sys.stderr)
        row.update({k: v * 1e3 for k, v in time_calls(fns, name).items()})
        del fns
        nan2 = (float("nan"), float("nan"))
        ic, iw = compile_times(name, "inductor") if compile_time and "inductor" in compilers else nan2
        ec, ew = compile_times(name, "ember") if compile_time else nan2
        print(f"{name:18s} {row['eager']:9.3f} {row['inductor']:12.3f} {row['ember']:9.3f} "
              f"{row['eager'] / row['inductor']:10.2f}x {row['eager'] / row['ember']:7.2f}x "
              f"{ic:11.2f} {iw:11.2f} {ec:13.2f} {ew:13.2f}   (load {os.getloadavg()[0]:.2f})", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--compile-time"]:
        compile_time_child(sys.argv[2], sys.argv[3])
    else:
        flags = {a for a in sys.argv[1:] if a.startswith("--")}
        names = [a for a in sys.argv[1:] if not a.startswith("--")] or list(WORKLOADS)
        main(names, ("eager", "ember") if "--no-inductor" in flags else ("eager", "inductor", "ember"),
             "--no-compile-time" not in flags)
