"""Split a joint forward+backward ATen graph into a forward and a backward graph, choosing what to save.

The backward needs some values that depend only on the primals (activations). Each one is either saved by the
forward (costs its bytes until the backward runs) or recomputed by the backward from other saved values.
We pick the cheapest set to save with a minimum cut (networkx max-flow), as AOTAutograd's partitioner does:

- flow network over the tensor values the backward needs that do not depend on tangents: each value is two
  vertices, `in -> out`, with capacity = its bytes (cutting that edge = saving the value);
- a value the backward may *recompute* gets edges `input.out -> value.in` (infinite): it is available if its inputs
  are. Recomputable = cheap: views and pointwise ops (`torch.Tag.pointwise`), never random ops
  (`Tag.nondeterministic_seeded`: recomputing bernoulli would draw a different dropout mask, so masks are saved)
  and never matmul/convolution/reductions (too costly to redo);
- primals and forward values that may not be recomputed hang off the source (`S -> value.in`, infinite);
- values read directly by backward nodes (those depending on tangents) feed the sink (`value.out -> T`).

Every S->T path then crosses a cut edge: the backward gets each needed value by walking back to saved ones, and
the saved bytes are minimal among such choices. A saved value the forward did not compute anyway (e.g. a
batch-norm statistic only the backward reads) is added to the forward graph.
"""
from __future__ import annotations

import dataclasses
import operator

import networkx as nx
import torch
import torch.fx

from ember.autograd.trace import TraceMeta

aten = torch.ops.aten


@dataclasses.dataclass
class Partition:
    forward: torch.fx.GraphModule    # primals -> (forward outputs..., saved...)
    backward: torch.fx.GraphModule   # (saved..., tangents...) -> grads of primals requiring grad (None if unused)
    num_forward_outputs: int
    saved: list[str]                 # node names of the saved values, in order
    saved_bytes: int
    recomputed: list[str]            # forward nodes the backward recomputes


def _bytes(node: torch.fx.Node) -> int | None:
    v = node.meta.get("val")
    if isinstance(v, torch.Tensor):
        return v.numel() * v.element_size()
    return None


def recomputable(node: torch.fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    op = node.target
    if not isinstance(op, torch._ops.OpOverload) or torch.Tag.nondeterministic_seeded in op.tags:
        return False
    schema = op._schema
    is_view = bool(schema.returns) and schema.returns[0].alias_info is not None
    return is_view or torch.Tag.pointwise in op.tags


def _ancestors(roots, stop=lambda n: False) -> set:
    seen, todo = set(), [r for r in roots if isinstance(r, torch.fx.Node)]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if not stop(n):
            todo.extend(n.all_input_nodes)
    return seen


def partition(joint: torch.fx.GraphModule, meta: TraceMeta) -> Partition:
    graph = joint.graph
    out_node = next(n for n in reversed(graph.nodes) if n.op == "output")
    outs = list(out_node.args[0])
    nf = meta.num_graph_outputs + len(meta.mutations)
    fw_outs, grad_outs = outs[:nf], outs[nf:]
    primals = [n for n in graph.nodes if n.op == "placeholder" and n.name.startswith("primal")]
    tangents = [n for n in graph.nodes if n.op == "placeholder" and n.name.startswith("tangent")]

    tangent_dep = set(tangents)
    for n in graph.nodes:
        if n.op == "call_function" and any(a in tangent_dep for a in n.all_input_nodes):
            tangent_dep.add(n)
    in_forward = _ancestors(fw_outs)
    needed_by_bw = _ancestors(grad_outs)
    bw_nodes = needed_by_bw & tangent_dep
    primal_only = needed_by_bw - tangent_dep     # values the backward needs: save or recompute

    G = nx.DiGraph()
    G.add_node("S")
    G.add_node("T")
    for n in primal_only:
        size = _bytes(n)
        if size is None:
            G.add_edge((n, "in"), (n, "out"))                      # a tuple: not a value one can save
        else:
            G.add_edge((n, "in"), (n, "out"), capacity=size)
        if n.op == "placeholder" or (n in in_forward and not recomputable(n)):
            G.add_edge("S", (n, "in"))
        else:
            for u in n.all_input_nodes:
                G.add_edge((u, "out"), (n, "in"))
        if any(user in bw_nodes for user in n.users) or n in grad_outs:
            G.add_edge((n, "out"), "T")
    saved: list[torch.fx.Node] = []
    if nx.has_path(G, "S", "T"):
        _, (reach, _) = nx.minimum_cut(G, "S", "T")
        saved = [n for n in graph.nodes if n in primal_only and (n, "in") in reach and (n, "out") not in reach]

    fw = _subgraph(joint, primals, fw_outs + saved, "AtenForward")
    saved_set = set(saved)
    bw = _subgraph(joint, saved + tangents, grad_outs, "AtenBackward")
    in_backward = _ancestors(grad_outs, stop=lambda n: n in saved_set)
    recomputed = [n.name for n in graph.nodes
                  if n in in_backward and n in in_forward and n not in saved_set and n.op == "call_function"]
    return Partition(fw, bw, nf, [n.name for n in saved], sum(_bytes(n) or 0 for n in saved), recomputed)


def _subgraph(joint: torch.fx.GraphModule, inputs: list, outputs: list, name: str) -> torch.fx.GraphModule:
    """The nodes of `joint` computing `outputs` from `inputs` (in the joint graph's order)."""
    g = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for n in inputs:
        env[n] = g.placeholder(n.name)
        env[n].meta = dict(n.meta)
    stop = set(inputs)
    needed = _ancestors(outputs, stop=lambda n: n in stop)
    for n in joint.graph.nodes:
        if n in needed and n not in env:
            if n.op == "placeholder":
                raise AssertionError(f"partition: {n.name} is needed by {name} but not one of its inputs")
            env[n] = g.node_copy(n, lambda a: env[a])
    g.output(tuple(env[o] if isinstance(o, torch.fx.Node) else o for o in outputs))
    g.lint()
    return torch.fx.GraphModule(joint, g, class_name=name)
