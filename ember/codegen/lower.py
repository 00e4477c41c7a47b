"""Lowering: an ATen-level fx graph -> a list of Buffers (loop IR), in execution order.

Each call_function node goes through ember.decomp.table: a decomposition builds TensorBoxes from
primitives (lazy: pointwise chains and views stay loaders), an extern op (mm, conv, SDPA) becomes an
ExternBuffer, and an op with no entry stays an ATen call (an ExternBuffer marked `fallback`, counted and
logged under EMBER_LOGS=fallbacks). A box is materialized (`realize`) when it is a graph output, an extern's
argument, or read by several nodes and costly to recompute.

Layout: an inference graph with 4-D float convolutions runs channels-last (NHWC), as cuDNN and oneDNN are
much faster on it (oneDNN here: resnet18 b8 224px eager 1.49 s NCHW, 0.73 s channels-last). The convolutions
take channels-last input and weight (a copy kernel where the value is not already so), their outputs are
channels-last, and a 4-D buffer computed from a channels-last buffer is stored channels-last too (its loops
then walk C innermost, see schedule.loop_order), so no layout changes happen between convolutions. Graph
outputs and arguments of ATen fallbacks get eager's strides back (a copy). Training graphs keep eager's
layouts: their saved activations would be converted at every forward/backward boundary; so does a training
step in one graph (measured slower channels-last on the GPU, see wants_channels_last).

Convolution epilogues (plan_conv_fusions): in an inference graph on the CPU, an eval batch norm that alone reads
a convolution's output is folded into it: the weight is scaled per output channel and the bias shifted, both
computed by a kernel on every call from the current parameters (the kernel that copied the weight to
channels-last before; a cached fold would be stale after `p.data.mul_(...)`, which no version counter sees).
Where oneDNN's fused convolutions exist (torch.ops.mkldnn._convolution_pointwise, float32, channels-last graph),
the relu or residual add (+ relu) after it become post-ops of that one call: the output is written once, where
a separate batch-norm/relu pass read and wrote it again (resnet18 b8 224px: 20 fewer passes over activations).

CPU float32 products of a linear layer's layout are oneDNN inner products, their bias inside (cpu_matmul); in an
inference graph a relu/gelu/silu that alone reads one becomes its post-op (plan_linear_fusions).
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import itertools
import math
import operator
import os
import threading

import sympy
import torch
import torch.utils._pytree as pytree

from ember import config
from ember.errors import CannotLower
from ember import ir
from ember.ir import Buffer, ExternBuffer, FloorDiv, InputBuffer, ModIndex, Pointwise, Reduction, TensorArg, \
    TensorBox
from ember.tools import collector
from ember.tools.logs import get_logger

fallback_log = get_logger("fallbacks")
FALLBACK_COUNTS: collections.Counter = collections.Counter()  # ATen op name -> times kept as an ATen call


@dataclasses.dataclass
class LoweredGraph:
    inputs: list[InputBuffer]  # one per placeholder, in order (None for non-tensor placeholders)
    buffers: list[Buffer]  # computed and extern buffers in execution order
    outputs: list  # per graph output: TensorArg (a view of a buffer) or a python constant
    fallbacks: list[str]
    constants: dict = dataclasses.field(default_factory=dict)  # buffer name -> tensor held by the graph (get_attr)


CONVOLUTIONS = (torch.ops.aten.convolution.default, torch.ops.aten._convolution.default)
aten = torch.ops.aten
CHANNELS_LAST_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def channels_last_strides(size) -> tuple:
    """Strides of a 4-D [N, C, H, W] tensor stored as N, H, W, C (torch.channels_last's strides)."""
    n, c, h, w = size
    return (h * w * c, sympy.Integer(1), w * c, c)


def wants_channels_last(gm: torch.fx.GraphModule) -> bool:
    """Whether gm runs channels-last: an inference graph (ember.autograd marks those) with a 4-D, non-transposed
    float convolution (Inductor's rule is similar: any 4-D convolution in the graph), and no convolution's
    backward. A training step in one graph (its backward inside, on the inference path) keeps eager's layouts:
    densenet121's step on the H100 with forward and backward channels-last took 8.34 ms against 7.16 NCHW (the
    convolutions 0.74 ms faster, the batch norms' per-channel sums over channels-last 1.18 ms slower: 530
    kernels against 294; bench/results/gpu_2026-11-26_s15_h100_train_channels_last_tried.log), and with only the
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


def _mkldnn_op(name: str):
    """torch.ops.mkldnn.<name> where this torch build has it and oneDNN runs (else None: the ATen path)."""
    try:
        return getattr(torch.ops.mkldnn, name) if torch.backends.mkldnn.is_available() else None
    except (AttributeError, RuntimeError):
        return None


@dataclasses.dataclass
class ConvFusion:
    """conv [-> eval batch norm] [-> add(other)] [-> relu], computed as one convolution at `last` (see the module
    docstring). The nodes before `last` are not lowered; every input is defined before `last` (the residual
    may come from a later branch, e.g. resnet's downsample, so the call runs where the chain ends)."""
    conv: torch.fx.Node
    bn: torch.fx.Node | None
    other: torch.fx.Node | None  # the residual added
    relu: bool
    last: torch.fx.Node
    skip: tuple  # the chain's nodes before `last`


def _eval_bn_args(n: torch.fx.Node):
    """(x, weight, bias, running_mean, running_var, eps) of an eval-mode batch norm node, else None."""
    if n.op != "call_function" or n.kwargs:
        return None
    if n.target is aten._native_batch_norm_legit_no_training.default and len(n.args) == 7:
        return n.args[:5] + (n.args[6],)
    if n.target is aten.native_batch_norm.default and len(n.args) == 8 and n.args[5] is False:
        return n.args[:5] + (n.args[7],)
    return None


def _only_user(n: torch.fx.Node):
    return next(iter(n.users)) if len(n.users) == 1 else None


def _channel_vector(a, v: torch.Tensor) -> bool:
    """a is None or a graph value of shape [C] and v's dtype (a batch-norm parameter or statistic, a bias)."""
    av = a.meta.get("val") if isinstance(a, torch.fx.Node) else None
    return a is None or (isinstance(av, torch.Tensor) and av.dtype == v.dtype and tuple(av.shape) == (v.shape[1],))




def plan_conv_fusions(gm: torch.fx.GraphModule, channels_last: bool) -> dict:
    """{last node: ConvFusion} for the convolutions of a CPU inference graph (float32/64) followed by an eval
    batch norm (folded) or, on oneDNN, by a relu or residual add (post-ops)."""
    if not config.FUSE_CONVOLUTIONS or not (isinstance(getattr(gm, "meta", None), dict) and gm.meta.get("ember_inference")):
        return {}
    pointwise = _mkldnn_op("_convolution_pointwise")
    plans, claimed = {}, set()
    for conv in gm.graph.nodes:
        if conv.op != "call_function" or conv.target is not aten.convolution.default or len(conv.args) != 9 \
                or conv.kwargs or conv.args[6] or not isinstance(conv.args[1], torch.fx.Node):
            continue
        v = conv.meta.get("val")
        if not isinstance(v, torch.Tensor) or v.device.type != "cpu" or v.dtype not in (torch.float32, torch.float64) \
                or not _channel_vector(conv.args[2], v):
            continue
        chain, tail, bn, other, relu = [conv], conv, None, None, False
        u = _only_user(conv)
        bn_args = _eval_bn_args(u) if u is not None else None
        if bn_args is not None and bn_args[0] is conv and conv not in bn_args[1:] and None not in bn_args[3:5] \
                and all(_channel_vector(a, v) for a in bn_args[1:5]):
            outs = list(u.users)
            if all(o.target is operator.getitem for o in outs) and [o.args[1] for o in outs].count(0) == 1 \
                    and not any(o.args[1] != 0 and o.users for o in outs):
                bn, tail = u, next(o for o in outs if o.args[1] == 0)
                chain += [u, *outs]
        if pointwise is not None and channels_last and v.ndim == 4 and v.dtype == torch.float32:  # oneDNN post-ops
            u = _only_user(tail)
            if u is not None and u not in claimed and u.target is aten.add.Tensor and len(u.args) == 2 \
                    and set(u.kwargs) <= {"alpha"} and u.kwargs.get("alpha", 1) == 1 and hasattr(pointwise, "binary"):
                o = u.args[1] if u.args[0] is tail else u.args[0]
                ov, uv = getattr(o, "meta", {}).get("val"), u.meta.get("val")
                if isinstance(o, torch.fx.Node) and o is not tail and isinstance(ov, torch.Tensor) and isinstance(
                        uv, torch.Tensor) and ov.shape == v.shape == uv.shape and ov.dtype == v.dtype == uv.dtype:
                    chain.append(u)
                    other, tail, u = o, u, _only_user(u)
            if u is not None and u not in claimed and u.target is aten.relu.default and u.args[0] is tail:
                chain.append(u)
                relu, tail = True, u
        if tail is conv:
            continue  # nothing to fuse
        claimed.update(chain)
        plans[tail] = ConvFusion(conv, bn, other, relu, tail, tuple(c for c in chain if c is not tail))
    return plans


def lower_conv_fusion(g: "Graph", f: ConvFusion, env: dict):
    """The fused convolution of f: the folded weight and bias (pointwise boxes, realized by the extern call),
    then one oneDNN call with post-ops, or the ATen convolution (no post-ops: float64, no oneDNN)."""
    from ember.decomp import prims as P
    x, w, b, stride, padding, dilation, _, output_padding, groups = \
        [env[a] if isinstance(a, torch.fx.Node) else a for a in f.conv.args]
    if f.bn is not None:
        _, gamma, beta, mean, var, eps = [env[a] if isinstance(a, torch.fx.Node) else a for a in _eval_bn_args(f.bn)]
        # as eager's CPU kernel: bn(y) = y * scale + shift, scale = gamma / sqrt(var + eps), shift = beta - mean * scale
        scale = P.unary("rsqrt", P.add(var, eps))
        if gamma is not None:
            scale = P.mul(scale, gamma)
        shift = P.mul(P.sub(b, mean) if b is not None else P.unary("neg", mean), scale)
        b = P.add(shift, beta) if beta is not None else shift
        w = P.mul(w, P.reshape(scale, [-1] + [1] * (w.ndim - 1)))
    pointwise = _mkldnn_op("_convolution_pointwise")
    if f.other is not None:
        return g.extern(pointwise.binary, (x, env[f.other], w, b, padding, stride, dilation, groups, "add", None,
                                           "relu" if f.relu else None, [], None), {}, fallback=False, channels_last=True)
    if f.relu:
        return g.extern(pointwise.default, (x, w, b, padding, stride, dilation, groups, "relu", [], None), {},
                        fallback=False, channels_last=True)
    return g.extern(aten.convolution.default, (x, w, b, stride, padding, dilation, False, output_padding, groups),
                    {}, fallback=False)


_POINTWISE_CONV = _mkldnn_op("_convolution_pointwise")
# every library convolution a lowered graph may call (tests and tools look for these)
CONV_CALLS = CONVOLUTIONS + tuple(getattr(_POINTWISE_CONV, o, None) for o in ("default", "binary")
                                  if getattr(_POINTWISE_CONV, o, None) is not None)


# CPU float32 products as oneDNN inner products (torch.ops.mkldnn._linear_pointwise: a @ w.T for a row-major
# input and a row-major [N, K] weight, a linear layer's own layout): on this 2-core AMD EPYC (Zen 5) ATen's mm
# (MKL) ran BERT's and the MLP's products 2.2-2.3x slower than oneDNN, one or two threads (1024x768x3072, two
# threads: 23.8 vs 11.0 ms), whatever the output buffer. Below ~2M multiply-adds oneDNN's ~12 us per call loses
# (1x64x64: 13 vs 2 us). A weight that is not row-major (x @ W of a [K, N] weight, the backward's products) stays with
# MKL: oneDNN reordered such a weight on every call, 3x slower than MKL. The weight is read as it is on every
# call (no packed copy kept across calls: `p.data.mul_(...)` changes a weight without bumping its version).
_LINEAR = _mkldnn_op("_linear_pointwise")
ONEDNN_MIN_WORK = 1 << 21  # multiply-adds (M*K*N) from which a product goes to oneDNN


def _onednn_product(m, k, n, dtypes, device) -> bool:
    """Whether an [m, k] @ [k, n] product of these dtypes on this device goes to oneDNN (see config.ONEDNN_MATMULS)."""
    return _LINEAR is not None and config.ONEDNN_MATMULS and device == "cpu" and all(d == torch.float32 for d in dtypes) \
        and m * k * n >= ONEDNN_MIN_WORK


def cpu_matmul(g: "Graph", a: TensorBox, b: TensorBox, bias: TensorBox | None = None,
               post_op: tuple = ("none", [], ""), any_weight: bool = False):
    """a @ b (+ bias, then oneDNN's post_op: (attr, scalars, algorithm)) for 2-D float32 CPU values as one
    oneDNN inner product, or None (then the caller keeps ATen's mm). `a` is made row-major where it is not
    (a copy of M*K elements against M*K*N multiply-adds). `b` must be the transpose of a row-major [N, K]
    weight, unless any_weight (a planned fusion: then another layout is copied into that one)."""
    v = g.val
    if not isinstance(v, torch.Tensor) or a.ndim != 2 or b.ndim != 2:
        return None
    m, k, n = (int(s) for s in (a.size[0], a.size[1], b.size[1]))
    if not _onednn_product(m, k, n, (a.dtype, b.dtype, v.dtype), v.device.type):
        return None
    from ember.decomp import prims as P
    w = P.permute(b, [1, 0])
    if w.strided is None or tuple(int(s) for s in w.strided[1]) != (k, 1):
        if not any_weight:
            return None
        w = g.realize(TensorBox(w.size, w.dtype, w.loader), stride=(k, 1))
    if a.strided is None or tuple(int(s) for s in a.strided[1]) != (k, 1):
        a = g.realize(TensorBox(a.size, a.dtype, a.loader), stride=(k, 1))
    if bias is not None and (bias.strided is None or tuple(int(s) for s in bias.strided[1]) != (1,)):
        bias = g.realize(TensorBox(bias.size, bias.dtype, bias.loader), stride=(1,))
    return g.extern(_LINEAR.default, (a, w, bias, *post_op), {}, fallback=False)


# activations that oneDNN applies to a product's result as it writes it (post-ops), as the ATen op's (attr,
# scalars, algorithm) given its arguments, or None; each agrees with eager to ~1 ulp (gelu's erf and tanh forms
# 1.4e-6 / 4.8e-7 at most over [-12, 12], relu exactly, silu 9.5e-7), and saves a kernel's pass over the result
LINEAR_POST_OPS = {
    aten.relu.default: lambda *a, **k: ("relu", [], "") if not a[1:] and not k else None,
    aten.gelu.default: lambda x, approximate="none": ("gelu", [], approximate) if approximate in ("none", "tanh") else None,
    aten.silu.default: lambda *a, **k: ("swish", [], "") if not a[1:] and not k else None,
}
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


@dataclasses.dataclass
class LinearFusion:
    """addmm(bias, x, weight.t()) or mm(x, weight.t()) [-> views] -> activation of a CPU inference graph, computed
    at `last` (the activation) as one oneDNN inner product with the bias and the activation as post-ops."""
    mm: torch.fx.Node
    post_op: tuple
    last: torch.fx.Node
    skip: tuple  # the addmm and the views


def plan_linear_fusions(gm: torch.fx.GraphModule) -> dict:
    """{activation node: LinearFusion} for the linear layers of a CPU float32 inference graph whose only reader
    is (through views) a relu, gelu or silu, where the product goes to oneDNN (cpu_matmul)."""
    if _LINEAR is None or not config.FUSE_LINEARS or not (isinstance(getattr(gm, "meta", None), dict)
                                                   and gm.meta.get("ember_inference")):
        return {}
    plans = {}
    for mm in gm.graph.nodes:
        if mm.op != "call_function" or mm.target not in (aten.addmm.default, aten.mm.default) or mm.kwargs \
                or len(mm.args) != (3 if mm.target is aten.addmm.default else 2) \
                or not all(isinstance(a, torch.fx.Node) for a in mm.args):
            continue
        v, (bv, av, wv) = mm.meta.get("val"), [a.meta.get("val") for a in mm.args[-3:]] if len(mm.args) == 3 \
            else [None] + [a.meta.get("val") for a in mm.args]
        if not all(isinstance(t, torch.Tensor) for t in (v, av, wv)) or av.ndim != 2 or wv.ndim != 2 \
                or tuple(wv.stride()) != (1, wv.shape[0]) \
                or (bv is not None and (not isinstance(bv, torch.Tensor) or tuple(bv.shape) != (v.shape[1],)
                                        or bv.dtype != v.dtype)) \
                or not _onednn_product(av.shape[0], av.shape[1], wv.shape[1], (av.dtype, wv.dtype, v.dtype), v.device.type):
            continue
        chain, u = [mm], _only_user(mm)
        while u is not None and u.target in _VIEWS and u.args[0] is chain[-1]:
            chain.append(u)
            u = _only_user(u)
        how = LINEAR_POST_OPS.get(u.target) if u is not None and u.op == "call_function" else None
        post_op = how(*u.args, **u.kwargs) if how is not None and u.args and u.args[0] is chain[-1] else None
        uv = u.meta.get("val") if u is not None else None
        if post_op is None or not isinstance(uv, torch.Tensor) or uv.dtype != v.dtype or uv.numel() != v.numel():
            continue
        plans[u] = LinearFusion(mm, post_op, u, tuple(chain))
    return plans


def lower_linear_fusion(g: "Graph", f: LinearFusion, env: dict):
    """The fused linear of f: one oneDNN call (its weight copied to row-major [N, K] first where it is not)."""
    from ember.decomp import prims as P
    bias, a, b = (env[x] for x in f.mm.args) if len(f.mm.args) == 3 else (None, *(env[x] for x in f.mm.args))
    with g.lowering_as(f.mm.meta["val"]) as out_val:
        y = cpu_matmul(g, a, b, bias, f.post_op, any_weight=True)
    return P.reshape(y, list(out_val.shape))


@dataclasses.dataclass(eq=False)
class SiblingProducts:
    """Linear layers reading one input (BERT's query, key and value projections) on CUDA: one library product of
    the input and their weights concatenated, each layer's result a slice of it plus its bias (lazy, as
    decomp.table's addmm). A wider product fills the H100's SMs better: three 1024x768x768 float32 products
    took 122 us, one 1024x768x2304 108 us, 112 with the weights concatenated on each call (bench/gpu_sibling_mm.py)."""
    members: list   # the addmm nodes, in graph order
    parts: dict | None = None   # node -> its result, made when the first member is lowered ({}: lowered one by one)


def plan_sibling_products(gm: torch.fx.GraphModule) -> dict:
    """{addmm node: SiblingProducts} for a CUDA float32 inference graph's linear layers (addmm of a 1-D bias, a
    2-D input and a 2-D weight) that read the same input, where decomp.table's addmm would take the library
    product and add the bias lazily (not a result the graph returns, nor one a library call reads a part of)."""
    if not (isinstance(getattr(gm, "meta", None), dict) and gm.meta.get("ember_inference")):
        return {}
    from ember.decomp.table import _library_reads_part, _returned
    by_input: dict = {}
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is not aten.addmm.default or n.kwargs or len(n.args) != 3 \
                or not all(isinstance(a, torch.fx.Node) for a in n.args):
            continue
        v, (bv, av, wv) = n.meta.get("val"), [a.meta.get("val") for a in n.args]
        if not all(isinstance(t, torch.Tensor) for t in (v, bv, av, wv)) \
                or {t.dtype for t in (v, bv, av, wv)} != {torch.float32} or av.ndim != 2 or wv.ndim != 2 \
                or tuple(bv.shape) != (v.shape[1],) or _returned(n) or _library_reads_part(n):
            continue
        by_input.setdefault(_value_key(n.args[1]), []).append(n)
    plans = {}
    for ms in by_input.values():
        if len(ms) > 1:
            group = SiblingProducts(ms)
            plans.update((m, group) for m in ms)
    return plans


def _value_key(n: torch.fx.Node):
    """n, or for a view of a value (each linear layer flattens the same input with a view of its own) the view's
    shape and its source's key: views alike give equal keys."""
    if n.op == "call_function" and n.target in (aten.view.default, aten._unsafe_view.default, aten.reshape.default) \
            and isinstance(n.args[0], torch.fx.Node):
        return ("view", _value_key(n.args[0]), tuple(n.args[1]))
    return n


def lower_sibling_product(g: "Graph", s: SiblingProducts, node: torch.fx.Node, env: dict) -> "TensorBox | None":
    """node's result as a slice of its group's product (made at the group's first member), or None where the
    group cannot be made there (a weight or bias computed later in the graph): then each is lowered alone."""
    from ember.decomp import prims as P
    if s.parts is None:
        s.parts = {}
        # weights kept as [N, K] and read through t() (a linear layer's) are concatenated in that layout (a plain
        # copy), the product reading the result transposed, as it read each weight
        stored = [m.args[2].args[0] if m.args[2].op == "call_function" and m.args[2].target is aten.t.default
                  else None for m in s.members]
        transposed = all(w is not None for w in stored)
        weights = stored if transposed else [m.args[2] for m in s.members]
        if all(env.get(a) is not None for a in [*weights, *(m.args[0] for m in s.members)]):
            if transposed:
                weights = P.permute(P.realize(P.cat([env[w] for w in weights], 0, torch.float32)), [1, 0])
            else:
                weights = P.cat([env[w] for w in weights], 1, torch.float32)
            x = env[s.members[0].args[1]]
            width = int(weights.size[1])
            with g.lowering_as(torch.empty((int(x.size[0]), width), dtype=torch.float32, device="meta")):
                prod = g.extern(aten.mm.default, (x, weights), {}, fallback=False)
            start = 0
            for m in s.members:
                n_cols = int(m.meta["val"].shape[1])
                s.parts[m] = P.add(P.slice_(prod, 1, start, start + n_cols), env[m.args[0]], dtype=torch.float32)
                start += n_cols
    return s.parts.get(node)




def plan_cat_chains(gm: torch.fx.GraphModule) -> dict:
    """{cat node: (the cat it extends or None, channels of the chain's widest cat)} for chains of channel
    concatenations of a channels-last graph where each one's pieces begin with the previous one's (densenet's
    dense blocks: cat([x0]), cat([x0, f1]), cat([x0, f1, f2]), ...). A chain shares one buffer as wide as its
    widest cat, and each cat is a window of its first channels onto it: a piece is copied in once, where
    separate concatenations copied every earlier piece again (quadratic in the block's depth)."""
    cats = []
    for n in gm.graph.nodes if config.SHARE_CAT_BUFFERS else ():
        if n.op != "call_function" or n.target is not aten.cat.default or n.kwargs or len(n.args) != 2 \
                or n.args[1] not in (1, -3) or not isinstance(n.meta.get("val"), torch.Tensor):
            continue
        v, pieces = n.meta["val"], n.args[0]
        if v.ndim != 4 or v.device.type != "cpu" or not v.dtype.is_floating_point or not all(
                isinstance(p, torch.fx.Node) and isinstance(p.meta.get("val"), torch.Tensor) and p.meta["val"].ndim == 4
                and p.meta["val"].dtype == v.dtype for p in pieces):
            continue
        cats.append(n)
    links, extended = {}, set()
    for i, n in enumerate(cats):
        for prev in reversed(cats[:i]):  # the latest cat whose pieces begin this one's
            pp = prev.args[0]
            if prev not in extended and len(pp) < len(n.args[0]) and list(n.args[0][:len(pp)]) == list(pp) \
                    and prev.meta["val"].shape[0::2] == n.meta["val"].shape[0::2]:
                links[n] = prev
                extended.add(prev)
                break
    chains = {}
    for n in cats:
        if n in links or n not in extended:
            continue
        chain = [n]
        while chain[-1] in extended:
            chain.append(next(m for m, p in links.items() if p is chain[-1]))
        width = int(chain[-1].meta["val"].shape[1])
        for k, m in enumerate(chain):
            chains[m] = (chain[k - 1] if k else None, width)
    return chains


def cat_chain_first(pieces: list, width: int) -> torch.Tensor:
    """The first cat of a chain: a channels-last buffer `width` channels wide, the pieces copied into its first
    channels; returns the window onto those."""
    n, _, h, w = pieces[0].shape
    out = torch.empty((n, width, h, w), dtype=pieces[0].dtype, memory_format=torch.channels_last)
    return cat_chain_extend(out[:, :0], pieces)


def cat_chain_extend(prev: torch.Tensor, pieces: list) -> torch.Tensor:
    """The next cat of a chain: the window onto the shared buffer widened past prev's channels by the pieces,
    copied in (prev's channels, which its readers see, stay as they are)."""
    c = prev.shape[1]
    size = (prev.shape[0], c + sum(p.shape[1] for p in pieces), prev.shape[2], prev.shape[3])
    out = prev.as_strided(size, prev.stride(), prev.storage_offset())
    for p in pieces:
        out[:, c:c + p.shape[1]].copy_(p)
        c += p.shape[1]
    return out


def lower_cat_chain(g: "Graph", pieces: list):
    """A cat of a chain (plan_cat_chains) as a call of cat_chain_first / cat_chain_extend; None where the
    pieces are not the node's (a decomposition dropped empty ones)."""
    prev, width = g.cat_chains[g.node]
    if len(pieces) != len(g.node.args[0]) or (prev is not None and prev not in g.cat_views):
        return None
    n, c, h, w = (int(s) for s in g.val.shape)
    stride = (h * w * width, 1, w * width, width)
    if prev is None:
        out = g.extern(cat_chain_first, (pieces, width), {}, fallback=False, out_stride=stride)
    else:
        out = g.extern(cat_chain_extend, (g.cat_views[prev], pieces[len(prev.args[0]):]), {}, fallback=False,
                       out_stride=stride)
    g.cat_views[g.node] = out
    return out


# --------------------------------------------------------------------------------------- split reductions
SPLIT_KINDS = ("sum", "prod", "max", "min", "any", "all")   # argmax/argmin: the first index would need both
GPU_SMS = 132             # H100's; torch.cuda's own count where a GPU is visible (gpu_sm_count)


@functools.lru_cache(maxsize=None)
def gpu_sm_count() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else GPU_SMS


def cpu_threads() -> int:
    return os.cpu_count() or 1   # what cpp.py's OpenMP loops share their work among


GPU_COLUMN_STRIP = 8   # columns a Triton program takes at least in a column reduction (triton.column_config)


# GPU row reductions of >= 16384 elements are split while fewer than this many SMs' worth of rows: one program a row
# over 256 rows of 16384 (densenet121's first dense block, batch-norm backward sums) streamed 1.6 TB/s
LONG_ROWS_SPLIT_BELOW = 2


def reduction_parts(out: int, rnumel: int, column: bool, target: str) -> int:
    """Into how many parts to split a reduction of `rnumel` elements for each of `out` results (1: none), so the
    partial reductions fill the machine the printer's loops leave idle. column: the reduction runs down columns
    (adjacent results adjacent in memory, the reduced index strides over rows).
    - gpu (Triton): a row reduction is one program per result, a column one a strip of >= 8 columns per program
      (triton.column_config); fewer than the 132 SMs (rows; 2x that for rows of >= 16384 elements,
      LONG_ROWS_SPLIT_BELOW) / 2x that (strips) leave SMs idle: the GPT-2
      layer-norm backward's column sums over 2048 x 768 ran on 96 programs, 20 us per layer against the 9 of
      Inductor's split. Parts are chosen for ~4 programs per SM, each part at least 32 rows (columns) or 1024
      elements (rows).
    - cpu (C++): rows are shared among OpenMP threads (one row: its loop is), column groups in blocks of >= 16
      results (cpp._column_group); split when fewer rows / blocks than threads and the work is worth it.
    The count is a divisor of rnumel (no ragged last part), the smallest >= the wanted one."""
    if out < 1 or rnumel < 2:
        return 1
    if target == "gpu":
        sms = gpu_sm_count()
        if column:
            strip = GPU_COLUMN_STRIP
            busy, want, min_chunk = math.ceil(out / strip), math.ceil(4 * sms * strip / out), 32
            if busy >= 2 * sms or rnumel < 256:
                return 1
        else:
            busy, want, min_chunk = out, math.ceil(4 * sms / out), 1024
            if rnumel < 8192 or busy >= sms * (LONG_ROWS_SPLIT_BELOW if rnumel >= 16384 else 1):
                return 1
    else:
        threads = cpu_threads()
        if out * rnumel < 4 * 32768:
            return 1
        if column:
            busy, want, min_chunk = math.ceil(out / 16), math.ceil(2 * 16 * threads / out), 64
        else:
            busy, want, min_chunk = (out if out > 1 else threads), math.ceil(2 * threads / out), 4096
        if busy >= threads:
            return 1
    fits = [d for d in sympy.divisors(rnumel) if d > 1 and rnumel // d >= min_chunk]
    if not fits:
        return 1
    return next((d for d in fits if d >= want), fits[-1])


def _reduces_columns(size, fn, rsize) -> bool:
    """Whether a reduction's loads run down columns: the innermost kept index steps by one element and the
    innermost reduced one by more (x.sum(0) of a row-major matrix); no load of the results' elements is contiguous
    along the reduction (triton.is_columnwise's rule)."""
    idx = [sympy.Symbol(f"sx{i}", integer=True, nonnegative=True) for i in range(len(size))]
    ridx = [sympy.Symbol(f"sr{i}", integer=True, nonnegative=True) for i in range(len(rsize))]
    kept = [i for i, n in zip(idx, size) if n != 1]
    if not kept:
        return False
    x, r = kept[-1], ridx[-1]
    column = False
    for e in fn(idx, ridx).walk():
        if e.op != "load":
            continue
        off = ir.expand_index(e.args[1])
        along_r = sympy.expand(off.subs(r, r + 1) - off)
        along_x = sympy.expand(off.subs(x, x + 1) - off)
        if along_r == 1 and along_x != 0:   # (a per-row statistic, mean[r], is read along r by every column)
            return False
        column |= along_x == 1 and along_r.is_Integer and abs(int(along_r)) >= 2
    return column


def split_reduction(g: "Graph", size: tuple, dtype: torch.dtype, fn, rsize: tuple, kind: str):
    """A reduction with too few results to keep the machine busy as a reduction of partial results: a Reduction
    buffer of S partial results per result, each over a part of the range, added to the graph, and returned as
    (fn, rsize) of the reduction over those S (None: no split). Column reductions keep the partials as
    [S, *size] (the partial reduction runs down columns too: a strip of columns per program), others as
    [*size, S] (each part a contiguous piece of a row). float16/bfloat16 partial sums and products are stored in
    float32 (the printers accumulate in float32; eager rounds once, at the end); max/min/any/all are exact in any
    order and keep NaN (a part's NaN is its max); integer sums wrap as the unsplit sum would."""
    if not config.SPLIT_REDUCTIONS or kind not in SPLIT_KINDS or not rsize or \
            not all(getattr(n, "is_Integer", False) for n in (*size, *rsize)):
        return None
    rnumel, out = ir.prod(rsize), ir.prod(size)
    if reduction_parts(out, rnumel, True, g.target) == reduction_parts(out, rnumel, False, g.target) == 1:
        return None   # (most reductions: no need to look at the loads)
    column = _reduces_columns(size, fn, rsize)
    parts = reduction_parts(out, rnumel, column, g.target)
    if parts <= 1:
        return None
    chunk = rnumel // parts
    if int(rsize[0]) % parts == 0:   # the outermost reduced dim splits: part s is rows [s*c0, (s+1)*c0)
        c0 = int(rsize[0]) // parts
        prsize = ((sympy.Integer(c0),) if c0 > 1 else ()) + tuple(rsize[1:])

        def reduced(s, pr):
            return [s * c0 + pr[0], *pr[1:]] if c0 > 1 else [s, *pr]
    else:   # a flat range of the reduced dims: their indices as div/mod of it (simplified by the scheduler)
        prsize, strides = (sympy.Integer(chunk),), ir.contiguous_strides(rsize)

        def reduced(s, pr):
            flat = s * chunk + pr[0]
            return [ir.FloorDiv(flat, st) if k == 0 else ir.ModIndex(ir.FloorDiv(flat, st), n)
                    for k, (n, st) in enumerate(zip(rsize, strides))]
    if column:
        psize = (sympy.Integer(parts),) + size
        pfn = lambda idx, pr: fn(list(idx[1:]), reduced(idx[0], pr))  # noqa: E731
        read = lambda idx, r: [r[0], *idx]  # noqa: E731
    else:
        psize = size + (sympy.Integer(parts),)
        pfn = lambda idx, pr: fn(list(idx[:-1]), reduced(idx[-1], pr))  # noqa: E731
        read = lambda idx, r: [*idx, r[0]]  # noqa: E731
    pdtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) and kind in ("sum", "prod") else dtype
    partial = g.add(Reduction(g.new_name(), psize, ir.contiguous_strides(psize), pdtype, fn=pfn, rsize=prsize,
                              kind=kind, origins=g.origins))
    return (lambda idx, r: partial.load(read(list(idx), r))), (sympy.Integer(parts),)


def one_hot_sum(size: tuple, dtype: torch.dtype, fn, rsize: tuple, kind: str) -> TensorBox | None:
    """A sum over r of where(r == k, v, 0) with k and v not depending on r (a row that is one-hot: the gradient
    nll_loss_backward makes, summed again by log_softmax's backward) as the value it adds up to,
    where(0 <= k < R, v, 0) + 0.0, with no loop over the row (GPT-2's loss backward looped over 50,257 columns
    of each row to find the one at the label). k outside [0, R) (ignore_index -100) hits no column: 0. The + 0.0
    is eager's sum adding v to zeros (-0.0 comes out 0.0). float32/float64 sums over one reduced dim of >= 2;
    None for anything else."""
    if kind != "sum" or dtype not in (torch.float32, torch.float64) or len(rsize) != 1 or \
            not getattr(rsize[0], "is_Integer", False) or int(rsize[0]) < 2:
        return None
    r = sympy.Symbol("onehot_r", integer=True, nonnegative=True)
    idx = [sympy.Symbol(f"onehot_x{i}", integer=True, nonnegative=True) for i in range(len(size))]
    if _one_hot_parts(fn(idx, [r]), r) is None:
        return None
    zero = ir.Expr("const", (0.0,), dtype)

    def loader(index):
        parts = _one_hot_parts(fn(list(index), [r]), r)
        if parts is None:   # (the same loaders at other indices: the same Expr structure)
            raise CannotLower("a one-hot sum whose body changed form at another index")
        k, v = parts
        inside = ir.Expr("logical_and", (ir.Expr("ge", (k, ir.Expr("const", (0,), k.dtype)), torch.bool),
                                         ir.Expr("lt", (k, ir.Expr("const", (int(rsize[0]),), k.dtype)), torch.bool)),
                         torch.bool)
        return ir.Expr("add", (ir.Expr("where", (inside, v, zero), dtype), zero), dtype)
    return TensorBox(size, dtype, loader)


def _one_hot_parts(body: ir.Expr, r) -> tuple | None:
    """(k, v) of a body where(index(r) == k, v, 0) (or k == index(r)), k an integer and v a value of the body's
    dtype, neither depending on r; else None."""
    if body.op != "where":
        return None
    cond, v, other = body.args
    if other.op != "const" or other.args[0] != 0 or math.copysign(1.0, other.args[0]) < 0 or v.dtype != body.dtype \
            or cond.op != "eq":
        return None
    a, b = cond.args
    if not (a.op == "index" and a.args[0] == r):
        a, b = b, a
    if not (a.op == "index" and a.args[0] == r) or a.dtype.is_floating_point or a.dtype == torch.bool or \
            b.dtype != a.dtype or _depends_on(b, r) or _depends_on(v, r):
        return None
    return b, v


def _depends_on(e: ir.Expr, r) -> bool:
    """Whether the value e changes with the index symbol r (a load's offset or an index value holds it)."""
    return any((x.op == "load" and r in x.args[1].free_symbols) or (x.op == "index" and r in x.args[0].free_symbols)
               for x in e.walk())


_FLAT = sympy.Symbol("flat", integer=True, nonnegative=True)


def value_key(x: TensorBox, stride: tuple) -> tuple | None:
    """What a dense buffer of `stride` holding x would store at each storage offset (x's value Expr at the index
    an offset `flat` stands for, each dimension's index `flat // stride % size`), its dtype and size in elements:
    equal keys, equal storage, whatever the sizes and strides (a matrix, and its transpose stored transposed).
    None for a layout with gaps or overlaps, and for an empty one."""
    size = [int(n) for n in x.size]
    stride = [int(n) for n in stride]
    if 0 in size:
        return None
    want = 1
    for d in sorted(range(len(size)), key=lambda d: stride[d]):
        if size[d] != 1:
            if stride[d] != want:
                return None
            want *= size[d]
    idx = [sympy.Integer(0) if n == 1 else ir.simplify_index(ModIndex(FloorDiv(_FLAT, st), n))
           for n, st in zip(size, stride)]
    return x.loader(idx), x.dtype, want


def same_strides(size, a, b) -> bool:
    """Whether strides a and b lay out a tensor of `size` alike: a dim of size 1 has no step, so its stride does
    not matter (resnet50's 1x1 convolution weights are channels-last as they are: they were copied each call)."""
    return all(int(x) == int(y) for n, x, y in zip(size, a, b) if int(n) != 1)


class Graph:
    """The lowering context: buffers made so far. ember.decomp.prims reaches it as ir.GRAPH."""

    def __init__(self, gm: torch.fx.GraphModule, target: str = "cpu"):
        self.gm = gm
        self.target = target  # the code generator: "cpu" (C++/OpenMP) or "gpu" (Triton); split_reduction asks
        self.channels_last = wants_channels_last(gm)
        self.cl: set = set()  # names of the buffers stored channels-last where eager's are not
        self.buffers: list[Buffer] = []
        self.by_name: dict[str, Buffer] = {}
        self.origins: tuple = ()
        self.val = None  # meta value of the node being lowered
        self.node = None  # the node being lowered
        self.cat_chains: dict = {}  # plan_cat_chains
        self.cat_views: dict = {}  # cat node of a chain -> its lowered box
        self.fallbacks: list[str] = []
        self.extern_inputs: dict = {}  # value_key -> a buffer made for a library call's argument (realize(share))

    @contextlib.contextmanager
    def lowering_as(self, val):
        """Calls inside make results like meta value `val` (a fused call's own), not like the node's; yields the
        node's."""
        node_val, self.val = self.val, val
        try:
            yield node_val
        finally:
            self.val = node_val

    def new_name(self) -> str:
        return f"buf{len(self.by_name)}"

    def add(self, buf: Buffer) -> Buffer:
        self.by_name[buf.name] = buf
        if not isinstance(buf, InputBuffer):
            self.buffers.append(buf)
        return buf

    # called by prims ------------------------------------------------------------------------------
    def realize(self, x: TensorBox, origin: str = "", stride=None, share: bool = False) -> TensorBox:
        """x stored in a buffer (of `stride`, else contiguous or channels-last). share: x is a library call's
        argument, which only reads it: a buffer made for another call's argument holding the same values at
        the same storage offsets is taken instead (GPT-2's backward stored a layer norm's gradient twice, for
        the two products reading it and its transpose)."""
        if x.strided is not None and (stride is None or same_strides(x.size, x.strided[1], stride)):
            return x
        if stride is None and self._reads_cl(x.size, lambda idx: x.loader(idx)):
            stride = channels_last_strides(x.size)
        stride = tuple(stride) if stride is not None else ir.contiguous_strides(x.size)
        key = value_key(x, stride) if share else None
        if key is not None and key in self.extern_inputs:
            from ember.decomp import prims as P
            return P.as_strided(TensorBox.of_buffer(self.extern_inputs[key]), x.size, stride)
        buf = self.add(Pointwise(self.new_name(), x.size, stride, x.dtype, fn=x.loader, origins=self.origins))
        self._note_layout(buf)
        if key is not None:
            self.extern_inputs[key] = buf
        return TensorBox.of_buffer(buf)

    def reduction(self, size, dtype, fn, rsize, kind, origin="") -> TensorBox:
        size, rsize = tuple(size), tuple(rsize)
        one_hot = one_hot_sum(size, dtype, fn, rsize, kind) if config.ONE_HOT_SUMS else None
        if one_hot is not None:   # a sum of one element at a computed column: that element, no loop
            return one_hot
        cl = self._reads_cl(size, lambda idx: fn(idx, [sympy.Symbol(f"lr{i}", integer=True, nonnegative=True)
                                                       for i in range(len(rsize))]))
        split = split_reduction(self, size, dtype, fn, rsize, kind)
        if split is not None:  # the partial results are a buffer of their own; this reduction reduces them
            fn, rsize = split
        buf = self.add(Reduction(self.new_name(), size, channels_last_strides(size) if cl else ir.contiguous_strides(size),
                                 dtype, fn=fn, rsize=rsize, kind=kind, origins=self.origins))
        self._note_layout(buf)
        return TensorBox.of_buffer(buf)

    # channels-last layout (see the module docstring) -------------------------------------------------
    def _reads_cl(self, size, fn) -> bool:
        """Whether a 4-D value computed by fn(index) loads from a channels-last buffer (then it is stored so)."""
        if not self.cl or len(size) != 4:
            return False
        idx = [sympy.Symbol(f"l{i}", integer=True, nonnegative=True) for i in range(4)]
        return any(e.op == "load" and e.args[0] in self.cl for e in fn(idx).walk())

    def reads_layout_changed(self, x: TensorBox) -> bool:
        """Whether x's value loads from a buffer not in eager's layout (storage-order ops must not see it)."""
        if not self.cl:
            return False
        idx = [sympy.Symbol(f"l{i}", integer=True, nonnegative=True) for i in range(x.ndim)]
        return any(e.op == "load" and e.args[0] in self.cl for e in x.loader(idx).walk())

    def _note_layout(self, buf: Buffer) -> None:
        if len(buf.size) == 4 and tuple(buf.stride) != ir.contiguous_strides(buf.size) \
                and tuple(buf.stride) == channels_last_strides(buf.size):
            self.cl.add(buf.name)

    def _eager_layout(self, x: TensorBox) -> TensorBox:
        """x as eager lays it out (its `eager_stride`, else contiguous) when it is a window onto a
        channels-last buffer: for ATen calls and graph outputs."""
        want = getattr(x, "eager_stride", None)
        if x.strided is None or x.strided[0].name not in self.cl or tuple(int(s) for s in x.strided[1]) == want:
            return x
        return self.realize(TensorBox(x.size, x.dtype, x.loader),
                            stride=want if want is not None else ir.contiguous_strides(x.size))

    def extern(self, target, args, kwargs, fallback: bool, channels_last: bool = False, out_stride=None):
        """A library call / kept ATen op on materialized arguments; returns boxes shaped like its meta value.
        channels_last: its 4-D arguments and results are channels-last (convolutions of a channels-last graph
        always are). out_stride: the strides of its one result, its arguments taken in the layouts they have
        (a concatenation chain's view, see plan_cat_chains)."""
        reads = []
        conv_cl = out_stride is None and (channels_last or (
            self.channels_last and target in CONVOLUTIONS and args[0].ndim == 4 and not args[6]))
        if conv_cl:  # input and weight channels-last (oneDNN: 36 ms vs 49 ms with an NCHW weight, 8x64x56x56)
            def to_cl(x):
                if isinstance(x, TensorBox) and x.ndim == 4 and (
                        x.strided is None or not same_strides(x.size, x.strided[1], channels_last_strides(x.size))):
                    return self.realize(TensorBox(x.size, x.dtype, x.loader), stride=channels_last_strides(x.size))
                return x
            args = pytree.tree_map(to_cl, args, is_leaf=lambda x: isinstance(x, TensorBox))

        def arg(x):
            if isinstance(x, TensorBox):
                if fallback:
                    x = self._eager_layout(x)
                # an ATen op sees the layout eager gives it (some kernels assume what their callers ensure);
                # a channels-last convolution's input and weight are channels-last (above)
                want = None if (conv_cl and x.ndim == 4) or out_stride is not None else getattr(x, "eager_stride", None)
                if want is not None and (x.strided is None or not same_strides(x.size, x.strided[1], want)):
                    x = self.realize(x, stride=want, share=True) if x.strided is None else \
                        self.realize(TensorBox(x.size, x.dtype, x.loader), stride=want, share=True)
                x = self.realize(x, share=True)
                buf, stride, offset = x.strided
                reads.append(buf.name)
                return TensorArg(buf.name, tuple(int(s) for s in x.size), tuple(int(s) for s in stride), int(offset))
            return x
        args, kwargs = pytree.tree_map(arg, (args, kwargs), is_leaf=lambda x: isinstance(x, TensorBox))
        val = self.val
        leaves, spec = pytree.tree_flatten(val)
        if not all(isinstance(v, torch.Tensor) or v is None for v in leaves):
            raise CannotLower(f"{target} returns non-tensor values")
        call = self.add(ExternBuffer(self.new_name(), (), (), None, target=target, args=args, kwargs=kwargs,
                                     inputs=tuple(reads), fallback=fallback, origins=self.origins))
        outs = []
        for i, v in enumerate(leaves):
            if v is None:
                outs.append(None)
                continue
            stride = out_stride if out_stride is not None else \
                channels_last_strides(v.shape) if conv_cl else tuple(v.stride())
            b = Buffer(f"{call.name}_{i}" if len(leaves) > 1 or spec.num_leaves != 1 or not isinstance(val, torch.Tensor)
                       else call.name, tuple(v.shape), tuple(int(s) for s in stride), v.dtype, 0)  # offsets from data_ptr()
            self._note_layout(b)
            if out_stride is not None and len(b.size) == 4 and int(b.stride[1]) == 1:
                self.cl.add(b.name)  # channels innermost, not dense: a window onto a wider channels-last buffer
            b.extern, b.index = call, i
            self.by_name[b.name] = b
            outs.append(TensorBox.of_buffer(b))
        call.outputs = [o.strided[0] if o is not None else None for o in outs]
        if val is None:
            return call
        return pytree.tree_unflatten(outs, spec)


# Lowering keeps its state in module globals (ir.GRAPH, the Expr interning table): graphs compiled by several
# threads at once (each missing its guards, e.g. on grad mode, which is per thread) take turns, in either backend
LOWERING_LOCK = threading.Lock()


def lower(gm: torch.fx.GraphModule, example_inputs: list, target: str = "cpu") -> LoweredGraph:
    """target: the code generator the buffers are for, "cpu" (C++) or "gpu" (Triton): reductions with too few
    results to keep it busy are split for it (split_reduction)."""
    with collector.frozen():
        return _lower(gm, example_inputs, target)


def _lower(gm: torch.fx.GraphModule, example_inputs: list, target: str = "cpu") -> LoweredGraph:
    from ember.decomp.table import EXTERN, TABLE  # the table imports prims, which import this module's users

    ir.reset_interning()
    g = Graph(gm, target)
    ir.GRAPH = g
    env: dict = {}
    inputs = []
    constants: dict = {}
    users = {n: len(n.users) for n in gm.graph.nodes}
    stored = stores_whole(gm)
    fusions = plan_conv_fusions(gm, g.channels_last)
    fusions.update(plan_linear_fusions(gm))
    siblings = plan_sibling_products(gm) if target == "gpu" else {}
    g.cat_chains = plan_cat_chains(gm) if g.channels_last else {}
    fused_away = {n for f in fusions.values() for n in f.skip}
    try:
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                v = node.meta.get("val", None)
                idx = len(inputs)
                v = example_inputs[idx] if v is None and idx < len(example_inputs) else v
                if isinstance(v, torch.Tensor):
                    buf = g.add(InputBuffer(f"arg{idx}", tuple(v.shape), tuple(v.stride()), v.dtype, 0))
                    env[node] = TensorBox.of_buffer(buf)
                    inputs.append(buf)
                else:
                    raise CannotLower(f"non-tensor graph input {node.name}")
            elif node.op == "get_attr":
                t = gm
                for part in node.target.split("."):
                    t = getattr(t, part)
                if not isinstance(t, torch.Tensor):
                    raise CannotLower(f"get_attr {node.target} is not a tensor")
                t = t.detach()
                name = f"const{len(constants)}"
                buf = g.add(InputBuffer(name, tuple(t.shape), tuple(t.stride()), t.dtype, 0))
                constants[name] = t
                env[node] = TensorBox.of_buffer(buf)
            elif node.op == "call_function":
                if node in fused_away:  # computed by a fused convolution or linear at its chain's end
                    env[node] = None
                    continue
                args, kwargs = pytree.tree_map(lambda a: env[a] if isinstance(a, torch.fx.Node) else a,
                                               (node.args, node.kwargs))
                g.val, g.node = node.meta.get("val"), node
                fused = fusions.get(node)
                if node.target is operator.getitem and fused is None:
                    out = args[0][args[1]]
                    # one result of a multi-output decomposition (layer_norm's) read by several nodes: computed
                    # once, as any other node's result (else each extern reading it stored its own copy)
                    if isinstance(out, TensorBox) and out.strided is None and users[node] > 1 and out.cost() > 3:
                        g.origins = getattr(out, "origin_names", g.origins)
                        out = g.realize(out)
                        out.origin_names = g.origins
                    env[node] = out
                    continue
                if not isinstance(node.target, torch._ops.OpOverload) and fused is None:
                    raise CannotLower(f"{node.target} is not an ATen op (ember compiles ATen-level graphs)")
                if g.val is None and fused is None and not node.target._schema.returns:  # run for its effect (error checks)
                    g.origins = (node.name,)
                    g.extern(node.target, args, kwargs, fallback=False).side_effect = True
                    env[node] = None
                    continue
                if g.val is None:
                    raise CannotLower(f"node {node.name} has no meta['val']")
                if fused is None and node.target._schema.is_mutable:
                    raise CannotLower(f"{node.target} mutates its inputs (graphs must be functional)")
                boxes = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, TensorBox)]
                # (chained, not summed: tuples added one to the next took 1.2 s of densenet121's training step)
                g.origins = tuple(dict.fromkeys(itertools.chain(*(b.origin_names for b in boxes if b.strided is None
                                                                  and hasattr(b, "origin_names")), (node.name,))))
                op = node.target
                g.op_name = str(op)
                fn = TABLE.get(op)
                out, why = None, "no ember decomposition"
                sibling = lower_sibling_product(g, siblings[node], node, env) if node in siblings else None
                if sibling is not None:
                    out = _check(sibling, g.val, node)
                elif fused is not None:
                    g.origins = tuple(n.name for n in fused.skip) + (node.name,)
                    lower_fused = lower_linear_fusion if isinstance(fused, LinearFusion) else lower_conv_fusion
                    out = _check(lower_fused(g, fused, env), g.val, node)
                elif fn is not None:
                    try:
                        out = _check(fn(*args, **kwargs), g.val, node)
                        why = "decomposition declined these arguments"
                    except Exception as e:  # a decomposition that cannot handle this case keeps the ATen op
                        out, why = None, f"decomposition failed: {type(e).__name__}: {e}"
                    if out is NotImplemented:
                        out = None
                if out is None:
                    fallback = op not in EXTERN
                    if fallback:
                        name = str(op)
                        FALLBACK_COUNTS[name] += 1
                        g.fallbacks.append(name)
                        fallback_log.debug("ATen fallback: %s at node %s (%s)", name, node.name, why)
                    out = _check(g.extern(op, args, kwargs, fallback), g.val, node)
                for b, v in zip(pytree.tree_leaves(out), pytree.tree_leaves(g.val)):
                    if isinstance(b, TensorBox):
                        b.origin_names = g.origins
                        if _dense(v) and b.size and any(s != 1 for s in v.shape):
                            b.eager_stride = tuple(v.stride())
                if isinstance(out, TensorBox) and out.strided is None and users[node] > 1 and (
                        out.cost() > 3 or stored.get(node, 0) > 1):
                    # in eager's layout where ember keeps eager's (GPT-2's key/value cache: a concatenation of
                    # the heads' view, laid out [b, s, h, d] as the projection it copies; contiguous, its copy
                    # ran 2.3x slower and attention read it in another layout than eager's)
                    want = getattr(out, "eager_stride", None)
                    keep = want is not None and not g.reads_layout_changed(out)
                    out = g.realize(out, stride=want if keep else None)
                    out.origin_names = g.origins
                env[node] = out
            elif node.op == "output":
                outs = []
                for a in pytree.tree_leaves(node.args[0]):
                    v = env[a] if isinstance(a, torch.fx.Node) else a
                    if isinstance(v, TensorBox):
                        val = a.meta.get("val")
                        stride = val.stride() if _dense(val) else None
                        if v.strided is not None and v.strided[0].name in g.cl and (  # eager's layout back
                                stride is None or tuple(int(s) for s in v.strided[1]) != tuple(stride)):
                            g.origins = getattr(v, "origin_names", ())
                            v = g.realize(TensorBox(v.size, v.dtype, v.loader),
                                          stride=stride if stride is not None else ir.contiguous_strides(v.size))
                        if v.strided is None or v.strided[0].name not in g.by_name:
                            g.origins = getattr(v, "origin_names", ())
                            v = g.realize(v, stride=stride)
                        buf, st, off = v.strided
                        v = TensorArg(buf.name, tuple(int(s) for s in v.size), tuple(int(s) for s in st), int(off))
                    outs.append(v)
                out_spec = pytree.tree_flatten(node.args[0])[1]
                return LoweredGraph(inputs, g.buffers, outs, g.fallbacks, constants), out_spec, g
            else:
                raise CannotLower(f"fx node kind {node.op} ({node.name})")
    finally:
        ir.GRAPH = None
    raise CannotLower("graph has no output")


def stores_whole(gm: torch.fx.GraphModule) -> dict:
    """{node: how many readers store its value whole}: graph outputs (each place the output lists it) and
    library calls. Read by two of them, a value however cheap is stored once where it is computed: GPT-2's
    key/value cache (a concatenation that is one copy) was stored three times, for attention, for the cache
    returned and for the backward."""
    from ember.decomp.table import EXTERN
    counts: dict = {}
    for n in gm.graph.nodes:
        if n.op == "output":
            for a in pytree.tree_leaves(n.args[0]):
                if isinstance(a, torch.fx.Node):
                    counts[a] = counts.get(a, 0) + 1
        elif n.op == "call_function" and n.target in EXTERN:
            for a in {a for a in pytree.tree_leaves((n.args, n.kwargs)) if isinstance(a, torch.fx.Node)}:
                counts[a] = counts.get(a, 0) + 1
    return counts


def _dense(v) -> bool:
    """Whether v's strides describe a non-overlapping, dense layout (then outputs use eager's strides)."""
    if not isinstance(v, torch.Tensor) or v.numel() == 0:
        return False
    pairs = sorted((s, n) for s, n in zip(v.stride(), v.shape) if n != 1)
    expected = 1
    for s, n in pairs:
        if s != expected:
            return False
        expected *= n
    return True


def _check(out, val, node):
    """A decomposition must produce what the op's meta value says: the same shapes and dtypes."""
    if out is NotImplemented:
        return out
    outs, vals = pytree.tree_leaves(out), pytree.tree_leaves(val)
    if len(outs) != len(vals):
        raise CannotLower(f"decomposition of {node.target} gave {len(outs)} outputs, expected {len(vals)}")
    for o, v in zip(outs, vals):
        if isinstance(o, TensorBox):
            if not isinstance(v, torch.Tensor) or tuple(int(s) for s in o.size) != tuple(v.shape) or o.dtype != v.dtype:
                raise CannotLower(f"decomposition of {node.target} at {node.name} gave {list(o.size)} {o.dtype}, "
                                  f"expected {getattr(v, 'shape', v)} {getattr(v, 'dtype', '')}")
    return out
