"""Where ember's code generation spends a cold compile: lowering, scheduling, printing (C++ or Triton), per model.

  PYTHONPATH=. .venv/bin/python bench/compile_profile.py [--base DIR] [--models a,b] [--backends cpp,triton]
                                                         [--rounds N] [--profile MODEL:BACKEND]

Each (model, backend) runs in a fresh process (a cold compile: empty sympy caches and Expr tables, as in a new
program): the model is captured by ember's frontend with a backend that only records the ATen graphs
(ember.autograd's forward and backward), then each graph goes through the code generator's phases, timed:
  lower     lower.lower (decompositions -> loop IR)
  schedule  schedule.schedule (+ split_elementwise for C++, split_few_row_groups / chunk_wide_groups for Triton)
  print     cpp.generate / triton.generate (the source text; nothing is built or run)
  wrapper   wrapper.python_wrapper (the host program's text, compiled by Python)
Times are the process's CPU time (time.process_time), robust to other jobs on a shared machine.
The Triton printer runs on the CPU graphs (no GPU needed, no kernel is built); the C++-only convolution
fusions are turned off for it (config.FUSE_CONVOLUTIONS = False), as on a GPU, where they do not apply.

--build (Triton only) also compiles every kernel the printer wrote for an H100 (sm_90) on this machine, one
after the other in this process (Triton compiles without a GPU when given the target): the "build" column is
that CPU time, the cost of Triton's own passes, LLVM, libdevice's linking and ptxas, which a GPU machine spreads
over worker processes (ember.runtime.triton_workers). Pointer alignment is not specialized, as on a GPU it is.
It is wall time (ptxas runs in processes of its own), so the machine's load shows in it.

--base DIR runs the same with the ember package found in DIR (e.g. `git archive <commit> | tar -x -C DIR`),
alternating base and current processes round by round, and checks that both generate the same sources
(sha256 of the C++/Triton source and the host program of every graph): the A/B of a compile-time change that
must not change the generated code. --profile prints a cProfile of one (model, backend) pass instead.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# CPU time of this process: the phases are single-threaded Python, and on a shared machine (other jobs running)
# wall time measured the load more than the code
CLOCK = time.process_time


# ------------------------------------------------------------------------------------------------ workloads
def _vision(name: str, *shape: int):
    """A torchvision model in eval mode and an inference step on a random batch of `shape`."""
    import torch
    import torchvision
    model = getattr(torchvision.models, name)().eval()
    x = torch.randn(*shape)

    def step(fn):
        with torch.no_grad():
            fn(x)
    return model, step


def resnet50():
    return _vision("resnet50", 8, 3, 224, 224)


def densenet121():
    return _vision("densenet121", 16, 3, 128, 128)


def bert():
    import torch
    from transformers import BertConfig, BertModel
    model = BertModel(BertConfig()).eval()
    ids = torch.randint(0, 30522, (8, 128))

    def step(fn):
        with torch.no_grad():
            fn(input_ids=ids)
    return model, step


def gpt2_train():
    """GPT-2 (124M) forward with the LM loss and backward; batch 2 x 128 to keep the eager run short on a CPU
    (the graphs have the same structure as the GPU bench's b8 s256)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    model = GPT2LMHeadModel(GPT2Config()).train()
    ids = torch.randint(0, 50257, (2, 128))

    def step(fn):
        model.zero_grad(set_to_none=True)
        fn(input_ids=ids, labels=ids).loss.backward()
    return model, step


def densenet121_train():
    """densenet121's training step (forward, loss, backward; no optimizer), batch 4 x 3 x 64 x 64 to keep the
    eager run short on a CPU (the graphs have the GPU bench's structure: batch 16, 128 x 128)."""
    import torch
    import torchvision
    model = torchvision.models.densenet121().train()
    x = torch.randn(4, 3, 64, 64)

    def step(fn):
        model.zero_grad(set_to_none=True)
        fn(x).sum().backward()
    return model, step


MODELS = {"resnet50": resnet50, "bert": bert, "gpt2_train": gpt2_train, "densenet121": densenet121,
          "densenet121_train": densenet121_train}


# ------------------------------------------------------------------------------------------------ one process
def capture(model_name: str, cuda: bool) -> list:
    """The ATen graphs (gm, example_inputs) ember.autograd hands its compilers for one step of the model.
    cuda: the graphs as a GPU would get them (see `_on_cuda`)."""
    import ember
    from ember.autograd import aot_module
    graphs, captured = [], []

    def record(gm, example_inputs):
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    def backend(gm, example_inputs):
        import torch
        n = len(graphs)
        run = aot_module(gm, example_inputs, record, record)
        if not torch.is_grad_enabled():
            captured.append((gm, list(example_inputs), n))
        return run
    model, step = MODELS[model_name]()
    step(ember.compile(model, backend=backend))
    if cuda:   # inference graphs as a GPU gets them; training graphs stay CPU ones (see _on_cuda)
        for gm, ex, n in captured:
            graphs[n] = _on_cuda(gm, ex)
    return graphs


def _on_cuda(gm, ex) -> tuple:
    """An inference graph of the frontend traced again by ember.autograd with CUDA fake tensors (this machine
    needs no GPU: FakeTensorMode only computes metadata), so the Triton printer sees what it gets on a GPU (the
    CUDA decompositions of softmax, attention, addmm differ). Devices the capture baked into the graph
    (factory calls' device=) are moved to CUDA too. Training graphs cannot be: autograd's engine wants a
    CUDA device to run a CUDA backward, even a fake one."""
    import torch
    from ember.autograd import aot_module, trace
    cuda = torch.device("cuda")

    def fakes(fake_mode, tensors):
        with fake_mode:
            return [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=cuda) for t in tensors]

    def constant(self, t):
        name = f"_tensor_constant{len(self.constants)}"
        self.constants[name] = t.detach().clone()
        with self.fake_mode:
            fake = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=cuda)
        self._new(fake, self.graph.get_attr(name))
        return fake

    graphs = []

    def record(gm, example_inputs):
        graphs.append((gm, list(example_inputs)))
        return gm.forward
    old = trace._fakes, trace._Recorder.constant
    trace._fakes, trace._Recorder.constant = fakes, constant
    try:
        for n in gm.graph.nodes:
            if isinstance(n.kwargs.get("device"), (torch.device, str)):
                n.kwargs = {**n.kwargs, "device": cuda}
        gm.recompile()
        with torch.no_grad():
            aot_module(gm, ex, record, record)
    finally:
        trace._fakes, trace._Recorder.constant = old
    assert len(graphs) == 1, "the CUDA trace failed (see the warning above)"
    return graphs[0]


def phases(gm, example_inputs, backend: str) -> tuple[dict, dict]:
    """Times of each phase for one graph, and the sha256 of what it generated."""
    from ember.codegen import lower, schedule, wrapper
    times, hashes = {}, {}
    t = CLOCK()
    with lower.LOWERING_LOCK:
        try:   # (a baseline tree from before split reductions has no target)
            low, _, _ = lower.lower(gm, example_inputs, target="gpu" if backend == "triton" else "cpu")
        except TypeError:
            low, _, _ = lower.lower(gm, example_inputs)
        times["lower"] = CLOCK() - t
        t = CLOCK()
        if backend == "cpp":
            from ember.codegen import cpp
            sched = schedule.schedule(low, row_buffers=True, mutations=gm.meta.get("ember_input_mutations"))
            sched = schedule.split_elementwise(sched, cpp.too_big_for_one_function)
            times["schedule"] = CLOCK() - t
            t = CLOCK()
            source, kernels = cpp.generate(sched)
            names = {n: None for n, *_ in kernels}
        else:
            from ember.codegen.triton import kernels as triton_kernels, passes
            sched = passes.chunk_wide_groups(passes.split_few_row_groups(
                schedule.schedule(low, mutations=gm.meta.get("ember_input_mutations"), across=True)))
            times["schedule"] = CLOCK() - t
            t = CLOCK()
            source, kernels = triton_kernels.generate(sched)
            names = {g.name: name for g, name, *_ in kernels}
        times["print"] = CLOCK() - t
        t = CLOCK()
        call = wrapper.python_wrapper(sched, lambda g: f"{names.get(g.name) or g.name}()", {"_fallback": None},
                                      not gm.meta.get("ember_guarded", False), persistent=backend == "cpp")
        times["wrapper"] = CLOCK() - t
    if os.environ.get("EMBER_PROFILE_DUMP"):   # the texts, for a diff of two runs
        d = os.environ["EMBER_PROFILE_DUMP"]
        os.makedirs(d, exist_ok=True)
        k = len(os.listdir(d)) // 2
        open(os.path.join(d, f"{k}_source.txt"), "w").write(source)
        open(os.path.join(d, f"{k}_wrapper.txt"), "w").write(call.source)
    hashes["source"] = hashlib.sha256(source.encode()).hexdigest()[:16]
    hashes["wrapper"] = hashlib.sha256(call.source.encode()).hexdigest()[:16]
    if backend == "triton" and BUILD:
        t = time.perf_counter()   # wall time: ptxas runs in processes of its own
        build_for_sm90(source, kernels, sched)
        times["build"] = time.perf_counter() - t
    return times, hashes


BUILD = False   # --build
TRITON_TYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64", "int64": "i64",
                "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "i1"}


def build_for_sm90(source: str, kernels: list, sched) -> None:
    """Every kernel of a printed module (and a flagged kernel's fixup) compiled by Triton for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ember.codegen.triton.heuristics import launch_meta
    from ember.codegen.triton.kernels import FIXUP_META
    from ember.runtime.triton_launch import load_module
    mod, target, seen = load_module(source), GPUTarget("cuda", 90, 32), set()
    for _, name, args, cfg, _grid in kernels:
        if name in seen:
            continue
        seen.add(name)
        types = [f"*{TRITON_TYPES[str(sched.buffers[a].dtype).removeprefix('torch.')]}" for a in args]
        jobs = [(name, launch_meta(cfg))] + ([(f"{name}_fixup", FIXUP_META)] if "fixup" in cfg else [])
        for kname, meta in jobs:
            fn = getattr(mod, kname)
            names = [n for n in fn.arg_names if n not in meta]
            sig = dict(zip(names, types + ["*i32"] * (len(names) - len(types))))
            consts = {k: v for k, v in meta.items() if k != "num_warps"}
            sig.update({k: "constexpr" for k in consts})
            triton.compile(ASTSource(fn, sig, constexprs=consts), target=target,
                           options={"num_warps": meta.get("num_warps", 4)})


def child(model_name: str, backend: str, profile: bool) -> None:
    import torch
    torch.manual_seed(0)
    from ember import config
    if backend == "triton":
        config.FUSE_CONVOLUTIONS = False    # CPU-only fusions: a GPU graph has none
    t = CLOCK()
    graphs = capture(model_name, cuda=backend == "triton")
    capture_s = CLOCK() - t
    if profile:
        import cProfile
        import pstats
        prof = cProfile.Profile()
        prof.enable()
    totals, hashes = {}, []
    t = CLOCK()
    for gm, ex in graphs:
        times, h = phases(gm, ex, backend)
        for k, v in times.items():
            totals[k] = totals.get(k, 0.0) + v
        hashes.append(h)
    totals["total"] = CLOCK() - t
    if profile:
        prof.disable()
        st = pstats.Stats(prof, stream=sys.stderr)
        st.sort_stats("cumulative").print_stats(60)
        st.sort_stats("tottime").print_stats(30)
    import ember
    print(json.dumps({"model": model_name, "backend": backend, "graphs": len(graphs), "capture": capture_s,
                      "times": totals, "hashes": hashes, "ember": os.path.dirname(os.path.dirname(ember.__file__))}))


# ------------------------------------------------------------------------------------------------ driver
def run_child(root: str, model: str, backend: str) -> dict:
    env = dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS="1", PYTHONHASHSEED="0")  # set orders reach the host program
    if BUILD:   # cold: Triton's and ember's caches fresh for each process
        import tempfile
        env.update(TRITON_CACHE_DIR=tempfile.mkdtemp(prefix="triton_cold_"), EMBER_CACHE_DIR=tempfile.mkdtemp(
            prefix="ember_cold_"))
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", f"{model}:{backend}"] +
                         (["--build"] if BUILD else []),
                         env=env, cwd=root, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{model}:{backend} under {root} failed:\n{out.stderr[-3000:]}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert os.path.realpath(got["ember"]) == os.path.realpath(root), (got["ember"], root)
    return got


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="resnet50,bert,gpt2_train,densenet121")
    ap.add_argument("--backends", default="cpp,triton")
    ap.add_argument("--base", default="", help="directory holding the baseline's ember package")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--child", default="")
    ap.add_argument("--profile", default="", help="MODEL:BACKEND: a cProfile of its phases, in this process")
    ap.add_argument("--build", action="store_true", help="Triton: also compile the kernels for sm_90")
    args = ap.parse_args()
    global BUILD
    BUILD = args.build
    if args.child or args.profile:
        model, backend = (args.child or args.profile).split(":")
        child(model, backend, bool(args.profile))
        return
    roots = [("new", ROOT)] + ([("base", os.path.abspath(args.base))] if args.base else [])
    results: dict = {}
    for r in range(args.rounds):
        for model in args.models.split(","):
            for backend in args.backends.split(","):
                for label, root in (roots if r % 2 == 0 else roots[::-1]):
                    got = run_child(root, model, backend)
                    results.setdefault((model, backend, label), []).append(got)
                    print(f"  round {r} {model:12s} {backend:6s} {label:4s} " +
                          " ".join(f"{k} {v:6.2f}" for k, v in got["times"].items()), file=sys.stderr, flush=True)
    load = os.getloadavg()
    print(f"# ember compile phases, seconds (median of {args.rounds} fresh processes each), "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load {load[0]:.1f}/{load[1]:.1f}")
    cols = ["lower", "schedule", "print", "wrapper"] + (["build"] if args.build else []) + ["total"]
    print(f"{'model':12s} {'backend':7s} {'code':5s} graphs " + " ".join(f"{c:>8s}" for c in cols) + "  same code")
    for model in args.models.split(","):
        for backend in args.backends.split(","):
            for label, _ in roots:
                runs = results[(model, backend, label)]
                med = {c: statistics.median(x["times"].get(c, 0.0) for x in runs) for c in cols}
                same = ""
                if label == "base":
                    same = "yes" if runs[0]["hashes"] == results[(model, backend, "new")][0]["hashes"] else "NO"
                print(f"{model:12s} {backend:7s} {label:5s} {runs[0]['graphs']:6d} " +
                      " ".join(f"{med[c]:8.3f}" for c in cols) + f"  {same}")
            if args.base:
                new = statistics.median(x["times"]["total"] for x in results[(model, backend, "new")])
                base = statistics.median(x["times"]["total"] for x in results[(model, backend, "base")])
                print(f"{'':12s} {'':7s} new/base total: {new / base:.2f}")


if __name__ == "__main__":
    main()
