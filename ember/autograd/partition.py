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

Normalizations are single ATen ops (native_layer_norm, batch norm) whose statistics the backward reads anyway;
their normalized output is, given those statistics, a pointwise function of the input (`_RECIPES`). So the
backward may recompute it with pointwise ops instead of saving it: a LayerNorm/BatchNorm output feeding a
matmul/conv and a ReLU need not be saved next to the normalization's input. The forward keeps the fused op.

A value a library call of the backward reads (a matmul, a convolution: directly or through views) is never
recomputed (a view of it still is: the backward takes the view of the saved value, and an expanded view saved
as such would reach the backward as a dense copy of the graph that wrote it), as AOTAutograd's partitioner bans it: recomputing it there writes it out again, while the forward
wrote it anyway for its own library call (GPT-2's GELU output, read by the projection's matmul forward and by its
weight gradient's backward: recomputed, it costs the backward two kernels writing it out per layer). The
normalization recipes above still apply where the backward only fuses pointwise work onto their output.

A log_softmax over a value alive anyway (a language model's logits: an input of the loss's own graph, or
returned by the forward) is written out in the joint graph as its parts, `(x - amax) - log(sum(exp(x - amax)))`,
and x is counted as costing one byte in the cut: the forward then saves x and the two row statistics, and the
backward recomputes the log_softmax pointwise where its gradient is computed, instead of the forward writing
and saving a second logits-sized tensor (a language model's vocabulary makes that hundreds of MB a step). Saving x
never holds more memory than saving the output (same size) and holds none when x is alive anyway.

Sizes (SymInt nodes of a symbolic graph) are not in the network: the backward receives the symbols its sizes
are computed from (int placeholders, sizes read off tensors) as ints the forward returns after its saved tensors,
and recomputes the arithmetic over them; byte costs are taken at the example's sizes.

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

from ember.autograd.symbolic import dispatch_context, hint, is_sym_node, is_symbol_source
from ember.autograd.trace_meta import TraceMeta

aten = torch.ops.aten


@dataclasses.dataclass
class Partition:
    forward: torch.fx.GraphModule    # primals -> (forward outputs..., saved activations..., saved symbols...)
    backward: torch.fx.GraphModule   # (saved primals..., saved activations..., saved symbols..., tangents...) ->
                                     # grads of the primals requiring grad, in order (None where a grad is unused)
    num_forward_outputs: int
    saved_primals: list[int]         # primal indices the backward reads: saved from the inputs, not returned
    saved: list[str]                 # node names of all saved tensors, in the backward's order
    saved_bytes: int                 # (at the example's sizes, for a symbolic graph)
    recomputed: list[str]            # forward nodes the backward recomputes
    saved_symbols: list[str] = dataclasses.field(default_factory=list)   # int values the backward reads (sizes)


def _bytes(node: torch.fx.Node) -> int | None:
    """A tensor value's bytes (symbolic sizes: at the example's values, a cost for the cut only)."""
    v = node.meta.get("val")
    if isinstance(v, torch.Tensor):
        return hint(v.numel()) * v.element_size()
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
    return is_view or torch.Tag.pointwise in op.tags or _is_cast(node)


def _is_cast(node: torch.fx.Node) -> bool:
    """A dtype conversion on the same device: pointwise, though ATen does not tag `_to_copy` so."""
    if node.target is not aten._to_copy.default or set(node.kwargs) - {"dtype", "device", "layout"}:
        return False
    x = node.args[0].meta.get("val") if isinstance(node.args[0], torch.fx.Node) else None
    v = node.meta.get("val")
    return isinstance(x, torch.Tensor) and isinstance(v, torch.Tensor) and x.device == v.device and \
        v.layout == x.layout == torch.strided


def _through_views(n):
    """The value a chain of views starts from."""
    while isinstance(n, torch.fx.Node) and _is_view(n):
        n = n.args[0]
    return n


def _split_log_softmax(graph: torch.fx.Graph, n: torch.fx.Node) -> None:
    """Replace `n = _log_softmax(x, dim)` by its parts, in the arithmetic order of eager's kernels (and of the
    decomposition in ember.decomp.table): `(x - amax(x)) - log(sum(exp(x - amax(x))))`."""
    x, dim = n.args[0], n.args[1]
    dtype = x.meta["val"].dtype
    low = dtype in (torch.float16, torch.bfloat16)   # computed in float32 and rounded once, as eager's kernel
    with graph.inserting_before(n):
        xf = _emit(graph, aten._to_copy.default, x, dtype=torch.float32) if low else x
        amax = _emit(graph, aten.amax.default, xf, [dim], True)
        shifted = _emit(graph, aten.sub.Tensor, xf, amax)
        total = _emit(graph, aten.sum.dim_IntList, _emit(graph, aten.exp.default, shifted), [dim], True)
        out = _emit(graph, aten.sub.Tensor, shifted, _emit(graph, aten.log.default, total))
        if low:
            out = _emit(graph, aten._to_copy.default, out, dtype=dtype)
    n.replace_all_uses_with(out)
    graph.erase_node(n)


def _is_view(n: torch.fx.Node) -> bool:
    return n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and \
        bool(n.target._schema.returns) and n.target._schema.returns[0].alias_info is not None


def _materialized_in_backward(n: torch.fx.Node, bw_nodes: set) -> bool:
    """Whether a backward node that ember's code generator leaves a library call (or an ATen call it cannot
    decompose) reads n, directly or through views of it."""
    from ember.decomp.table import EXTERN, TABLE   # (imported on first use: building the table costs an import)
    todo, seen = [n], {n}
    while todo:
        for u in todo.pop().users:
            if u in seen or u.op != "call_function":
                continue
            seen.add(u)
            if u in bw_nodes:
                if u.target is not operator.getitem and (u.target in EXTERN or u.target not in TABLE):
                    return True
            elif _is_view(u):
                todo.append(u)
    return False


def ancestors(roots, stop=lambda n: False, inputs_of=lambda n: n.all_input_nodes) -> set:
    """The nodes `roots` are computed from, roots included (not past a node where `stop` holds)."""
    seen, todo = set(), [r for r in roots if isinstance(r, torch.fx.Node)]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if not stop(n):
            todo.extend(inputs_of(n))
    return seen


# ------------------------------------------------------------------------ recompute recipes for normalizations

def _stat_items(norm: torch.fx.Node) -> tuple | None:
    items = {u.args[1]: u for u in norm.users if u.target is operator.getitem}
    return (items[1], items[2]) if 1 in items and 2 in items else None


def _recipe_inputs(out: torch.fx.Node) -> list | None:
    """For `getitem(norm, 0)`: the values that determine it pointwise (input, mean, rstd, weight, bias)."""
    if out.target is not operator.getitem or out.args[1] != 0 or out.args[0].op != "call_function":
        return None
    norm = out.args[0]
    stats = _stat_items(norm)
    if stats is None:
        return None
    x = norm.args[0]
    if norm.target is aten._native_batch_norm_legit_functional.default and norm.args[5]:   # training
        w, b = norm.args[1], norm.args[2]
    elif norm.target is aten.native_layer_norm.default:
        w, b = (list(norm.args) + [None, None])[2:4]
    else:
        return None
    if any(isinstance(v, torch.fx.Node) and v.meta["val"].dtype != x.meta["val"].dtype for v in (*stats, w, b)):
        return None
    return [x, stats[0], stats[1], w, b]


def _emit(g: torch.fx.Graph, op, *args, **kwargs) -> torch.fx.Node:
    node = g.call_function(op, args, kwargs)
    vals = [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args]
    fake_mode = next(v.fake_mode for v in vals if isinstance(v, torch.Tensor))
    with dispatch_context(fake_mode), fake_mode:
        node.meta["val"] = op(*vals, **kwargs)
    return node


def _build_recipe(g: torch.fx.Graph, out: torch.fx.Node, x, mean, rstd, w, b) -> torch.fx.Node:
    """The normalized output from input and statistics, in the arithmetic order of the CPU kernels."""
    if out.args[0].target is aten.native_layer_norm.default:
        shape = None                                         # mean/rstd already broadcast: [..., 1, 1]
    else:
        shape = [-1] + [1] * (x.meta["val"].dim() - 2)       # batch norm: per channel (dim 1)

    def bc(v):
        return v if shape is None or v is None else _emit(g, aten.view.default, v, shape)
    if shape is None:    # layer norm: addcmul(b, (x - mean) * rstd, w), bit-identical to the CPU kernel
        y = _emit(g, aten.mul.Tensor, _emit(g, aten.sub.Tensor, x, mean), rstd)
        if w is not None and b is not None:
            return _emit(g, aten.addcmul.default, b, y, w)
        y = y if w is None else _emit(g, aten.mul.Tensor, y, w)
        return y if b is None else _emit(g, aten.add.Tensor, y, b)
    # batch norm: x * alpha + beta with alpha = rstd * w, beta = b - mean * alpha, as the CPU kernel computes it
    alpha = bc(rstd) if w is None else _emit(g, aten.mul.Tensor, bc(rstd), bc(w))
    mean_alpha = _emit(g, aten.mul.Tensor, bc(mean), alpha)
    beta = _emit(g, aten.neg.default, mean_alpha) if b is None else _emit(g, aten.sub.Tensor, bc(b), mean_alpha)
    y = _emit(g, aten.addcmul.default, beta, x, alpha)
    return y
    beta = _emit(g, aten.neg.default, _emit(g, aten.mul.Tensor, bc(mean), alpha))     # batch norm: x*alpha + beta
    if b is not None:
        beta = _emit(g, aten.add.Tensor, bc(b), beta)
    y = _emit(g, aten.add.Tensor, _emit(g, aten.mul.Tensor, x, alpha), beta)
    return y


def partition(joint: torch.fx.GraphModule, meta: TraceMeta) -> Partition:
    graph = joint.graph
    out_node = next(n for n in reversed(graph.nodes) if n.op == "output")
    outs = list(out_node.args[0])
    nf = meta.num_graph_outputs + len(meta.mutations)
    fw_outs, grad_outs = outs[:nf], outs[nf:]
    primals = [n for n in graph.nodes if n.op == "placeholder" and n.name.startswith("primal")]
    tangents = [n for n in graph.nodes if n.op == "placeholder" and n.name.startswith("tangent")]

    # log_softmaxes over values alive anyway (the graph's inputs, what it returns): recomputed from their parts
    alive = {o for o in outs[:meta.num_graph_outputs] if isinstance(o, torch.fx.Node)} | set(primals)
    cheap = set()
    log_softmaxes = [n for n in graph.nodes if n.target is aten._log_softmax.default and not n.args[2]
                     and _through_views(n.args[0]) in alive and n.meta["val"].dtype == n.args[0].meta["val"].dtype]
    if log_softmaxes:
        in_forward, needed_by_bw = ancestors(fw_outs), ancestors(grad_outs)
        for n in log_softmaxes:
            if n in in_forward and n in needed_by_bw and n not in outs:   # (returned: alive anyway itself)
                cheap.add(_through_views(n.args[0]))
                _split_log_softmax(graph, n)
    tangent_dep = set(tangents)
    for n in graph.nodes:
        if n.op == "call_function" and any(a in tangent_dep for a in n.all_input_nodes):
            tangent_dep.add(n)
    in_forward = ancestors(fw_outs)
    needed_by_bw = ancestors(grad_outs)
    bw_nodes = needed_by_bw & tangent_dep
    # values the backward needs: save or recompute. Sizes (SymInt nodes) are not in the cut: the backward gets
    # their symbols as int inputs and recomputes the arithmetic over them (below)
    primal_only = {n for n in needed_by_bw - tangent_dep if not is_sym_node(n)}
    recipes = {n: r for n in primal_only if (r := _recipe_inputs(n)) is not None}
    inputs_of = lambda n: [a for a in recipes[n] if isinstance(a, torch.fx.Node)] if n in recipes \
        else n.all_input_nodes  # noqa: E731
    tensor_inputs_of = lambda n: [a for a in inputs_of(n) if not is_sym_node(a)]  # noqa: E731
    primal_only |= {a for n in recipes for a in inputs_of(n)}

    G = nx.DiGraph()
    G.add_node("S")
    G.add_node("T")
    for n in primal_only:
        size = _bytes(n)
        if size is None:
            G.add_edge((n, "in"), (n, "out"))                      # a tuple: not a value one can save
        else:
            G.add_edge((n, "in"), (n, "out"), capacity=1 if n in cheap else size)
        if n.op == "placeholder" or (n in in_forward and (not (recomputable(n) or n in recipes)
                                                          or (not _is_view(n) and _materialized_in_backward(n, bw_nodes)))):
            G.add_edge("S", (n, "in"))
        else:
            for u in tensor_inputs_of(n):
                G.add_edge((u, "out"), (n, "in"))
        if any(user in bw_nodes for user in n.users) or n in grad_outs:
            G.add_edge((n, "out"), "T")
    saved: list[torch.fx.Node] = []
    if nx.has_path(G, "S", "T"):
        _, (reach, _) = nx.minimum_cut(G, "S", "T")
        saved = [n for n in graph.nodes if n in primal_only and (n, "in") in reach and (n, "out") not in reach]

    # saved primals come straight from the Function's inputs, so the forward graph never returns an input
    saved = [n for n in saved if n.op == "placeholder"] + [n for n in saved if n.op != "placeholder"]
    saved_primals = [primals.index(n) for n in saved if n.op == "placeholder"]
    saved_set = set(saved)
    # the symbols the backward's sizes are computed from: int placeholders, sizes read off tensors
    needs = ancestors(grad_outs, stop=lambda n: n in saved_set or is_symbol_source(n), inputs_of=inputs_of)
    symbols = [n for n in graph.nodes if n in needs and is_symbol_source(n)]
    fw = _subgraph(joint, primals, fw_outs + saved[len(saved_primals):] + symbols, "AtenForward")
    bw = _subgraph(joint, saved + symbols + tangents, grad_outs, "AtenBackward", recipes)
    saved_set |= set(symbols)
    in_backward = ancestors(grad_outs, stop=lambda n: n in saved_set, inputs_of=inputs_of)
    recomputed = [n.name for n in graph.nodes
                  if n in in_backward and n in in_forward and n not in saved_set and n.op == "call_function"]
    return Partition(fw, bw, nf, saved_primals, [n.name for n in saved], sum(_bytes(n) or 0 for n in saved),
                     recomputed, [n.name for n in symbols])


def _subgraph(joint: torch.fx.GraphModule, inputs: list, outputs: list, name: str,
              recipes: dict | None = None) -> torch.fx.GraphModule:
    """The nodes of `joint` computing `outputs` from `inputs` (in the joint graph's order); a node with a recipe
    is recomputed by it rather than by its own (fused) op."""
    recipes = recipes or {}
    g = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for n in inputs:
        env[n] = g.placeholder(n.name)
        env[n].meta = dict(n.meta)
    stop = set(inputs)
    needed = ancestors(outputs, stop=lambda n: n in stop, inputs_of=lambda n: [
        a for a in recipes[n] if isinstance(a, torch.fx.Node)] if n in recipes else n.all_input_nodes)

    def get(a: torch.fx.Node) -> torch.fx.Node:
        if a not in env:          # a recipe, emitted at its first use: its statistics come after it in `joint`
            env[a] = _build_recipe(g, a, *[get(r) if isinstance(r, torch.fx.Node) else r for r in recipes[a]])
        return env[a]

    for n in joint.graph.nodes:
        if n in needed and n not in env and n not in recipes:
            if n.op == "placeholder":
                raise AssertionError(f"partition: {n.name} is needed by {name} but not one of its inputs")
            env[n] = g.node_copy(n, get)
    g.output(tuple(get(o) if isinstance(o, torch.fx.Node) else o for o in outputs))
    g.lint()
    return torch.fx.GraphModule(joint, g, class_name=name)
