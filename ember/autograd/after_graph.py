"""After a compiled graph runs: copy the new values of mutated inputs back into them, rebuild outputs that are views
of inputs, restore the program's output structure and grad mode (TraceMeta says which); run_graph wraps a
compiled trace_forward graph with it."""
from __future__ import annotations

import operator
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

from ember.autograd.symbolic import resolve
from ember.autograd.trace_meta import TraceMeta
from ember.tools.picker import picker


def replay_views(t: torch.Tensor, views: tuple, inputs: list | None = None) -> torch.Tensor:
    """The views (op, args, kwargs, item) of t; symbolic sizes among args (SymArg) computed from `inputs`."""
    for op, args, kwargs, item in views:
        if inputs is not None:
            args, kwargs = resolve((args, kwargs), inputs)
        t = op(t, *args, **kwargs)
        if item is not None:
            t = t[item]
    return t


def _copy_back_plan(dsts: tuple, srcs: tuple, same: tuple) -> tuple:
    """For copy-backs that autograd need not see: which mutated inputs the graph wrote in place (`same`), and
    the others grouped by kind of tensor, one foreach copy each. Made at the first call with this pattern of
    in-place writes (the host program writes in place; its fallback for overlapping inputs does not)."""
    kinds: dict = {}
    for i, (d, s) in enumerate(zip(dsts, srcs)):
        if not same[i]:
            kinds.setdefault(_copy_kind(d, s), []).append(i)
    written = [i for i, x in enumerate(same) if x]
    return (picker(written) if written else None), [picker(idx) for idx in kinds.values()]


def _copy_kind(d: torch.Tensor, s: torch.Tensor) -> tuple:
    """What one foreach copy may group: both sides' device and dtype (get_device: an int, cheaper than
    building torch.device objects for every pair)."""
    return d.get_device(), d.dtype, s.get_device(), s.dtype


def _copy_without_grad(groups) -> None:
    """One torch._foreach_copy_(dsts, srcs) per (dsts, srcs) group, grad mode off (switched directly:
    torch.no_grad() as a context manager costs more than the copy on a CPU)."""
    prev = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)
    try:
        for dsts, srcs in groups:
            torch._foreach_copy_(dsts, srcs)
    finally:
        torch._C._set_grad_enabled(prev)


def finish(meta: TraceMeta, inputs: list, outs: tuple | list) -> Any:
    """Apply input mutations, rebuild aliased outputs and the output structure from the graph's flat outputs."""
    fast = meta.__dict__.get("_copy_back")
    if fast is None:
        # mutations all written under no_grad (an optimizer step), or none autograd need see (batch norms'
        # running statistics in a training graph): where the graph wrote each, and the copies, follow a plan
        # per pattern of in-place writes, each read in C calls (an optimizer step's copy-backs are on its hot path)
        muts = meta.mutations
        fast = meta.__dict__["_copy_back"] = (len(muts) > 1 and (
            meta.copy_back_without_grad or not any(m.grad_enabled for m in muts))) and (
            picker([m.input_index for m in muts]), picker([m.output_index for m in muts]), {})
    if fast:
        dst_of, src_of, plans = fast
        dsts, srcs = dst_of(inputs), src_of(outs)
        same = tuple(map(operator.is_, dsts, srcs))
        plan = plans.get(same)
        if plan is None:
            plan = plans[same] = _copy_back_plan(dsts, srcs, same)
        written, groups = plan
        if written is not None:   # a compiled graph wrote these inputs in place: autograd must see the write
            torch.autograd.graph.increment_version(list(written(dsts)))
        if groups:
            _copy_without_grad((list(group(dsts)), list(group(srcs))) for group in groups)
        return _program_outputs(meta, inputs, outs)
    pairs = [(inputs[m.input_index], outs[m.output_index], m.grad_enabled) for m in meta.mutations]
    written = [d for d, s, _ in pairs if d is s]   # a compiled graph wrote these inputs in place:
    if written:                                     # autograd must see the write, as eager's in-place op's
        torch.autograd.graph.increment_version(written)
    pairs = [(d, s, g) for d, s, g in pairs if d is not s]
    if len(pairs) > 1 and not any(g and (d.requires_grad or s.requires_grad) for d, s, g in pairs):
        # many copies back that autograd need not see (an optimizer's step counters, batch norms' running
        # statistics): one foreach copy, one launch, per kind of tensor
        kinds: dict = {}
        for d, s, _ in pairs:
            kinds.setdefault(_copy_kind(d, s), []).append((d, s))
        _copy_without_grad(([d for d, _ in group], [s for _, s in group]) for group in kinds.values())
    else:
        mode = torch.is_grad_enabled()
        for dst, src, grad_enabled in pairs:
            # under the grad mode of the program's own write: recorded by autograd where eager's was, and a
            # parameter written under no_grad (an optimizer step) stays a leaf. The mode is switched only where
            # it differs (a training graph copies back every batch norm's running statistics on each call).
            if grad_enabled == mode:
                dst.copy_(src)
            else:
                with torch.set_grad_enabled(grad_enabled):
                    dst.copy_(src)
    return _program_outputs(meta, inputs, outs)


def _program_outputs(meta: TraceMeta, inputs: list, outs: tuple | list) -> Any:
    """The program's outputs: graph outputs, views of inputs rebuilt, constants, in the program's structure."""
    flat = []
    for s in meta.outputs:
        if s.kind == "graph":
            flat.append(outs[s.index])
        elif s.kind == "alias":
            flat.append(replay_views(inputs[s.index], s.views, inputs))
        elif s.kind == "sym":
            flat.append(s.value(inputs))
        else:
            flat.append(s.value)
    if meta.grad_mode_after is not None:
        torch.set_grad_enabled(meta.grad_mode_after)   # as the graph's own _set_grad_enabled call left it
    return pytree.tree_unflatten(flat, meta.out_spec)


def run_graph(compiled: Callable, meta: TraceMeta, gm: torch.nn.Module | None = None) -> Callable:
    """Wrap a compiled trace_forward graph into a callable with the program's calling convention."""
    lifted = _lifted_getter(gm, meta.lifted)

    def run(*args):
        inputs = list(args) + lifted()
        return finish(meta, inputs, compiled(*inputs))

    return run


def _lifted_getter(gm: torch.nn.Module | None, names: list[str]) -> Callable[[], list]:
    """Reads the module's current parameter/buffer tensors at call time (they may be replaced, e.g. by .to())."""
    if not names:
        return lambda: []
    slots = []
    for n in names:
        owner, _, attr = n.rpartition(".")
        slots.append((gm.get_submodule(owner), attr))
    return lambda: [getattr(m, a) for m, a in slots]
