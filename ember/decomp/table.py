"""ATen -> ember primitives. TABLE maps an OpOverload (or a whole OpOverloadPacket) to a function of the op's
arguments (TensorBoxes for tensors) returning TensorBoxes; returning NotImplemented (or raising) keeps the
op as an ATen call for that node. EXTERN lists the library calls that stay calls on purpose (not fallbacks).

Dtypes follow the node's meta value (`out()`): decompositions compute in the result dtype, or in float32/64
where eager does internally, and the lowering checks every result's shape and dtype against the meta value.
"""
from __future__ import annotations

import math

import sympy
import torch

from ember import ir
from ember.errors import CannotLower
from ember.ir import TensorBox
from ember.decomp import prims as P

aten = torch.ops.aten
TABLE: dict = {}
EXTERN = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.convolution.default,
          aten._scaled_dot_product_flash_attention_for_cpu.default, aten._convolution.default,
          aten.convolution_backward.default, aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
          aten._scaled_dot_product_efficient_attention.default,
          aten._scaled_dot_product_efficient_attention_backward.default,
          aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_flash_attention_backward.default}


def reg(*ops):
    def deco(fn):
        for op in ops:
            TABLE[op] = fn
        return fn
    return deco


def out():
    """The meta value of the node being lowered (its shape, dtype)."""
    return ir.GRAPH.val


def odt():
    v = out()
    return (v[0] if isinstance(v, (tuple, list)) else v).dtype


def floaty(d):
    return d.is_floating_point


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


def dims_of(x: TensorBox, dim) -> list[int]:
    if x.ndim == 0:
        return []
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return list(range(x.ndim))
    return [d % max(x.ndim, 1) for d in ([dim] if isinstance(dim, int) else dim)]


# ------------------------------------------------------------------------------------------------ pointwise
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
            TABLE[getattr(pk, ov)] = fn


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
    TABLE[getattr(aten, _op).Tensor] = TABLE[getattr(aten, _op).Scalar] = _compare(_op)
for _op in ("logical_and", "logical_or", "logical_xor"):
    TABLE[getattr(aten, _op).default] = lambda a, b, _op=_op: P.pointwise(_op, P.cast(a, torch.bool), P.cast(b, torch.bool))

_FLOAT_UNARY = ["exp", "exp2", "log", "log2", "log10", "sqrt", "rsqrt", "sin", "cos", "tan", "asin", "acos", "atan",
                "sinh", "cosh", "tanh", "asinh", "acosh", "atanh", "sigmoid", "erf", "erfc", "log1p", "expm1",
                "reciprocal", "lgamma", "frac"]
for _op in _FLOAT_UNARY:  # ints promote to the default float dtype
    TABLE[getattr(aten, _op).default] = lambda a, _op=_op: P.unary(_op, P.cast(a, odt()))
for _op in ["neg", "abs", "floor", "ceil", "round", "trunc", "sign", "bitwise_not", "relu"]:
    TABLE[getattr(aten, _op).default] = lambda a, _op=_op: P.unary(_op, P.cast(a, odt()))
TABLE[aten.sgn.default] = lambda a: P.unary("sign", a)
for _op in ["isnan", "isinf", "signbit", "logical_not"]:
    TABLE[getattr(aten, _op).default] = lambda a, _op=_op: P.unary(_op, a)
TABLE[aten.isfinite.default] = lambda a: P.unary("isfinite", a)
TABLE[aten.square.default] = lambda a: P.mul(a, a, dtype=odt())


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
    if e == 3:   # as eager's kernels (CPU and CUDA): x * x * x; libdevice.pow took GPT-2's tanh-GELU twice as long
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


# ------------------------------------------------------------------------------------------------ copies / creation
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
    return P.const(value, odt(), tuple(out().shape))


@reg(aten.copy.default)
def _copy_into(dst, src, non_blocking=False):
    """The functional copy_: src's values, broadcast to dst's shape, in dst's dtype."""
    return P.cast(P.expand(src, tuple(out().shape)), odt())


@reg(aten.fill.Scalar)
def _fill(x, value):
    return P.const(value, odt(), x.size)


@reg(aten.arange.start_step, aten.arange.default, aten.arange.start)
def _arange(*args, **kwargs):
    v = out()
    name = ir.GRAPH.op_name
    start, step = (0, 1) if name.endswith(".default") else (args[0], args[2] if name.endswith("start_step") else 1)
    if not floaty(v.dtype) and all(type(a) is int for a in (start, step)):
        return P.iota(v.shape, 0, v.dtype, start, step)
    return NotImplemented  # float aranges accumulate rounding exactly as eager's kernel does: keep it


@reg(aten.eye.default, aten.eye.m)
def _eye(n, m=None, **kwargs):
    size = tuple(out().shape)
    return P.cast(P.pointwise("eq", P.iota(size, 0), P.iota(size, 1)), odt())


@reg(aten.tril.default, aten.triu.default)
def _tril(x, diagonal=0):
    r, c = P.iota(x.size, x.ndim - 2), P.iota(x.size, x.ndim - 1)
    keep = P.pointwise("le" if ir.GRAPH.op_name.startswith("aten.tril") else "ge", P.sub(c, r), diagonal)
    return P.where(keep, x, 0)


# ------------------------------------------------------------------------------------------------ views
@reg(aten.view.default, aten.reshape.default)
def _view(x, size):
    return P.reshape(x, size)


TABLE[aten.permute.default] = lambda x, perm: P.permute(x, perm)
TABLE[aten.expand.default] = lambda x, size, implicit=False: P.expand(x, size)
TABLE[aten.unsqueeze.default] = lambda x, d: P.unsqueeze(x, d)
TABLE[aten.squeeze.default] = lambda x: P.squeeze(x)
TABLE[aten.squeeze.dim] = lambda x, d: P.squeeze(x, [d]) if x.ndim else x
TABLE[aten.squeeze.dims] = lambda x, ds: P.squeeze(x, ds) if x.ndim else x
TABLE[aten.flip.default] = lambda x, dims: P.flip(x, dims)
TABLE[aten.select.int] = lambda x, d, i: P.select(x, d, i)


@reg(aten.t.default)
def _t(x):
    return P.permute(x, [1, 0]) if x.ndim == 2 else x


@reg(aten.transpose.int)
def _transpose(x, a, b):
    if x.ndim == 0:
        return x
    perm = list(range(x.ndim))
    perm[a % x.ndim], perm[b % x.ndim] = perm[b % x.ndim], perm[a % x.ndim]
    return P.permute(x, perm)


@reg(aten.slice.Tensor)
def _slice(x, dim=0, start=None, end=None, step=1):
    n = int(x.size[dim % x.ndim])
    start = 0 if start is None else start
    end = n if end is None else end
    return P.slice_(x, dim, start, end, step)


@reg(aten.narrow.default)
def _narrow(x, dim, start, length):
    return P.slice_(x, dim, start, start + length)


@reg(aten.split.Tensor, aten.split_with_sizes.default)
def _split(x, sizes, dim=0):
    dim = dim % x.ndim
    n = int(x.size[dim])
    if isinstance(sizes, int):
        sizes = [min(sizes, n - i) for i in range(0, n, sizes)] if sizes else [n]
    outs, s = [], 0
    for k in sizes:
        outs.append(P.slice_(x, dim, s, s + k))
        s += k
    return outs


@reg(aten.unbind.int)
def _unbind(x, dim=0):
    return [P.select(x, dim, i) for i in range(int(x.size[dim % x.ndim]))]


@reg(aten.cat.default)
def cat(xs, dim=0):
    xs = [x for x in xs if not (x.ndim == 1 and int(x.size[0]) == 0)]
    if not xs:
        return NotImplemented
    return P.cat(xs, dim, odt())


@reg(aten.stack.default)
def _stack(xs, dim=0):
    dim = dim % (xs[0].ndim + 1)
    return P.cat([P.unsqueeze(x, dim) for x in xs], dim, odt())


@reg(aten.constant_pad_nd.default)
def _pad(x, pad, value=0):
    return P.pad(x, pad, value)


@reg(aten.as_strided.default)
def _as_strided(x, size, stride, storage_offset=None):
    if (x.strided is not None and x.strided[2] != 0) or storage_offset is not None:
        return NotImplemented  # offsets are absolute in the storage, which only eager's tensor knows
    if ir.GRAPH.reads_layout_changed(x):
        # it addresses storage: x must be stored in eager's layout (a copy, unless only the strides of size-1
        # dims differ, as for a channels-last [N, C, 1, 1] mean), or it stays an ATen call
        want = getattr(x, "eager_stride", None)
        if want is None:
            return NotImplemented
        same = x.strided is not None and x.strided[2] == 0 and tuple(x.strided[0].size) == tuple(x.size) and all(
            int(a) == int(b) for a, b, n in zip(x.strided[1], want, x.size) if int(n) != 1)
        if not same:
            x = ir.GRAPH.realize(TensorBox(x.size, x.dtype, x.loader), stride=want)
    return P.as_strided(x, size, stride, 0)


@reg(aten.repeat.default)
def _repeat(x, reps):
    k = len(reps) - x.ndim
    size = tuple(sympy.Integer(r) * (x.size[d - k] if d >= k else 1) for d, r in enumerate(reps))
    return TensorBox(size, x.dtype, lambda idx: x.loader([ir.ModIndex(idx[d + k], x.size[d]) for d in range(x.ndim)]))


@reg(aten.index.Tensor)
def _index(x, indices):
    if any(t is not None and t.dtype in (torch.bool, torch.uint8) for t in indices):
        return NotImplemented  # boolean masks make data-dependent shapes
    return P.index(x, list(indices) + [None] * (x.ndim - len(indices)))


@reg(aten.index_select.default)
def _index_select(x, dim, idx):
    if x.ndim == 0:
        return NotImplemented
    dim = dim % x.ndim
    return P.index(x, [None] * dim + [P.reshape(idx, [-1]) if idx.ndim == 0 else idx] + [None] * (x.ndim - dim - 1))


@reg(aten.gather.default)
def _gather(x, dim, idx, sparse_grad=False):
    return P.gather(x, dim, idx)


@reg(aten.embedding.default)
def _embedding(w, idx, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    return P.index(w, [idx, None])


@reg(aten.embedding_dense_backward.default)
def _embedding_dense_backward(grad, idx, num_weights, padding_idx, scale_grad_by_freq):
    """An embedding's weight gradient that one add reads, added to another gradient of the weight (GPT-2's
    tied token embedding and LM head): not zeros with the rows scattered in, then the sum (passes over the
    whole [50257, 768] table: a fill, ATen's kernel, the add: 0.15 ms of them the add alone, H100), but the
    rows added into a copy of the other gradient (`_add_scattered_rows`: ATen's index_put with accumulate,
    which adds a token's rows in order, deterministically; eager sums them first, a rounding's difference).
    Any other embedding backward is ATen's."""
    node, v = ir.GRAPH.node, out()
    user = next(iter(node.users)) if node is not None and len(node.users) == 1 else None
    if scale_grad_by_freq or padding_idx != -1 or user is None or user.target is not aten.add.Tensor \
            or len(user.args) != 2 or user.kwargs or user.args[0] is user.args[1]:
        return NotImplemented
    other = user.args[1] if user.args[0] is node else user.args[0]
    ov, uv = getattr(other, "meta", {}).get("val"), user.meta.get("val")
    if not all(isinstance(t, torch.Tensor) and t.shape == v.shape and t.dtype == v.dtype for t in (ov, uv)):
        return NotImplemented

    def unread(idx):
        raise CannotLower("an embedding gradient read other than by its add")
    box = TensorBox(v.shape, v.dtype, unread)
    box.scattered_rows = (grad, idx)
    return box


_add_tensor = TABLE[aten.add.Tensor]


@reg(aten.add.Tensor)
def _add_scattered_rows(a, b, *, alpha=1):
    """other + (rows scattered into zeros) as index_put(other, [idx], rows, accumulate=True); any other add as
    the other binary ops."""
    if not any(hasattr(x, "scattered_rows") for x in (a, b)):
        return _add_tensor(a, b, alpha=alpha)
    rows, other = (a, b) if hasattr(a, "scattered_rows") else (b, a)
    grad, idx = rows.scattered_rows
    n = ir.prod(idx.size)
    flat_idx = P.reshape(idx, [n])
    flat_grad = P.reshape(grad, [n, grad.size[-1]])
    return ir.GRAPH.extern(aten.index_put.default, (other, [flat_idx], flat_grad, True), {}, fallback=False)


# ------------------------------------------------------------------------------------------------ reductions
@reg(aten.sum.dim_IntList, aten.sum.default)
def _sum(x, dim=None, keepdim=False, *, dtype=None):
    return P.reduce("sum", x, dims_of(x, dim), keepdim, odt())


@reg(aten.prod.default, aten.prod.dim_int)
def _prod(x, dim=None, keepdim=False, *, dtype=None):
    return P.reduce("prod", x, dims_of(x, dim), keepdim, odt())


@reg(aten.mean.dim, aten.mean.default)
def _mean(x, dim=None, keepdim=False, *, dtype=None):
    dims = dims_of(x, dim)
    n = ir.prod(x.size[d] for d in dims)
    return P.div(P.reduce("sum", x, dims, keepdim, odt()), n)


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


def _var(x, dims, correction, keepdim, acc=None):
    """(var, mean) over dims, two-pass; `acc` overrides the dtype they are computed in."""
    d = acc or (odt() if floaty(odt()) else torch.float32)
    x = P.reuse(P.cast(x, d), 2)
    n = ir.prod(x.size[k] for k in dims)
    mean = P.div(P.reduce("sum", x, dims, True), n)
    diff = P.sub(x, mean)
    ss = P.reduce("sum", P.mul(diff, diff), dims, keepdim)
    return P.div(ss, max(n - correction, 0)), (mean if keepdim else P.squeeze(mean, dims))


@reg(aten.var.correction)
def _var_c(x, dim=None, *, correction=None, keepdim=False):
    return _var(x, dims_of(x, dim), 1 if correction is None else correction, keepdim)[0]


@reg(aten.std.correction)
def _std_c(x, dim=None, *, correction=None, keepdim=False):
    return P.unary("sqrt", _var(x, dims_of(x, dim), 1 if correction is None else correction, keepdim)[0])


@reg(aten.var_mean.correction)
def _var_mean(x, dim=None, *, correction=None, keepdim=False):
    return _var(x, dims_of(x, dim), 1 if correction is None else correction, keepdim)


@reg(aten.logsumexp.default)
def _logsumexp(x, dim, keepdim=False):
    if not floaty(x.dtype) or x.ndim == 0:
        return NotImplemented
    dims = dims_of(x, dim)
    x = P.reuse(x, 2)
    m = P.reduce("max", x, dims, True)
    m = P.where(P.unary("isinf", m), 0.0, m)
    s = P.unary("log", P.reduce("sum", P.unary("exp", P.sub(x, m)), dims, keepdim))
    return P.add(s, m if keepdim else P.squeeze(m, dims))


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


@reg(aten._softmax.default)
def _softmax(x, dim, half_to_float=False):
    if x.ndim == 0:
        return P.const(1.0, odt())
    # 16-bit inputs are computed in float32 and rounded once, as eager's kernels accumulate (a float16/bfloat16
    # row sum that reached memory between kernels lost the digits log_softmax keeps near 0)
    x = P.reuse(P.cast(x, _acc(odt())), 3)
    e = P.unary("exp", P.sub(x, P.reduce("max", x, [dim], True)))
    # where the lowering keeps a row in a per-thread buffer (Graph.keeps_row), exp is computed once into it,
    # read by the row sum and the output, not computed again for the output; elsewhere the store would reach memory
    e = P.realize(e) if ir.GRAPH.keeps_row(x, dim) else P.reuse(e, 2)
    # times the reciprocal of the row sum (one division per row, hoisted out of the loop), as eager's CPU
    # kernel does: a division per element was a tenth of a fused layer_norm+gelu+softmax row on CPU
    return P.cast(P.mul(e, P.unary("reciprocal", P.reduce("sum", e, [dim], True))), odt())


@reg(aten._log_softmax.default)
def _log_softmax(x, dim, half_to_float=False):
    if x.ndim == 0:
        return P.const(0.0, odt())
    x = P.reuse(P.cast(x, _acc(odt())), 3)
    shifted = P.sub(x, P.reduce("max", x, [dim], True))
    return P.cast(P.sub(shifted, P.unary("log", P.reduce("sum", P.unary("exp", shifted), [dim], True))), odt())


@reg(aten._softmax_backward_data.default)
def _softmax_bwd(g, y, dim, input_dtype):
    gy = P.mul(g, y)
    return P.sub(gy, P.mul(y, P.reduce("sum", gy, [dim], True)))


@reg(aten._log_softmax_backward_data.default)
def _log_softmax_bwd(g, y, dim, input_dtype):
    return P.sub(g, P.mul(P.unary("exp", y), P.reduce("sum", g, [dim], True)))


@reg(aten.native_dropout_backward.default)
def _dropout_bwd(g, mask, scale):
    # native_dropout itself stays an ATen call (eager's random numbers); its backward is the gradient times the
    # saved mask and scale, pointwise, so it fuses into the layer_norm / residual backward kernels around it
    return P.mul(P.mul(g, P.cast(mask, odt())), scale)


@reg(aten.native_layer_norm.default)
def _layer_norm(x, shape, w, b, eps):
    dims = list(range(x.ndim - len(shape), x.ndim))
    x = P.reuse(x, 3)
    var, mean = _var(x, dims, 0, True)
    rstd = P.unary("rsqrt", P.add(var, eps))
    y = P.mul(P.sub(x, mean), rstd)
    if w is not None:
        y = P.mul(y, w)
    if b is not None:
        y = P.add(y, b)
    return y, mean, rstd


@reg(aten.native_layer_norm_backward.default)
def _layer_norm_bwd(g, x, shape, mean, rstd, w, b, mask):
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
    return dx, dw, db


def _bn_shape(v, x):
    return P.reshape(v, [1, -1] + [1] * (x.ndim - 2))


@reg(aten._native_batch_norm_legit_no_training.default)
def _bn_eval(x, w, b, rm, rv, momentum, eps):
    y = P.mul(P.sub(x, _bn_shape(rm, x)), _bn_shape(P.unary("rsqrt", P.add(rv, eps)), x))
    if w is not None:
        y = P.mul(y, _bn_shape(w, x))
    if b is not None:
        y = P.add(y, _bn_shape(b, x))
    return (y,) + tuple(P.const(0, v.dtype, list(v.shape)) for v in out()[1:])


# Train-mode batch norm is decomposed and fused on the device types listed here; elsewhere it stays an ATen call.
# Its sums run in float64 (_bn_acc): with float32 sums, gradients through deep BatchNorm stacks (resnet18,
# densenet121 at small batches) were 5-26% off where eager is 1e-5 off. On CUDA, densenet121's training step
# (reduce-overhead) measured 7.2 ms of GPU time decomposed against 8.5 ms with cuDNN's kernels, in one run on
# one H200 (bench/results/gpu_2026-11-26_s10_h200_train_host.log).
TRAIN_BATCH_NORM_DECOMPOSED = {"cpu", "cuda"}


def _bn_decomposed(x) -> bool:
    """Whether this train-mode batch norm is decomposed: where the code generator's device type (C++: "cpu",
    Triton: "cuda") is in TRAIN_BATCH_NORM_DECOMPOSED."""
    return ("cuda" if ir.GRAPH.target == "gpu" else "cpu") in TRAIN_BATCH_NORM_DECOMPOSED


BN_FLOAT64_SUMS_ON_GPU = False   # True: float64 sums on the GPU too (A/B timing; eager's CUDA kernels use float32)


def _bn_acc(x) -> torch.dtype | None:
    """The dtype of train-mode batch-norm sums: float64 for float32 on the CPU, as eager's CPU kernels
    (acc_type<float, false>). A float32 sum over N*H*W elements is off by ~1e-6 relative; where a channel's
    variance is small (ReLU outputs, small batches) the batch-norm backward amplifies that (resnet18 at batch 4,
    96x96: gradients 20% off against float64 with float32 sums, 1e-5 with float64 sums, as eager). On the GPU
    float32, as eager's CUDA kernels (acc_type<float, true>): float64 made densenet121's batch-norm kernels,
    one program per channel, latency-bound."""
    if x.dtype != torch.float32 or (ir.GRAPH.target == "gpu" and not BN_FLOAT64_SUMS_ON_GPU):
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
    var, mean = _var(x, dims, 0, False, acc)
    # per channel, stored (they are outputs anyway): inlined, every element recomputed them from the float64 sums
    invstd = P.realize(P.cast(P.unary("rsqrt", P.add(var, eps)), x.dtype))
    var, mean = P.cast(var, x.dtype), P.realize(P.cast(mean, x.dtype))
    y = P.mul(P.sub(x, _bn_shape(mean, x)), _bn_shape(invstd, x))
    if w is not None:
        y = P.mul(y, _bn_shape(w, x))
    if b is not None:
        y = P.add(y, _bn_shape(b, x))
    new_rm = P.add(P.mul(rm, 1 - momentum), P.mul(mean, momentum))
    new_rv = P.add(P.mul(rv, 1 - momentum), P.mul(var, momentum * n / max(n - 1, 1)))
    return y, mean, invstd, new_rm, new_rv


@reg(aten.native_batch_norm.default)
def _native_bn(x, w, b, rm, rv, training, momentum, eps):
    if not training:
        # save_mean/save_invstd are unused in eval mode; their shape differs by device (CUDA: [C], CPU: [0])
        y, _, _ = _bn_eval(x, w, b, rm, rv, momentum, eps)
        return (y,) + tuple(P.const(0, v.dtype, list(v.shape)) for v in out()[1:])
    if rm is not None or rv is not None:
        return NotImplemented  # updates running stats in place: only the functional form is compiled
    r = _bn_train(x, w, b, P.const(0, x.dtype, [x.size[1]]), P.const(0, x.dtype, [x.size[1]]), True, 0.0, eps)
    return r if r is NotImplemented else r[:3]


@reg(aten.native_group_norm.default)
def _group_norm(x, w, b, N, C, HxW, group, eps):
    xg = P.reuse(P.reshape(x, [N, group, -1]), 3)
    var, mean = _var(xg, [2], 0, True)
    rstd = P.unary("rsqrt", P.add(var, eps))
    y = P.reshape(P.mul(P.sub(xg, mean), rstd), x.size)
    if w is not None:
        y = P.mul(y, _bn_shape(w, x))
    if b is not None:
        y = P.add(y, _bn_shape(b, x))
    return y, P.reshape(mean, [N, group]), P.reshape(rstd, [N, group])


@reg(aten.nll_loss_forward.default)
def _nll_loss(x, target, weight, reduction, ignore_index):
    if x.ndim > 2:
        return NotImplemented
    xs = x if x.ndim == 2 else P.unsqueeze(x, 0)
    t = target if target.ndim == 1 else P.unsqueeze(target, 0)
    valid = P.pointwise("ne", t, ignore_index)
    safe = P.where(valid, t, 0)
    picked = P.squeeze(P.gather(xs, 1, P.unsqueeze(safe, 1)), [1])
    wt = P.where(valid, 1.0, 0.0, dtype=x.dtype)
    if weight is not None:
        wt = P.mul(wt, P.gather(weight, 0, safe))
    loss = P.mul(P.unary("neg", picked), wt)
    if reduction == 0:  # none
        return (loss if x.ndim == 2 else P.squeeze(loss, [0])), P.const(0, x.dtype)
    total = P.reduce("sum", wt, [0])
    s = P.reduce("sum", loss, [0])
    return (P.div(s, total) if reduction == 1 else s), total


MAX_POOL_TAPS = 25  # windows up to this size are a pointwise maximum of their taps, larger ones a reduction


def _pair(v) -> list:
    """A pooling parameter (an int, or one or two of them) as [along H, along W]."""
    return [v, v] if isinstance(v, int) else (list(v) * 2 if len(v) == 1 else list(v))


@reg(aten.max_pool2d_with_indices.default)
def _max_pool2d(x, kernel, stride=(), padding=0, dilation=1, ceil_mode=False):
    """Windows up to MAX_POOL_TAPS taps: pointwise over the output, the maximum of the taps and the flat input
    index of the first maximum (of the last NaN), as eager's CPU kernels, out-of-bounds taps skipped. The loops
    then run over the output (channels-last: C innermost, so the taps' loads are contiguous and vectorize;
    NCHW: over the output width), where a reduction over each 3x3 window was a scalar loop of 9 per output
    element (resnet18 b8 224px: 85 ms, eager 5 ms). Larger windows: max/argmax reductions."""
    if not floaty(x.dtype):
        return NotImplemented
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = _pair(kernel), _pair(stride or kernel), _pair(padding), _pair(dilation)
    vals = out()[0]
    oh, ow = vals.shape[-2:]
    h, w = int(x.size[-2]), int(x.size[-1])
    lead = list(x.size[:-2])
    n = len(lead)
    i64 = lambda v: ir.Expr("const", (v,), torch.int64)  # noqa: E731
    neg_inf = ir.Expr("const", (-math.inf,), x.dtype)

    def tap(idx, a, c):
        """(value, -inf outside the input; whether inside; the flat index hi * w + wi) of tap (a, c)."""
        *b, i, j = idx
        hi, wi = i * sh - ph + a * dh, j * sw - pw + c * dw
        inside = None
        for v, lim in ((hi, h), (wi, w)):
            iv = ir.Expr("index", (v,), torch.int64)
            for cnd in (ir.Expr("ge", (iv, i64(0)), torch.bool), ir.Expr("lt", (iv, i64(lim)), torch.bool)):
                inside = cnd if inside is None else ir.Expr("logical_and", (inside, cnd), torch.bool)
        e = x.loader(list(b) + [P.clamp(hi, h - 1), P.clamp(wi, w - 1)])
        return ir.Expr("where", (inside, e, neg_inf), x.dtype), inside, ir.Expr("index", (hi * w + wi,), torch.int64)

    if kh * kw > MAX_POOL_TAPS:
        win = TensorBox(lead + [oh, ow, kh, kw], x.dtype, lambda idx: tap(idx[:-2], idx[-2], idx[-1])[0])
        values = P.reduce("max", win, [n + 2, n + 3])
        k = P.reduce("argmax", win, [n + 2, n + 3])
        hi = P.add(P.sub(P.iota(values.size, n, torch.int64, 0, sh), ph), P.mul(P.pointwise("floordiv", k, kw), dh))
        wi = P.add(P.sub(P.iota(values.size, n + 1, torch.int64, 0, sw), pw),
                   P.mul(P.pointwise("remainder", k, kw), dw))
        return values, P.add(P.mul(hi, w), wi)
    taps = [(a, c) for a in range(kh) for c in range(kw)]
    # each input element is read by about kh*kw/(sh*sw) windows: a costly producer (resnet's batch norm + relu)
    # is computed once into a buffer instead (resnet18 b8 224px: 40 ms fused, 12 ms + 8 ms separate)
    x = P.reuse(x, max(1, (kh * kw) // (sh * sw)))

    # without dilation, a tap outside the input loads (clamped) the input's edge, a position inside the same
    # window (eager rejects padding over half the kernel, and ceil_mode windows start inside the input or
    # its left padding): it cannot change the maximum, so no `where(inside, v, -inf)`; g++ did not vectorize
    # the loop over C with those selects (their loop-invariant conditions), 1.5x slower than eager's kernel
    edge_safe = dh == 1 and dw == 1 and 2 * ph <= kh and 2 * pw <= kw

    def max_loader(idx):
        e = None
        for a, c in taps:
            v = tap(idx, a, c)[0]
            if edge_safe:
                v = v.args[1]
            e = v if e is None else ir.Expr("maximum", (e, v), x.dtype)
        return e

    def argmax_loader(idx):
        # eager: `if (val > maxval || isnan(val))` over the taps inside the input, the first of them taken always
        best = arg = found = None
        for a, c in taps:
            v, inside, flat = tap(idx, a, c)
            v = v.args[1]  # the raw load: only taps inside are taken, so no -inf select
            if best is None:
                best, arg, found = v, flat, inside
                continue
            better = ir.Expr("logical_or", (ir.Expr("gt", (v, best), torch.bool), ir.Expr("ne", (v, v), torch.bool)),
                             torch.bool)
            first = ir.Expr("logical_not", (found,), torch.bool)
            take = ir.Expr("logical_and", (inside, ir.Expr("logical_or", (first, better), torch.bool)), torch.bool)
            best = ir.Expr("where", (take, v, best), x.dtype)
            arg = ir.Expr("where", (take, flat, arg), torch.int64)
            found = ir.Expr("logical_or", (found, inside), torch.bool)
        return arg
    size = lead + [oh, ow]
    return TensorBox(size, x.dtype, max_loader), TensorBox(size, torch.int64, argmax_loader)


def _avg_pool_divisor(out_hw, in_hw, kernel, stride, padding, count_include_pad, divisor_override):
    """The one divisor of every window of an average pool, or None where it varies over the output (padding
    without count_include_pad, ceil_mode windows past the edge)."""
    if divisor_override:
        return divisor_override

    def divisors(o, k, s, p, n):  # per output position along one dim: (clipped to the padding, to the input)
        out = []
        for i in range(o):
            start, end = i * s - p, min(i * s - p + k, n + p)
            out.append((end - start, min(end, n) - max(start, 0)))
        return out
    dh, dw = (divisors(o, k, s, p, n) for o, n, k, s, p in zip(out_hw, in_hw, kernel, stride, padding))
    pick = 0 if count_include_pad else 1
    sizes = {a[pick] * b[pick] for a in dh for b in dw}
    return sizes.pop() if len(sizes) == 1 else None


@reg(aten.avg_pool2d.default)
def _avg_pool2d(x, kernel, stride=(), padding=0, ceil_mode=False, count_include_pad=True, divisor_override=None):
    """The sum of the taps (out-of-bounds taps are 0) over a divisor; declined where the divisor varies over
    the output (padding without count_include_pad, ceil_mode windows past the edge) or windows are large."""
    if not floaty(x.dtype) or x.ndim not in (3, 4):
        return NotImplemented
    (kh, kw), (sh, sw), (ph, pw) = _pair(kernel), _pair(stride or kernel), _pair(padding)
    oh, ow = out().shape[-2:]
    h, w = int(x.size[-2]), int(x.size[-1])
    if kh * kw > MAX_POOL_TAPS:
        return NotImplemented
    div = _avg_pool_divisor((oh, ow), (h, w), (kh, kw), (sh, sw), (ph, pw), count_include_pad, divisor_override)
    if div is None:
        return NotImplemented
    acc = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    lead = list(x.size[:-2])
    zero = ir.Expr("const", (0.0,), acc)

    def tap(a, c):
        def loader(idx):
            *b, i, j = idx
            hi, wi = i * sh - ph + a, j * sw - pw + c
            e = P._cast_expr(x.loader(list(b) + [P.clamp(hi, h - 1), P.clamp(wi, w - 1)]), acc)
            for v, n in ((hi, h), (wi, w)):
                if ph or pw or ceil_mode:
                    iv = ir.Expr("index", (v,), torch.int64)
                    inside = ir.Expr("logical_and", (ir.Expr("ge", (iv, ir.Expr("const", (0,), torch.int64)), torch.bool),
                                                     ir.Expr("lt", (iv, ir.Expr("const", (n,), torch.int64)), torch.bool)), torch.bool)
                    e = ir.Expr("where", (inside, e, zero), acc)
            return e
        return TensorBox(lead + [oh, ow], acc, loader)
    total = None
    for a in range(kh):
        for c in range(kw):
            total = tap(a, c) if total is None else P.add(total, tap(a, c))
    return P.cast(P.div(total, float(div)), x.dtype)


def _window_of(i, k: int, s: int, p: int, n_out: int) -> tuple:
    """The one pooling window along a dim (kernel k <= stride s, padding p) that may hold input index i,
    o = (i + p) // s: (o clamped to the output, whether o is a window and holds i)."""
    i64 = lambda v: ir.Expr("const", (v,), torch.int64)  # noqa: E731
    o = ir.FloorDiv(i + p, s)
    ov = ir.Expr("index", (o,), torch.int64)
    ok = ir.Expr("logical_and", (ir.Expr("ge", (ov, i64(0)), torch.bool),
                                 ir.Expr("lt", (ov, i64(n_out)), torch.bool)), torch.bool)
    if k < s:   # (k == s: the window starting at or before i always reaches it)
        ok = ir.Expr("logical_and", (ok, ir.Expr("lt", (ir.Expr("index", (i + p - o * s,), torch.int64), i64(k)),
                                                 torch.bool)), torch.bool)
    return P.clamp(o, n_out - 1), ok


def _pool_backward(dy, x, kernel, stride, padding, term) -> TensorBox | None:
    """The gradient of a 2-d pooling without dilation whose windows do not overlap, pointwise over the input:
    term(dy's loaded value at the window holding the element, that window's index list, the element's flat
    index, whether a window holds it). As a loader it fuses into what reads it (densenet121's batch norm
    backward). GPU only: ATen's CPU kernels were not measured against it."""
    if ir.GRAPH.target != "gpu":
        return None
    (kh, kw), (sh, sw), (ph, pw) = _pair(kernel), _pair(stride or kernel), _pair(padding)
    oh, ow = int(dy.size[-2]), int(dy.size[-1])
    w = int(x.size[-1])
    if kh > sh or kw > sw:
        # overlapping windows (densenet121's 3x3 stride-2 max pool): a gather over 4 windows took 0.19 ms of its
        # training step as a Triton kernel, ATen's 0.05 ms
        return None
    acc = torch.float32 if dy.dtype in (torch.float16, torch.bfloat16) else dy.dtype
    # dy computed once: densenet121's is a sum of its dense block's slices, which the batch norm backward
    # reading the gradient would recompute in each of its passes
    dy = P.realize(dy)

    def loader(idx):
        *b, i, j = idx
        (oi, ok_h), (oj, ok_w) = _window_of(i, kh, sh, ph, oh), _window_of(j, kw, sw, pw, ow)
        at = list(b) + [oi, oj]
        held = ir.Expr("logical_and", (ok_h, ok_w), torch.bool)
        return P._cast_expr(term(P._cast_expr(dy.loader(at), acc), at, i * w + j, held), dy.dtype)
    return TensorBox(list(x.size), dy.dtype, loader)


@reg(aten.max_pool2d_with_indices_backward.default)
def _max_pool2d_backward(dy, x, kernel, stride, padding, dilation, ceil_mode, indices):
    """dy of each window whose argmax (indices: flat in the input's plane) is this element."""
    if not floaty(dy.dtype) or any(d != 1 for d in ([dilation] if isinstance(dilation, int) else dilation)):
        return NotImplemented
    zero = ir.Expr("const", (0.0,), torch.float32 if dy.dtype in (torch.float16, torch.bfloat16) else dy.dtype)

    def term(v, at, flat, held):
        hit = ir.Expr("logical_and", (held, ir.Expr("eq", (indices.loader(at), ir.Expr("index", (flat,), torch.int64)),
                                                    torch.bool)), torch.bool)
        return ir.Expr("where", (hit, v, zero), v.dtype)
    return _pool_backward(dy, x, kernel, stride, padding, term) or NotImplemented


@reg(aten.avg_pool2d_backward.default)
def _avg_pool2d_backward(dy, x, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override):
    """dy of each window holding this element over the window's divisor; declined where the divisor varies
    over the output, as the forward."""
    if not floaty(dy.dtype) or x.ndim not in (3, 4):
        return NotImplemented
    div = _avg_pool_divisor((int(dy.size[-2]), int(dy.size[-1])), (int(x.size[-2]), int(x.size[-1])),
                            _pair(kernel), _pair(stride or kernel), _pair(padding), count_include_pad,
                            divisor_override)
    if div is None:
        return NotImplemented
    div = float(div)
    acc = torch.float32 if dy.dtype in (torch.float16, torch.bfloat16) else dy.dtype
    zero, divisor = ir.Expr("const", (0.0,), acc), ir.Expr("const", (div,), acc)

    def term(v, at, flat, held):
        return ir.Expr("where", (held, ir.Expr("truediv", (v, divisor), acc), zero), acc)
    return _pool_backward(dy, x, kernel, stride, padding, term) or NotImplemented


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
    sum_dy = P.reduce("sum", dy, dims, dtype=acc)
    sum_dy_xhat = P.reduce("sum", P.mul(dy, xhat), dims, dtype=acc)
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


@reg(aten.nll_loss_backward.default)
def _nll_loss_backward(g, x, target, weight, reduction, ignore_index, total_weight):
    """d loss / d x: -weight[t] * g (/ total_weight for mean) at column t of each row; a compare, no scatter."""
    if x.ndim > 2:
        return NotImplemented
    xs_size = x.size if x.ndim == 2 else (sympy.Integer(1),) + x.size
    t = target if target.ndim == 1 else P.unsqueeze(target, 0)
    valid = P.pointwise("ne", t, ignore_index)
    wt = P.where(valid, 1.0, 0.0, dtype=x.dtype)
    if weight is not None:
        wt = P.mul(wt, P.gather(weight, 0, P.where(valid, t, 0)))
    gs = g if reduction == 0 else P.expand(P.reshape(g, [1]), [xs_size[0]])
    if reduction == 0 and x.ndim == 1:
        gs = P.reshape(g, [1])
    val = P.mul(P.unary("neg", wt), gs)
    if reduction == 1:
        val = P.div(val, total_weight)
    hit = P.pointwise("eq", P.iota(xs_size, 1), P.unsqueeze(t, 1))
    out = P.where(hit, P.unsqueeze(val, 1), 0.0, dtype=x.dtype)
    return out if x.ndim == 2 else P.squeeze(out, [0])


@reg(aten.hardswish_backward.default)
def _hardswish_backward(g, x):
    mid = P.mul(g, P.add(P.div(x, 3.0), 0.5))
    return P.where(P.pointwise("lt", x, -3.0), 0.0, P.where(P.pointwise("le", x, 3.0), mid, g))


@reg(aten.hardsigmoid_backward.default)
def _hardsigmoid_backward(g, x):
    inside = P.pointwise("logical_and", P.pointwise("gt", x, -3.0), P.pointwise("lt", x, 3.0))
    return P.where(inside, P.div(g, 6.0), 0.0)


@reg(aten._safe_softmax.default)
def _safe_softmax(x, dim, dtype=None):
    """softmax whose fully -inf rows give 0 instead of NaN (attention with every key masked)."""
    y = _softmax(x, dim)
    dead = P.reduce("all", P.pointwise("eq", P.cast(x, odt()), -math.inf), [dim], True)
    return P.where(dead, 0.0, y)


@reg(aten.select_backward.default)
def _select_backward(g, size, dim, index):
    dim = dim % len(size)
    index = index % size[dim]
    gx = P.unsqueeze(g, dim)
    hit = P.pointwise("eq", P.iota(size, dim), index)
    return P.where(hit, P.expand(gx, size), 0.0, dtype=odt())


@reg(aten.slice_backward.default)
def _slice_backward(g, size, dim, start, end, step):
    dim = dim % len(size)
    n = size[dim]
    start, end, _ = slice(start, end, step).indices(n)
    pads = [0, 0] * (len(size) - 1 - dim) + [start, n - start - int(g.size[dim] - 1) * step - 1]
    if step != 1:
        return NotImplemented
    return P.pad(g, pads, 0)


@reg(aten.linalg_vector_norm.default)
def _vector_norm(x, ord=2, dim=None, keepdim=False, *, dtype=None):
    d = odt()
    if not floaty(d) or x.ndim == 0 and dim not in (None, [], ()):
        return NotImplemented
    dims = dims_of(x, dim)
    a = P.unary("abs", P.cast(x, d))
    if ord == math.inf:
        return P.reduce("max", a, dims, keepdim)
    if ord == -math.inf:
        return P.reduce("min", a, dims, keepdim)
    if ord == 0:
        return P.reduce("sum", P.cast(P.pointwise("ne", a, 0.0), d), dims, keepdim)
    if ord == 1:
        return P.reduce("sum", a, dims, keepdim)
    if ord == 2:
        return P.unary("sqrt", P.reduce("sum", P.mul(a, a), dims, keepdim))
    return P.pointwise("pow", P.reduce("sum", P.pointwise("pow", a, float(ord)), dims, keepdim), 1.0 / ord)


# ------------------------------------------------------------------------------------------------ foreach
# torch._foreach_* ops (optimizers) apply one op to each tensor of a list: decomposed into that op per tensor,
# so the scheduler sees N independent pointwise loops it can fuse horizontally. Overload kinds: `List` (a list
# operand), `Scalar` (one scalar for all), `ScalarList` (a scalar per tensor), `Tensor` (one tensor operand
# for all), `default` (unary). The per-tensor op is the first overload of aten.<name> with a decomposition.
_FOREACH_PER_TENSOR = {"List": ("Tensor", "default"), "Scalar": ("Scalar", "Tensor", "default"),
                       "ScalarList": ("Scalar", "Tensor", "default"), "Tensor": ("Tensor", "default"),
                       "default": ("default",)}


def _foreach(fop: torch._ops.OpOverload):
    schema = fop._schema
    base = getattr(aten, schema.name.split("::")[1][len("_foreach_"):])
    kind = fop._overloadname
    per = [getattr(base, o) for o in _FOREACH_PER_TENSOR[kind] if hasattr(base, o)]
    per = [o for o in per if o in TABLE]
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
                ai = [a[i] if lst else TABLE[aten.select.int](a, 0, i) if pe else a
                      for a, lst, pe in zip(args, listed, per_elem)]
                ki = {k: (v[i] if listed[names.index(k)] else v) for k, v in kwargs.items()}
                r = TABLE[per[0]](*ai, **ki)
                if r is NotImplemented:
                    return NotImplemented
                res.append(r)
        finally:
            g.val = vals
        return res
    return fn


for _name in ("add", "sub", "mul", "div", "maximum", "minimum", "clamp_min", "clamp_max", "pow", "lerp", "addcmul",
              "addcdiv", "sqrt", "rsqrt", "exp", "log", "neg", "abs", "reciprocal", "sign", "sigmoid", "tanh", "sin",
              "cos", "log1p", "expm1", "erf", "floor", "ceil", "round", "trunc", "frac"):
    _pk = getattr(aten, "_foreach_" + _name, None)
    if _pk is None:
        continue
    for _ov in _pk.overloads():
        _f = getattr(_pk, _ov)
        if _ov in _FOREACH_PER_TENSOR and not any(a.alias_info is not None and a.alias_info.is_write
                                                  for a in _f._schema.arguments):
            TABLE[_f] = _foreach(_f)
