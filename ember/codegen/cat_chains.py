"""How concatenations are lowered: chains of channel concatenations of a channels-last graph (densenet's dense
blocks) written into one shared buffer, each piece copied in once (plan_cat_chains), and the library's
concatenation for channels of channels-last values (lower_cat)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ember import config
from ember import ir
from ember.ir import symbols
from ember.decomp import views

if TYPE_CHECKING:
    from ember.codegen.lower import Graph

aten = torch.ops.aten


def plan_cat_chains(gm: torch.fx.GraphModule) -> dict:
    """{cat node: (the cat it extends or None, channels of the chain's widest cat)} for chains of channel
    concatenations of a channels-last graph where each one's pieces begin with the previous one's (densenet's
    dense blocks: cat([x0]), cat([x0, f1]), cat([x0, f1, f2]), ...). A chain shares one buffer as wide as its
    widest cat, and each cat is a window of its first channels onto it: a piece is copied in once, where
    separate concatenations copied every earlier piece again (quadratic in the block's depth)."""
    cats = []
    for n in gm.graph.nodes if config.SHARE_CAT_BUFFERS else ():
        if n.op != "call_function" or n.target is not aten.cat.default or n.kwargs or len(n.args) != 2 \
                or n.args[1] not in (1, -3) or not isinstance(n.meta.get("val"), torch.Tensor):
            continue
        v, pieces = n.meta["val"], n.args[0]
        if v.ndim != 4 or v.device.type != "cpu" or not v.dtype.is_floating_point or not all(
                isinstance(p, torch.fx.Node) and isinstance(p.meta.get("val"), torch.Tensor) and p.meta["val"].ndim == 4
                and p.meta["val"].dtype == v.dtype for p in pieces):
            continue
        cats.append(n)
    links, extended = {}, set()
    for i, n in enumerate(cats):
        for prev in reversed(cats[:i]):  # the latest cat whose pieces begin this one's
            pp = prev.args[0]
            if prev not in extended and len(pp) < len(n.args[0]) and list(n.args[0][:len(pp)]) == list(pp) \
                    and prev.meta["val"].shape[0::2] == n.meta["val"].shape[0::2]:
                links[n] = prev
                extended.add(prev)
                break
    chains = {}
    for n in cats:
        if n in links or n not in extended:
            continue
        chain = [n]
        while chain[-1] in extended:
            chain.append(next(m for m, p in links.items() if p is chain[-1]))
        width = int(chain[-1].meta["val"].shape[1])
        for k, m in enumerate(chain):
            chains[m] = (chain[k - 1] if k else None, width)
    return chains


def cat_chain_first(pieces: list, width: int) -> torch.Tensor:
    """The first cat of a chain: a channels-last buffer `width` channels wide, the pieces copied into its first
    channels; returns the window onto those."""
    n, _, h, w = pieces[0].shape
    out = torch.empty((n, width, h, w), dtype=pieces[0].dtype, memory_format=torch.channels_last)
    return cat_chain_extend(out[:, :0], pieces)


def cat_chain_extend(prev: torch.Tensor, pieces: list) -> torch.Tensor:
    """The next cat of a chain: the window onto the shared buffer widened past prev's channels by the pieces,
    copied in (prev's channels, which its readers see, stay as they are)."""
    c = prev.shape[1]
    size = (prev.shape[0], c + sum(p.shape[1] for p in pieces), prev.shape[2], prev.shape[3])
    out = prev.as_strided(size, prev.stride(), prev.storage_offset())
    for p in pieces:
        out[:, c:c + p.shape[1]].copy_(p)
        c += p.shape[1]
    return out


def lower_cat_chain(g: "Graph", pieces: list):
    """A cat of a chain (plan_cat_chains) as a call of cat_chain_first / cat_chain_extend; None where the
    pieces are not the node's (a decomposition dropped empty ones)."""
    prev, width = g.cat_chains[g.node]
    if len(pieces) != len(g.node.args[0]) or (prev is not None and prev not in g.cat_views):
        return None
    n, c, h, w = (int(s) for s in g.val.shape)
    stride = (h * w * width, 1, w * width, width)
    if prev is None:
        out = g.extern(cat_chain_first, (pieces, width), {}, fallback=False, out_stride=stride)
    else:
        out = g.extern(cat_chain_extend, (g.cat_views[prev], pieces[len(prev.args[0]):]), {}, fallback=False,
                       out_stride=stride)
    g.cat_views[g.node] = out
    return out


def lower_cat(xs, dim=0):
    """aten.cat: a concatenation of a chain as one (lower_cat_chain); the channels of channels-last values as
    the library's concatenation; else the decomposition's (a fused concatenation)."""
    xs = [x for x in xs if not (x.ndim == 1 and symbols.same(x.size[0], 0))]
    if not xs:
        return NotImplemented
    g = ir.GRAPH
    if g.node in g.cat_chains:  # a concatenation extending the previous one (densenet's dense blocks)
        out = lower_cat_chain(g, xs)
        if out is not None:
            return out
    if g.channels_last and len(xs) > 2 and xs[0].ndim == 4 and dim % 4 == 1 and \
            any(g.reads_layout_changed(x) for x in xs):
        # channels of channels-last values: C is the inner loop, so a fused concatenation would pick its piece
        # per element (densenet121's concatenations of up to 25 pieces read every piece for each element);
        # the library's concatenation copies each piece's rows
        return g.extern(aten.cat.default, (xs, 1), {}, fallback=False, channels_last=True)
    return views.cat(xs, dim)
