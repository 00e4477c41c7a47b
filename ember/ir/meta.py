"""Output metadata of the commonest ops, computed directly instead of through FakeTensorMode's dispatch.

Capture runs every recorded op on fake tensors to learn what it returns. A FakeTensorMode dispatch whose cache
is cold (each new op/shape) costs milliseconds: eval-mode batch_norm runs a whole Python decomposition on meta
tensors, a pointwise op goes through the Python meta functions. For a few ops on plain inputs the answer is known without running anything: `fast_result` returns
the output FakeTensor for those (eval batch_norm, layer_norm, linear, addmm, conv2d, cat, same-shape
pointwise ops), or None, and the caller then dispatches through FakeTensorMode as for any other op.

The rules only take inputs whose result eager computes one way on every backend: every tensor dense with
canonical contiguous strides (`contiguous_strides`, so no size-1 dimension with an odd stride makes
suggest_memory_format ambiguous), one device, floating dtypes; no autograd involvement (grad mode off or no
input requiring grad: the output is then a leaf without requires_grad, as FakeTensorMode's is); no autocast, no
inference mode. tests/ir/test_meta.py compares each rule with eager and with FakeTensorMode over shapes,
dtypes, and argument spellings, and checks that inputs outside the rules fall through.
"""
from __future__ import annotations

import operator

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)

# Pointwise ops whose result, when it is floating point, has the promoted dtype of the inputs and (for same-shape
# contiguous inputs) contiguous strides: arithmetic and float math.
_UNARY = {torch.relu, F.relu, torch.sin, torch.cos, torch.exp, torch.tanh, torch.sigmoid, torch.neg, torch.abs,
          torch.sqrt, torch.rsqrt, torch.log, torch.erf, operator.neg, F.gelu, F.silu}
_UNARY_METHODS = {"relu", "sin", "cos", "exp", "tanh", "sigmoid", "neg", "abs", "sqrt", "rsqrt", "log", "erf",
                  "__neg__"}
_BINARY = {operator.add, operator.sub, operator.mul, operator.truediv, torch.add, torch.sub, torch.mul, torch.div}
_BINARY_METHODS = {"add", "sub", "mul", "div", "__add__", "__sub__", "__mul__", "__truediv__", "__radd__",
                   "__rmul__"}
# In place: the result is the first input itself (FakeTensorMode returns it too); its dtype must hold the result.
_INPLACE = {operator.iadd, operator.isub, operator.imul, operator.itruediv}
_INPLACE_METHODS = {"relu_", "add_", "sub_", "mul_", "div_"}
_OPERATORS = {operator.add, operator.sub, operator.mul, operator.truediv}


def contiguous_strides(shape) -> tuple:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


def _plain(t, device) -> bool:
    """A fake tensor of this capture with canonical contiguous strides, floating point, on `device`."""
    return (type(t) is FakeTensor and t.dtype in FLOATS and t.fake_device == device and t.layout is torch.strided
            and t.stride() == contiguous_strides(t.shape) and not t.is_neg() and not t.is_conj())


def _new(mode: FakeTensorMode, shape, dtype, device) -> FakeTensor:
    shape = tuple(shape)
    return FakeTensor(mode, torch.empty_strided(shape, contiguous_strides(shape), dtype=dtype, device="meta"), device)


def _grad_free(tensors) -> bool:
    return not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors)


def fake_of_real(mode: FakeTensorMode, t: torch.Tensor) -> FakeTensor | None:
    """FakeTensorMode.from_tensor for a plain leaf tensor or parameter (what module parameters and inputs are),
    without meta_utils' general description of views, storages and subclasses; None for anything else."""
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout is not torch.strided or t._is_view() or \
            t.storage_offset() != 0 or t.is_neg() or t.is_conj() or t.is_quantized or t.is_nested or \
            t.device.type == "meta" or (t.requires_grad and not t.is_leaf) or t.grad is not None or \
            torch.is_inference_mode_enabled() or t.is_inference() or getattr(t, "_is_buffer", False):
        return None
    meta = torch.empty_strided(tuple(t.shape), t.stride(), dtype=t.dtype, device="meta",
                               requires_grad=t.requires_grad)
    out = FakeTensor(mode, meta, t.device)
    if type(t) is torch.nn.Parameter:
        out._is_param = True
    return out


def fast_result(mode: FakeTensorMode, kind: str, target, args: tuple, kwargs: dict) -> FakeTensor | None:
    """The FakeTensor that running `target(*args, **kwargs)` under `mode` would return, for the ops and inputs
    described in the module docstring; None where the caller must dispatch."""
    if torch._C._is_any_autocast_enabled() or torch.is_inference_mode_enabled():
        return None
    method = kind == "call_method"
    if (target in _UNARY and not method) or (method and target in _UNARY_METHODS):
        inplace = False
        if target is F.relu and (len(args) == 2 or kwargs):  # F.relu(x, inplace)
            inplace = kwargs.get("inplace", args[1] if len(args) == 2 else False)
            if len(args) + len(kwargs) != 2 or (kwargs and "inplace" not in kwargs) or type(inplace) is not bool:
                return None
        elif len(args) != 1 or kwargs:
            return None
        x = args[0]
        if type(x) is not FakeTensor or not _plain(x, x.fake_device) or not _grad_free((x,)):
            return None
        return x if inplace else _new(mode, x.shape, x.dtype, x.fake_device)
    if method and target in _INPLACE_METHODS or not method and target in _INPLACE:
        return _pointwise(mode, target, args, kwargs, inplace=True, unary=target == "relu_")
    if (method and target in _BINARY_METHODS) or (not method and target in _BINARY):
        return _pointwise(mode, target, args, kwargs, inplace=False)
    if method:
        return None
    rule = next((r for f, r in _FUNCTION_RULES if target is f), None)
    return rule(mode, args, kwargs) if rule is not None else None


def _pointwise(mode, target, args, kwargs, inplace: bool, unary: bool = False):
    if kwargs or len(args) != (1 if unary else 2):
        return None
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    # torch.add(2, x) is a TypeError (operator.add(2, x) is x.__radd__(2)); in place, the first is the result
    if not tensors or type(args[0]) is not FakeTensor and (inplace or target not in _OPERATORS):
        return None
    first = tensors[0]
    if type(first) is not FakeTensor:   # (a batched tensor of vmap, a subclass: dispatched)
        return None
    device, shape, dtype = first.fake_device, first.shape, first.dtype
    for a in args:
        if isinstance(a, torch.Tensor):
            if type(a) is not FakeTensor or a.shape != shape or not _plain(a, device):
                return None
            dtype = torch.promote_types(dtype, a.dtype)
        elif type(a) not in (int, float, bool):  # a float tensor with a Python number keeps its dtype
            return None
    if not _grad_free(tensors):
        return None
    if inplace:
        return args[0] if dtype == args[0].dtype else None
    return _new(mode, shape, dtype, device)


def _bind(names: tuple, defaults: dict, args: tuple, kwargs: dict) -> dict | None:
    if len(args) > len(names) or any(k not in names for k in kwargs):
        return None
    bound = dict(defaults)
    bound.update(zip(names, args))
    for k, v in kwargs.items():
        if k in names[:len(args)]:
            return None
        bound[k] = v
    return bound if all(n in bound for n in names) else None


_BN_NAMES = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")
_BN_DEFAULTS = {"weight": None, "bias": None, "training": False, "momentum": 0.1, "eps": 1e-5}


def _batch_norm(mode, args, kwargs):
    """Eval-mode F.batch_norm with running statistics: eager's output is empty_like(input, suggested format)."""
    b = _bind(_BN_NAMES, _BN_DEFAULTS, args, kwargs)
    if b is None or b["training"] is not False or type(b["momentum"]) not in (float, int) or \
            type(b["eps"]) not in (float, int):
        return None
    x = b["input"]
    if type(x) is not FakeTensor or x.dim() < 2 or x.numel() == 0 or not _plain(x, x.fake_device):
        return None
    channels = x.shape[1]
    params = [b["running_mean"], b["running_var"]] + [b[n] for n in ("weight", "bias") if b[n] is not None]
    for p in params:
        if type(p) is not FakeTensor or p.shape != (channels,) or p.dtype != x.dtype or not _plain(p, x.fake_device):
            return None
    if not _grad_free([x] + params):
        return None
    return _new(mode, x.shape, x.dtype, x.fake_device)


_LN_NAMES = ("input", "normalized_shape", "weight", "bias", "eps")
_LN_DEFAULTS = {"weight": None, "bias": None, "eps": 1e-5}


def _layer_norm(mode, args, kwargs):
    """F.layer_norm: eager's kernels write a contiguous output of the input's shape and dtype."""
    b = _bind(_LN_NAMES, _LN_DEFAULTS, args, kwargs)
    if b is None or type(b["eps"]) not in (float, int):
        return None
    x, shape = b["input"], b["normalized_shape"]
    if not isinstance(shape, (tuple, list)) or not shape or not all(type(s) is int for s in shape):
        return None
    shape = tuple(shape)
    if type(x) is not FakeTensor or x.dim() < len(shape) or tuple(x.shape[x.dim() - len(shape):]) != shape or \
            x.numel() == 0 or not _plain(x, x.fake_device):
        return None
    params = [b[n] for n in ("weight", "bias") if b[n] is not None]
    for p in params:
        if type(p) is not FakeTensor or tuple(p.shape) != shape or p.dtype != x.dtype or not _plain(p, x.fake_device):
            return None
    if not _grad_free([x] + params):
        return None
    return _new(mode, x.shape, x.dtype, x.fake_device)


def _matrix_operands(ts) -> bool:
    first = ts[0]
    return all(type(t) is FakeTensor and t.dtype == first.dtype and t.numel() > 0 and _plain(t, first.fake_device)
               for t in ts) and _grad_free(ts)


def _linear(mode, args, kwargs):
    """F.linear with a 2-D input (eager: addmm or mm, a fresh contiguous result) or a contiguous 3-D input and a
    bias (eager: addmm of the input flattened to 2-D, then viewed back: the result is a view, built as one)."""
    b = _bind(("input", "weight", "bias"), {"bias": None}, args, kwargs)
    if b is None:
        return None
    x, w, bias = b["input"], b["weight"], b["bias"]
    ts = [x, w] + ([bias] if bias is not None else [])
    if type(x) is not FakeTensor or type(w) is not FakeTensor or w.dim() != 2 or x.dim() not in (2, 3) or \
            x.shape[-1] != w.shape[1] or (bias is not None and (type(bias) is not FakeTensor or
                                                               tuple(bias.shape) != (w.shape[0],))) or \
            (x.dim() == 3 and bias is None) or not _matrix_operands(ts):
        return None
    rows = x.numel() // x.shape[-1]
    out = _new(mode, (rows, w.shape[0]), x.dtype, x.fake_device)
    if x.dim() == 2:
        return out
    with mode:
        return out.view(x.shape[0], x.shape[1], w.shape[0])


def _addmm(mode, args, kwargs):
    """torch.addmm(bias, mat1, mat2) with a 1-D bias or one of the result's shape: a fresh contiguous result."""
    b = _bind(("input", "mat1", "mat2"), {}, args, kwargs)
    if b is None:
        return None
    bias, m1, m2 = b["input"], b["mat1"], b["mat2"]
    if type(m1) is not FakeTensor or type(m2) is not FakeTensor or type(bias) is not FakeTensor or \
            m1.dim() != 2 or m2.dim() != 2 or m1.shape[1] != m2.shape[0] or \
            tuple(bias.shape) not in ((m2.shape[1],), (m1.shape[0], m2.shape[1])) or \
            not _matrix_operands([bias, m1, m2]):
        return None
    return _new(mode, (m1.shape[0], m2.shape[1]), m1.dtype, m1.fake_device)


_CONV_NAMES = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_CONV_DEFAULTS = {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1}


def _pair(v):
    if type(v) is int:
        return (v, v)
    if isinstance(v, (tuple, list)) and len(v) == 2 and all(type(i) is int for i in v):
        return tuple(v)
    if isinstance(v, (tuple, list)) and len(v) == 1 and type(v[0]) is int:
        return (v[0], v[0])
    return None


def conv2d_output_shape(x_shape, w_shape, stride, padding, dilation, groups: int) -> tuple | None:
    """(n, o, ho, wo) of a 2-d convolution of a 4-d input and weight, or None where the arguments are invalid."""
    n, c, h, wd = x_shape
    o, cg, kh, kw = w_shape
    if groups < 1 or cg * groups != c or o % groups or min(stride) < 1 or min(dilation) < 1 or min(padding) < 0:
        return None
    ho = (h + 2 * padding[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    wo = (wd + 2 * padding[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    return (n, o, ho, wo) if ho >= 1 and wo >= 1 else None


def _conv2d(mode, args, kwargs):
    """torch.conv2d of a batched contiguous float32/float64 CPU input and weight: a contiguous output."""
    b = _bind(_CONV_NAMES, _CONV_DEFAULTS, args, kwargs)
    if b is None:
        return None
    x, w, bias, groups = b["input"], b["weight"], b["bias"], b["groups"]
    stride, padding, dilation = _pair(b["stride"]), _pair(b["padding"]), _pair(b["dilation"])
    if None in (stride, padding, dilation) or type(groups) is not int or groups < 1 or \
            type(x) is not FakeTensor or type(w) is not FakeTensor or x.dim() != 4 or w.dim() != 4:
        return None
    device = x.fake_device
    if device.type != "cpu" or x.dtype not in (torch.float32, torch.float64) or w.dtype != x.dtype or \
            not _plain(x, device) or not _plain(w, device) or x.numel() == 0 or w.numel() == 0:
        return None
    shape = conv2d_output_shape(x.shape, w.shape, stride, padding, dilation, groups)
    if shape is None:
        return None
    if bias is not None and (type(bias) is not FakeTensor or bias.shape != (shape[1],) or bias.dtype != x.dtype or
                             not _plain(bias, device)):
        return None
    if not _grad_free([t for t in (x, w, bias) if t is not None]):
        return None
    return _new(mode, shape, x.dtype, device)


def _cat(mode, args, kwargs):
    """torch.cat of same-rank, same-dtype, non-empty contiguous tensors: a contiguous result."""
    b = _bind(("tensors", "dim"), {"dim": 0}, args, kwargs)
    if b is None or type(b["dim"]) is not int or not isinstance(b["tensors"], (list, tuple)) or not b["tensors"]:
        return None
    ts = b["tensors"]
    first = ts[0]
    if type(first) is not FakeTensor or first.dim() == 0:
        return None
    nd, device = first.dim(), first.fake_device
    dim = b["dim"] + nd if b["dim"] < 0 else b["dim"]
    if not 0 <= dim < nd:
        return None
    total = 0
    for t in ts:
        if type(t) is not FakeTensor or t.dim() != nd or t.dtype != first.dtype or t.numel() == 0 or \
                not _plain(t, device) or any(t.shape[i] != first.shape[i] for i in range(nd) if i != dim):
            return None
        total += t.shape[dim]
    if not _grad_free(ts):
        return None
    shape = list(first.shape)
    shape[dim] = total
    return _new(mode, shape, first.dtype, device)


_FUNCTION_RULES = ((F.batch_norm, _batch_norm), (torch.conv2d, _conv2d), (torch.cat, _cat),
                   (F.layer_norm, _layer_norm), (F.linear, _linear), (torch.addmm, _addmm))


# torch.matmul spelled as a function, an operator or a method: `symbolic_matmul` computes it for symbolic sizes
MATMULS = {torch.matmul, operator.matmul}
MATMUL_METHODS = {"matmul", "__matmul__"}


def _symbolic(t) -> bool:
    return isinstance(t, torch.Tensor) and any(isinstance(x, torch.SymInt) and not x.node.expr.is_Integer
                                               for x in (*t.shape, *t.stride()))


def symbolic_matmul(a, b) -> torch.Tensor | None:
    """a @ b of a batched product (both operands at least 2-D, one at least 3-D) with a symbolic size, as torch.matmul
    computes it (the batch of a 2-D `b` folded into `a`'s rows and one mm; else both expanded to the broadcast
    batch and one bmm), in torch ops over the sizes as SymInts; None for any other product (torch.matmul runs).
    torch's own C++ matmul reads some sizes as ints (torch 2.11: `q @ k.transpose(-2, -1)` of a symbolic sequence
    length), which pins each symbol to its value: a graph per length."""
    if not (_symbolic(a) or _symbolic(b)) or not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) \
            or min(a.dim(), b.dim()) < 2 or max(a.dim(), b.dim()) < 3:
        return None
    return batched_matmul(a, b)


def batched_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """symbolic_matmul's product, for any sizes."""
    n, k, m = a.shape[-2], a.shape[-1], b.shape[-1]
    if b.dim() == 2:
        rows = 1
        for x in a.shape[:-1]:
            rows = rows * x
        return torch.mm(a.reshape(rows, k), b).view(*a.shape[:-1], m)
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    count = 1
    for x in batch:
        count = count * x
    a3 = a.expand(*batch, n, k).reshape(count, n, k)
    b3 = b.expand(*batch, k, m).reshape(count, k, m)
    return torch.bmm(a3, b3).view(*batch, n, m)


def symbolic_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """F.scaled_dot_product_attention as torch's math path computes it (q and k each scaled by sqrt(scale), a
    causal or boolean mask made additive, a softmax whose fully masked rows are zeros, two products), in torch
    ops over SymInts (symbolic_matmul); None where that path needs more (dropout, grouped heads, a symbolic head
    dim). For CUDA tensors of symbolic sizes whose fused kernel ember does not choose: torch picks its kernel
    inside C++ from the sizes, and on fakes its math path reads them as ints (a graph per sequence length)."""
    if dropout_p or enable_gqa or q.dim() < 2 or not isinstance(q.shape[-1], int):
        return None
    import math
    factor = math.sqrt(scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))
    keys = (k * factor).transpose(-2, -1)
    attn = symbolic_matmul(q * factor, keys)
    attn = torch.matmul(q * factor, keys) if attn is None else attn
    masks = [attn_mask] if attn_mask is not None else []
    if is_causal:
        masks.append(torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril())
    for m in masks:
        if m.dtype == torch.bool:
            m = torch.zeros(m.shape, dtype=attn.dtype, device=attn.device).masked_fill(m.logical_not(), float("-inf"))
        attn = attn + m
    attn = torch.ops.aten._safe_softmax(attn, -1)
    out = symbolic_matmul(attn, v)
    return torch.matmul(attn, v) if out is None else out
