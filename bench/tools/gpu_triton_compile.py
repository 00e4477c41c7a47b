"""Triton's compile time of one kernel of a saved ember kernel file, stage by stage, under text edits of its
source (what a change to the printer would save, measured before making it).

    python bench/tools/gpu_triton_compile.py KERNELS.py k_04b22c8682b8c4ef --block 1024 \
        --edit 'libdevice.pow(s0_22, tl.full([1], 0.5, tl.float64))=>tl.sqrt(s0_22)'

KERNELS.py: Triton kernels ember printed (EMBER_LOGS=output_code prints them; the prelude is added when
missing). Every pointer argument is taken as float32; each variant compiles `--repeats` times, in turns, with Triton's
cache off; medians (ms) per stage.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import re
import statistics
import sys
import tempfile
import time



def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("kernel")
    ap.add_argument("--block", type=int, default=1024)
    ap.add_argument("--num-warps", type=int, default=4)
    ap.add_argument("--edit", action="append", default=[], help="OLD=>NEW, applied to the file's text (a variant "
                    "each; ';;' joins edits into one variant)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--target", default="", help="backend:arch, e.g. cuda:90, instead of the GPU's")
    args = ap.parse_args()
    import triton
    from triton.compiler import ASTSource
    triton.knobs.compilation.always_compile = True
    target = None
    if args.target:   # e.g. cuda:90 (no GPU needed to compile)
        from triton.backends.compiler import GPUTarget
        backend, arch = args.target.split(":")
        target = GPUTarget(backend, int(arch), 32)
    times: dict = {}

    def listener(*, src, times: object, cache_hit, **_):
        stages = [("ir", times.ir_initialization), *times.lowering_stages]
        LAST.clear()
        LAST.update({k: v / 1e3 for k, v in stages})
    LAST: dict = {}
    triton.knobs.compilation.listener = listener
    text = open(args.path).read()
    if "import triton" not in text:   # a kernel saved without the module's prelude: today's
        from ember.codegen.triton.printer import PRELUDE
        text = PRELUDE + "\n\n" + text
    variants = {"as printed": text}
    for e in args.edit:
        t = text
        for one in e.split(";;"):
            old, new = one.split("=>")
            assert old in t, old
            t = t.replace(old, new)
        variants[f"{len(variants)}: {e}"[:70]] = t
    fns = {}
    d = tempfile.mkdtemp()
    for i, (name, t) in enumerate(variants.items()):
        p = os.path.join(d, f"variant{i}.py")
        open(p, "w").write(t)
        spec = importlib.util.spec_from_file_location(f"variant{i}", p)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        fns[name] = getattr(mod, args.kernel)
    for _ in range(args.repeats):
        for name, fn in fns.items():
            params = [p for p in re.search(rf"def {args.kernel}\((.*?)\)", variants[name]).group(1).split(", ")
                      if not p.endswith("constexpr")]
            sig = {p: "*fp32" for p in params} | {"BLOCK": "constexpr"}
            aligned = {(i,): [["tt.divisibility", 16]] for i in range(len(params))}   # (as ember's launches)
            t0 = time.perf_counter()
            triton.compile(ASTSource(fn, sig, constexprs={"BLOCK": args.block}, attrs=aligned), target=target,
                           options={"num_warps": args.num_warps})
            wall = (time.perf_counter() - t0) * 1e3
            times.setdefault(name, []).append({**LAST, "wall": wall})
    print(f"# {args.path} {args.kernel}: Triton {triton.__version__}, ms (median of {args.repeats})")
    for name, runs in times.items():
        keys = runs[0].keys()
        print(f"  {name:70s} " + "  ".join(f"{k} {statistics.median(r[k] for r in runs):6.1f}" for k in keys))


if __name__ == "__main__":
    sys.exit(main())
