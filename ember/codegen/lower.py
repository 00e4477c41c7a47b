"""Lowering: an ATen-level fx graph -> a list of Buffers (loop IR), in execution order.

Each call_function node goes through codegen's own choice for its op (CHOICES) or else ember.decomp.table: a
decomposition builds TensorBoxes from primitives (lazy: pointwise chains and views stay loaders), an extern op
(mm, conv, SDPA) becomes an ExternBuffer, and an op with no entry stays an ATen call (an ExternBuffer marked
`fallback`, counted and logged under EMBER_LOGS=fallbacks). A box is materialized (`realize`) when it is a graph
output, an extern's argument, or read by several nodes and costly to recompute.

The lowering's own choices live beside this file: the layout (layout.py), oneDNN calls and fusions (onednn.py),
matrix products (matmul.py), concatenations (cat_chains.py), split and one-hot reductions (reductions.py).
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import operator
import threading

import sympy
import torch
import torch.utils._pytree as pytree

from ember import config
from ember.errors import CannotLower
from ember import ir
from ember.ir import Buffer, ExternBuffer, InputBuffer, Pointwise, Reduction, TensorArg, TensorBox, symbols
from ember.codegen.cat_chains import lower_cat, plan_cat_chains
from ember.codegen.layout import ALIGNED_ARGUMENTS, CONVOLUTIONS, aligned_strides, channels_last_strides, \
    is_aligned, is_dense, padded, same_strides, value_key, wants_channels_last
from ember.codegen.matmul import addmm, bmm, convolution, lower_sibling_product, mm, plan_sibling_products
from ember.codegen.onednn import LinearFusion, lower_conv_fusion, lower_linear_fusion, plan_conv_fusions, \
    plan_linear_fusions
from ember.codegen.reductions import one_hot_sum, split_reduction
from ember.codegen.schedule import SCRATCH_BYTES
from ember.decomp import prims as P
from ember.decomp.table import EXTERN, TABLE
from ember.runtime import triton_scan
from ember.tools import collector
from ember.tools.logs import get_logger

fallback_log = get_logger("fallbacks")
FALLBACK_COUNTS: collections.Counter = collections.Counter()  # ATen op name -> times kept as an ATen call

aten = torch.ops.aten
# ATen ops whose lowering is codegen's own choice (a library call, a layout), looked up before the decomposition
# TABLE: each takes the op's arguments as a decomposition does; where it does not choose, it calls the op's
# decomposition itself or returns NotImplemented (the ATen call)


def cumsum(x, dim, *, dtype=None):
    """On the GPU, a floating-point prefix sum along the last dim is ember's own Triton scan
    (runtime.triton_scan.cumsum, a library call of one kernel): one pass of reads and writes, where ATen's CUDA
    cumsum stays well below the memory's bandwidth. Elsewhere ATen's op."""
    g = ir.GRAPH
    if g.target != "gpu" or not triton_scan.supported(x.dtype, x.ndim, dim, dtype):
        return NotImplemented
    return g.extern(triton_scan.cumsum, (x, dim), {}, fallback=False)


CHOICES = {aten.addmm.default: addmm, aten.mm.default: mm, aten.bmm.default: bmm, aten.cat.default: lower_cat,
           aten.convolution.default: convolution, aten.cumsum.default: cumsum}


# a value read by several nodes is stored once above this compute cost (ir.compute_cost), recomputed by each
# reader at or below it. On the CPU one exp or division (cost 2) per element costs more than a store and a load
# (a silu read by a squeeze-excite block's mean and by its gate's product: its exp computed twice per element
# costs more than one store); a GPU recomputes it for less than a pass over memory.
SHARED_STORE_COST = {"cpu": 2, "gpu": 3}

# sympy nodes an unmaterialized box's largest index may hold before the box is stored: past it, composing more
# views and concatenations onto it costs the simplifier more than the store costs at run time (channel shuffles
# nest a level per block and grow exponentially otherwise)
INDEX_BUDGET = 100


# compute ops (ir.compute_cost) a value read by several nodes may cost and still be computed again by each
# reader's kernel on the GPU (_recomputed_on_gpu), and the elements it has at least (smaller stores cost less
# than a launch; an optimizer's one-element values keep recompute_scalars' rules)
GPU_RECOMPUTE_COST = 8
GPU_RECOMPUTE_MIN = 1 << 16


def _recomputed_on_gpu(g: "Graph", box: TensorBox) -> bool:
    """On the GPU, a value several nodes read is computed again where each reads it, not stored, when that reads
    no more memory than loading a stored copy would: its expression reads at most one buffer of its size (any
    number of smaller ones: row statistics, a bias) and costs at most GPU_RECOMPUTE_COST ops. The store is
    saved: a smoothed cross-entropy's log_softmax, read by a row sum and by a gather of one element a row, is
    not written whole (256 MB for 64M logits)."""
    if g.target != "gpu" or box.cost() > GPU_RECOMPUTE_COST:
        return False
    n = symbols.hint(ir.prod(box.size))
    if n < GPU_RECOMPUTE_MIN:
        return False
    idx = [sympy.Symbol(f"c{i}", integer=True, nonnegative=True) for i in range(box.ndim)]
    big = {x.args[0] for x in box.loader(idx).walk() if x.op == "load" and x.args[0] in g.by_name
           and 8 * symbols.hint(ir.prod(g.by_name[x.args[0]].size)) > n}
    return len(big) <= 1


def _moves_elements(node: torch.fx.Node) -> bool:
    """Whether an op may compose index arithmetic (views, concatenations, gathers): a pointwise op reads its
    inputs where it writes, adding none."""
    return torch.Tag.pointwise not in getattr(node.target, "tags", ())


@dataclasses.dataclass
class LoweredGraph:
    inputs: list[InputBuffer]  # one per placeholder, in order (None for non-tensor placeholders)
    buffers: list[Buffer]  # computed and extern buffers in execution order
    outputs: list  # per graph output: TensorArg (a view of a buffer) or a python constant
    fallbacks: list[str]
    constants: dict = dataclasses.field(default_factory=dict)  # buffer name -> tensor held by the graph (get_attr)
    symbols: dict = dataclasses.field(default_factory=dict)  # placeholder position -> its size symbol (sympy)


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
        self.symbolic = is_symbolic(gm)  # sizes are sympy expressions over the ShapeEnv's symbols (dynamic.md)
        self.op_name = ""  # the ATen op being lowered (for messages)

    @contextlib.contextmanager
    def lowering_as(self, val):
        """Calls inside make results like meta value `val` (a fused call's own), not like the node's; yields the
        node's."""
        node_val, self.val = self.val, val
        try:
            yield node_val
        finally:
            self.val = node_val

    def keeps_row(self, x: TensorBox, dim: int) -> bool:
        """Whether a row of x along dim, stored by the node being lowered, stays in the C++ scheduler's per-thread
        row buffer (schedule.SCRATCH_BYTES): a CPU value's innermost dim, the row at most half the buffer."""
        # (a run-time width: as at the example's; the kernel allocates its row buffer for the call's width)
        row = symbols.hint(x.size[-1]) * ir.itemsize(x.dtype) if x.ndim else 0
        return self.val.device.type == "cpu" and dim % x.ndim == x.ndim - 1 and row <= SCRATCH_BYTES // 2

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
        the same storage offsets is taken instead (GPT-2's backward: a layer norm's gradient is stored once
        for the two products reading it and its transpose)."""
        if x.strided is not None and (stride is None or same_strides(x.size, x.strided[1], stride)):
            return x
        if stride is None and self._reads_cl(x.size, lambda idx: x.loader(idx)):
            stride = channels_last_strides(x.size)
        stride = tuple(stride) if stride is not None else ir.contiguous_strides(x.size)
        key = value_key(x, stride) if share else None
        if key is not None and key in self.extern_inputs:
            return P.as_strided(TensorBox.of_buffer(self.extern_inputs[key]), x.size, stride)
        buf = self.add(Pointwise(self.new_name(), x.size, stride, x.dtype, fn=x.loader, origins=self.origins))
        self._note_layout(buf)
        if key is not None:
            self.extern_inputs[key] = buf
        return TensorBox.of_buffer(buf)

    def reduction(self, size, dtype, fn, rsize, kind, origin="", partial_dtype=None) -> TensorBox:
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
                                 dtype, fn=fn, rsize=rsize, kind=kind, origins=self.origins,
                                 partial_dtype=None if split is not None else partial_dtype))
        self._note_layout(buf)
        return TensorBox.of_buffer(buf)

    # channels-last layout (see codegen/layout.py) -------------------------------------------------------
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
        if x.strided is None or x.strided[0].name not in self.cl or symbols.ints(x.strided[1]) == want:
            return x
        return self.realize(TensorBox(x.size, x.dtype, x.loader),
                            stride=want if want is not None else ir.contiguous_strides(x.size))

    def aligned(self, x: TensorBox) -> TensorBox:
        """x in a layout ALIGNED_ARGUMENTS' kernels take: itself where it is one, else stored with its rows 16 bytes
        apart (layout.aligned_strides); a dim x's value does not vary along (a bias broadcast over the batch)
        keeps stride 0, the value stored once."""
        if x.strided is not None and is_aligned(x.size, *x.strided[1:], x.dtype):
            return x
        idx = [sympy.Symbol(f"a{i}", integer=True, nonnegative=True) for i in range(x.ndim)]
        read = set()
        for e in x.loader(idx).walk():
            for a in e.args:
                if isinstance(a, sympy.Basic):
                    read |= a.free_symbols
        broadcast = {d for d in range(x.ndim - 1) if not symbols.same(x.size[d], 1) and idx[d] not in read}
        once = tuple(sympy.Integer(1) if d in broadcast else n for d, n in enumerate(x.size))
        stored = self.realize(TensorBox(once, x.dtype, lambda i: x.loader(
            [sympy.Integer(0) if d in broadcast else i[d] for d in range(x.ndim)])),
            stride=aligned_strides(once, x.dtype))
        return P.as_strided(stored, x.size, aligned_strides(x.size, x.dtype, broadcast))

    def extern(self, target, args, kwargs, fallback: bool, channels_last: bool = False, out_stride=None):
        """A library call / kept ATen op on materialized arguments; returns boxes shaped like its meta value.
        channels_last: its 4-D arguments and results are channels-last (convolutions of a channels-last graph
        always are). out_stride: the strides of its one result, its arguments taken in the layouts they have
        (a concatenation chain's view, see plan_cat_chains)."""
        reads = []
        conv_cl = out_stride is None and (channels_last or (
            self.channels_last and target in CONVOLUTIONS and args[0].ndim == 4 and not args[6]))
        if conv_cl:  # input and weight channels-last (oneDNN is slower with an NCHW weight)
            def to_cl(x):
                if isinstance(x, TensorBox) and x.ndim == 4 and (
                        x.strided is None or not same_strides(x.size, x.strided[1], channels_last_strides(x.size))):
                    return self.realize(TensorBox(x.size, x.dtype, x.loader), stride=channels_last_strides(x.size))
                return x
            args = pytree.tree_map(to_cl, args, is_leaf=lambda x: isinstance(x, TensorBox))

        def arg(x, align: bool = False):
            if isinstance(x, TensorBox):
                if fallback:
                    x = self._eager_layout(x)
                # an ATen op sees the layout eager gives it (some kernels assume what their callers ensure);
                # a channels-last convolution's input and weight are channels-last (above)
                want = None if (conv_cl and x.ndim == 4) or out_stride is not None else getattr(x, "eager_stride", None)
                if align and want is not None and not is_aligned(x.size, want, 0, x.dtype):
                    want = None   # (a layout the kernel refuses: aligned below)
                if want is not None and (x.strided is None or not same_strides(x.size, x.strided[1], want)):
                    x = self.realize(x, stride=want, share=True) if x.strided is None else \
                        self.realize(TensorBox(x.size, x.dtype, x.loader), stride=want, share=True)
                x = self.realize(self.aligned(x) if align else x, share=True)
                buf, stride, offset = x.strided
                reads.append(buf.name)
                return TensorArg(buf.name, symbols.ints(x.size), symbols.ints(stride), symbols.ints((offset,))[0])
            return x
        aligned = ALIGNED_ARGUMENTS.get(target, ())
        args = tuple(arg(a, align=True) if i in aligned and isinstance(a, TensorBox) else a
                     for i, a in enumerate(args))
        args, kwargs = pytree.tree_map(arg, (args, kwargs), is_leaf=lambda x: isinstance(x, TensorBox))
        val = self.val
        leaves, spec = pytree.tree_flatten(val)
        # a plain int result (cuDNN attention's max_q / max_k) is a constant of the graph: its sizes are guarded
        if not all(isinstance(v, torch.Tensor) or v is None or type(v) is int for v in leaves):
            raise CannotLower(f"{target} returns non-tensor values")
        call = self.add(ExternBuffer(self.new_name(), (), (), None, target=target, args=args, kwargs=kwargs,
                                     inputs=tuple(reads), fallback=fallback, origins=self.origins))
        outs = []
        for i, v in enumerate(leaves):
            if not isinstance(v, torch.Tensor):
                outs.append(v)
                continue
            shape = symbols.sym_sizes(v.shape) if self.symbolic else tuple(v.shape)
            stride = out_stride if out_stride is not None else \
                channels_last_strides(shape) if conv_cl else symbols.sym_sizes(v.stride())
            b = Buffer(f"{call.name}_{i}" if len(leaves) > 1 or spec.num_leaves != 1 or not isinstance(val, torch.Tensor)
                       else call.name, shape, symbols.ints(stride), v.dtype, 0)  # offsets from data_ptr()
            self._note_layout(b)
            if out_stride is not None and len(b.size) == 4 and int(b.stride[1]) == 1:
                self.cl.add(b.name)  # channels innermost, not dense: a window onto a wider channels-last buffer
            b.extern, b.index = call, i
            self.by_name[b.name] = b
            outs.append(TensorBox.of_buffer(b))
        call.outputs = [o.strided[0] if isinstance(o, TensorBox) else None for o in outs]
        if val is None:
            return call
        return pytree.tree_unflatten(outs, spec)


# Lowering keeps its state in module globals (ir.GRAPH, the Expr interning table): graphs compiled by several
# threads at once (each missing its guards, e.g. on grad mode, which is per thread) take turns, in either backend
LOWERING_LOCK = threading.Lock()


def lower(gm: torch.fx.GraphModule, example_inputs: list, target: str = "cpu") -> LoweredGraph:
    """target: the code generator the buffers are for, "cpu" (C++) or "gpu" (Triton): reductions with too few
    results to keep it busy are split for it (split_reduction). A symbolic graph is lowered with its ShapeEnv
    closed (symbols.no_new_guards): code deciding on a size's value raises, before the capture's ShapeEnv takes a
    guard the frame's entry would check (a decomposition's op then stays an ATen call; elsewhere the graph runs as
    its ATen graph), so a graph ember gives up on still serves every size."""
    with collector.frozen(), symbols.no_new_guards(shape_env_of(gm) if is_symbolic(gm) else None):
        return _lower(gm, example_inputs, target)


def _lower(gm: torch.fx.GraphModule, example_inputs: list, target: str = "cpu") -> LoweredGraph:

    ir.reset_interning()
    symbols.HINTS.clear()
    g = Graph(gm, target)
    shape_env = symbols.SHAPE_ENV = None
    if g.symbolic:
        shape_env = symbols.SHAPE_ENV = shape_env_of(gm)
        symbols.HINTS.update(hints_of(shape_env))
        guards_before = len(shape_env.guards)
    ir.GRAPH = g
    env: dict = {}
    inputs = []
    constants: dict = {}
    symbol_inputs: dict = {}
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
                    buf = g.add(InputBuffer(f"arg{idx}", symbols.sym_sizes(v.shape) if g.symbolic else tuple(v.shape),
                                            symbols.ints(symbols.sym_sizes(v.stride())) if g.symbolic else tuple(v.stride()),
                                            v.dtype, 0))
                    env[node] = TensorBox.of_buffer(buf)
                    inputs.append(buf)
                elif g.symbolic and isinstance(v, torch.SymInt):
                    sym = symbols.sym_expr(v)
                    if sym.is_Integer:   # specialized at capture (the entry guards its value): a constant
                        env[node], symbol_inputs[idx] = sym, sympy.Symbol(f"_fixed{idx}")
                    elif not sym.is_Symbol:
                        raise CannotLower(f"size input {node.name} is {sym}, not a symbol")
                    else:
                        symbol_inputs[idx] = env[node] = sym
                    inputs.append(None)
                elif type(v) is int:   # a size the capture specialized (guarded): a constant of the trace
                    env[node], symbol_inputs[idx] = sympy.Integer(v), sympy.Symbol(f"_fixed{idx}")
                    inputs.append(None)
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
            elif node.op == "call_function" and g.symbolic and isinstance(node.meta.get("val"), torch.SymInt):
                env[node] = symbols.sym_expr(node.meta["val"])   # a size computed from the symbols (s0 * 4)
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
                    # once, as any other node's result (else each extern reading it would store its own copy)
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
                # (chained, not summed: tuples added one to the next are quadratic in the number of inputs)
                g.origins = tuple(dict.fromkeys(itertools.chain(*(b.origin_names for b in boxes if b.strided is None
                                                                  and hasattr(b, "origin_names")), (node.name,))))
                op = node.target
                g.op_name = str(op)
                fn = CHOICES.get(op, TABLE.get(op))
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
                        if g.symbolic:
                            if is_dense(v) and b.size and any(not symbols.same(s, 1) for s in symbols.sym_sizes(v.shape)):
                                b.eager_stride = symbols.ints(symbols.sym_sizes(v.stride()))
                        elif is_dense(v) and b.size and any(s != 1 for s in v.shape):
                            b.eager_stride = tuple(v.stride())
                if isinstance(out, TensorBox) and out.strided is None and users[node] > 1 and (
                        out.cost() > SHARED_STORE_COST[g.target] or stored.get(node, 0) > 1) and not (
                        stored.get(node, 0) <= 1 and _recomputed_on_gpu(g, out)):
                    # in eager's layout where ember keeps eager's (GPT-2's key/value cache: a concatenation of
                    # the heads' view, laid out [b, s, h, d] as the projection it copies; contiguous, its copy
                    # is slower and attention reads it in another layout than eager's)
                    want = getattr(out, "eager_stride", None)
                    keep = want is not None and not g.reads_layout_changed(out)
                    out = g.realize(out, stride=want if keep else None)
                    out.origin_names = g.origins
                elif isinstance(out, TensorBox) and out.strided is None and _moves_elements(node) \
                        and out.index_size() > INDEX_BUDGET:
                    out = g.realize(out)
                    out.origin_names = g.origins
                env[node] = out
                # (closed, the ShapeEnv takes no guard: one that came by another way names its node here)
                if g.symbolic and len(shape_env.guards) != guards_before:
                    raise CannotLower(f"lowering {node.name} = {node.target} specialized a symbolic size "
                                      f"({shape_env.guards[guards_before].expr})"
                                      + (f" from {node.meta['where']}" if "where" in node.meta else ""))
            elif node.op == "output":
                outs = []
                for a in pytree.tree_leaves(node.args[0]):
                    v = env[a] if isinstance(a, torch.fx.Node) else a
                    if isinstance(v, TensorBox):
                        val = a.meta.get("val")
                        stride = (symbols.ints(symbols.sym_sizes(val.stride())) if g.symbolic else val.stride()) \
                            if is_dense(val) else None
                        moved = v.strided is not None and (stride is None or not same_strides(v.size, v.strided[1],
                                                                                               stride))
                        if moved and (v.strided[0].name in g.cl or stride is not None and padded(v.size, v.strided[1])):
                            # eager's layout back: of a channels-last value; of a dense one stored with padded rows
                            g.origins = getattr(v, "origin_names", ())
                            v = g.realize(TensorBox(v.size, v.dtype, v.loader),
                                          stride=stride if stride is not None else ir.contiguous_strides(v.size))
                        if v.strided is None or v.strided[0].name not in g.by_name:
                            g.origins = getattr(v, "origin_names", ())
                            v = g.realize(v, stride=stride)
                        buf, st, off = v.strided
                        v = TensorArg(buf.name, symbols.ints(v.size), symbols.ints(st), symbols.ints((off,))[0])
                    elif isinstance(v, sympy.Basic):
                        v = symbols.ints((v,))[0]
                    outs.append(v)
                out_spec = pytree.tree_flatten(node.args[0])[1]
                if g.symbolic and len(shape_env.guards) != guards_before:
                    # the lowering took a decision on a symbol's value (int() of a SymInt): its code would be wrong
                    # at other sizes
                    raise CannotLower(f"lowering specialized a symbolic size ({shape_env.guards[guards_before].expr})")
                return LoweredGraph(inputs, g.buffers, outs, g.fallbacks, constants, symbol_inputs), out_spec, g
            else:
                raise CannotLower(f"fx node kind {node.op} ({node.name})")
    except Exception as e:   # the op ember failed on, for the fail-safe's log line (ember.tools.failsafe)
        if not isinstance(e, CannotLower):
            e.add_note(f"ember: while lowering {node.name} = {node.target}({', '.join(map(str, node.args))})"
                       + (f" from {node.meta['where']}" if "where" in node.meta else ""))
        raise
    finally:
        ir.GRAPH = None
    raise CannotLower("graph has no output")


def stores_whole(gm: torch.fx.GraphModule) -> dict:
    """{node: how many readers store its value whole}: graph outputs (each place the output lists it) and
    library calls. Read by two of them, a value however cheap is stored once where it is computed, not once
    per reader (GPT-2's key/value cache, a concatenation that is one copy, is read by attention, returned as
    the cache and saved for the backward)."""
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


def _check(out, val, node):
    """A decomposition must produce what the op's meta value says: the same shapes and dtypes."""
    if out is NotImplemented:
        return out
    outs, vals = pytree.tree_leaves(out), pytree.tree_leaves(val)
    if len(outs) != len(vals):
        raise CannotLower(f"decomposition of {node.target} gave {len(outs)} outputs, expected {len(vals)}")
    for o, v in zip(outs, vals):
        if isinstance(o, TensorBox):
            if not isinstance(v, torch.Tensor) or o.dtype != v.dtype or (
                    tuple(int(s) for s in o.size) != tuple(v.shape) if not symbols.HINTS or not symbols.has_symbols(v) else
                    len(o.size) != len(v.shape) or not all(symbols.same(a, b) for a, b in
                                                           zip(o.size, symbols.sym_sizes(v.shape)))):
                raise CannotLower(f"decomposition of {node.target} at {node.name} gave {list(o.size)} {o.dtype}, "
                                  f"expected {getattr(v, 'shape', v)} {getattr(v, 'dtype', '')}")
    return out


@contextlib.contextmanager
def lowering(symbolic: bool):
    """A backend's lowering and printing of one graph: under LOWERING_LOCK, symbols.HINTS cleared after. In a
    symbolic graph a TypeError or NotImplementedError is a size decision the code generator takes on numbers only
    (a comparison of symbolic sizes): CannotLower, the graph runs as its ATen graph."""
    with LOWERING_LOCK:
        try:
            yield
        except (TypeError, NotImplementedError) as e:
            if not symbolic:
                raise
            raise CannotLower(f"no symbolic code for it ({type(e).__name__}: {e})") from e
        finally:
            symbols.HINTS.clear()
            symbols.SHAPE_ENV = None


def is_symbolic(gm: torch.fx.GraphModule) -> bool:
    """Whether a graph has symbolic sizes (docs/dynamic.md): a SymInt placeholder or a tensor input with a
    symbolic size or stride."""
    return any(n.op == "placeholder" and symbols.has_symbols(n.meta.get("val")) for n in gm.graph.nodes)


def shape_env_of(gm: torch.fx.GraphModule):
    for n in gm.graph.nodes:
        v = n.meta.get("val") if n.op == "placeholder" else None
        if isinstance(v, torch.SymInt):
            return v.node.shape_env
        if isinstance(v, torch.Tensor) and symbols.has_symbols(v):
            for x in (*v.shape, *v.stride()):
                if isinstance(x, torch.SymInt):
                    return x.node.shape_env
    raise CannotLower("symbolic graph without a ShapeEnv")


def hints_of(shape_env) -> dict:
    """{symbol: the example's value}: what heuristics choose by (ShapeEnv.backed_var_to_val, var_to_val before)."""
    vals = getattr(shape_env, "backed_var_to_val", None)
    if vals is None:
        vals = shape_env.var_to_val
    return {k: int(v) for k, v in vals.items() if getattr(v, "is_Integer", isinstance(v, int))}
