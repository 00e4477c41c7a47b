"""Functionalization's rules: the out-of-place op computing what an in-place op writes, the scatter that writes a
view back into its base, and the state per storage and per tensor (_Base, _Rec) the recorder keeps so that a view
read after a write into its base is re-derived from the new base. ember.autograd.recorder applies them."""
from __future__ import annotations

import dataclasses
import functools

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ember.autograd.trace_meta import TraceError

aten = torch.ops.aten


@dataclasses.dataclass
class _Base:
    """A storage as the trace sees it: the node holding its current value, bumped on every write."""
    fake: torch.Tensor
    node: torch.fx.Node
    input_index: int | None = None
    version: int = 0
    grad_enabled: bool = True  # the grad mode of its last write (the copy back into the input runs under it)
    grad_written: bool = False  # any write ran with grad on


@dataclasses.dataclass
class _Rec:
    """A tensor object of the traced program: its node is valid while `version == base.version`."""
    node: torch.fx.Node
    base: _Base
    chain: tuple = ()   # view steps from base: (op, args_after_self, kwargs, item, fake_out)
    version: int = 0


_SCATTER = {aten.slice.Tensor: aten.slice_scatter.default, aten.select.int: aten.select_scatter.default,
            aten.diagonal.default: aten.diagonal_scatter.default}
# Explicit functional forms that the naming conventions below do not find.
_FUNCTIONAL = {aten.native_batch_norm.default: aten._native_batch_norm_legit_functional.default}
# Ops whose schema does not declare what they write: native_batch_norm updates running stats when training.
_UNDECLARED_WRITES = {aten.native_batch_norm.default: ("running_mean", "running_var")}


def _arg_sig(schema) -> list[tuple[str, str]]:
    """Argument names and types, ignoring optionality, alias annotations and out= arguments."""
    return [(a.name, str(a.type).replace("?", "")) for a in schema.arguments if not (_is_write(a) and a.kwarg_only)]


def _is_write(a) -> bool:
    return a.alias_info is not None and a.alias_info.is_write


@functools.cache
def functional_variant(op: torch._ops.OpOverload) -> torch._ops.OpOverload:
    """The out-of-place op computing what `op` writes: `add_` -> `add`, `foo` -> `foo_functional`, `foo.out` -> `foo`.

    Its results are the op's non-aliasing results followed by the new values of the mutated arguments.
    """
    if op in _FUNCTIONAL:
        return _FUNCTIONAL[op]
    schema = op._schema
    name = schema.name.split("::")[1]
    want = _arg_sig(schema)
    is_out = any(_is_write(a) and a.kwarg_only for a in schema.arguments)
    candidates = [name.rstrip("_"), name.rstrip("_") + "_functional"] if not is_out else [name]
    for cand in candidates:
        packet = getattr(aten, cand, None)
        if packet is None:
            continue
        for ov in packet.overloads():
            f = getattr(packet, ov)
            if any(_is_write(a) for a in f._schema.arguments):
                continue
            if _arg_sig(f._schema) == want:
                return f
    raise TraceError(f"no functional form known for the in-place op {op}")


_INPLACE_VIEWS = {aten.t_.default: aten.t.default, aten.transpose_.default: aten.transpose.int,
                  aten.unsqueeze_.default: aten.unsqueeze.default, aten.squeeze_.default: aten.squeeze.default,
                  aten.squeeze_.dim: aten.squeeze.dim}


def _bind(schema, args, kwargs) -> dict:
    bound = {}
    for i, a in enumerate(schema.arguments):
        if i < len(args) and not a.kwarg_only:
            bound[a.name] = args[i]
        elif a.name in kwargs:
            bound[a.name] = kwargs[a.name]
        elif a.has_default_value():
            bound[a.name] = a.default_value
    return bound


def _split(schema, bound) -> tuple[list, dict]:
    args = [bound[a.name] for a in schema.arguments if not a.kwarg_only and a.name in bound]
    kwargs = {a.name: bound[a.name] for a in schema.arguments if a.kwarg_only and a.name in bound}
    return args, kwargs


def _same_layout(t: torch.Tensor, base: torch.Tensor) -> bool:
    """Same sizes, strides, offset and dtype; symbolic ones compared without adding a guard (not known equal at
    every admitted size: not the same layout, the general path follows)."""
    return t.dtype == base.dtype and _known_equal((*t.shape, *t.stride(), t.storage_offset()),
                                                  (*base.shape, *base.stride(), base.storage_offset()))


def _known_equal(a, b) -> bool:
    return len(a) == len(b) and all(x == y if type(x) is int and type(y) is int else statically_known_true(x == y)
                                    for x, y in zip(a, b))
