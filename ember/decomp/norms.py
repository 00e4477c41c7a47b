"""Normalizations: layer norm, batch norm (eval, train, and their backward) and group norm."""
from __future__ import annotations

import torch

from ember import config, ir
from ember.ir import symbols
from ember.decomp import prims as P
from ember.decomp.common import out, registrar
from ember.decomp.reductions import acc_dtype, var_and_mean

aten = torch.ops.aten
ENTRIES: dict = {}   # this family's part of decomp.table.TABLE
reg = registrar(ENTRIES)


def _as_outputs(*values) -> tuple:
    """The decomposition's results in the node's dtypes (a norm of 16-bit values is computed in float32, as eager's
    kernels compute it, and rounded once)."""
    return tuple(v if v is None else P.cast(v, o.dtype) for v, o in zip(values, out()))


@reg(aten.native_layer_norm.default)
def _layer_norm(x, shape, w, b, eps):
    dims = list(range(x.ndim - len(shape), x.ndim))
    x = P.reuse(P.cast(x, acc_dtype(x.dtype)), 3)
    var, mean = var_and_mean(x, dims, 0, True, x.dtype)
    rstd = P.unary("rsqrt", P.add(var, eps))
    y = P.mul(P.sub(x, mean), rstd)
    if w is not None:
        y = P.mul(y, w)
    if b is not None:
        y = P.add(y, b)
    return _as_outputs(y, mean, rstd)


@reg(aten.native_layer_norm_backward.default)
def _layer_norm_bwd(g, x, shape, mean, rstd, w, b, mask):
    acc = acc_dtype(x.dtype)
    g, x, mean, rstd = (P.cast(v, acc) for v in (g, x, mean, rstd))
    w = w if w is None else P.cast(w, acc)
    dims = list(range(x.ndim - len(shape), x.ndim))
    outer = list(range(x.ndim - len(shape)))
    n = ir.prod(x.size[d] for d in dims)
    xhat = P.mul(P.sub(x, mean), rstd)
    gw = P.mul(g, w) if w is not None else g
    dx = dw = db = None
    if mask[0]:
        a = P.reduce("sum", gw, dims, True)
        c = P.reduce("sum", P.mul(gw, xhat), dims, True)
        dx = P.mul(P.div(rstd, n), P.sub(P.sub(P.mul(gw, n), a), P.mul(xhat, c)))
    if mask[1] and w is not None:
        dw = P.reduce("sum", P.mul(g, xhat), outer, False)
    if mask[2] and b is not None:
        db = P.reduce("sum", g, outer, False)
    return _as_outputs(dx, dw, db)


def _bn_shape(v, x):
    return P.reshape(v, [1, -1] + [1] * (x.ndim - 2))


@reg(aten._native_batch_norm_legit_no_training.default)
def _bn_eval(x, w, b, rm, rv, momentum, eps):
    y = P.mul(P.sub(x, _bn_shape(rm, x)), _bn_shape(P.unary("rsqrt", P.add(rv, eps)), x))
    if w is not None:
        y = P.mul(y, _bn_shape(w, x))
    if b is not None:
        y = P.add(y, _bn_shape(b, x))
    return (y,) + tuple(P.const(0, v.dtype, symbols.sym_sizes(v.shape)) for v in out()[1:])


# Train-mode batch norm is decomposed and fused on the device types listed here; elsewhere it stays an ATen call.
# Its sums are accumulated as eager's kernels do (_bn_acc): float32 sums on the CPU put the gradients through
# deep BatchNorm stacks far off eager's. On CUDA the decomposed kernels, fused with their neighbours, beat
# cuDNN's on a training step.
TRAIN_BATCH_NORM_DECOMPOSED = {"cpu", "cuda"}


def _bn_decomposed(x) -> bool:
    """Whether this train-mode batch norm is decomposed: where the code generator's device type (C++: "cpu",
    Triton: "cuda") is in TRAIN_BATCH_NORM_DECOMPOSED."""
    return ("cuda" if ir.GRAPH.target == "gpu" else "cpu") in TRAIN_BATCH_NORM_DECOMPOSED




def _bn_acc(x) -> torch.dtype | None:
    """The dtype of train-mode batch-norm sums: float64 for float32 on the CPU, as eager's CPU kernels
    (acc_type<float, false>). A float32 sum over N*H*W elements is off by ~1e-6 relative; where a channel's
    variance is small (ReLU outputs, small batches) the batch-norm backward amplifies that far beyond eager's
    error. On the GPU float32, as eager's CUDA kernels (acc_type<float, true>): float64 makes the batch-norm
    kernels, one program per channel, latency-bound."""
    if x.dtype != torch.float32 or (ir.GRAPH.target == "gpu" and not config.BN_FLOAT64_SUMS_ON_GPU):
        return None
    return torch.float64


@reg(aten._native_batch_norm_legit_functional.default)
def _bn_train(x, w, b, rm, rv, training, momentum, eps):
    if not training or not _bn_decomposed(x):
        return NotImplemented
    dims = [0] + list(range(2, x.ndim))
    n = ir.prod(x.size[d] for d in dims)
    x = P.reuse(x, 3)
    acc = _bn_acc(x)
    var, mean = var_and_mean(x, dims, 0, False, acc)
    # per channel, stored (they are outputs anyway): inlined, every element recomputed them from the float64 sums
    invstd = P.realize(P.cast(P.unary("rsqrt", P.add(var, eps)), x.dtype))
    var, mean = P.cast(var, x.dtype), P.realize(P.cast(mean, x.dtype))
    y = P.mul(P.sub(x, _bn_shape(mean, x)), _bn_shape(invstd, x))
    if w is not None:
        y = P.mul(y, _bn_shape(w, x))
    if b is not None:
        y = P.add(y, _bn_shape(b, x))
    new_rm = P.add(P.mul(rm, 1 - momentum), P.mul(mean, momentum))
    if symbols.is_static(n):
        new_rv = P.add(P.mul(rv, 1 - momentum), P.mul(var, momentum * n / max(n - 1, 1)))
    else:   # a symbolic count (N*H*W, N >= 2): the unbiasing factor from the run-time count, in the kernel
        new_rv = P.add(P.mul(rv, 1 - momentum), P.div(P.mul(P.mul(var, momentum), n), n - 1))
    return y, mean, invstd, new_rm, new_rv


@reg(aten.native_batch_norm.default)
def _native_bn(x, w, b, rm, rv, training, momentum, eps):
    if not training:
        # save_mean/save_invstd are unused in eval mode; their shape differs by device (CUDA: [C], CPU: [0])
        y, _, _ = _bn_eval(x, w, b, rm, rv, momentum, eps)
        return (y,) + tuple(P.const(0, v.dtype, symbols.sym_sizes(v.shape)) for v in out()[1:])
    if rm is not None or rv is not None:
        return NotImplemented  # updates running stats in place: only the functional form is compiled
    r = _bn_train(x, w, b, P.const(0, x.dtype, [x.size[1]]), P.const(0, x.dtype, [x.size[1]]), True, 0.0, eps)
    return r if r is NotImplemented else r[:3]


@reg(aten.native_group_norm.default)
def _group_norm(x, w, b, N, C, HxW, group, eps):
    xg = P.reuse(P.cast(P.reshape(x, [N, group, -1]), acc_dtype(x.dtype)), 3)
    var, mean = var_and_mean(xg, [2], 0, True, xg.dtype)
    rstd = P.unary("rsqrt", P.add(var, eps))
    y = P.reshape(P.mul(P.sub(xg, mean), rstd), x.size)
    if w is not None:
        y = P.mul(y, _bn_shape(w, x))
    if b is not None:
        y = P.add(y, _bn_shape(b, x))
    return _as_outputs(y, P.reshape(mean, [N, group]), P.reshape(rstd, [N, group]))


@reg(aten.native_batch_norm_backward.default)
def _bn_backward(dy, x, w, rm, rv, save_mean, save_invstd, train, eps, mask):
    if train and not _bn_decomposed(x):
        return NotImplemented
    dims = [0] + list(range(2, x.ndim))
    n = ir.prod(x.size[d] for d in dims)
    if train:
        mean, invstd = save_mean, save_invstd
    else:
        mean, invstd = rm, P.unary("rsqrt", P.add(rv, eps))
    mean_b, invstd_b = _bn_shape(mean, x), _bn_shape(invstd, x)
    xhat = P.mul(P.sub(x, mean_b), invstd_b)
    acc = _bn_acc(x) if train else None
    # (rounded to x's dtype: short runs of values may be summed in it first, as eager's per-plane vector sums)
    sum_dy = P.reduce("sum", dy, dims, dtype=acc, partial_dtype=x.dtype)
    sum_dy_xhat = P.reduce("sum", P.mul(dy, xhat), dims, dtype=acc, partial_dtype=x.dtype)
    if acc is not None:
        sum_dy, sum_dy_xhat = P.cast(sum_dy, x.dtype), P.cast(sum_dy_xhat, x.dtype)
    scale = P.mul(invstd_b, _bn_shape(w, x)) if w is not None else invstd_b
    dx = None
    if mask[0]:
        if train:
            dx = P.mul(P.sub(P.sub(dy, P.div(_bn_shape(sum_dy, x), n)),
                             P.mul(xhat, P.div(_bn_shape(sum_dy_xhat, x), n))), scale)
        else:
            dx = P.mul(dy, scale)
    return dx, (sum_dy_xhat if mask[1] else None), (sum_dy if mask[2] else None)
