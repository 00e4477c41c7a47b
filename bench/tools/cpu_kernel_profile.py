"""Where a CPU suite row's time goes, kernel by kernel, for eager, Inductor and ember in one process.

    PYTHONPATH=. .venv/bin/python bench/tools/cpu_kernel_profile.py "llama eval f32" [--isa native|avx2|avx512]
        [--calls 5] [--top 30] [--cols eager,inductor,ember] [--ember-env NAME=VALUE,...]

The row's model and inputs are bench/suite.py's (one thread). torch.profiler times every ATen op (products,
convolutions, attention) in all columns; Inductor's generated kernels appear by name
(torch._inductor.config.cpp.enable_kernel_profile), and ember's C++ kernels are wrapped in a record_function
named after the fx nodes they fuse (the `// fused fx nodes:` line of their source), so each column lists its
kernels and library calls by self CPU time over --calls calls (ms per call). --ember-env sets ember's switches
(config attribute names, e.g. ONEDNN_MATMULS=0, or a module's constant: ember.codegen.lower.NAME=3) for an A/B
column "ember2".
"""
from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))


def _wrap_ember_kernels() -> None:
    """Each loaded ember C++ kernel runs inside a record_function named after what it fuses."""
    import torch
    from ember.backends import cpp_program
    orig = cpp_program.CompiledGraph._load

    def _load(self):
        orig(self)
        ns = getattr(self.call, "namespace", None)
        if ns is None:
            return
        src = self.source or ""
        for name, _, _ in self.kernels:
            f = ns.get(name)
            if f is None:
                continue
            m = re.search(r"// fused fx nodes: ([^\n]*)\n(?:[^\n]*\n)?[^\n]*\b" + re.escape(name) + r"\(", src)
            label = "ember " + (m.group(1)[:90] if m else name)

            def timed(*a, _f=f, _l=label):
                with torch.profiler.record_function(_l):
                    return _f(*a)
            ns[name] = timed
    cpp_program.CompiledGraph._load = _load


def run(a) -> None:
    import torch
    import suite
    torch.set_num_threads(1)
    import torch._inductor.config as ic
    ic.cpp.enable_kernel_profile = True
    _wrap_ember_kernels()
    import ember
    from ember import config
    row = next(r for r in suite.rows_for("cpu") if r.name == a.row)
    base, kwargs, labels = suite.build(row.model, "cpu", row.mode == "train", a.batch)
    base.train(row.mode == "train")
    cols = [c for c in a.cols.split(",") if c]
    env = dict(kv.split("=", 1) for kv in a.ember_env.split(",") if kv)
    if env:
        cols.append("ember2")
    steps = {}
    for col in cols:
        saved = {}
        if col == "ember2":
            for k, v in env.items():
                mod, _, name = k.rpartition(".")
                obj = importlib.import_module(mod) if mod else config
                old = getattr(obj, name)
                saved[(obj, name)] = old
                setattr(obj, name, type(old)(int(v)) if isinstance(old, bool) else type(old)(v))
        comp = {"eager": None, "inductor": torch.compile}.get(col, ember.compile)
        torch.manual_seed(1)
        step = suite.make_step(row, "cpu", base, kwargs, labels, comp)
        for _ in range(3):
            step()
        for (obj, name), v in saved.items():
            setattr(obj, name, v)
        steps[col] = step
    for col, step in steps.items():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(a.calls):
                step()
        ev = prof.key_averages()
        rows = sorted(ev, key=lambda e: -e.self_cpu_time_total)
        total = sum(e.self_cpu_time_total for e in ev) / 1e3 / a.calls
        print(f"\n== {a.row} [{col}] {torch.backends.cpu.get_cpu_capability()}: self CPU {total:.3f} ms per call")
        for e in rows[:a.top]:
            print(f"{e.self_cpu_time_total / 1e3 / a.calls:9.3f} ms {e.count // a.calls:5d}x  {e.key[:120]}")
        sys.stdout.flush()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("row")
    p.add_argument("--isa", default="native")
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--cols", default="eager,inductor,ember")
    p.add_argument("--ember-env", default="")
    p.add_argument("--child", action="store_true")
    a = p.parse_args()
    if a.child:
        return run(a)
    import suite
    env = {**os.environ, **suite.ISA_ENV[a.isa], "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    args = [sys.executable, __file__, a.row, "--child", "--calls", str(a.calls), "--top", str(a.top), "--cols", a.cols,
            "--ember-env", a.ember_env] + (["--batch", str(a.batch)] if a.batch else [])
    subprocess.run(args, env=env, check=True)


if __name__ == "__main__":
    main()
