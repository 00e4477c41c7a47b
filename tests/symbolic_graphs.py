"""Torch-level symbolic graphs as docs/dynamic.md says the frontend makes them, built without the frontend:
`torch.fx.symbolic_trace` of a function, then each placeholder's meta["val"] set from one ShapeEnv and its
FakeTensorMode (an int argument: a SymInt; a tensor: a fake tensor whose chosen dims are symbolic).

Sizes with the same example value share a symbol (the ShapeEnv's duck sizing), so an int argument equal to a
tensor's dynamic dim is that dim's symbol, as the frontend's `s0` placeholder is; give different dims different
example values to keep their symbols apart."""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.fx
from torch._guards import Source
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext


class _Name(str):
    """A source's name: a str that is also callable (torch 2.14 reads `source.name`, 2.11 calls it)."""

    def __call__(self) -> str:
        return str(self)


@dataclasses.dataclass(frozen=True)
class ArgSource(Source):
    """The graph argument a size comes from (guards name it; making symbols reads only its name)."""
    arg: str

    @property
    def name(self):
        return _Name(f"L[{self.arg!r}]")

    @property
    def _name_template(self) -> str:
        return f"L[{self.arg!r}]"


def symbolic_graph(fn: Callable | torch.nn.Module, example_inputs: list,
                   dynamic: dict[str, tuple[int, ...]] | None = None) -> torch.fx.GraphModule:
    """symbolic_trace(fn) with placeholder meta["val"]s: ints become SymInts; a tensor placeholder's dims listed in
    `dynamic[name]` (or `dynamic[position]`) are symbolic (every dim of every tensor when dynamic is None), its
    others static."""
    gm = torch.fx.symbolic_trace(fn)
    shape_env = ShapeEnv()
    fake_mode = FakeTensorMode(shape_env=shape_env)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert len(placeholders) == len(example_inputs)
    for i, (n, x) in enumerate(zip(placeholders, example_inputs)):
        if isinstance(x, torch.Tensor):
            dims = range(x.dim()) if dynamic is None else dynamic.get(n.name, dynamic.get(i, ()))
            ctx = StatelessSymbolicContext(dynamic_sizes=[
                DimDynamic.DUCK if d in dims else DimDynamic.STATIC for d in range(x.dim())])
            n.meta["val"] = fake_mode.from_tensor(x, symbolic_context=ctx, source=ArgSource(n.name))
    for n, x in zip(placeholders, example_inputs):
        if type(x) is int:
            src = ArgSource(n.name)
            sym = shape_env.create_symbol(x, src, dynamic_dim=DimDynamic.DUCK)
            n.meta["val"] = shape_env.create_symintnode(sym, hint=x, source=src)
    return gm
