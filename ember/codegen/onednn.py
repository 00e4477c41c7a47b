"""CPU library calls through oneDNN: convolutions with their epilogues fused, and float32 products as inner
products.

Convolution epilogues (plan_conv_fusions): in an inference graph on the CPU, an eval batch norm that alone reads
a convolution's output is folded into it: the weight is scaled per output channel and the bias shifted, both
computed by a kernel on every call from the current parameters (the kernel that copies the weight to
channels-last; a cached fold would be stale after `p.data.mul_(...)`, which no version counter sees).
Where oneDNN's fused convolutions exist (torch.ops.mkldnn._convolution_pointwise, float32, channels-last graph),
the relu or residual add (+ relu) after it become post-ops of that one call: the output is written once, where
a separate batch-norm/relu pass would read and write it again.

CPU float32 products of a linear layer's layout are oneDNN inner products on a CPU that is not Intel's, their bias
inside (cpu_matmul); in an inference graph a relu/gelu/silu that alone reads one becomes its post-op
(plan_linear_fusions). On an Intel CPU they stay MKL's (onednn_products).
"""
from __future__ import annotations

import dataclasses
import functools
import operator
import pathlib
from typing import TYPE_CHECKING

import torch

from ember import config
from ember import ir
from ember.ir import TensorBox, symbols
from ember.codegen.layout import CONVOLUTIONS

if TYPE_CHECKING:
    from ember.codegen.lower import Graph

aten = torch.ops.aten


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
    from ember.codegen.matmul import conv_product, product_conv
    # a relu stays oneDNN's post-op: the convolution's output is written once, activated, where a product's
    # relu is a pass of its own when a library call (a depthwise convolution) reads it (mobilenet_v3's expansions)
    with g.lowering_as(f.conv.meta["val"]):
        if not f.relu and product_conv(g, x, w, stride, padding, f.conv.args[6], groups):
            return conv_product(g, x, w, b, env[f.other] if f.other is not None else None, f.relu)
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
# input and a row-major [N, K] weight, a linear layer's own layout), on a CPU that is not Intel's: there ATen's
# mm (MKL) takes MKL's generic code paths, much slower than oneDNN. On an Intel CPU, MKL's sgemm is as fast or
# faster on linear layers' shapes, AVX-512 or AVX2, and a bias or activation inside the inner product buys nothing
# over the library mm and a kernel that adds them (bench/tools/cpu_products.py, cpu_linear_blocks.py), so there
# the products of static graphs stay ATen's mm (onednn_products).
# Below ONEDNN_MIN_WORK multiply-adds oneDNN's fixed cost per call loses. A weight that is not row-major (x @ W of a [K, N] weight, the backward's products) stays with MKL:
# oneDNN reorders such a weight on every call. The weight is read as it is on every call (no packed copy kept
# across calls: `p.data.mul_(...)` changes a weight without bumping its version).
_LINEAR = _mkldnn_op("_linear_pointwise")
ONEDNN_MIN_WORK = 1 << 21  # multiply-adds (M*K*N) from which a product goes to oneDNN


@functools.lru_cache(maxsize=None)
def _intel_cpu() -> bool:
    """Whether this machine's CPU is Intel's (MKL's own fast code paths run)."""
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(ln.startswith("vendor_id") and "GenuineIntel" in ln for ln in text.splitlines())


def onednn_products(symbolic: bool = False) -> bool:
    """Whether CPU float32 products go to oneDNN: config.ONEDNN_MATMULS, "auto" (the default) where ATen's mm is
    not MKL on an Intel CPU (the comment above), and in a symbolic graph on any CPU: there ATen's mm and the separate kernels adding bias and activation
    are slower than oneDNN's fused products (bench/dynamic.py's BERT loop, below eager's speed with MKL)."""
    v = config.ONEDNN_MATMULS
    if isinstance(v, str):
        v = v.strip().lower()
        if v == "auto":
            return symbolic or not (torch.backends.mkl.is_available() and _intel_cpu())
        return v not in ("0", "false", "off", "no", "")
    return bool(v)


def _onednn_product(m, k, n, dtypes, device) -> bool:
    """Whether an [m, k] @ [k, n] product of these dtypes on this device goes to oneDNN (onednn_products)."""
    return _LINEAR is not None and device == "cpu" and all(d == torch.float32 for d in dtypes) \
        and m * k * n >= ONEDNN_MIN_WORK and onednn_products(getattr(ir.GRAPH, "symbolic", False))


def _hints(*sizes) -> tuple:
    """Sizes (ints or SymInts of a symbolic graph) as the example's ints, without a guard on a symbol's value."""
    return tuple(symbols.hint(symbols.sym_expr(x)) for x in sizes)


def cpu_matmul(g: "Graph", a: TensorBox, b: TensorBox, bias: TensorBox | None = None,
               post_op: tuple = ("none", [], ""), any_weight: bool = False):
    """a @ b (+ bias, then oneDNN's post_op: (attr, scalars, algorithm)) for 2-D float32 CPU values as one
    oneDNN inner product, or None (then the caller keeps ATen's mm). `a` is made row-major where it is not
    (a copy of M*K elements against M*K*N multiply-adds). `b` must be the transpose of a row-major [N, K]
    weight, unless any_weight (a planned fusion: then another layout is copied into that one)."""
    v = g.val
    if not isinstance(v, torch.Tensor) or a.ndim != 2 or b.ndim != 2:
        return None
    # (symbolic sizes: whether oneDNN is worth it by the example's; its call is right at every size)
    m, k, n = (symbols.hint(s) for s in (a.size[0], a.size[1], b.size[1]))
    if not _onednn_product(m, k, n, (a.dtype, b.dtype, v.dtype), v.device.type):
        return None
    from ember.decomp import prims as P
    k = symbols.ints((a.size[1],))[0]
    w = P.permute(b, [1, 0])
    if w.strided is None or symbols.ints(w.strided[1]) != (k, 1):
        if not any_weight:
            return None
        w = g.realize(TensorBox(w.size, w.dtype, w.loader), stride=(k, 1))
    if a.strided is None or symbols.ints(a.strided[1]) != (k, 1):
        a = g.realize(TensorBox(a.size, a.dtype, a.loader), stride=(k, 1))
    if bias is not None and (bias.strided is None or symbols.ints(bias.strided[1]) != (1,)):
        bias = g.realize(TensorBox(bias.size, bias.dtype, bias.loader), stride=(1,))
    return g.extern(_LINEAR.default, (a, w, bias, *post_op), {}, fallback=False)


# activations that oneDNN applies to a product's result as it writes it (post-ops), as the ATen op's (attr,
# scalars, algorithm) given its arguments, or None; each agrees with eager to ~1 ulp (relu exactly), and saves a
# kernel's pass over the result
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
                or not _onednn_product(*_hints(av.shape[0], av.shape[1], wv.shape[1]), (av.dtype, wv.dtype, v.dtype),
                                       v.device.type):
            continue
        chain, u = [mm], _only_user(mm)
        while u is not None and u.target in _VIEWS and u.args[0] is chain[-1]:
            chain.append(u)
            u = _only_user(u)
        how = LINEAR_POST_OPS.get(u.target) if u is not None and u.op == "call_function" else None
        post_op = how(*u.args, **u.kwargs) if how is not None and u.args and u.args[0] is chain[-1] else None
        uv = u.meta.get("val") if u is not None else None
        if post_op is None or not isinstance(uv, torch.Tensor) or uv.dtype != v.dtype or \
                not symbols.same(symbols.sym_expr(uv.numel()), symbols.sym_expr(v.numel())):
            continue
        plans[u] = LinearFusion(mm, post_op, u, tuple(chain))
    return plans


def lower_linear_fusion(g: "Graph", f: LinearFusion, env: dict):
    """The fused linear of f: one oneDNN call (its weight copied to row-major [N, K] first where it is not)."""
    from ember.decomp import prims as P
    bias, a, b = (env[x] for x in f.mm.args) if len(f.mm.args) == 3 else (None, *(env[x] for x in f.mm.args))
    with g.lowering_as(f.mm.meta["val"]) as out_val:
        y = cpu_matmul(g, a, b, bias, f.post_op, any_weight=True)
    return P.reshape(y, list(symbols.sym_sizes(out_val.shape)))
