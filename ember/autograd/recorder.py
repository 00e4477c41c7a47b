"""The ATen recorder: a TorchDispatchMode on fake tensors that writes every ATen op below autograd into an fx
graph, functionalized as it goes (ember.autograd.functionalize's rules), each node stamped with the torch-level
node that made it."""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from ember import config
from ember.autograd.fake_dispatch import _DIRECT, _all_fake, _fake_call, _map_tensors, _memo_fake_call, _tensors
from ember.autograd.functionalize import _INPLACE_VIEWS, _SCATTER, _UNDECLARED_WRITES, _Base, _bind, _is_write, \
    _Rec, _known_equal, _same_layout, _split, functional_variant
from ember.autograd.symbolic import SymNodes
from ember.autograd.trace_meta import TraceError
from ember.ir.meta import MATMUL_METHODS, MATMULS, symbolic_attention, symbolic_matmul
from ember.ir.symbols import has_symbols

aten = torch.ops.aten
_PRIM_DEVICE = torch.ops.prim.device.default
_META = torch.device("meta")


class _StampingGraph(torch.fx.Graph):
    """An fx graph whose new nodes remember which torch-level node was running (`origin`, "where" it came from
    in user code when the frontend said so), or that they belong to the backward."""

    origin: dict = {}

    def create_node(self, *args, **kwargs) -> torch.fx.Node:
        node = super().create_node(*args, **kwargs)
        node.meta.update(self.origin)
        return node


class _OriginInterpreter(torch.fx.Interpreter):
    """Runs a GraphModule node by node, telling the recorder's graph which node is running."""

    def __init__(self, gm: torch.fx.GraphModule, graph: _StampingGraph):
        super().__init__(gm)
        self.stamp = graph

    def run_node(self, n: torch.fx.Node):
        if n.op in ("call_function", "call_method", "call_module"):
            self.stamp.origin = {"origin": n.name, **({"where": n.meta["where"]} if "where" in n.meta else {})}
        try:
            return super().run_node(n)
        finally:
            self.stamp.origin = {}

    def call_function(self, target, args, kwargs):
        if target is torch.nn.functional.scaled_dot_product_attention:
            out = cuda_attention(*args, **kwargs)
            if out is not None:
                return out
        if target in MATMULS and len(args) == 2 and not kwargs:
            out = symbolic_matmul(*args)   # (a batched product of symbolic sizes: its ops recorded one by one)
            if out is not None:
                return out
        return super().call_function(target, args, kwargs)

    def call_method(self, target, args, kwargs):
        if target in MATMUL_METHODS and len(args) == 2 and not kwargs:
            out = symbolic_matmul(*args)
            if out is not None:
                return out
        return super().call_method(target, args, kwargs)


def cuda_attention(*args, **kwargs):
    """F.scaled_dot_product_attention on CUDA tensors as ember records it, or None (torch's own op runs): the fused
    kernel eager would run (_cuda_fused_sdpa), else, for symbolic sizes, the math path written over SymInts
    (ir.meta.symbolic_attention: torch's C++ choice on fakes would pin the sizes to their values)."""
    fused = _cuda_fused_sdpa(*args, **kwargs)
    if fused is not None:
        return fused
    q = args[0] if args else kwargs.get("query")
    if isinstance(q, torch.Tensor) and q.is_cuda and any(
            isinstance(t, torch.Tensor) and has_symbols(t) for t in (*args, *kwargs.values())):
        return symbolic_attention(*args, **kwargs)
    return None


def _cuda_fused_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                     enable_gqa=False):
    """F.scaled_dot_product_attention on CUDA as the fused kernel eager would run, or None (the op decomposes as
    usual). The op picks its kernel inside C++ from the inputs; on fake tensors that choice falls back to the math
    path (bmm + softmax) whenever a mask is given, although eager runs the memory-efficient kernel on the real
    ones. So the choice is made here with torch.backends.cuda's public checks, and the mask prepared as the op
    prepares it for that kernel (boolean -> additive float, broadcast to batch x heads)."""
    if not (isinstance(query, torch.Tensor) and query.is_cuda and not enable_gqa) or query.dim() != 4:
        return None
    try:
        params = torch.backends.cuda.SDPAParams(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
        if not (torch.backends.cuda.mem_efficient_sdp_enabled() and
                torch.backends.cuda.can_use_efficient_attention(params)):
            return None
        if torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.can_use_flash_attention(params):
            return None          # eager prefers flash; the op's own path gets there
    except Exception:            # older torch without these checks, or fake tensors they cannot read
        return None
    bias = attn_mask
    if bias is not None:
        if not _known_multiple(key.shape[-2], 16 // query.element_size()):
            # the kernel needs the bias rows 16-byte aligned; eager pads a view for it, and so does the code
            # generator (codegen.layout.ALIGNED_ARGUMENTS), but this graph also runs as it is where it is not
            # compiled, and the expanded bias below is compact: such shapes take torch's own path (a symbolic
            # length too, unless the guards say it is a multiple: deciding would guard on its remainder)
            return None
        if bias.dtype == torch.bool:
            bias = torch.zeros(bias.shape, dtype=query.dtype, device=query.device).masked_fill(
                bias.logical_not(), float("-inf"))
        bias = bias.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[-2])
    need_lse = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, bias, need_lse, dropout_p, is_causal, scale=scale)[0]


def _known_multiple(n, k: int) -> bool:
    return n % k == 0 if type(n) is int else statically_known_true(n % k == 0)


class _Recorder(TorchDispatchMode):
    """Records every ATen op into `graph`, functionalized (see the module docstring)."""

    def __init__(self, fake_mode: FakeTensorMode):
        super().__init__()
        self.fake_mode = fake_mode
        self.graph = _StampingGraph()
        self.recs: dict[int, _Rec] = {}
        self.keep: list[torch.Tensor] = []   # keeps every recorded tensor alive, so ids stay unique
        self.constants: dict[str, torch.Tensor] = {}
        self.bases: list[_Base] = []
        self.memo: dict = {}                 # _memo_fake_call's: per op, memoizable; per call's metadata, outputs
        self.syms = SymNodes(self.graph)     # the nodes of the SymInts ops take (ember.autograd.symbolic)
        self.input_index: dict[torch.fx.Node, int] = {}   # placeholder -> its position among the graph's inputs

    # -- bookkeeping
    def _new(self, t: torch.Tensor, node: torch.fx.Node, base: _Base | None = None, chain: tuple = ()) -> None:
        node.meta["val"] = t
        if base is None:
            base = _Base(t, node)
            self.bases.append(base)
        self.keep.append(t)
        self.recs[id(t)] = _Rec(node, base, chain, base.version)

    def placeholder(self, t: torch.Tensor, name: str, input_index: int | None) -> torch.fx.Node:
        node = self.graph.placeholder(name)
        self._new(t, node)
        self.recs[id(t)].base.input_index = input_index
        self.input_index[node] = input_index
        self.syms.bind_dims(t, node)
        return node

    def sym_placeholder(self, s: torch.SymInt, name: str, input_index: int) -> torch.fx.Node:
        """An int input carrying a symbol (docs/dynamic.md): the node of that symbol in the graph's ops."""
        node = self.graph.placeholder(name)
        node.meta["val"] = s
        self.input_index[node] = input_index
        self.syms.bind(s, node)
        return node

    def int_placeholder(self, value: int, name: str, input_index: int) -> torch.fx.Node:
        """An int input a static trace takes as a constant (the graph is specialized to it)."""
        node = self.graph.placeholder(name)
        node.meta["val"] = value
        self.input_index[node] = input_index
        return node

    def alias_placeholder(self, t: torch.Tensor, of: torch.Tensor) -> None:
        """`t` stands for the same value as the already registered `of` (e.g. a non-leaf clone of a primal)."""
        self.keep.append(t)
        self.recs[id(t)] = self.recs[id(of)]

    def constant(self, t: torch.Tensor) -> torch.Tensor:
        name = f"_tensor_constant{len(self.constants)}"
        with _disable_current_modes():                 # a real tensor: copy it outside fake mode
            self.constants[name] = t.detach().clone()
        fake = self.fake_mode.from_tensor(self.constants[name], static_shapes=True)
        self._new(fake, self.graph.get_attr(name))
        return fake

    def node_of(self, t: torch.Tensor) -> torch.fx.Node:
        rec = self.recs.get(id(t))
        if rec is None:
            if not isinstance(t, FakeTensor):
                return self.node_of(self.constant(t))
            raise TraceError(f"a tensor of shape {tuple(t.shape)} reached the graph without being made in it "
                             f"(a tensor cached across calls, or created outside the traced function?)")
        if rec.version != rec.base.version:   # its base was written since: re-derive this view from it
            node = rec.base.node
            for op, args, kwargs, item, fake in rec.chain:
                node = self.graph.call_function(op, (node, *args), kwargs)
                if item is not None:
                    node = self.graph.call_function(operator.getitem, (node, item))
                node.meta["val"] = fake
            rec.node, rec.version = node, rec.base.version
        return rec.node

    def _to_nodes(self, x):
        return _map_tensors(x, self.node_of, self.syms.to_node)

    def _record(self, op, args, kwargs, out) -> torch.fx.Node:
        node = self.graph.call_function(op, tuple(self._to_nodes(list(args))), self._to_nodes(dict(kwargs)))
        node.meta["val"] = out
        return node

    def _result_nodes(self, node: torch.fx.Node, out) -> list[tuple[torch.Tensor, torch.fx.Node, Any]]:
        """(tensor, node, item index) for each tensor result of `node`."""
        if isinstance(out, torch.Tensor):
            return [(out, node, None)]
        res = []
        for i, o in enumerate(out):
            if isinstance(o, torch.Tensor):
                g = self.graph.call_function(operator.getitem, (node, i))
                res.append((o, g, i))
            elif isinstance(o, (list, tuple)):
                g = self.graph.call_function(operator.getitem, (node, i))
                g.meta["val"] = o
                for j, oj in enumerate(o):
                    gj = self.graph.call_function(operator.getitem, (g, j))
                    res.append((oj, gj, (i, j)))
        return res

    # -- the dispatch hook
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _PRIM_DEVICE and len(args) == 1 and type(args[0]) is FakeTensor:
            # `.device` of a fake tensor asked from C++ (the autograd engine asks it of every gradient: most of a
            # joint trace's dispatches): answered as FakeTensorMode's own handler answers it, nothing to record
            return _META if args[0].fake_mode.in_kernel_invocation else args[0].fake_device
        kwargs = kwargs or {}
        if func is aten.lift_fresh.default:          # torch.tensor(...) in the program: a constant
            return self.constant(args[0])
        # Real tensors reaching the graph (module attributes that are not buffers) become constants.
        if not (_all_fake(args) and _all_fake(kwargs)):
            args, kwargs = _map_tensors((args, kwargs), lambda t: t if isinstance(t, FakeTensor) else self.constant(t))
        schema = func._schema
        if func is aten.native_batch_norm_backward.default and args[7]:
            # training: the running stats are not read; passing them would make the partitioner save the
            # updated stats (fresh tensors) where eager saves the buffers themselves
            args = (*args[:3], None, None, *args[5:])
        if func in _INPLACE_VIEWS:
            return self._inplace_view(func, args, kwargs)
        written = [a.name for a in schema.arguments if _is_write(a)]
        if func in _UNDECLARED_WRITES:
            bound = _bind(schema, args, kwargs)
            if bound["training"] and all(bound[n] is not None for n in _UNDECLARED_WRITES[func]):
                written = list(_UNDECLARED_WRITES[func])
        if written:
            return self._mutation(func, args, kwargs, written)
        rule = _DIRECT.get(func)
        out = rule(args, kwargs) if rule is not None else None
        if out is None:
            out = _memo_fake_call(self.memo, self.fake_mode, func, args, kwargs) if config.MEMO else \
                _fake_call(func, args, kwargs)
        if not _tensors(out):
            return out                                 # prim.device, size queries: nothing to record
        node = self._record(func, args, kwargs, out)
        is_view = bool(schema.returns) and schema.returns[0].alias_info is not None
        src = self.recs[id(args[0])] if is_view else None
        for t, n, item in self._result_nodes(node, out):
            if is_view and id(t) not in self.recs:
                step = (func, tuple(self._to_nodes(list(args[1:]))), self._to_nodes(dict(kwargs)), item, t)
                self._new(t, n, src.base, src.chain + (step,))
            elif id(t) not in self.recs:
                self._new(t, n)
            else:                                      # an op returned an existing tensor object
                n.meta["val"] = t
        return out

    def _inplace_view(self, func, args, kwargs):
        self.node_of(args[0])
        rec = self.recs[id(args[0])]
        if rec.base.input_index is not None:
            raise TraceError(f"{func} changes the shape/strides of a graph input in place; eager keeps that change, "
                             f"the graph cannot")
        view_op = _INPLACE_VIEWS[func]
        out_fake = view_op(*args, **kwargs)
        func(*args, **kwargs)                           # updates the fake tensor's metadata in place
        node = self._record(view_op, args, kwargs, out_fake)
        node.meta["val"] = out_fake
        step = (view_op, tuple(self._to_nodes(list(args[1:]))), self._to_nodes(dict(kwargs)), None, out_fake)
        rec.node, rec.chain = node, rec.chain + (step,)
        return args[0]

    def _mutation(self, func, args, kwargs, written: list[str]):
        schema = func._schema
        fop = functional_variant(func)
        bound = _bind(schema, args, kwargs)
        if any(bound.get(n) is None for n in written):
            raise TraceError(f"{func}: an optional argument it writes into is None")
        fnames = {a.name for a in fop._schema.arguments}
        fargs, fkwargs = _split(fop._schema, {k: v for k, v in bound.items() if k in fnames})
        fout = _memo_fake_call(self.memo, self.fake_mode, fop, fargs, fkwargs) if config.MEMO else \
            _fake_call(fop, fargs, fkwargs)
        node = self._record(fop, fargs, fkwargs, fout)
        results = list(fout) if isinstance(fout, tuple) else [fout]
        per_result = []                                # node (or list of nodes) per functional result
        for i, r in enumerate(results):
            if len(results) == 1:
                rn = node
            else:
                rn = self.graph.call_function(operator.getitem, (node, i))
                rn.meta["val"] = r
            if isinstance(r, (list, tuple)):
                items = []
                for j, rj in enumerate(r):
                    g = self.graph.call_function(operator.getitem, (rn, j))
                    g.meta["val"] = rj
                    items.append(g)
                per_result.append(items)
            else:
                per_result.append(rn)
        n_new = len(written)
        fresh, new_vals = list(zip(results, per_result))[:len(results) - n_new], list(zip(results, per_result))[-n_new:]
        for name, (vals, nodes) in zip(written, new_vals):
            target = bound[name]
            if isinstance(target, torch.Tensor):
                self._write(target, nodes, vals)
            else:
                for t, n, v in zip(target, nodes, vals):
                    self._write(t, n, v)
        # What the caller gets back: the written arguments themselves where the schema says so, fresh tensors else.
        out, fresh_it = [], iter(fresh)
        alias_of = {next(iter(a.alias_info.before_set)): a.name for a in schema.arguments if _is_write(a)
                    and a.alias_info.before_set}
        for r in schema.returns:
            if r.alias_info is not None and r.alias_info.is_write:
                out.append(bound[alias_of[next(iter(r.alias_info.before_set))]])
            else:
                val, n = next(fresh_it)
                self._new(val, n)
                out.append(val)
        if not schema.returns:
            return None
        return out[0] if len(schema.returns) == 1 else tuple(out)

    def _write(self, t: torch.Tensor, new: torch.fx.Node, new_fake: torch.Tensor) -> None:
        """The program wrote `new` into tensor `t`: update t's base (scatter if t is a view)."""
        rec = self.recs.get(id(t))
        if rec is None:
            raise TraceError("an in-place op wrote into a tensor made outside the traced program")
        if not _known_equal(new_fake.shape, t.shape):
            raise TraceError(f"in-place op changed a tensor's shape {tuple(t.shape)} -> {tuple(new_fake.shape)}")
        base = rec.base
        if new_fake.dtype != t.dtype:                  # in-place ops keep the written tensor's dtype
            new_fake = aten._to_copy.default(new_fake, dtype=t.dtype)
            new = self.graph.call_function(aten._to_copy.default, (new,), {"dtype": t.dtype})
            new.meta["val"] = new_fake
        chain = [s for s in rec.chain if s[0] not in (aten.alias.default, aten.detach.default)]
        if not chain or _same_layout(t, base.fake):
            base.node = new
        else:
            base.node = self._scatter(base, rec, new, t, chain)
        base.version += 1
        base.grad_enabled = torch.is_grad_enabled()
        base.grad_written |= base.grad_enabled
        if not rec.chain:
            rec.node, rec.version = new, base.version   # else: re-derived from the base on next read

    def _scatter(self, base: _Base, rec: _Rec, new: torch.fx.Node, t: torch.Tensor, chain: list) -> torch.fx.Node:
        cur = base.node
        if len(chain) == 1 and chain[0][0] in _SCATTER:
            op, args, kwargs, _, _ = chain[0]
            node = self.graph.call_function(_SCATTER[op], (cur, new, *args), kwargs)
        else:
            # as_strided_scatter writes into a clone of the base: offsets are relative to it, so the clone must
            # keep the base's strides (true for dense tensors) and the view its dtype
            if not _known_equal(torch.empty_like(base.fake).stride(), base.fake.stride()) or \
                    t.dtype != base.fake.dtype:
                raise TraceError("an in-place write into a view of a non-dense tensor, or into a dtype view")
            node = self.graph.call_function(aten.as_strided_scatter.default, self._to_nodes((
                cur, new, list(t.shape), list(t.stride()), t.storage_offset() - base.fake.storage_offset())))
        node.meta["val"] = base.fake
        return node
