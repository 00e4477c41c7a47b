"""Layouts of lowered values: whether a graph runs channels-last (NHWC), and the stride helpers the lowering
compares layouts with.

An inference graph with 4-D float convolutions runs channels-last, as cuDNN and oneDNN are much faster on it. The
convolutions take channels-last input and weight (a copy kernel where the value is not already so), their outputs
are channels-last, and a 4-D buffer computed from a channels-last buffer is stored channels-last too (its loops
then walk C innermost, see schedule.loop_order), so no layout changes happen between convolutions. Graph outputs
and arguments of ATen fallbacks get eager's strides back (a copy). Training graphs keep eager's layouts: their
saved activations would be converted at every forward/backward boundary; so does a training step in one graph
(see wants_channels_last).

Some library kernels check their arguments' layouts instead of copying what does not suit them
(ALIGNED_ARGUMENTS): such an argument is handed over in a layout they take (Graph.aligned in lower.py).
"""
from __future__ import annotations

import sympy
import torch

from ember import ir
from ember.ir import FloorDiv, ModIndex, TensorBox, symbols

CONVOLUTIONS = (torch.ops.aten.convolution.default, torch.ops.aten._convolution.default)
aten = torch.ops.aten
CHANNELS_LAST_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Library kernels that read tensor arguments with 16-byte vector loads and raise on a layout that does not allow
# them (ATen's fused CUDA attention: "attn_bias is not correctly aligned (strideH). attn_bias.stride(1) = 38809,
# and should be a multiple of 4" for a 197x197 relative-position bias stored compact), by op: the positions of
# those arguments. Each is handed over with a dense last dim and its other strides and its offset multiples of
# 16 bytes, as eager's scaled_dot_product_attention pads a bias for them (preprocess_mask) and Inductor's
# sdpa_constraint does. Matrix products and convolutions need no entry: ATen copies an operand cuBLAS, cuDNN or
# oneDNN cannot take.
ALIGN_BYTES = 16
ALIGNED_ARGUMENTS = {op: positions for name, positions in (
    ("_scaled_dot_product_efficient_attention", (0, 1, 2, 3)),
    ("_scaled_dot_product_efficient_attention_backward", (0, 1, 2, 3, 4, 5)),
    ("_scaled_dot_product_flash_attention", (0, 1, 2)),
    ("_scaled_dot_product_flash_attention_backward", (0, 1, 2, 3, 4)),
    ("_scaled_dot_product_cudnn_attention", (0, 1, 2, 3)),
    ("_scaled_dot_product_cudnn_attention_backward", (0, 1, 2, 3, 4, 8)),
) if hasattr(aten, name) for op in (getattr(aten, name).default,)}


def _multiple(e, k: int) -> bool:
    """Whether size expression e is a multiple of k at every size."""
    return int(e) % k == 0 if symbols.is_static(e) else sympy.Mod(e, k) == 0


def is_aligned(size, stride, offset, dtype: torch.dtype) -> bool:
    """Whether a strided view suits ALIGNED_ARGUMENTS' kernels: its last dim dense, every other stride and its
    offset a multiple of ALIGN_BYTES (a dim of size 1 takes no step; a broadcast dim's stride 0 is a multiple)."""
    k = max(ALIGN_BYTES // ir.itemsize(dtype), 1)
    if size and not symbols.same(size[-1], 1) and not symbols.same(stride[-1], 1):
        return False
    return _multiple(offset, k) and all(symbols.same(n, 1) or _multiple(s, k) for n, s in zip(size[:-1], stride[:-1]))


def aligned_strides(size, dtype: torch.dtype, broadcast=()) -> tuple:
    """Row-major strides for `size` whose rows (the last dim) start ALIGN_BYTES apart: the last dim padded to a
    multiple of 16 bytes, as eager pads an attention bias (a symbolic row: ((n + k - 1) // k) * k, padded at every
    size); dims in `broadcast` (never the last) get stride 0, their value stored once."""
    k = max(ALIGN_BYTES // ir.itemsize(dtype), 1)
    out, acc = [0] * len(size), 1
    for d in reversed(range(len(size))):
        if d in broadcast and d != len(size) - 1:
            continue
        out[d] = acc
        acc = acc * (int(size[d]) if symbols.is_static(size[d]) else size[d])
        if d == len(size) - 1:
            acc = -(-acc // k) * k if symbols.is_static(acc) else ir.FloorDiv(acc + k - 1, k) * k
    return tuple(out)


def channels_last_strides(size) -> tuple:
    """Strides of a 4-D [N, C, H, W] tensor stored as N, H, W, C (torch.channels_last's strides)."""
    n, c, h, w = size
    return (h * w * c, sympy.Integer(1), w * c, c)


def wants_channels_last(gm: torch.fx.GraphModule) -> bool:
    """Whether gm runs channels-last: an inference graph (ember.autograd marks those) with a 4-D, non-transposed
    float convolution (Inductor's rule is similar: any 4-D convolution in the graph), and no convolution's
    backward. A training step in one graph (its backward inside, on the inference path) keeps eager's layouts:
    channels-last, its batch norms' per-channel sums lose more than its convolutions gain, and with only the
    forward channels-last each convolution's backward would convert its arguments back."""
    if not (isinstance(getattr(gm, "meta", None), dict) and gm.meta.get("ember_inference")):
        return False
    conv = False
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if n.target is aten.convolution_backward.default:
            return False
        if n.target in CONVOLUTIONS and not conv:
            v = n.args[0].meta.get("val") if isinstance(n.args[0], torch.fx.Node) else None
            conv = isinstance(v, torch.Tensor) and v.ndim == 4 and v.dtype in CHANNELS_LAST_DTYPES and not n.args[6]
    return conv


_FLAT = sympy.Symbol("flat", integer=True, nonnegative=True)


def value_key(x: TensorBox, stride: tuple) -> tuple | None:
    """What a buffer of `stride` holding x would store at each storage offset (x's value Expr at the index an
    offset `flat` stands for: each dimension's index `flat // stride % (the next larger stride / stride)`), its
    dtype and its layout's (stride, size) steps: equal keys, equal storage, whatever the sizes and strides (a
    matrix, and its transpose stored transposed; rows padded too). None for overlapping layouts, for an empty
    one, and for symbolic sizes."""
    if not all(symbols.is_static(n) for n in (*x.size, *stride)):
        return None
    size = [int(n) for n in x.size]
    stride = [int(n) for n in stride]
    if 0 in size:
        return None
    steps = sorted((stride[d], size[d]) for d in range(len(size)) if size[d] != 1)
    reach = 1
    for st, n in steps:
        if st < reach:
            return None
        reach = st * n
    period = {st: (steps[i + 1][0] // st if i + 1 < len(steps) else n) for i, (st, n) in enumerate(steps)}
    idx = [sympy.Integer(0) if n == 1 else ir.simplify_index(ModIndex(FloorDiv(_FLAT, st), period[st]))
           for n, st in zip(size, stride)]
    merged: list = []   # (steps of dims that abut merge: a dense layout's key is its size, whatever its shape)
    for st, n in steps:
        if merged and merged[-1][0] * merged[-1][1] == st:
            merged[-1] = (merged[-1][0], merged[-1][1] * n)
        else:
            merged.append((st, n))
    return x.loader(idx), x.dtype, tuple(merged)


def padded(size, stride) -> bool:
    """Whether a static layout has gaps between its rows (padded_product's results, an aligned bias)."""
    if not all(symbols.is_static(n) for n in (*size, *stride)):
        return False
    reach = 1
    for st, n in sorted((int(st), int(n)) for n, st in zip(size, stride) if int(n) != 1):
        if st > reach:
            return True
        reach = st * n
    return False


def same_strides(size, a, b) -> bool:
    """Whether strides a and b lay out a tensor of `size` alike: a dim of size 1 has no step, so its stride does
    not matter (a 1x1 convolution's weight is channels-last as it is, with no copy)."""
    return all(symbols.same(x, y) for n, x, y in zip(size, a, b) if not symbols.same(n, 1))


def is_dense(v) -> bool:
    """Whether v's strides describe a non-overlapping, dense layout (then outputs use eager's strides)."""
    if not isinstance(v, torch.Tensor):
        return False
    if not symbols.HINTS or not symbols.has_symbols(v):   # (HINTS: a symbolic graph is being lowered)
        if v.numel() == 0:
            return False
        pairs = sorted((s, n) for s, n in zip(v.stride(), v.shape) if n != 1)
        expected = 1
        for s, n in pairs:
            if s != expected:
                return False
            expected *= n
        return True
    shape, stride = symbols.sym_sizes(v.shape), symbols.sym_sizes(v.stride())
    if any(symbols.same(n, 0) for n in shape):
        return False
    # (symbolic strides ordered by the example's values; each step is then checked at every size)
    pairs = sorted(((s, n) for s, n in zip(stride, shape) if not symbols.same(n, 1)),
                   key=lambda p: (symbols.hint(p[0]), symbols.hint(p[1])))
    expected = 1
    for s, n in pairs:
        if not symbols.same(s, expected):
            return False
        expected = expected * n
    return True
