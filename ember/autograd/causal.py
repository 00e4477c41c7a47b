"""Attention masks that are the causal mask: scaled_dot_product_attention then runs with is_causal=True.

Libraries build a causal mask as a tensor when they are traced (transformers does whenever is_compiling() is True,
so that the mask does not depend on a data-dependent check), and the fused attention kernels then read it as a
bias and compute every block, where is_causal lets them skip the half above the diagonal: twice the attention
work, forward and backward. A mask computed from constants only (aranges and comparisons over static sizes) has
one value for every call of the graph: it is computed once, before the graph is traced (use_is_causal, on the
torch-level graph), and where it equals tril(ones(L, S)) (the lower triangle is_causal means) the call is made
with is_causal=True and no mask.
"""
from __future__ import annotations

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import _disable_current_modes

from ember.tools.logs import get_logger

log = get_logger("autograd")

# ops whose value is not a function of their arguments: a subgraph holding one is not a constant
_RANDOM = ("rand", "bernoulli", "dropout", "normal", "multinomial", "poisson", "exponential", "uniform", "cauchy",
           "geometric", "empty", "manual_seed", "seed")


def constant_value(node: torch.fx.Node) -> torch.Tensor | None:
    """The value of a torch-level node computed from constants alone, evaluated for real (outside the fake and
    recording modes); None if it reads an input, a module attribute, a symbolic size or random state."""
    nodes = {node, *_ancestors(node)}
    for n in nodes:
        if n.op not in ("call_function", "call_method"):
            return None
        name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
        if any(word in name.lower() for word in _RANDOM) or any(
                isinstance(leaf, (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool))
                for leaf in pytree.tree_leaves((n.args, n.kwargs))):
            return None
    graph, env = torch.fx.Graph(), {}
    for n in sorted(nodes, key=_position(node.graph)):
        env[n] = graph.node_copy(n, lambda x: env[x])
    graph.output(env[node])
    try:
        with _disable_current_modes(), torch.no_grad():
            out = torch.fx.GraphModule(torch.nn.Module(), graph)()
    except Exception:   # (whatever raises here raises in the graph's own run too, where it belongs)
        return None
    return out if isinstance(out, torch.Tensor) else None


def _position(graph: torch.fx.Graph):
    index = {n: i for i, n in enumerate(graph.nodes)}
    return index.__getitem__


def is_causal_mask(mask: torch.Tensor, q_len: int, kv_len: int) -> bool:
    """Whether attention with this mask (boolean: True attends; float: added to the scores) is attention with
    is_causal=True: the mask broadcasts to tril(ones(q_len, kv_len)); a float mask's masked entries at or below
    its dtype's lowest value (their softmax weight is exactly 0 in any row that attends somewhere)."""
    if mask.dim() < 2 or mask.dtype not in (torch.bool, torch.float16, torch.bfloat16, torch.float32, torch.float64):
        return False
    if any(m not in (1, n) for m, n in zip(mask.shape[-2:], (q_len, kv_len))):
        return False
    tril = torch.ones(q_len, kv_len, dtype=torch.bool, device=mask.device).tril()
    if mask.dtype == torch.bool:
        return bool((mask == tril).all())
    return bool(torch.where(tril, mask == 0, mask <= torch.finfo(mask.dtype).min).all())


# masks evaluated while compiling at most this big (broadcast included): the check compares every element
MAX_MASK_ELEMENTS = 1 << 28


def use_is_causal(gm: torch.fx.GraphModule) -> int:
    """Rewrite gm's scaled_dot_product_attention calls whose mask is a constant causal mask into is_causal=True
    calls without it, and drop the mask's ops left unused; returns how many calls changed. Run on a torch-level
    graph before it is traced or split (a piece holding the attention would receive the mask as an input)."""
    verdicts: dict = {}
    changed = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch.nn.functional.scaled_dot_product_attention:
            continue
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
        bound = dict(zip(names, node.args), **node.kwargs)
        mask = bound.get("attn_mask")
        q, k = (getattr(bound.get(n), "meta", {}).get("val") for n in ("query", "key"))
        if not isinstance(mask, torch.fx.Node) or bound.get("is_causal") or \
                not all(isinstance(t, torch.Tensor) and t.dim() >= 2 and type(t.shape[-2]) is int for t in (q, k)):
            continue
        key = (mask, q.shape[-2], k.shape[-2])
        shown = mask.meta.get("val")
        if not isinstance(shown, torch.Tensor) or shown.numel() > MAX_MASK_ELEMENTS:
            continue
        if key not in verdicts:
            value = constant_value(mask)
            with _disable_current_modes():
                verdicts[key] = value is not None and is_causal_mask(value, q.shape[-2], k.shape[-2])
        if not verdicts[key]:
            continue
        bound["attn_mask"], bound["is_causal"] = None, True
        node.args, node.kwargs = (bound.pop("query"), bound.pop("key"), bound.pop("value")), bound
        changed += 1
        log.debug("attention mask %s is the causal mask: is_causal=True (%s)", mask.name, node.meta.get("where", "?"))
    if changed:
        mask_ops = set()   # the masks' own ops (constant_value's: pure), erased where nothing reads them now
        for (mask, _q, _k), causal in verdicts.items():
            if causal:
                mask_ops |= {mask, *_ancestors(mask)}
        for n in reversed(list(gm.graph.nodes)):
            if n in mask_ops and not n.users:
                gm.graph.erase_node(n)
        gm.recompile()
    return changed


def _ancestors(node: torch.fx.Node) -> set:
    """The nodes node reads, directly or not."""
    seen, todo = set(), list(node.all_input_nodes)
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo += n.all_input_nodes
    return seen
