"""`torch.vmap(fn, in_dims, out_dims, randomness)(*args)` in a captured program, inlined as torch.compile inlines it.

The graph does what vmap does in eager: it enters a vmap level (`vmap_enter`), wraps each mapped input as a batched
tensor of that level (`add_batch_dim`), runs fn's ops on them (fn is interpreted like any Python: its ops are
graph ops whose fakes are batched tensors, so their metadata comes from torch's own batching rules), takes the
batch dimension out of each output (`remove_batch_dim`) and leaves the level (`vmap_exit`). These are torch's vmap
primitives (the ones torch.vmap's Python runs); each reads the current level when it runs, so a graph called
inside an outer transform nests as eager does. Downstream, the ATen tracer runs them on its fakes and records the
batching rules' ATen ops, so the compiled graph has no batched tensors. A break inside fn is a break at the vmap
call: the whole call runs as Python (torch's vmap), never split at a level's middle. Unsupported too: chunk_size,
and arguments or in/out dims vmap would reject (Python raises eager's error there).
"""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree

from ember.errors import Unsupported
from ember.frontend.python_objects import is_namedtuple_cls
from ember.frontend.values import ConstV, DictV, ListV, ObjV, PartialV, TensorV, TupleV, V

if TYPE_CHECKING:
    from ember.frontend.interpreter import Frame

_functorch = torch._C._functorch


# -- the graph's vmap ops ---------------------------------------------------------------------------------------
def vmap_decompositions() -> None:
    """vmap's Python batching rules (registered by torch.vmap's first call; a saved graph may run before any)."""
    _load_decompositions()


@functools.lru_cache(maxsize=None)
def _load_decompositions() -> None:
    torch.vmap(torch.neg)(torch.zeros(1))   # torch.vmap registers them once per process before it maps


def vmap_enter(batch_size: int, randomness: str) -> int:
    return _functorch._vmap_increment_nesting(batch_size, randomness)


def add_batch_dim(x: torch.Tensor, dim: int) -> torch.Tensor:
    return _functorch._add_batch_dim(x, dim, _functorch.maybe_current_level())


def remove_batch_dim(y: torch.Tensor, batch_size: int, out_dim: int) -> torch.Tensor:
    return _functorch._remove_batch_dim(y, _functorch.maybe_current_level(), batch_size, out_dim)


def vmap_exit() -> int:
    return _functorch._vmap_decrement_nesting()


EFFECTS = (vmap_decompositions, vmap_enter, vmap_exit)   # global state: kept though nothing reads their results


def vmapped(func, in_dims, out_dims, randomness, chunk_size, *args, **kwargs):
    """What `torch.vmap(func, ...)` made in a capture is at a break: torch's vmap of func, called."""
    return torch.vmap(func, in_dims, out_dims, randomness, chunk_size=chunk_size)(*args, **kwargs)


@functools.lru_cache(maxsize=None)
def _torch_wrapper_code():
    return torch.vmap(torch.neg).__code__   # the function torch.vmap returns (its closure: func, in_dims, ...)


# -- capture -------------------------------------------------------------------------------------------------
def make_vmapped(frame: Frame, args: list[V], kwargs: dict[str, V]) -> V:
    """`torch.vmap(func, in_dims=0, out_dims=0, randomness="error", *, chunk_size=None)`: the mapped function."""
    names = ("func", "in_dims", "out_dims", "randomness")
    defaults = {"in_dims": ConstV(0), "out_dims": ConstV(0), "randomness": ConstV("error"), "chunk_size": ConstV(None)}
    bound = {**defaults, **dict(zip(names, args)), **kwargs}
    if len(args) > 4 or set(bound) - {*names, "chunk_size"} or "func" not in bound:
        raise Unsupported("torch.vmap with arguments it does not take", frame.where())
    return PartialV(ObjV(vmapped), [bound[k] for k in (*names, "chunk_size")], {})


def torch_vmapped_parts(f) -> dict[str, Any] | None:
    """A function torch.vmap returned (made before the capture): its func, in_dims, out_dims, randomness and
    chunk_size, or None."""
    code = getattr(f, "__code__", None)
    if code is None or code is not _torch_wrapper_code() or not set(_PARTS) <= set(code.co_freevars):
        return None
    return {name: cell.cell_contents for name, cell in zip(code.co_freevars, f.__closure__)}


_PARTS = ("func", "in_dims", "out_dims", "randomness", "chunk_size")


def call_torch_vmapped(frame: Frame, fn_v: V, f, args: list[V], kwargs: dict[str, V]) -> V:
    parts = torch_vmapped_parts(f)
    src = fn_v.source
    index = {name: i for i, name in enumerate(f.__code__.co_freevars)}
    vals = [frame.cap.wrap(parts[k], f"{src}.__closure__[{index[k]}].cell_contents" if src else None)
            for k in _PARTS]
    return call_vmapped(frame, vals + list(args), kwargs)


def call_vmapped(frame: Frame, args: list[V], kwargs: dict[str, V]) -> V:
    """`vmapped(func, in_dims, out_dims, randomness, chunk_size, *args, **kwargs)` inlined (the module docstring)."""
    func, in_dims_v, out_dims_v, randomness_v, chunk_v, *args = args
    in_dims, out_dims = _plain(frame, in_dims_v), _plain(frame, out_dims_v)
    randomness, chunk_size = _plain(frame, randomness_v), _plain(frame, chunk_v)
    if chunk_size is not None or randomness not in ("error", "different", "same"):
        raise Unsupported(f"torch.vmap with chunk_size={chunk_size!r}, randomness={randomness!r}", frame.where())
    if not isinstance(in_dims, (int, tuple)) or not args:
        raise Unsupported("torch.vmap's in_dims or arguments as vmap rejects them", frame.where())
    flat_args, args_spec = pytree.tree_flatten(tuple(_tree_of(a) for a in args))
    flat_in_dims = pytree._broadcast_to_and_flatten(in_dims, args_spec)
    if flat_in_dims is None or not _mappable(flat_args, flat_in_dims):
        raise Unsupported("torch.vmap's in_dims do not match its arguments as vmap needs", frame.where())
    flat_in_dims = [d if d is None else d % a.fake.dim() for d, a in zip(flat_in_dims, flat_args)]
    sizes = {a.fake.size(d) for d, a in zip(flat_in_dims, flat_args) if d is not None}
    if len(sizes) != 1:
        raise Unsupported("torch.vmap over inputs of different sizes (or none)", frame.where())
    batch_size = frame.const_value(ConstV(sizes.pop()))   # (a symbolic size specialized, guarded)
    cap = frame.cap
    _effect(frame, vmap_decompositions)
    level = _effect(frame, vmap_enter, batch_size, randomness)
    try:
        batched = [a if d is None else cap.record("call_function", add_batch_dim, (a, ConstV(d)), {}, frame.where())
                   for d, a in zip(flat_in_dims, flat_args)]
        out = frame.call(func, [_from_tree(x) for x in pytree.tree_unflatten(batched, args_spec)], kwargs)
        flat_out, out_spec = pytree.tree_flatten(_tree_of(out))
        flat_out_dims = pytree._broadcast_to_and_flatten(out_dims, out_spec)
        if flat_out_dims is None:
            raise Unsupported("torch.vmap's out_dims do not match its function's outputs", frame.where())
        unbatched = [_unbatch(frame, o, d, batch_size, level) for o, d in zip(flat_out, flat_out_dims)]
    finally:
        _effect(frame, vmap_exit)
    return _from_tree(pytree.tree_unflatten(unbatched, out_spec))


def _effect(frame: Frame, target, *args):
    """A vmap op run now (its effect on torch's vmap levels is what the capture's fakes need) and recorded."""
    out = target(*args)
    node = frame.cap.graph.create_node("call_function", target, tuple(args), {})
    node.meta["where"] = frame.where()
    node.meta["val"] = out
    return out


def _unbatch(frame: Frame, o, out_dim, batch_size: int, level: int) -> V:
    batched = isinstance(o, TensorV) and _functorch.is_batchedtensor(o.fake) and \
        _functorch.maybe_get_level(o.fake) == level
    if out_dim is None:
        if batched:
            raise Unsupported("torch.vmap's function returned a batched tensor where out_dims is None", frame.where())
        return o
    if not isinstance(o, TensorV):
        raise Unsupported("torch.vmap's function returned a non-tensor where out_dims maps it", frame.where())
    return frame.cap.record("call_function", remove_batch_dim, (o, ConstV(batch_size), ConstV(out_dim)), {},
                            frame.where())


def _mappable(flat_args: list, flat_in_dims: list) -> bool:
    return all(d is None or isinstance(d, int) and isinstance(a, TensorV) and -a.fake.dim() <= d < a.fake.dim()
               for a, d in zip(flat_args, flat_in_dims))


def _plain(frame: Frame, v: V):
    """A constant argument of vmap (in_dims, out_dims: nested tuples of ints and None) as its Python value."""
    if isinstance(v, ConstV):
        return frame.const_value(v)
    if isinstance(v, (TupleV, ListV)):
        items = [_plain(frame, x) for x in v.items]
        return items if isinstance(v, ListV) else tuple(items)
    if isinstance(v, DictV):
        return {k: _plain(frame, x) for k, x in v.items.items()}
    raise Unsupported(f"torch.vmap with a {frame.type_name(v)} for a constant argument", frame.where())


def _tree_of(v: V):
    """A V's containers as Python containers (a pytree), other Vs as its leaves."""
    if isinstance(v, TupleV) and v.cls is tuple:
        return tuple(_tree_of(x) for x in v.items)
    if isinstance(v, TupleV) and is_namedtuple_cls(v.cls):   # (a pytree node to torch, as tuples)
        return v.cls(*[_tree_of(x) for x in v.items])
    if isinstance(v, ListV):
        return [_tree_of(x) for x in v.items]
    if isinstance(v, DictV) and v.cls is dict:
        return {k: _tree_of(x) for k, x in v.items.items()}
    return v


def _from_tree(x) -> V:
    if isinstance(x, tuple):
        return TupleV([_from_tree(y) for y in x], None, type(x))
    if isinstance(x, list):
        return ListV([_from_tree(y) for y in x])
    if isinstance(x, dict):
        return DictV({k: _from_tree(y) for k, y in x.items()})
    return x
