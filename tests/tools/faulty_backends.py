"""Backends with one fault each, for the checked-mode and minifier tests. EMBER_TEST_FAULT=off removes the fault
(a repro script run with it set must pass)."""
import os

import torch


def _fault_on() -> bool:
    return os.environ.get("EMBER_TEST_FAULT", "on") != "off"


def _is(node: torch.fx.Node, name: str) -> bool:
    return node.op in ("call_function", "call_method") and getattr(node.target, "__name__", node.target) == name


def slightly_wrong_tanh(gm: torch.fx.GraphModule, example_inputs: list):
    """Runs the graph as it is, except that each tanh comes out 1e-4 of its value too large."""
    if not _fault_on():
        return gm.forward
    graph = torch.fx.Graph()
    env = {}
    for n in gm.graph.nodes:
        env[n] = graph.node_copy(n, lambda a: env[a])
        if _is(n, "tanh"):
            env[n] = graph.call_function(torch.mul, (env[n], 1.0001))
    return torch.fx.GraphModule(gm, graph).forward


def refuses_cumsum(gm: torch.fx.GraphModule, example_inputs: list):
    """Raises on every graph that computes a cumulative sum; runs the others as they are."""
    if _fault_on() and any(_is(n, "cumsum") for n in gm.graph.nodes):
        raise NotImplementedError("faulty backend: no cumsum")
    return gm.forward
