"""torch._foreach_* ops (optimizers) decomposed into their per-tensor op, for every tensor of the list."""
from __future__ import annotations

import torch

from ember import ir
from ember.ir import TensorBox
from ember.decomp.common import out

aten = torch.ops.aten


# torch._foreach_* ops (optimizers) apply one op to each tensor of a list: decomposed into that op per tensor,
# so the scheduler sees N independent pointwise loops it can fuse horizontally. Overload kinds: `List` (a list
# operand), `Scalar` (one scalar for all), `ScalarList` (a scalar per tensor), `Tensor` (one tensor operand
# for all), `default` (unary). The per-tensor op is the first overload of aten.<name> with a decomposition.
_FOREACH_PER_TENSOR = {"List": ("Tensor", "default"), "Scalar": ("Scalar", "Tensor", "default"),
                       "ScalarList": ("Scalar", "Tensor", "default"), "Tensor": ("Tensor", "default"),
                       "default": ("default",)}


def _foreach(fop: torch._ops.OpOverload, table: dict):
    schema = fop._schema
    base = getattr(aten, schema.name.split("::")[1][len("_foreach_"):])
    kind = fop._overloadname
    per = [getattr(base, o) for o in _FOREACH_PER_TENSOR[kind] if hasattr(base, o)]
    per = [o for o in per if o in table]
    listed = [isinstance(a.type, torch.ListType) for a in schema.arguments]
    names = [a.name for a in schema.arguments]

    def fn(*args, **kwargs):
        if not per:
            return NotImplemented
        vals = out()
        n = len(vals)
        for a, is_list in zip(args, listed):
            if is_list and len(a) != n:
                return NotImplemented
        # addcmul/addcdiv's `Tensor` overload: a 1-D `scalars` tensor, one value per list element (optimizers
        # pass their per-parameter step sizes so when compiling)
        per_elem = [kind == "Tensor" and name == "scalars" and isinstance(a, TensorBox) and a.ndim == 1
                    for a, name in zip(args, names)]
        if kind == "Tensor" and any(name == "scalars" and not pe for name, pe in zip(names, per_elem)):
            return NotImplemented
        if any(p and args[k].size[0] != n for k, p in enumerate(per_elem)):
            return NotImplemented
        g = ir.GRAPH
        res = []
        try:
            for i in range(n):
                g.val = vals[i]
                ai = [a[i] if lst else table[aten.select.int](a, 0, i) if pe else a
                      for a, lst, pe in zip(args, listed, per_elem)]
                ki = {k: (v[i] if listed[names.index(k)] else v) for k, v in kwargs.items()}
                r = table[per[0]](*ai, **ki)
                if r is NotImplemented:
                    return NotImplemented
                res.append(r)
        finally:
            g.val = vals
        return res
    return fn


def entries(table: dict) -> dict:
    """{foreach overload: its decomposition} for the functional foreach ops, each calling its per-tensor op's
    entry in `table` (the whole decomposition table)."""
    found = {}
    for name in ("add", "sub", "mul", "div", "maximum", "minimum", "clamp_min", "clamp_max", "pow", "lerp", "addcmul",
                 "addcdiv", "sqrt", "rsqrt", "exp", "log", "neg", "abs", "reciprocal", "sign", "sigmoid", "tanh",
                 "sin", "cos", "log1p", "expm1", "erf", "floor", "ceil", "round", "trunc", "frac"):
        pk = getattr(aten, "_foreach_" + name, None)
        if pk is None:
            continue
        for ov in pk.overloads():
            f = getattr(pk, ov)
            if ov in _FOREACH_PER_TENSOR and not any(a.alias_info is not None and a.alias_info.is_write
                                                     for a in f._schema.arguments):
                found[f] = _foreach(f, table)
    return found
