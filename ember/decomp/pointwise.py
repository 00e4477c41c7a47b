"""Pointwise ops and their gradients (arithmetic, comparisons, math functions, activations), copies and casts,
and tensors made from a value or an index (full, zeros, arange, eye, tril)."""
from __future__ import annotations

import math

import sympy
import torch

from ember import ir
from ember.ir import TensorBox
from ember.decomp import prims as P
from ember.decomp.common import floaty, odt, out, out_shape, registrar

aten = torch.ops.aten
ENTRIES: dict = {}   # this family's part of decomp.table.TABLE
reg = registrar(ENTRIES)


def _meta(x):
    if isinstance(x, TensorBox):
        return torch.empty([1] * min(x.ndim, 1), dtype=x.dtype, device="meta")
    return x


def promote(*xs) -> torch.dtype:
    """PyTorch's type promotion of the operands (0-dim tensors and python scalars count less)."""
    d = None
    for a in xs:
        d = _meta(a) if d is None else torch.empty([1] * max(getattr(d, "ndim", 0), getattr(_meta(a), "ndim", 0)),
                                                    dtype=torch.result_type(d, _meta(a)), device="meta")
    return d.dtype if isinstance(d, torch.Tensor) else torch.tensor(d).dtype


def _binary(op, float_only=False, int_ok=True):
    def fn(a, b, *, alpha=1):
        d = odt()
        if not floaty(d) and not int_ok:
            return NotImplemented
        if alpha != 1:
            b = P.mul(b, alpha, dtype=d)
        return P.pointwise(op, a, b, dtype=d)
    return fn


for _op, _prim in [("add", "add"), ("sub", "sub"), ("mul", "mul"), ("maximum", "maximum"), ("minimum", "minimum"),
                   ("fmax", "fmax"), ("fmin", "fmin"), ("bitwise_and", "bitwise_and"), ("bitwise_or", "bitwise_or"),
                   ("bitwise_xor", "bitwise_xor"), ("atan2", "atan2"), ("copysign", "copysign"), ("hypot", "hypot")]:
    pk = getattr(aten, _op)
    fn = _binary(_prim)
    for ov in ("Tensor", "Scalar", "default"):
        if hasattr(pk, ov):
            ENTRIES[getattr(pk, ov)] = fn


@reg(aten.rsub.Tensor, aten.rsub.Scalar)
def _rsub(a, b, alpha=1):
    return P.sub(b, P.mul(a, alpha, dtype=odt()) if alpha != 1 else a, dtype=odt())


@reg(aten.div.Tensor, aten.div.Scalar)
def _div(a, b):
    return P.div(a, b, dtype=odt())


@reg(aten.div.Tensor_mode, aten.div.Scalar_mode)
def _div_mode(a, b, *, rounding_mode=None):
    d = odt()
    if not floaty(d):
        return NotImplemented  # integer division by zero must raise as in eager: keep the ATen op
    if rounding_mode is None:
        return P.div(a, b, dtype=d)
    if rounding_mode == "trunc":
        return P.unary("trunc", P.div(a, b, dtype=d))
    return P.pointwise("floordiv", a, b, dtype=d)


@reg(aten.floor_divide.default, aten.floor_divide.Scalar)
def _floor_divide(a, b):
    return P.pointwise("floordiv", a, b, dtype=odt()) if floaty(odt()) else NotImplemented


@reg(aten.remainder.Tensor, aten.remainder.Scalar)
def _remainder(a, b):
    return P.pointwise("remainder", a, b, dtype=odt()) if floaty(odt()) else NotImplemented


@reg(aten.fmod.Tensor, aten.fmod.Scalar)
def _fmod(a, b):
    return P.pointwise("fmod", a, b, dtype=odt()) if floaty(odt()) else NotImplemented


def _compare(op):
    def fn(a, b):
        return P.pointwise(op, a, b, dtype=promote(a, b))
    return fn


for _op in ("eq", "ne", "lt", "le", "gt", "ge"):
    ENTRIES[getattr(aten, _op).Tensor] = ENTRIES[getattr(aten, _op).Scalar] = _compare(_op)
for _op in ("logical_and", "logical_or", "logical_xor"):
    ENTRIES[getattr(aten, _op).default] = lambda a, b, _op=_op: P.pointwise(_op, P.cast(a, torch.bool), P.cast(b, torch.bool))

_FLOAT_UNARY = ["exp", "exp2", "log", "log2", "log10", "sqrt", "rsqrt", "sin", "cos", "tan", "asin", "acos", "atan",
                "sinh", "cosh", "tanh", "asinh", "acosh", "atanh", "sigmoid", "erf", "erfc", "log1p", "expm1",
                "reciprocal", "lgamma", "frac"]
for _op in _FLOAT_UNARY:  # ints promote to the default float dtype
    ENTRIES[getattr(aten, _op).default] = lambda a, _op=_op: P.unary(_op, P.cast(a, odt()))
for _op in ["neg", "abs", "floor", "ceil", "round", "trunc", "sign", "bitwise_not", "relu"]:
    ENTRIES[getattr(aten, _op).default] = lambda a, _op=_op: P.unary(_op, P.cast(a, odt()))
ENTRIES[aten.sgn.default] = lambda a: P.unary("sign", a)
for _op in ["isnan", "isinf", "signbit", "logical_not"]:
    ENTRIES[getattr(aten, _op).default] = lambda a, _op=_op: P.unary(_op, a)
ENTRIES[aten.isfinite.default] = lambda a: P.unary("isfinite", a)
ENTRIES[aten.square.default] = lambda a: P.mul(a, a, dtype=odt())


@reg(aten.round.decimals)
def _round_dec(a, *, decimals=0):
    if decimals == 0:
        return P.unary("round", a)
    return NotImplemented


@reg(aten.pow.Tensor_Scalar)
def _pow_ts(a, e):
    d = odt()
    if not floaty(d):
        return NotImplemented
    a = P.cast(a, d)
    if e == 2:
        return P.mul(a, a)
    if e == 3:   # as eager's kernels (CPU and CUDA): x * x * x; libdevice.pow is much slower
        return P.mul(P.mul(a, a), a)
    if e == -2:  # 1 / (x * x), as eager's kernels
        return P.unary("reciprocal", P.mul(a, a))
    if e == 1:
        return a
    if e == 0.5:
        return P.unary("sqrt", a)
    if e == -1:
        return P.unary("reciprocal", a)
    return P.pointwise("pow", a, e, dtype=d)


@reg(aten.pow.Tensor_Tensor, aten.pow.Scalar)
def _pow(a, b):
    return P.pointwise("pow", a, b, dtype=odt()) if floaty(odt()) else NotImplemented


@reg(aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar)
def _where(c, a, b):
    return P.where(c, a, b, dtype=odt())


@reg(aten.clamp.default, aten.clamp.Tensor, aten.clamp_min.default, aten.clamp_max.default,
     aten.clamp_min.Tensor, aten.clamp_max.Tensor)
def _clamp(x, lo=None, hi=None):
    d = odt()
    y = P.cast(x, d)
    if "clamp_max" in ir.GRAPH.op_name:  # clamp_max(x, hi) has its bound in the second position
        lo, hi = None, lo
    if lo is not None:  # NaN in x stays NaN: max(x, lo) written as where(x < lo, lo, x)
        lo = P.cast(lo, d) if isinstance(lo, TensorBox) else lo
        y = P.where(P.pointwise("lt", y, lo, dtype=d), lo, y, dtype=d)
    if hi is not None:
        hi = P.cast(hi, d) if isinstance(hi, TensorBox) else hi
        y = P.where(P.pointwise("gt", y, hi, dtype=d), hi, y, dtype=d)
    return y


@reg(aten.hardtanh.default)
def _hardtanh(x, lo=-1.0, hi=1.0):
    return P.where(P.pointwise("lt", x, lo), lo, P.where(P.pointwise("gt", x, hi), hi, x))


@reg(aten.gelu.default)
def _gelu(x, approximate="none"):
    if approximate == "tanh":
        inner = P.mul(math.sqrt(2 / math.pi), P.add(x, P.mul(0.044715, P.mul(x, P.mul(x, x)))))
        return P.mul(P.mul(x, 0.5), P.add(1.0, P.unary("tanh", inner)))
    return P.mul(P.mul(x, 0.5), P.add(1.0, P.unary("erf", P.mul(x, 1 / math.sqrt(2)))))


@reg(aten.gelu_backward.default)
def _gelu_backward(g, x, approximate="none"):
    if approximate == "tanh":
        return NotImplemented
    cdf = P.mul(0.5, P.add(1.0, P.unary("erf", P.mul(x, 1 / math.sqrt(2)))))
    pdf = P.mul(1 / math.sqrt(2 * math.pi), P.unary("exp", P.mul(-0.5, P.mul(x, x))))
    return P.mul(g, P.add(cdf, P.mul(x, pdf)))


@reg(aten.silu.default)
def _silu(x):
    return P.mul(x, P.unary("sigmoid", x))


@reg(aten.silu_backward.default)
def _silu_backward(g, x):
    s = P.unary("sigmoid", x)
    return P.mul(g, P.mul(s, P.add(1.0, P.mul(x, P.sub(1.0, s)))))


@reg(aten.sigmoid_backward.default)
def _sigmoid_backward(g, y):
    return P.mul(g, P.mul(y, P.sub(1.0, y)))


@reg(aten.tanh_backward.default)
def _tanh_backward(g, y):
    return P.mul(g, P.sub(1.0, P.mul(y, y)))


@reg(aten.threshold_backward.default)
def _threshold_backward(g, x, threshold):
    return P.where(P.pointwise("le", x, threshold), 0, g, dtype=odt())


@reg(aten.threshold.default)
def _threshold(x, threshold, value):
    return P.where(P.pointwise("le", x, threshold), value, x, dtype=odt())


@reg(aten.leaky_relu.default)
def _leaky_relu(x, slope=0.01):
    return P.where(P.pointwise("gt", x, 0), x, P.mul(x, slope))


@reg(aten.elu.default)
def _elu(x, alpha=1.0, scale=1.0, input_scale=1.0):
    neg = P.mul(P.unary("expm1", P.mul(x, input_scale)), alpha)
    return P.mul(P.where(P.pointwise("gt", x, 0), x, neg), scale)


@reg(aten.hardsigmoid.default)
def _hardsigmoid(x):
    return P.div(_clamp(P.add(x, 3.0), 0.0, 6.0), 6.0)


@reg(aten.hardswish.default)
def _hardswish(x):
    return P.mul(x, _hardsigmoid(x))


@reg(aten.softplus.default)
def _softplus(x, beta=1.0, threshold=20.0):
    bx = P.mul(x, beta)
    return P.where(P.pointwise("gt", bx, threshold), x, P.div(P.unary("log1p", P.unary("exp", bx)), beta))


@reg(aten.mish.default)
def _mish(x):
    return P.mul(x, P.unary("tanh", _softplus(x)))


@reg(aten.lerp.Scalar, aten.lerp.Tensor)
def _lerp(a, b, w):
    d = odt()
    a, b = P.cast(a, d), P.cast(b, d)
    return P.add(a, P.mul(w, P.sub(b, a), dtype=d))


@reg(aten.addcmul.default)
def _addcmul(x, a, b, value=1):
    return P.add(x, P.mul(value, P.mul(a, b, dtype=odt()), dtype=odt()), dtype=odt())


@reg(aten.addcdiv.default)
def _addcdiv(x, a, b, value=1):
    if not floaty(odt()):
        return NotImplemented
    return P.add(x, P.mul(value, P.div(a, b, dtype=odt()), dtype=odt()), dtype=odt())


@reg(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
def _masked_fill(x, mask, value):
    return P.where(mask, value, x, dtype=odt())


@reg(aten.nan_to_num.default)
def _nan_to_num(x, nan=0.0, posinf=None, neginf=None):
    if not floaty(x.dtype):
        return x
    fi = torch.finfo(x.dtype)
    posinf = fi.max if posinf is None else posinf
    neginf = fi.min if neginf is None else neginf
    y = P.where(P.unary("isnan", x), nan, x)
    y = P.where(P.pointwise("eq", x, math.inf), posinf, y)
    return P.where(P.pointwise("eq", x, -math.inf), neginf, y)


@reg(aten.xlogy.Tensor)
def _xlogy(x, y):
    d = odt()
    x, y = P.cast(x, d), P.cast(y, d)
    r = P.where(P.pointwise("eq", x, 0), 0.0, P.mul(x, P.unary("log", y)))
    return P.where(P.unary("isnan", y), math.nan, r)


@reg(aten.clone.default, aten.alias.default, aten.detach.default, aten.lift_fresh_copy.default, aten.contiguous.default,
     aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten._unsafe_view.default)
def _copy(x, *args, **kwargs):
    if args and isinstance(args[0], (list, tuple)):  # _unsafe_view(x, size)
        return P.reshape(x, args[0])
    return P.cast(x, odt())


@reg(aten.full.default)
def _full(size, value, **kwargs):
    return P.const(value, odt(), size)


@reg(aten.scalar_tensor.default)
def _scalar_tensor(value, **kwargs):
    return P.const(value, odt())


@reg(aten.full_like.default)
def _full_like(x, value, **kwargs):
    return P.const(value, odt(), x.size)


@reg(aten.zeros_like.default)
def _zeros_like(x, **kwargs):
    return P.const(0, odt(), x.size)


@reg(aten.ones_like.default)
def _ones_like(x, **kwargs):
    return P.const(1, odt(), x.size)


@reg(aten.zeros.default)
def _zeros(size, **kwargs):
    return P.const(0, odt(), size)


@reg(aten.ones.default)
def _ones(size, **kwargs):
    return P.const(1, odt(), size)


@reg(aten.new_ones.default, aten.new_zeros.default, aten.new_full.default, aten.empty_like.default,
     aten.new_empty.default, aten.empty.memory_format, aten.empty_strided.default)
def _new_filled(*args, **kwargs):
    """new_ones/new_zeros/new_full; empty* too: any content is correct for an uninitialized tensor, zeros are cheap."""
    name = ir.GRAPH.op_name
    value = 1 if "ones" in name else args[2] if "new_full" in name else 0
    return P.const(value, odt(), out_shape())


@reg(aten.copy.default)
def _copy_into(dst, src, non_blocking=False):
    """The functional copy_: src's values, broadcast to dst's shape, in dst's dtype."""
    return P.cast(P.expand(src, out_shape()), odt())


@reg(aten.fill.Scalar)
def _fill(x, value):
    return P.const(value, odt(), x.size)


@reg(aten.arange.start_step, aten.arange.default, aten.arange.start)
def _arange(*args, **kwargs):
    v = out()
    name = ir.GRAPH.op_name
    start, step = (0, 1) if name.endswith(".default") else (args[0], args[2] if name.endswith("start_step") else 1)
    # (a symbolic start, a size's expression: the position ids arange(past, past + n) of a cache)
    if not floaty(v.dtype) and type(step) is int and (type(start) is int or isinstance(start, sympy.Basic)
                                                      and start.is_integer):
        return P.iota(out_shape(), 0, v.dtype, start, step)
    return NotImplemented  # float aranges accumulate rounding exactly as eager's kernel does: keep it


@reg(aten.eye.default, aten.eye.m)
def _eye(n, m=None, **kwargs):
    size = out_shape()
    return P.cast(P.pointwise("eq", P.iota(size, 0), P.iota(size, 1)), odt())


@reg(aten.tril.default, aten.triu.default)
def _tril(x, diagonal=0):
    r, c = P.iota(x.size, x.ndim - 2), P.iota(x.size, x.ndim - 1)
    keep = P.pointwise("le" if ir.GRAPH.op_name.startswith("aten.tril") else "ge", P.sub(c, r), diagonal)
    return P.where(keep, x, 0)


@reg(aten.native_dropout_backward.default)
def _dropout_bwd(g, mask, scale):
    # native_dropout itself stays an ATen call (eager's random numbers); its backward is the gradient times the
    # saved mask and scale, pointwise, so it fuses into the layer_norm / residual backward kernels around it
    return P.mul(P.mul(g, P.cast(mask, odt())), scale)


@reg(aten.hardswish_backward.default)
def _hardswish_backward(g, x):
    mid = P.mul(g, P.add(P.div(x, 3.0), 0.5))
    return P.where(P.pointwise("lt", x, -3.0), 0.0, P.where(P.pointwise("le", x, 3.0), mid, g))


@reg(aten.hardsigmoid_backward.default)
def _hardsigmoid_backward(g, x):
    inside = P.pointwise("logical_and", P.pointwise("gt", x, -3.0), P.pointwise("lt", x, 3.0))
    return P.where(inside, P.div(g, 6.0), 0.0)
