"""Pooling (max and average over 2-d windows, and their gradients), the negative log-likelihood loss and the mean
squared error loss."""
from __future__ import annotations

import math

import sympy
import torch

from ember import ir
from ember.ir import TensorBox, symbols
from ember.decomp import prims as P
from ember.decomp.common import floaty, out, registrar

aten = torch.ops.aten
ENTRIES: dict = {}   # this family's part of decomp.table.TABLE
reg = registrar(ENTRIES)


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
    NCHW: over the output width), where a reduction over each 3x3 window would be a scalar loop of 9 per
    output element, many times slower than eager's kernel. Larger windows: max/argmax reductions."""
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
    # is computed once into a buffer instead of once per window reading it
    x = P.reuse(x, max(1, (kh * kw) // (sh * sw)))

    # without dilation, a tap outside the input loads (clamped) the input's edge, a position inside the same
    # window (eager rejects padding over half the kernel, and ceil_mode windows start inside the input or
    # its left padding): it cannot change the maximum, so no `where(inside, v, -inf)`; g++ does not vectorize
    # the loop over C with those selects (their loop-invariant conditions)
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
    backward). GPU only: not measured against ATen's CPU kernels."""
    if ir.GRAPH.target != "gpu":
        return None
    (kh, kw), (sh, sw), (ph, pw) = _pair(kernel), _pair(stride or kernel), _pair(padding)
    oh, ow = int(dy.size[-2]), int(dy.size[-1])
    w = int(x.size[-1])
    if kh > sh or kw > sw:
        # overlapping windows (densenet121's 3x3 stride-2 max pool): a gather over 4 windows is slower as a
        # Triton kernel than ATen's
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


@reg(aten.mse_loss.default)
def _mse_loss(x, target, reduction=1):
    """(x - target)^2, summed or averaged over every element as eager's loss reduction: one fused reduction (as an
    ATen call it wrote the squares to memory and read them back)."""
    d = P.sub(x, target)
    sq = P.mul(d, d)
    if reduction == 0:
        return sq
    s = P.reduce("sum", sq, list(range(sq.ndim)))
    return P.div(s, ir.prod(sq.size)) if reduction == 1 else s


@reg(aten.mse_loss_backward.default)
def _mse_loss_backward(g, x, target, reduction):
    """norm * (x - target) * g, norm 2/numel (mean, rounded to x's dtype as eager's) or 2, in eager's order."""
    d = P.sub(x, target)
    n = ir.prod(x.size)
    if not symbols.same(ir.prod(d.size), n) or not symbols.is_static(n):
        return NotImplemented   # a target broadcast past x (eager's gradient has x's shape), a symbolic numel
    return P.mul(P.mul(d, 2.0 / int(n) if reduction == 1 else 2.0), g)
