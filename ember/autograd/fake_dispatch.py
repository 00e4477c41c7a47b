"""Running an ATen op on fake tensors for the recorder: walking an op's arguments for tensors, direct output
metadata for ops whose fake dispatch is slow, and a trace's own memo of fake dispatches."""
from __future__ import annotations

from typing import Callable

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._mode_utils import no_dispatch

from ember.autograd.functionalize import _is_write
from ember.ir.meta import FLOATS, contiguous_strides, conv2d_output_shape
from ember.ir.symbols import SizeDecision, no_new_guards

aten = torch.ops.aten
_SYM_TYPES = (torch.SymInt, torch.SymFloat, torch.SymBool)


def _tensors(x) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    _collect_tensors(x, out)
    return out


# An ATen op's arguments and results are tensors, (nested) lists and tuples of them, and a kwargs dict: walked
# directly, pytree's general tree functions cost more than the recorder's own bookkeeping of an op.

def _collect_tensors(x, out: list) -> None:
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif type(x) in (list, tuple):
        for y in x:
            _collect_tensors(y, out)
    elif type(x) is dict:
        for y in x.values():
            _collect_tensors(y, out)
    elif isinstance(x, (list, tuple, dict)):   # a namedtuple, a dict subclass: pytree knows them
        out.extend(t for t in pytree.tree_leaves(x) if isinstance(t, torch.Tensor))


def _map_tensors(x, fn: Callable, sym_fn: Callable | None = None):
    """pytree.tree_map_only(torch.Tensor, fn, x) for an ATen op's arguments (see _collect_tensors); with sym_fn,
    SymInts (SymFloats, SymBools) are mapped by it too."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    t = type(x)
    if t is list or t is tuple:
        return t([_map_tensors(y, fn, sym_fn) for y in x])
    if t is dict:
        return {k: _map_tensors(y, fn, sym_fn) for k, y in x.items()}
    if sym_fn is not None and t in _SYM_TYPES:
        return sym_fn(x)
    if isinstance(x, (list, tuple, dict)):
        out = pytree.tree_map_only(torch.Tensor, fn, x)
        return out if sym_fn is None else pytree.tree_map_only(_SYM_TYPES, sym_fn, out)
    return x


def _all_fake(x) -> bool:
    """No real (non-fake) tensor among an op's arguments."""
    if isinstance(x, torch.Tensor):
        return isinstance(x, FakeTensor)
    t = type(x)
    if t is list or t is tuple:
        return all(_all_fake(y) for y in x)
    if t is dict:
        return all(_all_fake(y) for y in x.values())
    if isinstance(x, (list, tuple, dict)):
        return all(isinstance(y, FakeTensor) for y in pytree.tree_leaves(x) if isinstance(y, torch.Tensor))
    return True


# ------------------------------------------------------------------------------ direct output metadata

def _plain(t, device, dtype) -> bool:
    """A fake tensor with static, canonical contiguous strides, of `dtype`, on `device`, no conj/neg bit (a
    symbolic one is dispatched: comparing its sizes would add guards)."""
    return (type(t) is FakeTensor and not t._has_symbolic_sizes_strides and t.dtype == dtype and t.fake_device == device and t.layout is torch.strided
            and t.storage_offset() == 0 and t.stride() == contiguous_strides(t.shape) and not t.is_neg()
            and not t.is_conj() and t.constant is None)


def _fresh(mode: FakeTensorMode, shape, dtype, device) -> FakeTensor:
    shape = tuple(shape)
    return _fake_tensor(mode, shape, contiguous_strides(shape), dtype, device)


def _fake_tensor(mode: FakeTensorMode, shape, stride, dtype, device) -> FakeTensor:
    """A fresh fake tensor, made as FakeTensorMode makes one: its meta tensor with Python dispatch off (this
    runs inside the recorder's dispatch, where the FakeTensorMode below would otherwise take the factory call)."""
    with no_dispatch():
        meta = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
    return FakeTensor(mode, meta, device)


def _eval_batch_norm(args, kwargs):
    """native_batch_norm(input, weight, bias, running_mean, running_var, training=False, momentum, eps): its
    meta function is a Python decomposition on meta tensors, slow for each new shape (a large part of a CNN's
    trace). For a contiguous input and same-dtype vectors: a contiguous output like the input, and the saved
    statistics as FakeTensorMode computes them: empty on a CPU, the running statistics' copies (in the
    computation dtype, float32 for half inputs) elsewhere."""
    if kwargs or len(args) != 8 or args[5] is not False:
        return None
    x, w, b, rm, rv = args[:5]
    if type(x) is not FakeTensor or x._has_symbolic_sizes_strides or x.dtype not in FLOATS or x.dim() < 2 or \
            x.numel() == 0 or rm is None or \
            rv is None or type(args[6]) not in (float, int) or type(args[7]) not in (float, int):
        return None
    device, dtype, channels = x.fake_device, x.dtype, x.shape[1]
    if not _plain(x, device, dtype):
        return None
    for v in (w, b, rm, rv):
        if v is not None and (not _plain(v, device, dtype) or tuple(v.shape) != (channels,)):
            return None
    mode = x.fake_mode
    if mode.in_kernel_invocation or any(v is not None and v.fake_mode is not mode for v in (w, b, rm, rv)):
        return None
    if device.type == "cpu":
        stats = [_fresh(mode, (0,), dtype, device) for _ in range(2)]
    else:
        compute = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        stats = [_fresh(mode, (channels,), compute, device) for _ in range(2)]
    return (_fresh(mode, x.shape, dtype, device), *stats)


def _cpu_convolution(args, kwargs):
    """convolution(input, weight, bias, stride, padding, dilation, transposed=False, output_padding, groups)
    of a 4-D contiguous float32/float64 CPU input and weight: a contiguous output (ember.ir.meta's conv2d
    rule, at the ATen level). Its meta function runs in Python, milliseconds a call."""
    if kwargs or len(args) != 9 or args[6] is not False:
        return None
    x, w, bias, stride, padding, dilation, _, _, groups = args
    if type(x) is not FakeTensor or type(w) is not FakeTensor or x.dim() != 4 or w.dim() != 4 or \
            x._has_symbolic_sizes_strides or w._has_symbolic_sizes_strides or \
            x.fake_device.type != "cpu" or x.dtype not in (torch.float32, torch.float64) or type(groups) is not int:
        return None
    device, dtype = x.fake_device, x.dtype
    if not (_plain(x, device, dtype) and _plain(w, device, dtype)) or x.numel() == 0 or w.numel() == 0 or \
            (bias is not None and not _plain(bias, device, dtype)):
        return None
    if not all(isinstance(v, (list, tuple)) and len(v) == 2 and all(type(i) is int for i in v)
               for v in (stride, padding, dilation)):
        return None
    mode = x.fake_mode
    if mode.in_kernel_invocation or w.fake_mode is not mode or (bias is not None and bias.fake_mode is not mode):
        return None
    shape = conv2d_output_shape(x.shape, w.shape, stride, padding, dilation, groups)
    if shape is None or (bias is not None and tuple(bias.shape) != (shape[1],)):
        return None
    return _fresh(mode, shape, dtype, device)


# ops whose FakeTensorMode dispatch is slow, answered directly for the inputs their rule takes (None: dispatch);
# tests/autograd/test_trace.py compares each rule with FakeTensorMode
_DIRECT = {aten.native_batch_norm.default: _eval_batch_norm, aten.convolution.default: _cpu_convolution}


# ------------------------------------------------------------------------------ a trace's own dispatch memo

_SCALARS = (int, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
_UNMEMOIZED_TAGS = (torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output, torch.Tag.inplace_view)


def _memo_key(mode: FakeTensorMode, x):
    """What an op's output metadata can depend on in argument x: a fake tensor's metadata, a scalar's type and
    value, a list's items; None where x is anything else (the op is then dispatched as usual)."""
    if type(x) is FakeTensor:
        # (symbolic sizes: not memoized, a SymInt is no dict key)
        if x.fake_mode is not mode or x.constant is not None or x.layout is not torch.strided or \
                x._has_symbolic_sizes_strides:
            return None
        return (x.shape, x.stride(), x.dtype, x.fake_device, x.storage_offset(), x.requires_grad, x.is_neg(),
                x.is_conj())
    t = type(x)
    if t in _SCALARS:
        return (t, x)
    if t is float:
        return (t, x) if x == x else None                    # (nan: never equal to itself)
    if t is list or t is tuple:
        items = [_memo_key(mode, y) for y in x]
        return None if any(k is None for k in items) else (t, *items)
    return None


def _fresh_spec(out, inputs: list):
    """out as (shape, stride, dtype, device) per tensor (a tuple/list of them as such), when each is a plain
    tensor of its own storage (no input's, no other output's: a view returned under a schema that does not say
    so, e.g. _unsafe_view, is not memoized); None otherwise."""
    outs = [out] if isinstance(out, torch.Tensor) else list(out) if type(out) in (tuple, list) else None
    if not outs or not all(type(o) is FakeTensor for o in outs):
        return None
    storages = {t.untyped_storage()._cdata for t in inputs}
    specs = []
    for o in outs:
        if o.storage_offset() != 0 or o.layout is not torch.strided or o.is_neg() or o.is_conj() or \
                o.requires_grad or o.constant is not None:
            return None
        st = o.untyped_storage()
        need = 0 if o.numel() == 0 else (1 + sum((n - 1) * d for n, d in zip(o.shape, o.stride()))) * o.element_size()
        if st._cdata in storages or st.nbytes() != need:
            return None
        storages.add(st._cdata)
        specs.append((tuple(o.shape), o.stride(), o.dtype, o.fake_device))
    return specs[0] if isinstance(out, torch.Tensor) else (type(out), specs)


def _from_spec(mode: FakeTensorMode, spec):
    if type(spec[0]) is type:
        return spec[0](_from_spec(mode, s) for s in spec[1])
    return _fake_tensor(mode, *spec)


def _memo_fake_call(memo: dict, mode: FakeTensorMode, func, args, kwargs):
    """_fake_call through a memo of this trace's own: a model's repeated layers dispatch the same ops on the same
    metadata over and over, and FakeTensorMode's process-wide cache, though it answers them, spends most of a
    dispatch on its general cache key (about half of a transformer's joint trace). Ops that may return
    views, depend on data or reshape in place are dispatched as usual, and so is any call whose arguments hold
    something _memo_key does not describe; a fresh tensor per output is made from the remembered metadata, as
    FakeTensorMode's own cache makes it."""
    ok = memo.get(func)
    if ok is None:
        schema = func._schema
        ok = memo[func] = not any(r.alias_info is not None for r in schema.returns) and \
            not any(_is_write(a) for a in schema.arguments) and not any(t in func.tags for t in _UNMEMOIZED_TAGS)
    if not ok or mode.in_kernel_invocation:
        return _fake_call(func, args, kwargs)
    key = _memo_key(mode, args)
    kw = _memo_key(mode, tuple(kwargs.items())) if kwargs else ()
    if key is None or kw is None:
        return _fake_call(func, args, kwargs)
    key = (func, key, kw)
    spec = memo.get(key)
    if spec is not None:
        return _from_spec(mode, spec)
    out = _fake_call(func, args, kwargs)
    spec = _fresh_spec(out, _tensors((args, kwargs)))
    if spec is not None:
        memo[key] = spec
    return out


def _fake_call(func, args, kwargs):
    """func on fake tensors. The foreach ops' fake kernels refuse a CPU `scalars` tensor (the optimizers' stacked
    step sizes, `_foreach_addcdiv.Tensor`): their results are shaped like `self`, made here instead."""
    try:
        return func(*args, **kwargs)
    except RuntimeError as e:
        if not (func._schema.name.startswith("aten::_foreach_add") and "scalars" in str(e)
                and func._overloadname == "Tensor"):
            raise
        return [torch.empty_like(t) for t in args[0]]


# ------------------------------------------------------------------------------ symbolic sizes: direct results

def _dense(mode: FakeTensorMode, t, device=None, dtype=None) -> bool:
    """A fake tensor of `mode` with canonical contiguous strides (sizes symbolic or not), no bits, no constant;
    called with the ShapeEnv closed, so a comparison its ranges do not decide raises SizeDecision."""
    return (type(t) is FakeTensor and t.fake_mode is mode and t.layout is torch.strided and t.constant is None
            and (device is None or t.fake_device == device) and (dtype is None or t.dtype == dtype)
            and t.dtype in FLOATS and not t.is_neg() and not t.is_conj() and t.storage_offset() == 0
            and t.stride() == contiguous_strides(t.shape))


def _like(mode, t, dtype=None):
    return _fake_tensor(mode, tuple(t.shape), t.stride(), dtype or t.dtype, t.fake_device)


def _sym_unary(mode, args, kwargs):
    """relu(x): a result like x."""
    return _like(mode, args[0]) if len(args) == 1 and not kwargs and _dense(mode, args[0]) else None


def _sym_log_softmax(mode, args, kwargs):
    """_log_softmax(x, dim, half_to_float=False): a result like x."""
    if kwargs or len(args) != 3 or args[2] is not False or type(args[1]) is not int or not _dense(mode, args[0]):
        return None
    return _like(mode, args[0])


def _sym_nll_loss(mode, args, kwargs):
    """nll_loss_forward(x (N, C), target (N,), weight=None, reduction mean or sum, ignore_index): the loss and
    the total weight, 0-d tensors of x's dtype."""
    if kwargs or len(args) != 5 or args[2] is not None or args[3] not in (1, 2) or type(args[4]) is not int:
        return None
    x, target = args[0], args[1]
    if not _dense(mode, x) or x.dim() != 2 or type(target) is not FakeTensor or target.dtype != torch.int64 or \
            target.dim() != 1 or target.fake_mode is not mode or target.shape[0] != x.shape[0]:
        return None
    return _fake_tensor(mode, (), (), x.dtype, x.fake_device), _fake_tensor(mode, (), (), x.dtype, x.fake_device)


def _sym_threshold_backward(mode, args, kwargs):
    """threshold_backward(grad, x, threshold) of same-shape, same-dtype tensors: a result like grad."""
    if kwargs or len(args) != 3 or type(args[2]) not in (int, float) or not _dense(mode, args[0]):
        return None
    return _like_paired(mode, args[0], args[1])


def _like_paired(mode, g, other):
    """A result like g, where `other` is dense of g's shape, device and dtype (an elementwise backward's
    operands); None otherwise."""
    if not _dense(mode, other, g.fake_device, g.dtype) or tuple(other.shape) != tuple(g.shape):
        return None
    return _like(mode, g)


def _sym_log_softmax_backward(mode, args, kwargs):
    """_log_softmax_backward_data(grad, out, dim, input_dtype) of same-shape tensors of input_dtype: like grad."""
    if kwargs or len(args) != 4 or type(args[2]) is not int or not _dense(mode, args[0], None, args[3]):
        return None
    return _like_paired(mode, args[0], args[1])


def _sym_nll_loss_backward(mode, args, kwargs):
    """nll_loss_backward(grad, x (N, C), target, weight=None, reduction mean or sum, ignore_index, total_weight):
    a result like x."""
    if kwargs or len(args) != 7 or args[3] is not None or args[4] not in (1, 2) or type(args[5]) is not int:
        return None
    g, x, target, total = args[0], args[1], args[2], args[6]
    if not _dense(mode, x) or x.dim() != 2 or any(type(t) is not FakeTensor or t.fake_mode is not mode
                                                 for t in (g, target, total)) or g.dim() != 0 or total.dim() != 0:
        return None
    return _like(mode, x)


def _bn_vectors(mode, x, vectors) -> bool:
    """Batch norm's per-channel vectors (None or dense (C,) of x's dtype, C = x.shape[1])."""
    return all(v is None or (_dense(mode, v, x.fake_device, x.dtype) and v.dim() == 1 and v.shape[0] == x.shape[1])
               for v in vectors)


def _bn_input(mode, x) -> bool:
    return _dense(mode, x) and x.dtype in (torch.float32, torch.float64) and x.dim() >= 2


def _channels(mode, x):
    return _fake_tensor(mode, (x.shape[1],), (1,), x.dtype, x.fake_device)


def _sym_batch_norm(mode, args, kwargs):
    """native_batch_norm(x, weight, bias, running_mean, running_var, training=True, momentum, eps) of a float32 or
    float64 input: the output like x and the saved mean and inverse deviation, (C,) of x's dtype."""
    if kwargs or len(args) != 8 or args[5] is not True or not _bn_input(mode, args[0]) or \
            not _bn_vectors(mode, args[0], args[1:5]):
        return None
    x = args[0]
    return _like(mode, x), _channels(mode, x), _channels(mode, x)


def _sym_batch_norm_functional(mode, args, kwargs):
    """_native_batch_norm_legit_functional(x, weight, bias, running_mean, running_var, training=True, momentum,
    eps): native_batch_norm's three results and the new running statistics."""
    if kwargs or len(args) != 8 or args[5] is not True or args[3] is None or args[4] is None or \
            not _bn_input(mode, args[0]) or not _bn_vectors(mode, args[0], args[1:5]):
        return None
    x = args[0]
    return (_like(mode, x), *(_channels(mode, x) for _ in range(4)))


def _sym_batch_norm_backward(mode, args, kwargs):
    """native_batch_norm_backward(grad, x, weight, running_mean, running_var, save_mean, save_invstd, train=True,
    eps, output_mask all True): the gradients of x (like x), weight and bias ((C,) of x's dtype)."""
    if kwargs or len(args) != 10 or args[7] is not True or list(args[9]) != [True, True, True] or \
            args[2] is None or not _bn_input(mode, args[1]) or not _bn_vectors(mode, args[1], args[2:7]):
        return None
    g, x = args[0], args[1]
    if not _dense(mode, g, x.fake_device, x.dtype) or tuple(g.shape) != tuple(x.shape):
        return None
    return _like(mode, x), _channels(mode, x), _channels(mode, x)


# ATen ops whose fake dispatch runs a Python decomposition on symbolic sizes (FakeTensorMode's cache then holds
# it per ShapeEnv only: each capture and trace of a symbolic graph pays it anew), answered directly
_SYMBOLIC_DIRECT = {
    aten.relu.default: _sym_unary,
    aten._log_softmax.default: _sym_log_softmax,
    aten.nll_loss_forward.default: _sym_nll_loss,
    aten.threshold_backward.default: _sym_threshold_backward,
    aten._log_softmax_backward_data.default: _sym_log_softmax_backward,
    aten.nll_loss_backward.default: _sym_nll_loss_backward,
    aten.native_batch_norm.default: _sym_batch_norm,
    aten._native_batch_norm_legit_functional.default: _sym_batch_norm_functional,
    aten.native_batch_norm_backward.default: _sym_batch_norm_backward,
}


class SymbolicFakeMode(FakeTensorMode):
    """The FakeTensorMode of a capture with symbolic sizes (the ATen trace of its graph runs in it too): the ops
    of _SYMBOLIC_DIRECT on symbolic inputs their rule takes are answered from the inputs' metadata, each rule run
    with the ShapeEnv closed (ir.symbols.no_new_guards: a size comparison the symbols' ranges do not decide gives
    up on the rule, never adds a guard); everything else dispatches as FakeTensorMode does.
    tests/autograd/test_fake_dispatch.py compares each rule with FakeTensorMode."""

    def dispatch(self, func, types, args=(), kwargs=None):
        rule = _SYMBOLIC_DIRECT.get(func)
        if rule is not None and not self.in_kernel_invocation and self.shape_env is not None and \
                any(type(a) is FakeTensor and a._has_symbolic_sizes_strides for a in args):
            try:
                with no_new_guards(self.shape_env):
                    out = rule(self, args, kwargs or {})
            except SizeDecision:
                out = None
            if out is not None:
                return out
        return super().dispatch(func, types, args, kwargs)
