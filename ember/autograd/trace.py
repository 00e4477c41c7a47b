"""ATen-level tracing: a torch-level fx graph -> a functional ATen fx graph, plus what the runtime must do after it.

How: the graph runs on fake tensors (FakeTensorMode: shapes, dtypes, strides, devices, no data) under our own
TorchDispatchMode, `_Recorder`, which sees every ATen op below autograd and writes it into a new fx graph. For the
joint forward+backward trace (`trace_joint`) PyTorch's own autograd runs the backward on the same fake tensors
under the same recorder, so backward ATen ops are recorded too.

## The graph `trace_forward` returns (what a code generator consumes)

- placeholders: `example_inputs`, then the graph module's own parameters and buffers (`meta.lifted` names them,
  in order; none for graphs from ember's frontend, which passes them as inputs already). All are tensors.
- nodes: `call_function` on `torch.ops.aten.*` OpOverloads (plus `operator.getitem` to take one result of a
  multi-result op, and `get_attr` for tensor constants the program made, stored on the GraphModule).
  Every node has `node.meta["val"]`: its fake tensor (or tuple of them), i.e. shape, dtype, stride, device.
- `node.meta["origin"]`: the name of the torch-level node whose execution recorded it ("backward" for ops of the
  backward), and `node.meta["where"]` (user file:line) when the torch-level node had one (ember's frontend sets it).
- functional: no node mutates anything. In-place ops (`add_`, `bernoulli_`, `copy_`, ...) became their
  out-of-place forms (`add`, `bernoulli.p`, `copy`, `_native_batch_norm_legit_functional`, ...); a write into a
  view became a scatter into its base (`slice_scatter`, `select_scatter`, `as_strided_scatter`) and later reads of
  other views of that base re-derive them from the new base. View ops (`view`, `permute`, `expand`, `slice`, ...)
  remain as they are: pure functions of their input, which a backend may implement as views or as copies.
- output: one flat tuple = the values of the program's outputs that the graph computes (`OutputSpec.kind ==
  "graph"`), then the new values of mutated inputs (`meta.mutations`).

## After the graph (done by `run_graph`, which any compiler's output can be wrapped with)

- input mutations: for each `InputMutation(input_index, output_index)`: `inputs[input_index].copy_(outs[output_index])`
  (e.g. BatchNorm's running_mean / running_var / num_batches_tracked, or a user's `x.add_(1)`), so the real
  tensors end exactly as eager leaves them.
- outputs that are inputs or views of inputs (`OutputSpec.kind == "alias"`) are not computed by the graph:
  the runtime replays their view ops on the (already updated) input, so they alias it as in eager.
- grad mode: a graph that switches it (`torch._C._set_grad_enabled` nodes, from a `with torch.no_grad()` cut by a
  graph break) leaves it switched for the code after it, as eager would: `meta.grad_mode_after`.
- `meta.out_spec` (a pytree spec) rebuilds the program's output structure from the flat list.

Random ops (`Tag.nondeterministic_seeded`: bernoulli, rand, ...) are recorded as ops that draw from the global
generator when the graph runs, in program order, so a graph run eagerly draws the same numbers as the eager program.
"""
from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Any, Callable

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._mode_utils import no_dispatch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from ember import config
from ember.ir.meta import FLOATS, contiguous_strides, conv2d_output_shape
from ember.tools.picker import picker

aten = torch.ops.aten
_PRIM_DEVICE = torch.ops.prim.device.default
_META = torch.device("meta")


class TraceError(Exception):
    """The program does something the ATen tracer cannot make functional; callers fall back to eager."""


# ---------------------------------------------------------------------------------------------- data structures

@dataclasses.dataclass(frozen=True)
class InputMutation:
    input_index: int   # which placeholder the program mutated in place
    output_index: int  # which graph output holds its final value
    grad_enabled: bool = True  # the grad mode the program wrote it under (an optimizer step: off)
    grad_written: bool = True  # some write ran with grad on: the new value may carry autograd history


@dataclasses.dataclass(frozen=True)
class OutputSpec:
    kind: str                  # "graph": graph output `index`; "alias": view of input `index`; "const": `value`
    index: int = -1
    views: tuple = ()          # for "alias": ((op, args, kwargs, item), ...) replayed on the input
    value: Any = None          # for "const": a non-tensor output (None, int, ...) returned as is


@dataclasses.dataclass
class TraceMeta:
    num_inputs: int                       # placeholders (len(example_inputs) + len(lifted)); joint: primals only
    lifted: list[str]                     # gm parameters then buffers appended after example_inputs
    outputs: list[OutputSpec]             # one per flat program output, in order
    out_spec: pytree.TreeSpec             # rebuilds the program's output structure
    mutations: list[InputMutation]        # applied after the graph, in order
    num_graph_outputs: int = 0            # program outputs the graph computes (mutation values follow them)
    # joint trace only (trace_joint):
    requires_grad: list[bool] = dataclasses.field(default_factory=list)   # per primal
    tangent_of: list[int] = dataclasses.field(default_factory=list)       # per tangent: which forward output
    copy_back_without_grad: bool = False   # a training graph's copies back need no autograd (set by aot_module)
    grad_mode_after: bool | None = None   # the graph switched grad mode (torch._C._set_grad_enabled): set it after


# ---------------------------------------------------------------------------------------------- functionalization

@dataclasses.dataclass
class _Base:
    """A storage as the trace sees it: the node holding its current value, bumped on every write."""
    fake: torch.Tensor
    node: torch.fx.Node
    input_index: int | None = None
    version: int = 0
    grad_enabled: bool = True  # the grad mode of its last write (the copy back into the input runs under it)
    grad_written: bool = False  # any write ran with grad on


@dataclasses.dataclass
class _Rec:
    """A tensor object of the traced program: its node is valid while `version == base.version`."""
    node: torch.fx.Node
    base: _Base
    chain: tuple = ()   # view steps from base: (op, args_after_self, kwargs, item, fake_out)
    version: int = 0


_SCATTER = {aten.slice.Tensor: aten.slice_scatter.default, aten.select.int: aten.select_scatter.default,
            aten.diagonal.default: aten.diagonal_scatter.default}
# Explicit functional forms that the naming conventions below do not find.
_FUNCTIONAL = {aten.native_batch_norm.default: aten._native_batch_norm_legit_functional.default}
# Ops whose schema does not declare what they write: native_batch_norm updates running stats when training.
_UNDECLARED_WRITES = {aten.native_batch_norm.default: ("running_mean", "running_var")}


def _arg_sig(schema) -> list[tuple[str, str]]:
    """Argument names and types, ignoring optionality, alias annotations and out= arguments."""
    return [(a.name, str(a.type).replace("?", "")) for a in schema.arguments if not (_is_write(a) and a.kwarg_only)]


def _is_write(a) -> bool:
    return a.alias_info is not None and a.alias_info.is_write


@functools.cache
def functional_variant(op: torch._ops.OpOverload) -> torch._ops.OpOverload:
    """The out-of-place op computing what `op` writes: `add_` -> `add`, `foo` -> `foo_functional`, `foo.out` -> `foo`.

    Its results are the op's non-aliasing results followed by the new values of the mutated arguments.
    """
    if op in _FUNCTIONAL:
        return _FUNCTIONAL[op]
    schema = op._schema
    name = schema.name.split("::")[1]
    want = _arg_sig(schema)
    is_out = any(_is_write(a) and a.kwarg_only for a in schema.arguments)
    candidates = [name.rstrip("_"), name.rstrip("_") + "_functional"] if not is_out else [name]
    for cand in candidates:
        packet = getattr(aten, cand, None)
        if packet is None:
            continue
        for ov in packet.overloads():
            f = getattr(packet, ov)
            if any(_is_write(a) for a in f._schema.arguments):
                continue
            if _arg_sig(f._schema) == want:
                return f
    raise TraceError(f"no functional form known for the in-place op {op}")


_INPLACE_VIEWS = {aten.t_.default: aten.t.default, aten.transpose_.default: aten.transpose.int,
                  aten.unsqueeze_.default: aten.unsqueeze.default, aten.squeeze_.default: aten.squeeze.default,
                  aten.squeeze_.dim: aten.squeeze.dim}


def _bind(schema, args, kwargs) -> dict:
    bound = {}
    for i, a in enumerate(schema.arguments):
        if i < len(args) and not a.kwarg_only:
            bound[a.name] = args[i]
        elif a.name in kwargs:
            bound[a.name] = kwargs[a.name]
        elif a.has_default_value():
            bound[a.name] = a.default_value
    return bound


def _split(schema, bound) -> tuple[list, dict]:
    args = [bound[a.name] for a in schema.arguments if not a.kwarg_only and a.name in bound]
    kwargs = {a.name: bound[a.name] for a in schema.arguments if a.kwarg_only and a.name in bound}
    return args, kwargs


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


def _map_tensors(x, fn: Callable):
    """pytree.tree_map_only(torch.Tensor, fn, x) for an ATen op's arguments (see _collect_tensors)."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    t = type(x)
    if t is list or t is tuple:
        return t([_map_tensors(y, fn) for y in x])
    if t is dict:
        return {k: _map_tensors(y, fn) for k, y in x.items()}
    if isinstance(x, (list, tuple, dict)):
        return pytree.tree_map_only(torch.Tensor, fn, x)
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
            fused = _cuda_fused_sdpa(*args, **kwargs)
            if fused is not None:
                return fused
        return super().call_function(target, args, kwargs)


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
        if key.shape[-2] % (16 // query.element_size()):
            # the kernel needs the bias rows 16-byte aligned; eager pads a view for it, but the code generator
            # may hand the extern call a compact copy instead: leave such shapes to the math path
            return None
        if bias.dtype == torch.bool:
            bias = torch.zeros(bias.shape, dtype=query.dtype, device=query.device).masked_fill(
                bias.logical_not(), float("-inf"))
        bias = bias.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[-2])
    need_lse = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, bias, need_lse, dropout_p, is_causal, scale=scale)[0]


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
        return _map_tensors(x, self.node_of)

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
            # `.device` of a fake tensor asked from C++ (the autograd engine asks it of every gradient: 72% of
            # GPT-2's dispatches): answered as FakeTensorMode's own handler answers it, nothing to record
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
        if tuple(new_fake.shape) != tuple(t.shape):
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
            if torch.empty_like(base.fake).stride() != base.fake.stride() or t.dtype != base.fake.dtype:
                raise TraceError("an in-place write into a view of a non-dense tensor, or into a dtype view")
            node = self.graph.call_function(aten.as_strided_scatter.default, (
                cur, new, list(t.shape), list(t.stride()), t.storage_offset() - base.fake.storage_offset()))
        node.meta["val"] = base.fake
        return node


# ------------------------------------------------------------------------------ direct output metadata

def _plain(t, device, dtype) -> bool:
    """A fake tensor with canonical contiguous strides, of `dtype`, on `device`, no conj/neg bit."""
    return (type(t) is FakeTensor and t.dtype == dtype and t.fake_device == device and t.layout is torch.strided
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
    meta function is a Python decomposition on meta tensors, 20-80 ms a shape (half of resnet50's trace). For a
    contiguous input and same-dtype vectors: a contiguous output like the input, and the saved statistics as
    FakeTensorMode computes them: empty on a CPU, the running statistics' copies (in the computation dtype,
    float32 for half inputs) elsewhere."""
    if kwargs or len(args) != 8 or args[5] is not False:
        return None
    x, w, b, rm, rv = args[:5]
    if type(x) is not FakeTensor or x.dtype not in FLOATS or x.dim() < 2 or x.numel() == 0 or rm is None or \
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
    rule, at the ATen level). Its meta function runs in Python, ~2 ms a call."""
    if kwargs or len(args) != 9 or args[6] is not False:
        return None
    x, w, bias, stride, padding, dilation, _, _, groups = args
    if type(x) is not FakeTensor or type(w) is not FakeTensor or x.dim() != 4 or w.dim() != 4 or \
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
        if x.fake_mode is not mode or x.constant is not None or x.layout is not torch.strided:
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
    dispatch on its general cache key (GPT-2's joint trace: 0.7 of 1.3 s under cProfile). Ops that may return
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


def _same_layout(t: torch.Tensor, base: torch.Tensor) -> bool:
    return (t.shape == base.shape and t.stride() == base.stride() and t.storage_offset() == base.storage_offset()
            and t.dtype == base.dtype)


# ---------------------------------------------------------------------------------------------- driving a trace

def lift_parameters(gm: torch.nn.Module) -> tuple[list[str], list[torch.Tensor]]:
    """The module's parameters then buffers (qualified names, tensors): they become graph inputs."""
    named = list(gm.named_parameters(remove_duplicate=True)) + list(gm.named_buffers(remove_duplicate=True))
    return [n for n, _ in named], [t for _, t in named]


class _swap_tensors:
    """Temporarily replace the module's parameters and buffers by other tensors (the fakes)."""

    def __init__(self, mod: torch.nn.Module, names: list[str], values: list[torch.Tensor]):
        new_for = {}
        for name, v in zip(names, values):
            owner, _, attr = name.rpartition(".")
            new_for[id(getattr(mod.get_submodule(owner), attr))] = v
        # every slot holding a lifted tensor (tied weights live in several)
        self.slots = [(d, k, old, new_for[id(old)]) for m in mod.modules() for d in (m._parameters, m._buffers)
                      for k, old in d.items() if old is not None and id(old) in new_for]

    def __enter__(self):
        for d, k, old, new in self.slots:
            d[k] = new

    def __exit__(self, *exc):
        for d, k, old, new in self.slots:
            d[k] = old


def _fakes(fake_mode: FakeTensorMode, tensors: list) -> list:
    out = []
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TraceError(f"graph input of type {type(t).__name__}: only tensors are supported")
        out.append(fake_mode.from_tensor(t.detach(), static_shapes=True))
    return out


def _check_inputs_do_not_overlap(inputs: list[torch.Tensor], mutated: set[int]) -> None:
    """Two inputs sharing memory, one of them written: each is traced as its own storage, so refuse."""
    storages = {}
    for i, t in enumerate(inputs):
        if t.numel() == 0:
            continue
        key = (t.device, t.untyped_storage().data_ptr())
        if key in storages and (i in mutated or storages[key] in mutated):
            raise TraceError(f"graph inputs {storages[key]} and {i} share memory and one is written in place")
        storages.setdefault(key, i)


def _run(gm: torch.nn.Module, example_inputs: list, grad: bool, lift: bool = True):
    """Trace gm on fakes. Returns (recorder, fake primals, fake outputs (flat), out_spec, lifted names, all inputs)."""
    names, lifted = lift_parameters(gm) if lift else ([], [])
    inputs = list(example_inputs) + lifted
    fake_mode = FakeTensorMode()
    rec = _Recorder(fake_mode)
    fakes = _fakes(fake_mode, inputs)
    primals, program_inputs = [], []
    with fake_mode:
        for i, (f, real) in enumerate(zip(fakes, inputs)):
            p = f.requires_grad_(grad and real.requires_grad)
            rec.placeholder(p, f"primal_{i}" if grad else f"arg_{i}", i)
            primals.append(p)
            if p.requires_grad:                    # a non-leaf stand-in, so the program may write into it
                with torch.enable_grad():
                    x = p.clone()
                rec.alias_placeholder(x, p)
                program_inputs.append(x)
            else:
                program_inputs.append(p)
    n_user = len(example_inputs)
    # cudnn off while tracing: batch norm then goes to native_batch_norm, whose functional form we know
    # (convolutions are recorded as aten.convolution either way and still use cudnn when the graph runs).
    mode = grad or torch.is_grad_enabled()      # inference traces run in the caller's mode (nothing requires grad)
    with torch.set_grad_enabled(mode), torch.backends.cudnn.flags(enabled=False), fake_mode, rec, \
            _swap_tensors(gm, names, program_inputs[n_user:]):
        if isinstance(gm, torch.fx.GraphModule):
            out = _OriginInterpreter(gm, rec.graph).run(*program_inputs[:n_user])
        else:
            out = gm(*program_inputs[:n_user])
        after = torch.is_grad_enabled()          # a graph may switch grad mode for the code after it
        rec.grad_mode_after = after if after != mode else None
    flat, spec = pytree.tree_flatten(out)
    return rec, fake_mode, primals, program_inputs, flat, spec, names, inputs


def _outputs(rec: _Recorder, flat: list, program_inputs: list) -> tuple[list[OutputSpec], list, list]:
    """Classify program outputs; returns (specs, graph output nodes, graph output fakes)."""
    specs, nodes, fakes = [], [], []
    for o in flat:
        if not isinstance(o, torch.Tensor):
            specs.append(OutputSpec("const", value=o))
            continue
        r = rec.recs.get(id(o))
        if r is not None and r.base.input_index is not None and all(
                not _tensors((s[1], s[2])) for s in r.chain):
            views = tuple((op, args, kwargs, item) for op, args, kwargs, item, _ in r.chain)
            specs.append(OutputSpec("alias", r.base.input_index, views))
            continue
        specs.append(OutputSpec("graph", len(nodes)))
        nodes.append(rec.node_of(o))
        fakes.append(o)
    return specs, nodes, fakes


def _mutations(rec: _Recorder, first_output: int) -> tuple[list[InputMutation], list, list]:
    muts, nodes, fakes = [], [], []
    for b in rec.bases:
        if b.input_index is not None and b.version > 0:
            muts.append(InputMutation(b.input_index, first_output + len(nodes), b.grad_enabled, b.grad_written))
            nodes.append(b.node)
            fakes.append(b.fake)
    return muts, nodes, fakes


def _graph_module(rec: _Recorder, name: str) -> torch.fx.GraphModule:
    root = torch.nn.Module()
    for k, v in rec.constants.items():
        root.register_buffer(k, v)
    rec.graph.eliminate_dead_code()
    rec.graph.lint()
    return torch.fx.GraphModule(root, rec.graph, class_name=name)


def trace_forward(gm: torch.nn.Module, example_inputs: list) -> tuple[torch.fx.GraphModule, TraceMeta]:
    """The functional ATen graph of `gm` for inference (no autograd), and what to do after it (module docstring)."""
    rec, fake_mode, primals, program_inputs, flat, spec, names, inputs = _run(gm, example_inputs, grad=False)
    specs, out_nodes, _ = _outputs(rec, flat, program_inputs)
    muts, mut_nodes, _ = _mutations(rec, len(out_nodes))
    _check_inputs_do_not_overlap(inputs, {m.input_index for m in muts})
    rec.graph.output(tuple(out_nodes + mut_nodes))
    meta = TraceMeta(len(inputs), names, specs, spec, muts, num_graph_outputs=len(out_nodes),
                     grad_mode_after=rec.grad_mode_after)
    return _graph_module(rec, "AtenForward"), meta


def trace_joint(gm: torch.nn.Module, example_inputs: list) -> tuple[torch.fx.GraphModule, TraceMeta]:
    """Forward and backward in one functional ATen graph.

    placeholders: primals (example_inputs, then lifted parameters/buffers), then tangents: one per forward output
    that requires grad (`meta.tangent_of[k]` = its index among the forward outputs).
    output: (program outputs the graph computes..., new values of mutated inputs..., grad of each primal that
    requires grad (None where the output does not depend on it)...). The forward outputs are the first
    `meta.num_graph_outputs + len(meta.mutations)` of them.
    """
    rec, fake_mode, primals, program_inputs, flat, spec, names, inputs = _run(gm, example_inputs, grad=True)
    specs, out_nodes, out_fakes = _outputs(rec, flat, program_inputs)
    muts, mut_nodes, _ = _mutations(rec, len(out_nodes))
    _check_inputs_do_not_overlap(inputs, {m.input_index for m in muts})
    fw_fakes = out_fakes + [program_inputs[m.input_index] for m in muts]
    fw_nodes = out_nodes + mut_nodes
    # an input written only under no_grad (an optimizer's parameters) keeps the caller's autograd history: its
    # new value needs no tangent
    differentiable = [True] * len(out_fakes) + [m.grad_written for m in muts]
    diff = [k for k, f in enumerate(fw_fakes) if f.requires_grad and differentiable[k]]
    wrt = [p for p in primals if p.requires_grad]
    # tangent placeholders go right after the primals
    last = [n for n in rec.graph.nodes if n.op == "placeholder"][-1]
    tangents = []
    with fake_mode:
        for k in diff:
            # contiguous: the runtime passes grads made contiguous (CompiledGraphFunction.backward)
            tangent = torch.empty(fw_fakes[k].shape, dtype=fw_fakes[k].dtype, device=fw_fakes[k].device)
            with rec.graph.inserting_after(last):
                node = last = rec.graph.placeholder(f"tangent_{len(tangents)}")
            rec._new(tangent, node)
            tangents.append(tangent)
    grads = [None] * len(wrt)
    if diff and wrt:
        rec.graph.origin = {"origin": "backward"}
        with fake_mode, rec:
            grads = torch.autograd.grad([fw_fakes[k] for k in diff], wrt, tangents, allow_unused=True)
    grad_nodes = [None if g is None else rec.node_of(g) for g in grads]
    rec.graph.output(tuple(fw_nodes + grad_nodes))
    meta = TraceMeta(len(primals), names, specs, spec, muts, num_graph_outputs=len(out_nodes),
                     grad_mode_after=rec.grad_mode_after,
                     requires_grad=[p.requires_grad for p in primals], tangent_of=diff)
    return _graph_module(rec, "AtenJoint"), meta


# ---------------------------------------------------------------------------------------------- after the graph

def replay_views(t: torch.Tensor, views: tuple) -> torch.Tensor:
    for op, args, kwargs, item in views:
        t = op(t, *args, **kwargs)
        if item is not None:
            t = t[item]
    return t


def _copy_back_plan(dsts: tuple, srcs: tuple, same: tuple) -> tuple:
    """For copy-backs that autograd need not see: which mutated inputs the graph wrote in place (`same`), and
    the others grouped by kind of tensor, one foreach copy each. Made at the first call with this pattern of
    in-place writes (the host program writes in place; its fallback for overlapping inputs does not)."""
    kinds: dict = {}
    for i, (d, s) in enumerate(zip(dsts, srcs)):
        if not same[i]:
            kinds.setdefault(_copy_kind(d, s), []).append(i)
    written = [i for i, x in enumerate(same) if x]
    return (picker(written) if written else None), [picker(idx) for idx in kinds.values()]


def _copy_kind(d: torch.Tensor, s: torch.Tensor) -> tuple:
    """What one foreach copy may group: both sides' device and dtype (get_device: an int, cheaper than
    building torch.device objects for every pair)."""
    return d.get_device(), d.dtype, s.get_device(), s.dtype


def _copy_without_grad(groups) -> None:
    """One torch._foreach_copy_(dsts, srcs) per (dsts, srcs) group, grad mode off (switched directly:
    torch.no_grad() as a context manager cost more than the copy on a CPU)."""
    prev = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)
    try:
        for dsts, srcs in groups:
            torch._foreach_copy_(dsts, srcs)
    finally:
        torch._C._set_grad_enabled(prev)


def finish(meta: TraceMeta, inputs: list, outs: tuple | list) -> Any:
    """Apply input mutations, rebuild aliased outputs and the output structure from the graph's flat outputs."""
    fast = meta.__dict__.get("_copy_back")
    if fast is None:
        # mutations all written under no_grad (an optimizer step), or none autograd need see (batch norms'
        # running statistics in a training graph): where the graph wrote each, and the copies, follow a plan
        # per pattern of in-place writes, each read in C calls (~13 -> ~6 us an Adam step over 10 weights, VM)
        muts = meta.mutations
        fast = meta.__dict__["_copy_back"] = (len(muts) > 1 and (
            meta.copy_back_without_grad or not any(m.grad_enabled for m in muts))) and (
            picker([m.input_index for m in muts]), picker([m.output_index for m in muts]), {})
    if fast:
        dst_of, src_of, plans = fast
        dsts, srcs = dst_of(inputs), src_of(outs)
        same = tuple(map(operator.is_, dsts, srcs))
        plan = plans.get(same)
        if plan is None:
            plan = plans[same] = _copy_back_plan(dsts, srcs, same)
        written, groups = plan
        if written is not None:   # a compiled graph wrote these inputs in place: autograd must see the write
            torch.autograd.graph.increment_version(list(written(dsts)))
        if groups:
            _copy_without_grad((list(group(dsts)), list(group(srcs))) for group in groups)
        return _program_outputs(meta, inputs, outs)
    pairs = [(inputs[m.input_index], outs[m.output_index], m.grad_enabled) for m in meta.mutations]
    written = [d for d, s, _ in pairs if d is s]   # a compiled graph wrote these inputs in place:
    if written:                                     # autograd must see the write, as eager's in-place op's
        torch.autograd.graph.increment_version(written)
    pairs = [(d, s, g) for d, s, g in pairs if d is not s]
    if len(pairs) > 1 and not any(g and (d.requires_grad or s.requires_grad) for d, s, g in pairs):
        # many copies back that autograd need not see (an optimizer's step counters, batch norms' running
        # statistics): one foreach copy, one launch, per kind of tensor
        kinds: dict = {}
        for d, s, _ in pairs:
            kinds.setdefault(_copy_kind(d, s), []).append((d, s))
        _copy_without_grad(([d for d, _ in group], [s for _, s in group]) for group in kinds.values())
    else:
        mode = torch.is_grad_enabled()
        for dst, src, grad_enabled in pairs:
            # under the grad mode of the program's own write: recorded by autograd where eager's was, and a
            # parameter written under no_grad (an optimizer step) stays a leaf. The mode is switched only where
            # it differs (a training graph copies back every batch norm's running statistics on each call).
            if grad_enabled == mode:
                dst.copy_(src)
            else:
                with torch.set_grad_enabled(grad_enabled):
                    dst.copy_(src)
    return _program_outputs(meta, inputs, outs)


def _program_outputs(meta: TraceMeta, inputs: list, outs: tuple | list) -> Any:
    """The program's outputs: graph outputs, views of inputs rebuilt, constants, in the program's structure."""
    flat = []
    for s in meta.outputs:
        if s.kind == "graph":
            flat.append(outs[s.index])
        elif s.kind == "alias":
            flat.append(replay_views(inputs[s.index], s.views))
        else:
            flat.append(s.value)
    if meta.grad_mode_after is not None:
        torch.set_grad_enabled(meta.grad_mode_after)   # as the graph's own _set_grad_enabled call left it
    return pytree.tree_unflatten(flat, meta.out_spec)


def run_graph(compiled: Callable, meta: TraceMeta, gm: torch.nn.Module | None = None) -> Callable:
    """Wrap a compiled trace_forward graph into a callable with the program's calling convention."""
    lifted = _lifted_getter(gm, meta.lifted)

    def run(*args):
        inputs = list(args) + lifted()
        return finish(meta, inputs, compiled(*inputs))

    return run


def _lifted_getter(gm: torch.nn.Module | None, names: list[str]) -> Callable[[], list]:
    """Reads the module's current parameter/buffer tensors at call time (they may be replaced, e.g. by .to())."""
    if not names:
        return lambda: []
    slots = []
    for n in names:
        owner, _, attr = n.rpartition(".")
        slots.append((gm.get_submodule(owner), attr))
    return lambda: [getattr(m, a) for m, a in slots]
