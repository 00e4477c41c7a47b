"""Graphs captured inside DistributedDataParallel's forward, split at its gradient buckets so that the all-reduce of
each bucket overlaps the backward of the rest (docs/distributed.md).

A captured graph runs its backward as one autograd node: every parameter's gradient is ready only when the whole
backward is done, so DDP's reducer (hooked on the parameters' gradient accumulation) would start its first
all-reduce after the last gradient kernel. Split into pieces, each its own compiled autograd node, the last piece's
backward finishes first: its parameters' gradients are accumulated, DDP's hooks fire and the bucket's all-reduce
runs while the earlier pieces' backward computes. Pieces hold about one bucket of parameters each, counted from the
graph's end as DDP fills its buckets in the order gradients become ready (the first, DDP's small first bucket).

The split is a wrapper around any backend, active while DDP runs the module it wraps
(`DistributedDataParallel._get_active_ddp_module()`, DDP's own hook for compilers); anywhere else the backend gets
the graph whole.
"""
from __future__ import annotations

import functools
import inspect

import operator
from typing import Callable

import torch
from torch.fx.passes.split_module import split_module

from ember.autograd.causal import use_is_causal
from ember.tools.logs import get_logger

log = get_logger("distributed")

DEFAULT_FIRST_BUCKET_BYTES = 1024 * 1024   # DDP's first bucket under its default sizes (dist._DEFAULT_FIRST_BUCKET_BYTES)


def active_ddp():
    """The DistributedDataParallel whose forward is running its module, or None."""
    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:
        return None
    return DistributedDataParallel._get_active_ddp_module()


def bucket_caps(ddp) -> tuple[int, int]:
    """DDP's (first bucket, other buckets) size limits in bytes, as its reducer rebuilds its buckets."""
    cap = int(ddp.bucket_bytes_cap)
    config = getattr(ddp, "_bucket_config", None)
    if config is not None:
        return min(int(config.first_bucket_bytes_cap), cap), cap
    first = getattr(torch.distributed, "_DEFAULT_FIRST_BUCKET_BYTES", DEFAULT_FIRST_BUCKET_BYTES)
    return (min(first, cap) if getattr(ddp, "bucket_bytes_cap_default", False) else cap), cap


def split_at_ddp_buckets(backend: Callable) -> Callable:
    """The backend, given each graph captured under DDP's forward as pieces of about one gradient bucket each."""
    def backend_at_ddp_buckets(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        ddp = active_ddp()
        if ddp is None or not torch.is_grad_enabled():
            return backend(gm, example_inputs)
        if getattr(inspect.unwrap(backend), "traces_aten", False):
            use_is_causal(gm)   # (before the split: the attention's piece would receive the mask as an input)
        params = {id(p) for p in ddp.parameters() if p.requires_grad}
        pieces = piece_of_nodes(gm, example_inputs, params, *bucket_caps(ddp))
        if pieces is None:
            return backend(gm, example_inputs)
        return compile_pieces(gm, example_inputs, pieces, backend)
    # the backend's name, module and marks (fail_safe: ember's own), and __wrapped__ to find it by
    functools.update_wrapper(backend_at_ddp_buckets, backend)
    if not hasattr(backend, "__name__"):
        backend_at_ddp_buckets.__name__ = type(backend).__name__
    return backend_at_ddp_buckets


def _inplace(node: torch.fx.Node) -> bool:
    """Whether a torch-level call writes its first argument (`add_`, `__iadd__`, `setitem`, `inplace=True`, `out=`)."""
    t = node.target
    name = t if isinstance(t, str) else getattr(t, "__name__", "")
    return name.endswith("_") and not name.endswith("__") or name.startswith("__i") and name.endswith("__") or \
        name == "setitem" or node.kwargs.get("inplace") is True or "out" in node.kwargs


def _storage(node) -> int | None:
    v = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return v.untyped_storage()._cdata if isinstance(v, torch.Tensor) else None


def cut_points(body: list[torch.fx.Node], grad_mode: bool) -> list[bool]:
    """cut[i]: whether the graph may be split between body[i] and body[i + 1]. Only where the grad mode is the
    entry's and no autocast block is open (each piece is traced on its own), every value crossing is a tensor, and
    none crossing is written in place later (a piece must not write an earlier piece's output)."""
    position = {n: i for i, n in enumerate(body)}
    cut = [True] * len(body)
    mode, autocast = grad_mode, 0
    for i, n in enumerate(body):
        if n.target is torch._C._set_grad_enabled:
            mode = n.args[0]
        elif n.target is torch.amp.autocast_mode._enter_autocast:
            autocast += 1
        elif n.target is torch.amp.autocast_mode._exit_autocast:
            autocast -= 1
        cut[i] = mode == grad_mode and autocast == 0
    last_use = {n: max((position[u] for u in n.users if u in position), default=i) for i, n in enumerate(body)}
    written_after: dict[int, int] = {}   # storage -> the last position that writes it in place
    for i, n in enumerate(body):
        if _inplace(n) and n.args and (s := _storage(n.args[0])) is not None:
            written_after[s] = i
    for i, n in enumerate(body):
        if n.op == "get_attr":   # (a constant: split_module reads it once and passes it to each piece using it)
            continue
        crosses_bad = not isinstance(n.meta.get("val"), torch.Tensor)
        written = written_after.get(_storage(n), -1)
        end = max(last_use[n] if crosses_bad else -1, written)
        for j in range(i, min(end, len(body))):
            cut[j] = False
    cut[-1] = False
    return cut


def piece_of_nodes(gm: torch.fx.GraphModule, example_inputs: list, params: set[int], first_cap: int,
                   cap: int) -> dict[torch.fx.Node, int] | None:
    """Each node's piece, numbered in forward order, or None where the graph stays whole (one bucket or less).
    Walking back from the graph's end, a piece closes once the parameters its nodes read reach the bucket size."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs) or not all(isinstance(t, torch.Tensor) for t in example_inputs):
        return None   # (a symbolic graph's sizes come as int inputs: kept whole)
    param_bytes = {n: t.numel() * t.element_size() for n, t in zip(placeholders, example_inputs)
                   if isinstance(t, torch.Tensor) and id(t) in params}
    if sum(param_bytes.values()) <= first_cap:
        return None
    body = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    if len(body) < 2:
        return None
    cut = cut_points(body, torch.is_grad_enabled())
    starts, counted, filled = [], set(), 0
    for i in range(len(body) - 1, 0, -1):
        for a in body[i].all_input_nodes:
            if a in param_bytes and a not in counted:
                counted.add(a)
                filled += param_bytes[a]
        if filled >= (first_cap if not starts else cap) and cut[i - 1]:
            starts.append(i)
            filled = 0
    if not starts:
        return None
    starts = sorted(starts)
    piece, k = {}, 0
    for i, n in enumerate(body):
        while k < len(starts) and i >= starts[k]:
            k += 1
        piece[n] = k
    return piece


class _Piece(torch.nn.Module):
    """A compiled piece in the split graph's place (the split graph calls its submodules)."""

    def __init__(self, compiled: Callable):
        super().__init__()
        self.compiled = compiled

    def forward(self, *args):
        return self.compiled(*args)


_TUPLE_RETURN = "tuple_return" in inspect.signature(split_module).parameters


def _pieces_return_tuples(split: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Every piece returns a tuple, as a backend takes a graph (torch before 2.12's split_module returns a piece's
    one value bare, and has no tuple_return): its one value in a tuple, read back with a getitem."""
    for node in list(split.graph.nodes):
        if node.op != "call_module":
            continue
        sub = getattr(split, node.target)
        out = next(n for n in sub.graph.nodes if n.op == "output")
        if isinstance(out.args[0], (tuple, list)):
            continue
        out.args = ((out.args[0],),)
        sub.recompile()
        with split.graph.inserting_after(node):
            item = split.graph.call_function(operator.getitem, (node, 0))
        node.replace_all_uses_with(item, delete_user_cb=lambda user: user is not item)
    split.recompile()
    return split


def compile_pieces(gm: torch.fx.GraphModule, example_inputs: list, pieces: dict, backend: Callable) -> Callable:
    """gm split into its pieces (torch.fx's split_module), each compiled by the backend on example inputs made from
    the capture's metadata (a piece's inputs from another piece: empty tensors of their size, stride, dtype and
    requires_grad; the backend reads no values)."""
    if _TUPLE_RETURN:
        split = split_module(gm, None, lambda n: pieces[n], keep_original_order=True, tuple_return=True)
    else:
        split = _pieces_return_tuples(split_module(gm, None, lambda n: pieces[n], keep_original_order=True))
    real = {n.name: t for n, t in zip((n for n in gm.graph.nodes if n.op == "placeholder"), example_inputs)}
    real.update({n.name: operator.attrgetter(n.target)(gm) for n in gm.graph.nodes if n.op == "get_attr"})
    names = []
    for node in split.graph.nodes:
        if node.op != "call_module":
            continue
        sub = getattr(split, node.target)
        sub.meta.update({k: v for k, v in gm.meta.items() if k.startswith("ember_")})
        ex = [real[p.name] if p.name in real else _empty_like(p.meta["val"])
              for p in sub.graph.nodes if p.op == "placeholder"]
        setattr(split, node.target, _Piece(backend(sub, ex)))
        names.append(node.target)
    log.info("graph captured at %s: %d pieces at DDP's gradient buckets", gm.meta.get("ember_where", "?"),
             len(names))
    split.meta.update(gm.meta)
    return split.forward


def _empty_like(v: torch.Tensor) -> torch.Tensor:
    t = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
    return t.requires_grad_(v.requires_grad)
