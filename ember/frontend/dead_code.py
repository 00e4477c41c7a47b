"""Dead code of a captured graph: calls whose results nobody uses are dropped, unless they have an effect (a
mutation, global state, a random draw, which advances the generator)."""
from __future__ import annotations

import operator

import torch

from ember.autograd.backward import grads_of
from ember.frontend.vmap import EFFECTS as VMAP_EFFECTS


INPLACE_OPERATORS = {operator.setitem, operator.delitem, operator.iadd, operator.isub, operator.imul,
                     operator.itruediv, operator.ifloordiv, operator.imod, operator.ipow, operator.imatmul,
                     operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift}
RANDOM_WORDS = ("rand", "normal", "bernoulli", "dropout", "multinomial", "uniform", "exponential", "cauchy",
                "geometric", "poisson", "log_normal", "random")


def has_effect(node: torch.fx.Node) -> bool:
    """Mutations, global state and random draws (which advance the generator) stay even when unused."""
    t = node.target
    name = t if isinstance(t, str) else getattr(t, "__name__", "")
    if name.endswith("_") and not name.endswith("__") or t in INPLACE_OPERATORS:
        return True
    if t in (torch._C._set_grad_enabled, torch.amp.autocast_mode._enter_autocast,
             torch.amp.autocast_mode._exit_autocast, grads_of, *VMAP_EFFECTS) or "out" in node.kwargs:
        return True
    return any(w in name for w in RANDOM_WORDS)


def eliminate_dead_code(graph: torch.fx.Graph) -> int:
    """Drops them; returns how many (explain and bench/zoo.py count them as captured: torch.compile's graphs keep
    dead ops)."""
    dropped = 0
    for node in reversed(list(graph.nodes)):
        if node.op in ("call_function", "call_method") and not node.users and not has_effect(node):
            graph.erase_node(node)
            dropped += not _item_of_outputs(node)
    return dropped


def _item_of_outputs(node: torch.fx.Node) -> bool:
    # the capture reads every item of a multi-output op: the unread ones are no op of the program
    return node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node) and \
        isinstance(node.args[0].meta.get("val"), (tuple, list))
