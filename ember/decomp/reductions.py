"""Reductions (sum, mean, max/argmax, any/all, var/std, logsumexp, vector norms) and softmax, log_softmax and
their gradients."""
from __future__ import annotations

import math

import sympy
import torch

from ember import ir
from ember.ir import TensorBox, symbols
from ember.decomp import prims as P
from ember.decomp.common import floaty, odt, registrar

aten = torch.ops.aten
ENTRIES: dict = {}   # this family's part of decomp.table.TABLE
reg = registrar(ENTRIES)


def dims_of(x: TensorBox, dim) -> list[int]:
    if x.ndim == 0:
        return []
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return list(range(x.ndim))
    return [d % max(x.ndim, 1) for d in ([dim] if isinstance(dim, int) else dim)]


# float16/bfloat16 reductions (and the values made from them: a mean, a variance, a norm) are computed in float32 and
# rounded once, as eager's CPU and CUDA kernels accumulate: a 16-bit sum of 100,000 ones is inf, its mean 1
@reg(aten.sum.dim_IntList, aten.sum.default)
def _sum(x, dim=None, keepdim=False, *, dtype=None):
    return P.cast(P.reduce("sum", x, dims_of(x, dim), keepdim, acc_dtype(odt())), odt())


@reg(aten.prod.default, aten.prod.dim_int)
def _prod(x, dim=None, keepdim=False, *, dtype=None):
    return P.cast(P.reduce("prod", x, dims_of(x, dim), keepdim, acc_dtype(odt())), odt())


@reg(aten.mean.dim, aten.mean.default)
def _mean(x, dim=None, keepdim=False, *, dtype=None):
    dims = dims_of(x, dim)
    n = ir.prod(x.size[d] for d in dims)
    return P.cast(P.div(P.reduce("sum", x, dims, keepdim, acc_dtype(odt())), n), odt())


@reg(aten.amax.default, aten.amin.default)
def _amax(x, dim=(), keepdim=False):
    kind = "max" if ir.GRAPH.op_name.startswith("aten.amax") else "min"
    return P.reduce(kind, x, dims_of(x, dim), keepdim)


@reg(aten.max.default, aten.min.default)
def _max_all(x):
    return P.reduce("max" if ir.GRAPH.op_name.startswith("aten.max") else "min", x, dims_of(x, None))


@reg(aten.max.dim, aten.min.dim)
def _max_dim(x, dim, keepdim=False):
    kind = "max" if ir.GRAPH.op_name.startswith("aten.max") else "min"
    return P.reduce(kind, x, [dim], keepdim), P.reduce("arg" + kind, x, [dim], keepdim)


@reg(aten.argmax.default, aten.argmin.default)
def _argmax(x, dim=None, keepdim=False):
    kind = "argmax" if ir.GRAPH.op_name.startswith("aten.argmax") else "argmin"
    if dim is None:
        r = P.reduce(kind, P.reshape(x, [-1]) if x.ndim else x, [0] if x.ndim else [])
        return P.reshape(r, [1] * x.ndim) if keepdim else r
    return P.reduce(kind, x, [dim], keepdim)


@reg(aten.any.default, aten.any.dim, aten.any.dims, aten.all.default, aten.all.dim, aten.all.dims)
def _any(x, dim=None, keepdim=False):
    kind = "any" if ir.GRAPH.op_name.startswith("aten.any") else "all"
    return P.reduce(kind, P.cast(x, torch.bool), dims_of(x, dim), keepdim)


def var_and_mean(x: TensorBox, dims: list, correction, keepdim: bool, acc: torch.dtype | None = None) -> tuple:
    """(var, mean) over dims, two-pass, in float32 for 16-bit results (the caller casts them); `acc` overrides the
    dtype they are computed in."""
    d = acc or (acc_dtype(odt()) if floaty(odt()) else torch.float32)
    x = P.reuse(P.cast(x, d), 2)
    n = ir.prod(x.size[k] for k in dims)
    mean = P.div(P.reduce("sum", x, dims, True), n)
    diff = P.sub(x, mean)
    ss = P.reduce("sum", P.mul(diff, diff), dims, keepdim)
    dof = max(n - correction, 0) if symbols.is_static(n) else \
        n - correction if symbols.is_nonnegative(n - correction) else sympy.Max(n - correction, 0)
    return P.div(ss, dof), (mean if keepdim else P.squeeze(mean, dims))


@reg(aten.var.correction)
def _var_c(x, dim=None, *, correction=None, keepdim=False):
    return P.cast(var_and_mean(x, dims_of(x, dim), 1 if correction is None else correction, keepdim)[0], odt())


@reg(aten.std.correction)
def _std_c(x, dim=None, *, correction=None, keepdim=False):
    var = var_and_mean(x, dims_of(x, dim), 1 if correction is None else correction, keepdim)[0]
    return P.cast(P.unary("sqrt", var), odt())


@reg(aten.var_mean.correction)
def _var_mean(x, dim=None, *, correction=None, keepdim=False):
    var, mean = var_and_mean(x, dims_of(x, dim), 1 if correction is None else correction, keepdim)
    return P.cast(var, odt()), P.cast(mean, odt())


@reg(aten.logsumexp.default)
def _logsumexp(x, dim, keepdim=False):
    if not floaty(x.dtype) or x.ndim == 0:
        return NotImplemented
    dims = dims_of(x, dim)
    x = P.reuse(P.cast(x, acc_dtype(odt())), 2)
    m = P.reduce("max", x, dims, True)
    m = P.where(P.unary("isinf", m), 0.0, m)
    s = P.unary("log", P.reduce("sum", P.unary("exp", P.sub(x, m)), dims, keepdim))
    return P.cast(P.add(s, m if keepdim else P.squeeze(m, dims)), odt())


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype values of `dtype` are accumulated and computed in: float32 for float16/bfloat16."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


@reg(aten._softmax.default)
def _softmax(x, dim, half_to_float=False):
    if x.ndim == 0:
        return P.const(1.0, odt())
    # 16-bit inputs are computed in float32 and rounded once, as eager's kernels accumulate (a float16/bfloat16
    # row sum reaching memory between kernels would lose the digits log_softmax keeps near 0)
    x = P.reuse(P.cast(x, acc_dtype(odt())), 3)
    e = P.unary("exp", P.sub(x, P.reduce("max", x, [dim], True)))
    # where the lowering keeps a row in a per-thread buffer (Graph.keeps_row), exp is computed once into it,
    # read by the row sum and the output, not computed again for the output; elsewhere the store would reach memory
    e = P.realize(e) if ir.GRAPH.keeps_row(x, dim) else P.reuse(e, 2)
    # times the reciprocal of the row sum (one division per row, hoisted out of the loop), as eager's CPU
    # kernel does: a division per element costs a noticeable part of a fused row on CPU
    return P.cast(P.mul(e, P.unary("reciprocal", P.reduce("sum", e, [dim], True))), odt())


@reg(aten._log_softmax.default)
def _log_softmax(x, dim, half_to_float=False):
    if x.ndim == 0:
        return P.const(0.0, odt())
    x = P.reuse(P.cast(x, acc_dtype(odt())), 3)
    shifted = P.sub(x, P.reduce("max", x, [dim], True))
    return P.cast(P.sub(shifted, P.unary("log", P.reduce("sum", P.unary("exp", shifted), [dim], True))), odt())


@reg(aten._softmax_backward_data.default)
def _softmax_bwd(g, y, dim, input_dtype):
    g, y = P.cast(g, acc_dtype(odt())), P.cast(y, acc_dtype(odt()))
    gy = P.mul(g, y)
    return P.cast(P.sub(gy, P.mul(y, P.reduce("sum", gy, [dim], True))), odt())


@reg(aten._log_softmax_backward_data.default)
def _log_softmax_bwd(g, y, dim, input_dtype):
    g, y = P.cast(g, acc_dtype(odt())), P.cast(y, acc_dtype(odt()))
    return P.cast(P.sub(g, P.mul(P.unary("exp", y), P.reduce("sum", g, [dim], True))), odt())


@reg(aten._safe_softmax.default)
def _safe_softmax(x, dim, dtype=None):
    """softmax whose fully -inf rows give 0 instead of NaN (attention with every key masked)."""
    y = _softmax(x, dim)
    dead = P.reduce("all", P.pointwise("eq", P.cast(x, odt()), -math.inf), [dim], True)
    return P.where(dead, 0.0, y)


@reg(aten.linalg_vector_norm.default)
def _vector_norm(x, ord=2, dim=None, keepdim=False, *, dtype=None):
    d = odt()
    if not floaty(d) or x.ndim == 0 and dim not in (None, [], ()):
        return NotImplemented
    dims = dims_of(x, dim)
    a = P.unary("abs", P.cast(x, acc_dtype(d)))
    return P.cast(_norm_of_abs(a, ord, dims, keepdim), d)


def _norm_of_abs(a: TensorBox, ord, dims: list, keepdim: bool) -> TensorBox:
    if ord == math.inf:
        return P.reduce("max", a, dims, keepdim)
    if ord == -math.inf:
        return P.reduce("min", a, dims, keepdim)
    if ord == 0:
        return P.reduce("sum", P.cast(P.pointwise("ne", a, 0.0), a.dtype), dims, keepdim)
    if ord == 1:
        return P.reduce("sum", a, dims, keepdim)
    if ord == 2:
        return P.unary("sqrt", P.reduce("sum", P.mul(a, a), dims, keepdim))
    return P.pointwise("pow", P.reduce("sum", P.pointwise("pow", a, float(ord)), dims, keepdim), 1.0 / ord)
