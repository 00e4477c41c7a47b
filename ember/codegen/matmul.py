"""CUDA linear layers that read one input (BERT's query, key and value projections) as one library product of
the input and their weights concatenated (plan_sibling_products)."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from ember.ir import TensorBox

if TYPE_CHECKING:
    from ember.codegen.lower import Graph

aten = torch.ops.aten


@dataclasses.dataclass(eq=False)
class SiblingProducts:
    """Linear layers reading one input (BERT's query, key and value projections) on CUDA: one library product of
    the input and their weights concatenated, each layer's result a slice of it plus its bias (lazy, as
    decomp.table's addmm). A wider product fills the H100's SMs better: three 1024x768x768 float32 products
    took 122 us, one 1024x768x2304 108 us, 112 with the weights concatenated on each call (bench/gpu_sibling_mm.py)."""
    members: list   # the addmm nodes, in graph order
    parts: dict | None = None   # node -> its result, made when the first member is lowered ({}: lowered one by one)


def plan_sibling_products(gm: torch.fx.GraphModule) -> dict:
    """{addmm node: SiblingProducts} for a CUDA float32 inference graph's linear layers (addmm of a 1-D bias, a
    2-D input and a 2-D weight) that read the same input, where decomp.table's addmm would take the library
    product and add the bias lazily (not a result the graph returns, nor one a library call reads a part of)."""
    if not (isinstance(getattr(gm, "meta", None), dict) and gm.meta.get("ember_inference")):
        return {}
    from ember.decomp.table import _library_reads_part, _returned
    by_input: dict = {}
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is not aten.addmm.default or n.kwargs or len(n.args) != 3 \
                or not all(isinstance(a, torch.fx.Node) for a in n.args):
            continue
        v, (bv, av, wv) = n.meta.get("val"), [a.meta.get("val") for a in n.args]
        if not all(isinstance(t, torch.Tensor) for t in (v, bv, av, wv)) \
                or {t.dtype for t in (v, bv, av, wv)} != {torch.float32} or av.ndim != 2 or wv.ndim != 2 \
                or tuple(bv.shape) != (v.shape[1],) or _returned(n) or _library_reads_part(n):
            continue
        by_input.setdefault(_value_key(n.args[1]), []).append(n)
    plans = {}
    for ms in by_input.values():
        if len(ms) > 1:
            group = SiblingProducts(ms)
            plans.update((m, group) for m in ms)
    return plans


def _value_key(n: torch.fx.Node):
    """n, or for a view of a value (each linear layer flattens the same input with a view of its own) the view's
    shape and its source's key: views alike give equal keys."""
    if n.op == "call_function" and n.target in (aten.view.default, aten._unsafe_view.default, aten.reshape.default) \
            and isinstance(n.args[0], torch.fx.Node):
        return ("view", _value_key(n.args[0]), tuple(n.args[1]))
    return n


def lower_sibling_product(g: "Graph", s: SiblingProducts, node: torch.fx.Node, env: dict) -> "TensorBox | None":
    """node's result as a slice of its group's product (made at the group's first member), or None where the
    group cannot be made there (a weight or bias computed later in the graph): then each is lowered alone."""
    from ember.decomp import prims as P
    if s.parts is None:
        s.parts = {}
        # weights kept as [N, K] and read through t() (a linear layer's) are concatenated in that layout (a plain
        # copy), the product reading the result transposed, as it read each weight
        stored = [m.args[2].args[0] if m.args[2].op == "call_function" and m.args[2].target is aten.t.default
                  else None for m in s.members]
        transposed = all(w is not None for w in stored)
        weights = stored if transposed else [m.args[2] for m in s.members]
        if all(env.get(a) is not None for a in [*weights, *(m.args[0] for m in s.members)]):
            if transposed:
                weights = P.permute(P.realize(P.cat([env[w] for w in weights], 0, torch.float32)), [1, 0])
            else:
                weights = P.cat([env[w] for w in weights], 1, torch.float32)
            x = env[s.members[0].args[1]]
            width = int(weights.size[1])
            with g.lowering_as(torch.empty((int(x.size[0]), width), dtype=torch.float32, device="meta")):
                prod = g.extern(aten.mm.default, (x, weights), {}, fallback=False)
            start = 0
            for m in s.members:
                n_cols = int(m.meta["val"].shape[1])
                s.parts[m] = P.add(P.slice_(prod, 1, start, start + n_cols), env[m.args[0]], dtype=torch.float32)
                start += n_cols
    return s.parts.get(node)
