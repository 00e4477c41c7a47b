"""Symbolic ATen graphs for the codegen tests (what ember.autograd hands a device compiler under dynamic shapes,
docs/dynamic.md), built without ember's tracer: torch.fx.symbolic_trace of a function over ints and tensors that
calls torch.ops.aten ops, then every node's meta["val"] from a run on symbolic fakes of one ShapeEnv.

    gm, example = symbolic_graph(fn, [s, x], dynamic={1: [0]})

Int arguments become SymInt placeholders (symbols s0, s1, ...); `dynamic` names the tensor dims that are symbolic
(each is the symbol of an int argument of the same value, ShapeEnv's duck sizing: give independent sizes distinct
values). Sizes computed in fn from the ints (s * 4, s // 2) are operator.* nodes, as in ember.autograd's graphs.
"""
from __future__ import annotations

import dataclasses
import inspect

import torch
from torch._guards import GuardSource, Source
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext


@dataclasses.dataclass(frozen=True)
class ArgSource(Source):
    index: int
    dim: int = -1

    @property
    def _name_template(self) -> str:
        return f"args[{self.index}]" + (f".size()[{self.dim}]" if self.dim >= 0 else "")

    @property
    def guard_source(self):
        return GuardSource.LOCAL


class _Record(torch.fx.Interpreter):
    def run_node(self, n):
        out = super().run_node(n)
        n.meta["val"] = out
        return out


def symbolic_graph(fn, args: list, dynamic: dict) -> tuple[torch.fx.GraphModule, ShapeEnv]:
    """(gm, shape_env): fn traced over `args` (ints become SymInt placeholders; `dynamic` {arg index: [dims]}
    the symbolic dims of tensor arguments), every node's meta["val"] set."""
    names = list(inspect.signature(fn).parameters)
    gm = torch.fx.symbolic_trace(fn, concrete_args=None)
    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env, allow_non_fake_inputs=False)
    fakes = []
    for i, a in enumerate(args):
        if isinstance(a, int):
            sym = env.create_symbol(a, ArgSource(i), dynamic_dim=DimDynamic.DUCK)
            fakes.append(env.create_symintnode(sym, hint=a, source=ArgSource(i)))
        else:
            dims = dynamic.get(i, [])
            ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DUCK if d in dims else DimDynamic.STATIC
                                                          for d in range(a.dim())])
            fakes.append(mode.from_tensor(a, source=ArgSource(i), symbolic_context=ctx))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert [p.name for p in placeholders] == names[:len(placeholders)]
    with mode:
        _Record(gm).run(*fakes)
    for p, f in zip(placeholders, fakes):
        p.meta["val"] = f
    return gm, env


def aten_fn(fn):
    """fn, for symbolic_trace: its output is a tuple (as an ATen graph's)."""
    names = ", ".join(inspect.signature(fn).parameters)
    ns = {"fn": fn}
    exec(f"def wrapped({names}):\n    out = fn({names})\n    return out if isinstance(out, tuple) else (out,)", ns)
    return ns["wrapped"]


def check(compiled, fn, args, **tol):
    """A compiled ATen graph's outputs against fn's (eager) on the same arguments, dtypes included."""
    out = compiled(*args)
    want = fn(*args)
    want = want if isinstance(want, tuple) else (want,)
    assert len(out) == len(want)
    for o, w in zip(out, want):
        torch.testing.assert_close(o, w, **tol)


def views_by_symbolic_sizes(s0, s1, x):
    """Views whose sizes are products of symbols, for both backends' tests: a permuted copy flattened, a view of
    a product, a sum broadcast over a new dim."""
    aten = torch.ops.aten
    a = aten.permute.default(x, [1, 0, 2])                       # [s1, s0, 4]
    b = aten.clone.default(a, memory_format=torch.contiguous_format)
    c = aten.view.default(b, [s1 * s0 * 4])
    d = aten.view.default(aten.mul.Tensor(x, 2.0), [s0, s1 * 4])
    e = aten.expand.default(aten.unsqueeze.default(aten.sum.dim_IntList(x, [2]), 0), [3, s0, s1])
    return aten.cos.default(c), aten.add.Tensor(d, 1.0), aten.mul.Tensor(e, 2.0)


def cat_and_slices_by_symbolic_bounds(s0, x, y):
    """A concatenation and slices whose bounds are symbols, for both backends' tests: [2*s0, 8] and rows 1 ..
    s0-1 of it, a strided slice of columns, and the second half of y's rows."""
    aten = torch.ops.aten
    a = aten.cat.default([x, y], 0)
    b = aten.slice.Tensor(a, 0, 1, s0)
    c = aten.slice.Tensor(x, 1, 2, 7, 2)
    d = aten.slice.Tensor(y, 0, s0 // 2, s0)
    return aten.mul.Tensor(a, 3.0), aten.neg.default(b), aten.exp.default(c), aten.add.Tensor(d, 1.0)


def cache_mask(device: str):
    """transformers' sdpa_mask for one new token over a key/value cache of s0 tokens (masking_utils, as ember
    records it where the mask is not skipped): key positions arange(s0 + 1) + 0 viewed [1, 1, 1, s0 + 1] through a
    whole slice, compared with the query's position s0 (arange(s0, s0 + 1)), expanded to [1, 1, 1, s0 + 1]; and
    x [2, s0] and the new token's column (x's first), masked. The function of (s0, x) for `symbolic_graph`."""
    aten = torch.ops.aten

    def mask(s0, x):
        n = s0 + 1
        kv = aten.add.Tensor(aten.arange.default(n, device=device, pin_memory=False), 0)
        kv = aten.unsqueeze.default(aten.unsqueeze.default(aten.unsqueeze.default(kv, 0), 1), 2)
        kv = aten.slice.Tensor(kv, 3, 0, 9223372036854775807)
        q = aten.arange.start(s0, n, device=device, pin_memory=False)
        q = aten.unsqueeze.default(aten.unsqueeze.default(aten.unsqueeze.default(q, 0), 1), 3)
        m = aten.expand.default(aten.le.Tensor(kv, q), [1, -1, 1, n])
        return m, aten.mul.Tensor(aten.cat.default([x, aten.slice.Tensor(x, 1, 0, 1)], 1), m)
    return mask


def sgd_momentum(s0, p, buf, g):
    """An SGD-with-momentum update over a symbolic length: (new p, new buf), each the new value of an input (the
    graph's `ember_input_mutations` [(1, 0), (2, 1)]: what ember.autograd says of an optimizer step)."""
    aten = torch.ops.aten
    b = aten.add.Tensor(aten.mul.Tensor(buf, 0.9), g)
    return aten.sub.Tensor(p, aten.mul.Tensor(b, 0.1)), b


SGD_MUTATIONS = {"ember_input_mutations": [(1, 0), (2, 1)]}


def check_sgd_in_place(compiled, rand) -> None:
    """`sgd_momentum` compiled with SGD_MUTATIONS, against eager on copies of the inputs: inputs of separate memory
    are written in place (the outputs are the inputs themselves) at every size; inputs that overlap (views of one
    tensor) take the copying path (fresh outputs, the inputs unchanged: the caller copies back), also when the
    same addresses overlapped at no earlier size (extents change with the sizes)."""
    def call(n, p, buf, g, in_place: bool):
        before = [t.clone() for t in (p, buf, g)]
        want = sgd_momentum(n, *before)
        out = compiled(n, p, buf, g)
        for o, w in zip(out, want):
            torch.testing.assert_close(o, w)
        assert (out[0] is p and out[1] is buf) == in_place, (n, in_place)
        if not in_place:   # the copying path leaves its inputs as they were
            for t, b in zip((p, buf, g), before):
                torch.testing.assert_close(t, b)
    for n in (2, 3, 17, 100, 257):
        call(n, rand(n), rand(n), rand(n), True)
    base = rand(64)
    call(5, base[:5], base[5:10], rand(5), True)
    call(9, base[:9], base[5:14], rand(9), False)      # (same addresses as the last call, longer: overlapping)
    call(9, base[:9], rand(9), base[4:13], False)      # an input read overlaps one written
    call(5, base[:5], base[5:10], rand(5), True)
