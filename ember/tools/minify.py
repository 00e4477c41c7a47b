"""The minifier: `python -m ember minify DIR` / `ember.minify(DIR)` shrinks a saved repro (repro.py) to a small
standalone script that still fails the same way: the same exception type for a crash, AccuracyMismatch for a
divergence.

Each candidate is a repro script, run in this process as the saved one runs (eager must pass, then ember.compile
with the same backend, mode and options, the fail-safe off), so what it finds is what the written script shows:
1. nodes, by delta debugging: the longest prefix of the graph that is not needed (cut after the first node at
   which it still fails, found by bisection), then the longest run of leading nodes (they become inputs holding
   the values eager computed for them), then chunks of the rest, halved down to single nodes (ddmin). A kept
   graph returns its values no kept node reads.
2. inputs: each saved value is replaced by one the script generates from a seed (integers in the saved range)
   where the failure persists, so the script stands alone.
3. shapes: each size shared by the generated inputs is halved, again and again, while the failure persists
   (a graph with sizes written into it then fails in eager, and the size stays).
Candidates run in this process: a fault that crashes the interpreter (a segfault) stops the minifier itself.
"""
from __future__ import annotations

import contextlib
import os
import pathlib
from typing import Callable

import torch

from ember.tools import repro
from ember.tools.checked import AccuracyMismatch
from ember.tools.logs import get_logger

log = get_logger("fallbacks")


class Candidate:
    """A graph over some of the original nodes, with the values of its inputs and how the script makes each."""

    def __init__(self, graph: torch.fx.Graph, values: list, specs: list[dict]):
        self.graph, self.values, self.specs = graph, values, specs

    def nodes(self) -> int:
        return len(self.graph.nodes)


def minify(path: str | os.PathLike, out: str | os.PathLike | None = None) -> pathlib.Path:
    """Shrink the repro in directory `path`; write the result to `out` (default: path/minified) and return it."""
    path = pathlib.Path(path)
    ns, meta = repro.load(path)
    want = "accuracy" if meta["kind"] == "accuracy" else meta["error"]
    gm = torch.fx.symbolic_trace(ns["f"])
    values = ns["make_inputs"]()
    env = _values(gm, values)
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    tried = {}

    def fails(cand: Candidate) -> bool:
        key = repro.script(cand.graph, cand.specs, meta)
        if key not in tried:
            tried[key] = outcome(key, cand.values, path) == want
        return tried[key]

    def of(kept: list) -> Candidate:
        return _candidate(gm, kept, env, values)

    whole = of(nodes)
    got = outcome(repro.script(whole.graph, whole.specs, meta), whole.values, path)
    if got != want:
        raise RuntimeError(f"the repro in {path} does not fail as saved: wanted {want}, got {got}")
    kept = _shortest_prefix(nodes, lambda ks: fails(of(ks)))
    kept = _shortest_suffix(kept, lambda ks: fails(of(ks)))
    kept = _ddmin(kept, lambda ks: fails(of(ks)))
    cand = of(kept)
    cand = _generated_inputs(cand, fails)
    cand = _smaller_shapes(cand, fails)
    log.info("minified %s: %d nodes to %d in %d runs", path, len(gm.graph.nodes), cand.nodes(), len(tried))
    out = pathlib.Path(out) if out is not None else path / "minified"
    reason = f"minified from {path.name}: {len(gm.graph.nodes)} nodes to {cand.nodes()}; {meta.get('reason', '')}"
    return repro.write(out, cand.graph, cand.specs, cand.values, {**meta, "reason": reason})


@contextlib.contextmanager
def _trial_environment():
    """A candidate runs with the fail-safe off and neither checks nor repros (they would recurse)."""
    names = ("EMBER_FAIL_SAFE", "EMBER_CHECK", "EMBER_REPRO_DIR")
    before = {k: os.environ.get(k) for k in names}
    os.environ.pop("EMBER_CHECK", None)
    os.environ.pop("EMBER_REPRO_DIR", None)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def outcome(text: str, values: list, where: pathlib.Path) -> str:
    """What a repro script does: "eager raises", "pass", "accuracy", or the type name of the error it raises."""
    ns = {"__name__": "ember_repro_candidate", "__file__": str(where / "repro.py")}
    with _trial_environment():
        try:
            exec(compile(text, "<ember minify candidate>", "exec"), ns)
            ns["SAVED"] = values
            ns["f"](*ns["make_inputs"]())
        except Exception:
            return "eager raises"
        try:
            ns["main"]()
        except AccuracyMismatch:
            return "accuracy"
        except Exception as e:
            return type(getattr(e, "inner_exception", None) or e).__name__
    return "pass"


def _values(gm: torch.fx.GraphModule, values: list) -> dict:
    run = torch.fx.Interpreter(gm, garbage_collect_values=False)
    with torch.no_grad():
        run.run(*repro.copies(values))
    return run.env


def _candidate(gm: torch.fx.GraphModule, kept: list, env: dict, values: list) -> Candidate:
    """The graph of the `kept` nodes; what they read from other nodes becomes inputs holding eager's values."""
    kept_set = set(kept)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    needed = []
    for n in kept:
        for a in n.all_input_nodes:
            if a not in kept_set and a not in needed:
                needed.append(a)
    order = {n: k for k, n in enumerate(gm.graph.nodes)}
    needed.sort(key=order.__getitem__)
    graph, new, vals = torch.fx.Graph(), {}, []
    for a in needed:
        new[a] = graph.placeholder(repro._ident(a.name))
        vals.append(values[placeholders.index(a)] if a.op == "placeholder" else env[a])
    for n in kept:
        new[n] = graph.node_copy(n, lambda a: new[a])
    read = {a for n in kept for a in n.all_input_nodes}
    graph.output(tuple(new[n] for n in kept if n not in read))
    vals = [v.detach().clone().requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor) and v.is_leaf
            else v.detach().clone() if isinstance(v, torch.Tensor) else v for v in vals]
    return Candidate(graph, vals, [repro.saved_spec(v) for v in vals])


def _shortest_prefix(nodes: list, fails: Callable[[list], bool]) -> list:
    lo, hi = 1, len(nodes)   # fails(nodes[:hi])
    while lo < hi:
        mid = (lo + hi) // 2
        if fails(nodes[:mid]):
            hi = mid
        else:
            lo = mid + 1
    return nodes[:hi]


def _shortest_suffix(nodes: list, fails: Callable[[list], bool]) -> list:
    lo, hi = 0, len(nodes) - 1   # fails(nodes[lo:]); find the largest start that still fails
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fails(nodes[mid:]):
            lo = mid
        else:
            hi = mid - 1
    return nodes[lo:]


def _ddmin(nodes: list, fails: Callable[[list], bool]) -> list:
    """Zeller's delta debugging over complements: drop chunks while the failure persists."""
    n = 2
    while len(nodes) >= 2:
        size = -(-len(nodes) // n)
        chunks = [nodes[k:k + size] for k in range(0, len(nodes), size)]
        for chunk in chunks:
            rest = [x for x in nodes if x not in chunk]
            if rest and fails(rest):
                nodes, n = rest, max(n - 1, 2)
                break
        else:
            if n >= len(nodes):
                break
            n = min(2 * n, len(nodes))
    return nodes


def _generated_inputs(cand: Candidate, fails: Callable[[Candidate], bool]) -> Candidate:
    for k, v in enumerate(cand.values):
        spec = repro.generated_spec(v)
        if cand.specs[k]["how"] == "saved" and spec is not None:
            trial = Candidate(cand.graph, cand.values, [*cand.specs[:k], spec, *cand.specs[k + 1:]])
            if fails(trial):
                cand = trial
    return cand


def _smaller_shapes(cand: Candidate, fails: Callable[[Candidate], bool]) -> Candidate:
    while True:
        sizes = sorted({d for s in cand.specs if s["how"] == "random" for d in s["shape"] if d > 1}, reverse=True)
        for size in sizes:
            specs = [{**s, "shape": [d // 2 if d == size else d for d in s["shape"]]} if s["how"] == "random" else s
                     for s in cand.specs]
            trial = Candidate(cand.graph, cand.values, specs)
            if fails(trial):
                cand = trial
                break
        else:
            return cand
