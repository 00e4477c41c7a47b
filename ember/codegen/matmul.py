"""How a graph's matrix products are lowered: addmm and mm (a oneDNN inner product, the library mm with a lazy
bias add, or ATen's addmm), and CUDA linear layers that read one input (BERT's query, key and value projections)
as one library product of the input and their weights concatenated (plan_sibling_products)."""
from __future__ import annotations

import dataclasses
import operator
from typing import TYPE_CHECKING

import torch

from ember import config, ir
from ember.ir import TensorBox
from ember.codegen.layout import channels_last_strides, is_dense
from ember.codegen.onednn import cpu_matmul
from ember.decomp import prims as P
from ember.decomp.common import floaty, out
from ember.decomp.table import EXTERN

if TYPE_CHECKING:
    from ember.codegen.lower import Graph

aten = torch.ops.aten


def addmm(bias, a, b, *, beta=1, alpha=1):
    """A linear layer's addmm. On CPU in float32 where the weight is laid out for it and oneDNN's products are
    chosen (onednn.onednn_products: a CPU that is not Intel's), one oneDNN inner product
    with the bias inside (onednn.cpu_matmul: added as the product is written, no extra pass; a reader that is a
    library call, attention reading Q, K and V, then takes the product as it is). Elsewhere the library mm plus a
    lazy bias add, which fuses into whatever reads the result (gelu, the residual add + layer_norm): on CPU,
    ATen's addmm first copies the broadcast bias into its output (one more pass over it, and one more parallel
    region) and then accumulates the product on it; on CUDA, cuBLASLt's bias epilogue picks slower kernels for
    BERT's shapes; float32 only there, where the product is rounded to the output's dtype either way. On CUDA a
    result the graph returns (a training forward saves GPT-2's pre-activations for the backward) is stored whole
    anyway: there ATen's addmm adds the bias in the product's epilogue at no cost, and the lazy add would cost a
    pass (read the product, write the sum) where none fuses. A library call reading a part of the result that
    is not dense (GPT-2's query, key and value: one projection, split and viewed as heads) would be handed a
    copy of that part, which the lazy add has to store anyway: there too ATen's addmm, whose result the call
    then reads through views as eager's does (its bias costs nothing there either)."""
    v = out()
    if beta != 1 or alpha != 1 or not floaty(v.dtype) or not isinstance(bias, TensorBox) or bias.dtype != v.dtype \
            or (v.device.type == "cuda" and (v.dtype != torch.float32 or _returned(ir.GRAPH.node))) \
            or v.device.type not in ("cpu", "cuda"):
        return NotImplemented
    row_bias = bias.ndim == 1 and int(bias.size[0]) == int(v.shape[-1])  # what oneDNN's bias is: one per column
    parts = _library_reads_part(ir.GRAPH.node)   # (oneDNN's product with the bias inside serves them as it is)
    if parts and not row_bias:
        return NotImplemented
    prod = cpu_matmul(ir.GRAPH, a, b, bias if row_bias else None)
    if prod is not None and row_bias:
        return prod
    if parts:
        return NotImplemented
    if prod is None:
        prod = padded_product(ir.GRAPH, a, b) or ir.GRAPH.extern(aten.mm.default, (a, b), {}, fallback=False)
    return P.add(prod, bias, dtype=v.dtype)


_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.t.default, aten.transpose.int,
          aten.permute.default, aten.alias.default}


_PARTS = _VIEWS | {aten.split.Tensor, aten.split_with_sizes.default, aten.slice.Tensor, aten.select.int,
                   aten.unsqueeze.default, aten.squeeze.dim, operator.getitem}


def _library_reads_part(node, top: bool = True) -> bool:
    """Whether a library call (EXTERN) reads, through views, a part of node's value that is not dense."""
    if node is None:
        return False
    for u in node.users:
        if u.op != "call_function":
            continue
        if u.target in _PARTS and _library_reads_part(u, top=False):
            return True
        if u.target in EXTERN and not top and not _dense_value(node.meta.get("val")):
            return True
    return False


def _dense_value(v) -> bool:
    if not isinstance(v, torch.Tensor):
        return True
    return is_dense(v)


def _returned(node) -> bool:
    """Whether the graph returns node's value, itself or through views."""
    return node is not None and any(u.op == "output" or (u.op == "call_function" and u.target in _VIEWS
                                                          and _returned(u)) for u in node.users)


def mm(a, b):
    """On CPU in float32, a oneDNN inner product where the weight is laid out for one and oneDNN's products are
    chosen (onednn.cpu_matmul); on
    CUDA with a leading dimension cuBLAS reads slowly, the product with padded rows (padded_product); else ATen's
    mm (the extern it is listed as)."""
    return cpu_matmul(ir.GRAPH, a, b) or padded_product(ir.GRAPH, a, b) or NotImplemented


def bmm(a, b):
    """A batched product whose second operand is one matrix broadcast over the batch (batch stride 0) as one
    product of all the batch's rows: torch.matmul under no_grad makes it from a 3-D input that no view flattens
    (nn.MultiheadAttention's in-projection of a transposed input: vit_b_16), and ATen's CPU bmm runs a stride-0
    operand ~10x slower than the same work as one mm (CPU only: cuBLAS's strided batched product was not measured
    slow). The rows are taken in the order a's strides store them, so a stored `a` is read as it is and the result
    is a view of the product."""
    v = out()
    if v.device.type != "cpu" or ir.GRAPH.symbolic or a.ndim != 3 or b.ndim != 3 or b.strided is None \
            or int(b.strided[1][0]) != 0 or not floaty(v.dtype) or a.dtype != v.dtype or b.dtype != v.dtype:
        return NotImplemented
    s0, s1, n = int(a.size[0]), int(a.size[1]), int(b.size[2])
    swap = a.strided is not None and int(a.strided[1][1]) > int(a.strided[1][0])   # rows stored dim 1 first
    rows = P.permute(a, [1, 0, 2]) if swap else a
    flat = P.reshape(rows, (s0 * s1, int(a.size[2])))
    w = P.select(b, 0, 0)
    g = ir.GRAPH
    with g.lowering_as(torch.empty((s0 * s1, n), dtype=v.dtype)):
        prod = cpu_matmul(g, flat, w) or g.extern(aten.mm.default, (flat, w), {}, fallback=False)
    prod = P.reshape(prod, (s1, s0, n) if swap else (s0, s1, n))
    return P.permute(prod, [1, 0, 2]) if swap else prod


def product_conv(g: "Graph", x, w, stride, padding, transposed, groups) -> bool:
    """Whether convolution(x, w, ...) is computed as a matrix product (conv_product): a 1x1 convolution
    (stride 1, no padding, one group, not transposed) of a channels-last float32 CPU graph, with static sizes.
    Its input stored channels-last is the pixels' matrix [N*H*W, Cin] as it is, and the product with the weight's
    [Cin, Cout] is the channels-last output: the library product (MKL's sgemm) ran every 1x1 convolution of
    efficientnet/mobilenet/resnet50 at the suite's batches 4-95% faster than ATen's convolution (oneDNN, or at a
    small batch on one thread ATen's slow path, which copies a channels-last input to NCHW and back), AVX-512 or
    AVX2, and ATen's convolution of NCHW values (eager's and Inductor's) 3-190% slower (bench/tools/
    cpu_conv1x1.py); the bias, a folded batch norm's shift and a residual add become pointwise work that fuses
    into the kernel reading the product (a fused relu stays oneDNN's post-op: onednn.lower_conv_fusion)."""
    v = out()
    return config.CONV_PRODUCTS and isinstance(v, torch.Tensor) and v.device.type == "cpu" \
        and v.dtype == torch.float32 and g.channels_last \
        and not g.symbolic and isinstance(x, TensorBox) and isinstance(w, TensorBox) and x.ndim == 4 \
        and w.ndim == 4 and not transposed and groups == 1 and x.dtype == w.dtype == v.dtype \
        and tuple(int(k) for k in w.size[2:]) == (1, 1) and list(stride) == [1, 1] and list(padding) == [0, 0]


def conv_product(g: "Graph", x: TensorBox, w: TensorBox, bias=None, other=None, relu: bool = False) -> TensorBox:
    """The 1x1 convolution product_conv accepts, (+ bias) (+ other) (relu), as one library product of the
    pixels and the weight; the rest stays pointwise (lazy). The product's buffer is marked channels-last, so a
    4-D value computed from it is stored so too, and graph outputs and ATen calls get eager's layout back."""
    n, c, h, wd = (int(d) for d in x.size)
    co = int(w.size[0])
    pixels = None
    if x.strided is not None and int(x.strided[1][1]) == 1:   # a stored value, channels innermost (or a window of
        pixels = P.reshape(P.permute(x, [0, 2, 3, 1]), (n * h * wd, c))   # a wider one: a concatenation's)
        pixels = pixels if pixels.strided is not None else None   # (its pixels a matrix with a leading dim)
    if pixels is None:
        cl = channels_last_strides(x.size)
        x = g.realize(TensorBox(x.size, x.dtype, x.loader), stride=cl)
        pixels = P.reshape(P.permute(x, [0, 2, 3, 1]), (n * h * wd, c))
    weight = P.permute(P.reshape(w, (co, c)), [1, 0])
    with g.lowering_as(torch.empty((n * h * wd, co), dtype=x.dtype, device="meta")):
        prod = cpu_matmul(g, pixels, weight, any_weight=True) or \
            g.extern(aten.mm.default, (pixels, weight), {}, fallback=False)
    g.cl.add(prod.strided[0].name)
    y = P.permute(P.reshape(prod, (n, h, wd, co)), [0, 3, 1, 2])
    if bias is not None:
        y = P.add(y, P.reshape(bias, (1, co, 1, 1)), dtype=x.dtype)
    if other is not None:
        y = P.add(y, other, dtype=x.dtype)
    return P.unary("relu", y) if relu else y


def convolution(x, w, bias, stride, padding, dilation, transposed, output_padding, groups):
    """A 1x1 convolution of a channels-last CPU graph as a matrix product (product_conv); else the library's."""
    g = ir.GRAPH
    if not product_conv(g, x, w, stride, padding, transposed, groups):
        return NotImplemented
    return conv_product(g, x, w, bias)


# cuBLAS takes its fast kernels (vector loads and stores) only where each matrix's contiguous extent and leading
# dimension are multiples of 16 bytes (an odd vocabulary's LM head otherwise runs at half speed; a padded leading
# dimension alone does not do). A product big enough for it to matter runs on operands zero-padded along those dimensions, and its
# result is a slice of the padded product: zeros added along K add nothing; rows and columns added along M and N
# are sliced off. A padded operand ember computes itself is computed straight into its padded buffer; a stored one
# (a weight) is copied, a pass over it, small next to the product.
LEAD_ALIGN_BYTES = 16
PAD_MIN_MACS = 1 << 27
PADDED_DEVICES = ("cuda",)


def padded_product(g: "Graph", a: TensorBox, b: TensorBox) -> "TensorBox | None":
    """a @ b on CUDA as a slice of the product of operands padded as the comment above says, or None."""
    v = out()
    if v.device.type not in PADDED_DEVICES or g.symbolic or a.ndim != 2 or b.ndim != 2 or not floaty(v.dtype) \
            or a.dtype != v.dtype or b.dtype != v.dtype:
        return None
    m, k, n = int(a.size[0]), int(a.size[1]), int(b.size[1])
    if m * k * n < PAD_MIN_MACS:
        return None
    step = max(LEAD_ALIGN_BYTES // ir.itemsize(v.dtype), 1)
    a_cols, b_cols = _along_columns(a), _along_columns(b)   # (the dim each is contiguous along)
    pad_m = not a_cols and m % step != 0
    pad_k = (a_cols or not b_cols) and k % step != 0
    pad_n = n % step != 0
    if not (pad_m or pad_k or pad_n):
        return None
    mp, kp, np_ = (-(-d // step) * step if p else d for d, p in ((m, pad_m), (k, pad_k), (n, pad_n)))
    a2 = _padded(g, a, mp, kp, a_cols) if (mp, kp) != (m, k) else a
    b2 = _padded(g, b, kp, np_, b_cols) if (kp, np_) != (k, n) else b
    with g.lowering_as(torch.empty((mp, np_), dtype=v.dtype, device="meta")):
        prod = g.extern(aten.mm.default, (a2, b2), {}, fallback=False)
    if mp != m:
        prod = P.slice_(prod, 0, 0, m)
    return P.slice_(prod, 1, 0, n) if np_ != n else prod


def _along_columns(x: TensorBox) -> bool:
    """Whether matrix x is (or, not yet stored, will be as eager lays it out) contiguous along its columns (dim 1:
    row-major) rather than its rows (a transposed view)."""
    stride = x.strided[1] if x.strided is not None else getattr(x, "eager_stride", None)
    return stride is None or int(x.size[0]) == 1 or not (int(stride[0]) == 1 and int(x.size[1]) != 1)


def _padded(g: "Graph", x: TensorBox, rows: int, cols: int, along_columns: bool) -> TensorBox:
    """x zero-padded to [rows, cols], stored contiguous along the dim x is (a library argument: realize's share)."""
    p = P.pad(x, (0, cols - int(x.size[1]), 0, rows - int(x.size[0])), 0)
    return g.realize(p, stride=(cols, 1) if along_columns else (1, rows), share=True)


@dataclasses.dataclass(eq=False)
class SiblingProducts:
    """Linear layers reading one input (BERT's query, key and value projections) on CUDA: one library product of
    the input and their weights concatenated, each layer's result a slice of it plus its bias (lazy, as
    addmm). A wider product fills the GPU's SMs better, even with the weights concatenated on each call."""
    members: list   # the addmm nodes, in graph order
    parts: dict | None = None   # node -> its result, made when the first member is lowered ({}: lowered one by one)


def plan_sibling_products(gm: torch.fx.GraphModule) -> dict:
    """{addmm node: SiblingProducts} for a CUDA float32 inference graph's linear layers (addmm of a 1-D bias, a
    2-D input and a 2-D weight) that read the same input, where addmm would take the library
    product and add the bias lazily (not a result the graph returns, nor one a library call reads a part of)."""
    if not (isinstance(getattr(gm, "meta", None), dict) and gm.meta.get("ember_inference")):
        return {}
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
            v = s.members[0].meta["val"]   # (a symbolic graph's: the product's row count is its SymInt)
            like = v.new_empty((v.shape[0], width)) if g.symbolic else \
                torch.empty((int(x.size[0]), width), dtype=torch.float32, device="meta")
            with g.lowering_as(like):
                prod = g.extern(aten.mm.default, (x, weights), {}, fallback=False)
            start = 0
            for m in s.members:
                n_cols = int(m.meta["val"].shape[1])
                s.parts[m] = P.add(P.slice_(prod, 1, start, start + n_cols), env[m.args[0]], dtype=torch.float32)
                start += n_cols
    return s.parts.get(node)
