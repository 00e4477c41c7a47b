"""ember.explain(fn)(*args): what ember captured when running fn on these arguments.

It compiles fn with the "eager" backend in a fresh cache, runs it once, and reports the graphs that ran,
the breaks (reason and the user's file:line), the ops per graph and the guards of each entry.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch


@dataclasses.dataclass
class BreakReason:
    reason: str
    where: str  # the user's file:line

    def __str__(self):
        return f"{self.reason} at {self.where}"


@dataclasses.dataclass
class ExplainOutput:
    graphs: list[torch.fx.GraphModule]
    break_reasons: list[BreakReason]
    ops_per_graph: list[list]  # each graph's op targets, in order
    guards: list[str]
    result: Any = None

    @property
    def graph_count(self) -> int:
        return len(self.graphs)

    @property
    def graph_break_count(self) -> int:
        return len(self.break_reasons)

    @property
    def op_count(self) -> int:
        return sum(len(ops) for ops in self.ops_per_graph)

    @property
    def dead_op_count(self) -> int:
        """Ops captured, then dropped from the graphs as nothing used them (torch.compile's graphs keep these)."""
        return sum(gm.meta.get("ember_dead_ops", 0) for gm in self.graphs)

    def __str__(self):
        lines = [f"Graph count: {self.graph_count}", f"Graph break count: {self.graph_break_count}",
                 f"Op count: {self.op_count} (and {self.dead_op_count} dead ops dropped)", "Ops per graph: " + ", ".join(str(len(ops)) for ops in self.ops_per_graph)]
        if self.break_reasons:
            lines.append("Break reasons:")
            lines += [f"  {i + 1}. {b}" for i, b in enumerate(self.break_reasons)]
        lines.append(f"Guards ({len(self.guards)}):")
        lines += [f"  {g}" for g in self.guards]
        return "\n".join(lines)

    __repr__ = __str__


def explain(fn: Callable, **compile_kwargs) -> Callable[..., ExplainOutput]:
    """ember.explain(fn)(*args) -> an object with graphs, breaks and guards; print() it for a summary."""
    from ember.api import compile as ember_compile
    from ember.frontend import convert

    def run(*args, **kwargs) -> ExplainOutput:
        events: list = []
        compiled = ember_compile(fn, backend=compile_kwargs.pop("backend", "eager"), **compile_kwargs)
        convert.RECORDERS.append(events)
        try:
            result = compiled(*args, **kwargs)
        finally:
            convert.RECORDERS.remove(events)
        graphs = [info["gm"] for kind, info in events if kind == "graph"]
        ops = [[n.target for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
               for gm in graphs]
        breaks = [BreakReason(info["reason"], info["where"]) for kind, info in events if kind == "break"]
        guards = [g for kind, info in events if kind == "entry" for g in info["guards"]]
        return ExplainOutput(graphs, breaks, ops, guards, result)

    return run
