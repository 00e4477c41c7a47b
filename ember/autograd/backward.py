"""`loss.backward()` inside a captured graph.

Where a compiled function calls `loss.backward()` on a value of its graph (a training step), the frontend does
not break the graph there. It records one op, `grads_of(loss, *leaves)`: the gradients of the scalar `loss`
with respect to the leaf tensors it reaches, each laid out as its leaf. Then it does AccumulateGrad's part
itself, in Python's terms: `p.grad = g` where the grad was None, `p.grad += g` in place otherwise
(ember.frontend.interpreter: Frame.tensor_backward).

The op is torch.autograd.grad both when the graph runs uncompiled and when ember.autograd.trace records it on
fake tensors, so there the backward's ATen ops join the graph: a training step with its optimizer becomes one
graph (under mode="reduce-overhead", one CUDA-graph replay) with no autograd engine, no saved tensors handed
between graphs and no gradient copies.
"""
from __future__ import annotations

import torch


def grads_of(loss: torch.Tensor, *leaves: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """d loss / d leaf for each leaf, as `loss.backward()` would store it in `leaf.grad` when that was None:
    in the leaf's layout, and each in memory of its own (AccumulateGrad copies a gradient that is a view,
    strided differently or shared, e.g. the expanded ones of a sum's backward)."""
    grads = torch.autograd.grad(loss, leaves)   # frees loss's graph, as backward() does
    out, seen = [], set()
    for g, p in zip(grads, leaves):
        if g._is_view() or g.stride() != p.stride() or id(g) in seen:
            g = torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device=p.device).copy_(g)
        seen.add(id(g))
        out.append(g)
    return tuple(out)


class _FreedGraph(torch.autograd.Function):
    """Stands for the autograd history of a value the graph's backward went through (the loss, or what it was
    computed from): that history is freed, as after eager's `loss.backward()`, so a second backward raises."""

    @staticmethod
    def forward(ctx, t):
        return t.detach()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError(
            "Trying to backward through the graph a second time (or directly access saved tensors after they "
            "have already been freed). The compiled function ran this tensor's backward() inside its graph; "
            "specify retain_graph=True there if you need to backward through it again (that backward then runs "
            "eagerly).")


def with_freed_history(t: torch.Tensor) -> torch.Tensor:
    """t (computed by a graph without autograd history) as a non-leaf that requires grad, whose backward raises
    as eager's does after the graph it belonged to was freed."""
    with torch.enable_grad():
        return _FreedGraph.apply(t.detach().requires_grad_())
