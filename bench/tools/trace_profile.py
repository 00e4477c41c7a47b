"""Compile time of ember's frontend capture and ATen tracing, phase by phase, without code generation.

    PYTHONPATH=. .venv/bin/python bench/tools/trace_profile.py [--models gpt2,bert,resnet50] [--repeats 3]
        [--save graphs.json | --compare graphs.json] [--profile gpt2]

Workloads (default configs, random weights, small inputs: only compile time matters here):
  gpt2      transformers GPT2LMHeadModel(GPT2Config()) train step: loss = model(ids, labels=ids).loss; backward
            (batch 2, seq 64; dropout on, as bench/gpu.py's training row)
  bert      BertModel(BertConfig()) inference under no_grad (batch 2, seq 64)
  resnet50  torchvision resnet50 inference under no_grad (batch 2, 3x64x64)

Phases, each summed over the graphs of one compile (ember.compile with the "aot_eager" backend: ATen graphs run as
they are, no code generation):
  capture    FrameCompiler.capture minus the backend call inside it (bytecode interpretation, fake tensors, guards)
  trace      trace_forward / trace_joint (ATen tracing on fake tensors under the recorder)
  partition  the min-cut partition of a joint graph
Cold: before each repeat ember.reset() and FakeTensorMode.cache_clear() (the process-wide dispatch cache), as
bench/frontend.py does; one untimed compile first pays the process's one-time costs (imports, lazy registrations).
The reported time per phase is the median over the repeats, in CPU seconds of this process (time.process_time,
one torch thread): on a shared machine CPU time moves far less with other load than wall time.

Correctness: every graph of a compile (the torch-level graph from capture; the ATen inference or joint graph; the
partition's forward and backward graphs) is reduced to a text listing each node's op, target, arguments and its
meta["val"] (shape, stride, dtype, requires_grad), plus the partition's saved values. --save writes these texts,
--compare checks a later run against them (so a speed-up that changes any graph shows as a difference).
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import hashlib
import json
import os
import pathlib
import pstats
import statistics
import sys
import time

import torch

# CPU time of this process, not wall time: other work on a shared machine barely moves it;
# torch runs on one thread here, so it is the compile's own time
clock = time.process_time




def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    model = GPT2LMHeadModel(GPT2Config()).train()
    ids = torch.randint(0, 50257, (2, 64))

    def step(fn):
        model.zero_grad(set_to_none=True)
        loss = fn(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach()
    return model, step


def bert():
    from transformers import BertConfig, BertModel
    model = BertModel(BertConfig()).eval()
    ids = torch.randint(0, 30522, (2, 64))

    def step(fn):
        with torch.no_grad():
            return fn(input_ids=ids).last_hidden_state
    return model, step


def resnet50():
    import torchvision
    model = torchvision.models.resnet50().eval()
    x = torch.randn(2, 3, 64, 64)

    def step(fn):
        with torch.no_grad():
            return fn(x)
    return model, step


MODELS = {"gpt2": gpt2, "bert": bert, "resnet50": resnet50}


# ------------------------------------------------------------------------------------------------ fingerprints

def _val_text(v) -> str:
    if isinstance(v, torch.Tensor):
        return f"{tuple(v.shape)}/{v.stride()}/{str(v.dtype)[6:]}/{'rg' if v.requires_grad else ''}"
    if isinstance(v, (tuple, list)):
        return "(" + ",".join(_val_text(x) for x in v) + ")"
    return type(v).__name__ if v is not None else "-"


def _arg_text(a) -> str:
    if isinstance(a, torch.fx.Node):
        return "%" + a.name
    if isinstance(a, (tuple, list)):
        return "[" + ",".join(_arg_text(x) for x in a) + "]"
    if isinstance(a, dict):
        return "{" + ",".join(f"{k}:{_arg_text(x)}" for k, x in a.items()) + "}"
    return repr(a)


def graph_text(gm: torch.fx.GraphModule) -> str:
    lines = []
    for n in gm.graph.nodes:
        target = n.target if isinstance(n.target, str) else getattr(n.target, "__qualname__", None) or str(n.target)
        if hasattr(n.target, "_schema"):
            target = str(n.target)
        lines.append(f"{n.name} = {n.op} {target} {_arg_text(n.args)} {_arg_text(n.kwargs)} :: "
                     f"{_val_text(n.meta.get('val'))}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ instrumentation

class Phases:
    """Times ember's phases by wrapping the functions that run them (bench-only patching)."""

    def __init__(self):
        import ember.autograd.function as function
        import ember.frontend.convert as convert
        self.times: dict[str, float] = {}
        self.graphs: list[tuple[str, str]] = []
        self.backend_time = 0.0
        self.profile, self.profile_phase = None, None   # --profile-phase: profile only inside that phase
        phases = self
        orig_capture = convert.FrameCompiler.capture

        def capture(fc, frame_args):
            t0, b0 = clock(), phases.backend_time
            try:
                return orig_capture(fc, frame_args)
            finally:
                phases.add("capture", clock() - t0 - (phases.backend_time - b0))
        convert.FrameCompiler.capture = capture

        def timed(name, f, record):
            def run(*args, **kwargs):
                prof = phases.profile if phases.profile_phase == name else None
                if prof is not None:
                    prof.enable()
                t0 = clock()
                out = f(*args, **kwargs)
                phases.add(name, clock() - t0)
                if prof is not None:
                    prof.disable()
                record(out)
                return out
            return run
        function.trace_forward = timed("trace", function.trace_forward,
                                       lambda out: self.graphs.append(("aten_forward", graph_text(out[0]))))
        function.trace_joint = timed("trace", function.trace_joint,
                                     lambda out: self.graphs.append(("aten_joint", graph_text(out[0]))))
        function.partition = timed("partition", function.partition, lambda p: self.graphs.extend([
            ("part_forward", graph_text(p.forward)), ("part_backward", graph_text(p.backward)),
            ("part_saved", " ".join(p.saved) + f" | {p.saved_bytes} | " + " ".join(p.recomputed))]))

    def add(self, name, dt):
        self.times[name] = self.times.get(name, 0.0) + dt

    def backend(self, gm, example_inputs):
        from ember.backends import lookup_backend
        self.graphs.append(("captured", graph_text(gm)))
        t0 = clock()
        try:
            return lookup_backend("aot_eager")(gm, example_inputs)
        finally:
            self.backend_time += clock() - t0

    def reset(self):
        self.times, self.graphs, self.backend_time = {}, [], 0.0


class GCTime:
    """CPU time spent in the cyclic garbage collector, per generation (gc.callbacks)."""

    def __init__(self):
        self.t = {0: 0.0, 1: 0.0, 2: 0.0}
        self.n = {0: 0, 1: 0, 2: 0}
        self._start = 0.0
        gc.callbacks.append(self)

    def __call__(self, phase, info):
        if phase == "start":
            self._start = clock()
        else:
            self.t[info["generation"]] += clock() - self._start
            self.n[info["generation"]] += 1

    def reset(self):
        self.t = {0: 0.0, 1: 0.0, 2: 0.0}
        self.n = {0: 0, 1: 0, 2: 0}


def gc_ab(name: str, phases: Phases, repeats: int, after_steps: int = 3) -> None:
    """Cold compiles with the collector paused during compiles (ember's default) and not, interleaved: the
    phases, the whole first step, the `after_steps` steps after it (where collections the compile put off
    land), and the collector's own time over all of them."""
    from ember import config
    cold_compile(name, phases)
    meter = GCTime()
    rows = {True: [], False: []}
    for _ in range(repeats):
        for paused in (True, False):
            config.COMPILE_WITHOUT_GC = paused
            meter.reset()
            times, _, first, fn, step = cold_compile(name, phases, keep=True)
            t0 = clock()
            for _ in range(after_steps):
                step(fn)
            after = clock() - t0
            rows[paused].append((times.get("capture", 0) + times.get("trace", 0) + times.get("partition", 0),
                                 first, after, sum(meter.t.values()), dict(meter.n)))
            del fn, step
    config.COMPILE_WITHOUT_GC = True
    for paused, rs in rows.items():
        med = lambda i: statistics.median(r[i] for r in rs)  # noqa: E731
        print(f"{name:9s} gc {'paused' if paused else 'on    '} during compile: capture+trace+partition "
              f"{med(0):.3f}s, whole first step {med(1):.3f}s, next {after_steps} steps {med(2):.3f}s; "
              f"collector {med(3):.3f}s over all of them (collections per generation {rs[-1][4]})")


def flag_ab(name: str, phases: Phases, repeats: int, flag: str) -> None:
    """Cold compiles with a module flag of ember's on and off, interleaved (`module:NAME`, e.g.
    ember.config:MEMO): the phases' median CPU times each way."""
    import importlib
    mod_name, attr = flag.split(":")
    mod = importlib.import_module(mod_name)
    keep = getattr(mod, attr)
    cold_compile(name, phases)
    runs = {True: [], False: []}
    for _ in range(repeats):
        for on in (True, False):
            setattr(mod, attr, on)
            runs[on].append(cold_compile(name, phases)[0])
    setattr(mod, attr, keep)
    for on, rs in runs.items():
        print(f"{name:9s} {attr}={on!s:5s} " + "  ".join(
            f"{k} {statistics.median(r.get(k, 0.0) for r in rs):.3f}s" for k in ("capture", "trace", "partition")) +
            "   per repeat trace: " + " ".join(f"{r.get('trace', 0):.3f}" for r in rs))


def cold_compile(name: str, phases: Phases, profile: cProfile.Profile | None = None, keep: bool = False):
    import ember
    from torch._subclasses.fake_tensor import FakeTensorMode
    torch.manual_seed(0)
    model, step = MODELS[name]()
    ember.reset()
    FakeTensorMode.cache_clear()
    gc.collect()
    phases.reset()
    fn = ember.compile(model, backend=phases.backend)
    torch.manual_seed(1)
    if profile is not None:
        profile.enable()
    t0 = clock()
    step(fn)
    total = clock() - t0
    if profile is not None:
        profile.disable()
    if keep:
        return dict(phases.times), list(phases.graphs), total, fn, step
    return dict(phases.times), list(phases.graphs), total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="gpt2,bert,resnet50")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--save")
    ap.add_argument("--compare")
    ap.add_argument("--profile", help="a model to cProfile (one extra cold compile), printed by cumulative time")
    ap.add_argument("--gc-ab", action="store_true", help="compare compiles with the collector paused and not")
    ap.add_argument("--ab", help="module:FLAG of ember to compare on and off (e.g. ember.config:MEMO)")
    ap.add_argument("--profile-lines", type=int, default=60)
    ap.add_argument("--profile-phase", choices=["trace", "partition"],
                    help="with --profile: only that phase is profiled")
    args = ap.parse_args()
    torch.set_num_threads(1)  # the graphs' eager runs are not what is measured: keep them from competing
    phases = Phases()
    names = args.models.split(",")
    import ember
    print(f"# ember from {pathlib.Path(ember.__file__).parent}; {os.uname().nodename}, torch {torch.__version__}, "
          f"Python {sys.version.split()[0]}, "
          f"load {os.getloadavg()[0]:.2f}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    fingerprints = {}
    if args.ab:
        for name in names:
            flag_ab(name, phases, args.repeats, args.ab)
        return
    if args.gc_ab:
        for name in names:
            gc_ab(name, phases, args.repeats)
        return
    for name in names:
        cold_compile(name, phases)                    # one-time costs of the process, untimed
        runs = [cold_compile(name, phases) for _ in range(args.repeats)]
        keys = ["capture", "trace", "partition"]
        med = {k: statistics.median(r[0].get(k, 0.0) for r in runs) for k in keys}
        total = statistics.median(r[2] for r in runs)
        graphs = runs[-1][1]
        if any(r[1] != graphs for r in runs):
            print(f"  {name}: graphs differ between repeats!")
        fingerprints[name] = graphs
        counts = " ".join(f"{k}:{len(t.splitlines()) if not k.startswith('part_saved') else len(t.split())}"
                          for k, t in graphs)
        print(f"{name:9s} " + "  ".join(f"{k} {med[k]:.3f}s" for k in keys) +
              f"  (sum {sum(med.values()):.3f}s; whole first step {total:.3f}s)  nodes {counts}")
        print(f"          per repeat: " + "; ".join(" ".join(f"{r[0].get(k, 0):.3f}" for k in keys) for r in runs))
    if args.profile:
        prof = cProfile.Profile()
        if args.profile_phase:
            phases.profile, phases.profile_phase = prof, args.profile_phase
            cold_compile(args.profile, phases)
        else:
            cold_compile(args.profile, phases, prof)
        st = pstats.Stats(prof)
        st.sort_stats("cumulative").print_stats(args.profile_lines)
        st.sort_stats("tottime").print_stats(30)
    if args.save:
        pathlib.Path(args.save).write_text(json.dumps(fingerprints, indent=0))
        print(f"graphs saved to {args.save}")
    if args.compare:
        before = json.loads(pathlib.Path(args.compare).read_text())
        for name in names:
            if name not in before:
                continue
            a, b = before[name], [list(x) for x in fingerprints[name]]
            same = a == b
            digest = hashlib.sha1(json.dumps(b).encode()).hexdigest()[:10]
            print(f"{name}: graphs {'identical' if same else 'DIFFER'} to {args.compare} ({len(b)} graphs, {digest})")
            if not same:
                for (ka, ta), (kb, tb) in zip(a, b):
                    if ta != tb:
                        la, lb = ta.splitlines(), tb.splitlines()
                        first = next((i for i, (x, y) in enumerate(zip(la, lb)) if x != y), min(len(la), len(lb)))
                        print(f"  {ka}: {len(la)} vs {len(lb)} lines; first difference at line {first}:\n"
                              f"    before: {la[first] if first < len(la) else '<end>'}\n"
                              f"    after:  {lb[first] if first < len(lb) else '<end>'}")


if __name__ == "__main__":
    main()
