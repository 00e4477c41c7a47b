"""CPU scalars in a CUDA graph: their inputs copied to the GPU in one transfer, the CPU results made by the C++
backend.

torch.optim keeps its step counters on the CPU (capturable=False, the default), so an optimizer step's graph
mixes CPU 0-d tensors (step + 1, the bias corrections 1 - beta ** step, the step size) with the CUDA tensors
they scale; eager CUDA kernels read such a 0-d CPU tensor as a scalar argument. Here a call

  1. gathers the values of the CPU inputs into one pinned buffer per dtype (one C call reading every input's
     address) and copies it to the GPU (asynchronous: the GPU work queued before it is not waited for);
  2. runs the device graph: the original graph with each CPU input replaced by `select(pack, 0, i)` and the CPU
     nodes recomputed on the GPU (scalar arithmetic that fuses into the kernels that read it);
  3. runs the host graph, the CPU nodes the graph's CPU outputs need (step + 1), through the C++ backend, which
     writes the step counters in place.
In a big graph (SENT_FROM_HOST_ABOVE), CPU values the device reads that need a libdevice function on the GPU
(`beta ** step`, LINKED_ON_DEVICE) are not recomputed there: every kernel reading one would link libdevice,
slow to compile, and a training step's optimizer updates fuse into hundreds of its backward's kernels. The host
graph runs first and computes them, and they reach the device in packs of their own, sent each call.

An optimizer's step counters change by `+ 1` each call, on the CPU and (recomputed) on the GPU alike: the
device graph also returns the new counters, stacked, and the next call passes that tensor as the pack when
the CPU counters still hold exactly the values the host graph wrote (one C comparison), with no transfer.

CPU values that are not 0-d (a mask or positions built on the host from an input) are not recomputed on the
device, nor is anything made from them: the host graph computes them and each is sent as a tensor of its own,
as eager copies it (`.to(device)`, or a CUDA op reading CPU indices). Before any split, fold_constants computes
once, at compile time and on the CPU as eager does, the CPU values made from no input (a relative-position index
built with arange and meshgrid, a bucket table, a constant tensor) and hands the device its copy of them.
A CPU node that reads a CUDA value (a device-to-host copy, e.g. `.item()`) gives up the split: the caller runs
the graph eagerly.
A graph whose CPU tensors only travel between library calls (cpu_values_pass_through) needs no split.
"""
from __future__ import annotations

import collections
import ctypes
import operator
from typing import Callable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode

from ember.codegen.wrapper import fast_unflatten
from ember.tools.picker import picker

aten = torch.ops.aten

GATHER_SOURCE = """#include <stdint.h>
#include <string.h>
// out[i * size .. (i + 1) * size) = the `size` bytes at address ptrs[i]
extern "C" void ember_gather(const int64_t* ptrs, int64_t n, int64_t size, char* out) {
  for (int64_t i = 0; i < n; i++) memcpy(out + i * size, (const void*)ptrs[i], size);
}
// whether the `size` bytes at each address ptrs[i] equal expected[i * size ..)
extern "C" int ember_all_equal(const int64_t* ptrs, int64_t n, int64_t size, const char* expected) {
  for (int64_t i = 0; i < n; i++)
    if (memcmp((const void*)ptrs[i], expected + i * size, size) != 0) return 0;
  return 1;
}
"""
_lib = None
_build = None   # the future of GATHER_SOURCE's library, started when a graph is first split (see `split`)


def _start_build():
    """Start building GATHER_SOURCE's library in the background (g++, which the split graph's own code
    generation then overlaps; the first call waits for it in `_c_functions`)."""
    global _build
    if _build is None:
        from ember.runtime import cache
        _build = cache.build_cpp(GATHER_SOURCE)
    return _build


def _c_functions():
    """(ember_gather, ember_all_equal) from GATHER_SOURCE, built once."""
    global _lib
    if _lib is None:
        lib = ctypes.CDLL(str(_start_build().result()))
        for f in (lib.ember_gather, lib.ember_all_equal):
            f.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
        lib.ember_gather.restype, lib.ember_all_equal.restype = None, ctypes.c_int
        _lib = lib.ember_gather, lib.ember_all_equal
    return _lib


def _gather_fn():
    return _c_functions()[0]


def _counter_step(new: fx.Node, old: fx.Node, dtype: torch.dtype) -> bool:
    """Whether `new` is `old + constant` in `old`'s dtype: computed the same to the bit on the CPU and the GPU
    (one correctly rounded addition), so the GPU's copy of the result can stand for the CPU's."""
    return (new.target in (aten.add.Tensor, aten.add.Scalar) and len(new.args) == 2 and new.args[0] is old
            and new.kwargs.get("alpha", 1) == 1 and set(new.kwargs) <= {"alpha"} and type(new.args[1]) in (int, float)
            and isinstance(new.meta.get("val"), torch.Tensor) and new.meta["val"].dtype == dtype)


def _device_type(n: fx.Node) -> str | None:
    """'cpu' / 'cuda' / ... for a node whose tensor values are all on one device type, else None."""
    kinds = {v.device.type for v in pytree.tree_leaves(n.meta.get("val")) if isinstance(v, torch.Tensor)}
    return kinds.pop() if len(kinds) == 1 else None


def fold_constants(gm: fx.GraphModule) -> int:
    """Compute gm's CPU values that depend on no graph input once, now, with the ATen ops eager runs (the same
    values to the bit, on the CPU); a CUDA node ember generates code for reads a device copy of it instead (a
    constant of gm), others the CPU value. Random ops are never folded (each call draws anew). Returns the
    number of ops folded away; gm is changed in place."""
    from torch.utils._python_dispatch import _disable_current_modes

    nodes = list(gm.graph.nodes)
    devices = [v.device for n in nodes for v in pytree.tree_leaves(n.meta.get("val"))
               if isinstance(v, torch.Tensor) and v.device.type != "cpu"]
    # (the meta device only where nothing else is: tests stand it in for CUDA)
    device = next((d for d in devices if d.type != "meta"), devices[0] if devices else None)
    if device is None:
        return 0
    values: dict = {}
    for n in nodes:
        if n.op == "get_attr" and _device_type(n) == "cpu":
            values[n] = _attr(gm, n.target)
        elif n.op == "call_function" and _device_type(n) == "cpu" and (
                n.target is operator.getitem or isinstance(n.target, torch._ops.OpOverload)) and \
                torch.Tag.nondeterministic_seeded not in getattr(n.target, "tags", ()) and \
                all(a in values for a in n.all_input_nodes):
            args, kwargs = pytree.tree_map(lambda a: values[a] if isinstance(a, fx.Node) else a, (n.args, n.kwargs))
            with _disable_current_modes(), torch.no_grad():
                values[n] = n.target(*args, **kwargs)
    folded = 0
    made: dict = {}
    first = next(n for n in nodes if n.op != "placeholder")
    for n in [n for n in nodes if n in values]:
        for u in list(n.users):
            if u in values:
                continue
            # the host, an output and a library call (eager's kernel: see cpu_values_pass_through) read the CPU
            # value, a generated kernel a device copy
            on_host = u.op == "output" or _device_type(u) == "cpu" or _library_call(u)
            if n.op == "get_attr" and on_host:
                continue      # a constant read as it is
            key = (n, on_host)
            if key not in made:
                value = values[n] if on_host else values[n].to(device)
                name = f"_ember_folded_{sum(k.startswith('_ember_folded_') for k in gm._buffers)}"
                gm.register_buffer(name, value)
                with gm.graph.inserting_before(first):
                    made[key] = gm.graph.get_attr(name)
                with FakeTensorMode(allow_non_fake_inputs=True) as mode:
                    made[key].meta["val"] = mode.from_tensor(value)
            u.replace_input_with(n, made[key])
    for n in reversed(nodes):
        if n in values and not n.users:
            gm.graph.erase_node(n)
            folded += n.op == "call_function"
    if made:
        gm.graph.lint()
        gm.recompile()
    return folded


def _attr(gm: fx.GraphModule, target: str):
    t = gm
    for part in target.split("."):
        t = getattr(t, part)
    return t


def cpu_values_pass_through(gm: torch.fx.GraphModule) -> bool:
    """Whether every CPU tensor of a CUDA graph only travels between library calls, inputs and outputs, so no
    generated kernel reads one: e.g. the philox seed and offset (CPU scalars) that CUDA attention with dropout
    returns and its backward takes."""
    def on_cpu(n: torch.fx.Node) -> bool:
        v = n.meta.get("val")
        return isinstance(v, torch.Tensor) and v.device.type == "cpu"

    for n in gm.graph.nodes:
        if not on_cpu(n):
            continue
        made_by = n.args[0] if n.target is operator.getitem else n
        if not (n.op in ("placeholder", "get_attr") or _library_call(made_by)):
            return False
        if not all(u.op == "output" or _library_call(u) for u in n.users):
            return False
    return True


def _library_call(n: torch.fx.Node) -> bool:
    """Whether n stays an ATen call in the compiled graph (no generated kernel reads its arguments): eager's
    kernel takes CPU arguments as it always does. (Not an op the lowering makes its own choice for: a
    concatenation, addmm's bias add, may become kernels.)"""
    from ember.codegen.lower import CHOICES
    from ember.decomp.table import EXTERN, TABLE
    return n.op == "call_function" and n.target not in CHOICES and (n.target in EXTERN or (
        isinstance(n.target, torch._ops.OpOverload) and n.target not in TABLE))


def _named(n: fx.Node) -> str:
    return f"{n.target if n.op == 'call_function' else n.name}" + (f" at {n.meta['where']}" if "where" in n.meta else "")


# the per-tensor overload of a foreach op, by the foreach overload's kind (a `Tensor` kind, one tensor operand
# for every element, is left as it is)
_PER_TENSOR = {"List": "Tensor", "Scalar": "Scalar", "ScalarList": "Scalar", "default": "default"}


def unroll_cpu_foreach(gm: fx.GraphModule) -> int:
    """Each foreach op over CPU tensors (an optimizer's step counters: `_foreach_add(steps, 1)` in a whole
    training step's graph) made into its per-tensor op, one node per element, which the split below handles as
    any 0-d CPU value: the host graph computes them, the device recomputes the ones it reads. Returns how many."""
    done = 0
    for n in list(gm.graph.nodes):
        val = n.meta.get("val")
        if not (n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
                and n.target._schema.name.startswith("aten::_foreach_") and isinstance(val, (list, tuple))
                and val and all(isinstance(v, torch.Tensor) and v.device.type == "cpu" for v in val)
                and all(u.target is operator.getitem for u in n.users)):
            continue
        base = getattr(aten, n.target._schema.name[len("aten::_foreach_"):], None)
        per = getattr(base, _PER_TENSOR.get(n.target._overloadname, ""), None)
        if per is None or not _same_arguments(n.target, per) or any(a.alias_info is not None and a.alias_info.is_write for a in n.target._schema.arguments):
            continue
        listed = {a.name for a in n.target._schema.arguments if isinstance(a.type, torch.ListType)}
        names = [a.name for a in n.target._schema.arguments]
        elements = []
        with gm.graph.inserting_before(n):
            for i, v in enumerate(val):
                args = tuple(a[i] if name in listed else a for a, name in zip(n.args, names))
                kwargs = {k: (a[i] if k in listed else a) for k, a in n.kwargs.items()}
                e = gm.graph.call_function(per, args, kwargs)
                e.meta = {**n.meta, "val": v}
                elements.append(e)
        for u in list(n.users):
            u.replace_all_uses_with(elements[u.args[1]])
            gm.graph.erase_node(u)
        gm.graph.erase_node(n)
        done += 1
    if done:
        gm.recompile()
    return done


def _same_arguments(foreach: torch._ops.OpOverload, per: torch._ops.OpOverload) -> bool:
    """Whether per takes foreach's arguments, one element of each list (`_foreach_pow.Scalar` raises a list to a
    Scalar power; `pow.Scalar` raises a Scalar to a tensor's: not the same op)."""
    a, b = foreach._schema.arguments, per._schema.arguments

    def element(t):
        return t.getElementType() if isinstance(t, torch.ListType) else t
    return len(a) <= len(b) and all(y.has_default_value() for y in b[len(a):]) and all(
        str(element(x.type)) == str(y.type) and x.kwarg_only == y.kwarg_only for x, y in zip(a, b))


def split(gm: fx.GraphModule) -> tuple[fx.GraphModule, fx.GraphModule, dict] | str:
    """(host graph, device graph, how to call them) for a graph whose CPU values are made on the CPU, else why
    not (the fallback's log line names the node)."""
    unroll_cpu_foreach(gm)
    nodes = list(gm.graph.nodes)
    output = nodes[-1]
    host = {n for n in nodes if n.op in ("placeholder", "call_function", "get_attr") and _device_type(n) == "cpu"}
    if not host:
        return "no CPU value"
    for n in host:
        if any(a not in host for a in n.all_input_nodes):
            # a CPU value made from a device value: a device-to-host copy, which must wait
            return f"a CPU value is made from a CUDA one ({_named(n)})"
        if not isinstance(n.meta["val"], torch.Tensor):
            return f"a CPU node's result is not a tensor ({_named(n)})"
    # CPU values that are not 0-d, and what is made from them: computed on the host only (module doc)
    heavy: set = set()
    for n in nodes:
        if n in host and (n.meta["val"].ndim > 0 or any(a in heavy for a in n.all_input_nodes)):
            heavy.add(n)
    device = next(v.device for n in nodes if n not in host and n.op != "output"
                  for v in pytree.tree_leaves(n.meta.get("val")) if isinstance(v, torch.Tensor))
    placeholders = [n for n in nodes if n.op == "placeholder"]
    host_inputs = [n for n in placeholders if n in host]
    out_leaves, out_spec = pytree.tree_flatten(output.args[0])
    host_outs = [x for x in out_leaves if isinstance(x, fx.Node) and x in host]
    dev_outs = [x for x in out_leaves if isinstance(x, fx.Node) and x not in host]
    packs: dict[torch.dtype, list[fx.Node]] = {}
    for n in host_inputs:
        if n not in heavy:
            packs.setdefault(n.meta["val"].dtype, []).append(n)
    # heavy values a device node reads: each sent as a tensor, an input's as it comes, others from the host graph
    tensors_sent = [n for n in nodes if n in heavy and any(u not in host and u.op != "output" for u in n.users)]
    if any(n.op == "get_attr" for n in tensors_sent):   # (fold_constants hands the device a constant's copy first)
        return f"the device reads a CPU constant ({_named(next(n for n in tensors_sent if n.op == 'get_attr'))})"

    # CPU values the device reads that are made with a libdevice function (Adam's bias corrections
    # `1 - beta ** step`): computed once by the host graph and sent, not recomputed in every kernel reading them
    costly: set = set()
    for n in nodes if len(nodes) > SENT_FROM_HOST_ABOVE else ():
        if n in host and n.op == "call_function" and (
                n.target in LINKED_ON_DEVICE or any(a in costly for a in n.all_input_nodes)):
            costly.add(n)
    sent = [n for n in nodes if n in costly and any(u not in host and u.op != "output" for u in n.users)]

    # host graph: every CPU input (one calling convention), the CPU nodes, the CPU outputs, then the values sent
    hg, henv = fx.Graph(), {}
    for n in nodes:
        if n in host:
            henv[n] = hg.node_copy(n, henv.__getitem__)
    from_host = [n for n in tensors_sent if n.op != "placeholder"]
    hg.output(tuple(henv[x] for x in host_outs + sent + from_host))
    hg.eliminate_dead_code()

    # device graph: its inputs, then one pack per dtype whose elements stand for the CPU inputs; CPU nodes
    # recomputed on the device
    dg, denv = fx.Graph(), {}
    for n in placeholders:
        if n not in host:
            denv[n] = dg.node_copy(n, denv.__getitem__)
    with FakeTensorMode(allow_non_fake_inputs=True):
        sent_packs: dict[torch.dtype, list[fx.Node]] = {}
        for n in sent:
            sent_packs.setdefault(n.meta["val"].dtype, []).append(n)
        for i, (dtype, members) in enumerate([*packs.items(), *sent_packs.items()]):
            p = dg.placeholder(f"host_scalars_{i}")
            p.meta["val"] = torch.empty((len(members),), dtype=dtype, device=device)
            for j, m in enumerate(members):
                denv[m] = dg.call_function(aten.select.int, (p, 0, j))
                denv[m].meta["val"] = torch.empty((), dtype=dtype, device=device)
        for i, n in enumerate(tensors_sent):
            denv[n] = dg.placeholder(f"host_tensor_{i}")
            denv[n].meta["val"] = torch.empty_strided(*_sent_layout(n.meta["val"]), dtype=n.meta["val"].dtype,
                                                      device=device)
        for n in nodes:
            if n.op == "get_attr" and n not in heavy:   # (a CPU one: its device copy is fold_constants' there)
                denv[n] = dg.node_copy(n, denv.__getitem__)
            if n.op != "call_function" or n in costly or n in heavy:
                continue
            new = denv[n] = dg.node_copy(n, denv.__getitem__)
            if n in host:
                if "device" in new.kwargs:
                    new.kwargs = {**new.kwargs, "device": device}
                new.meta = {**n.meta, "val": torch.empty((), dtype=n.meta["val"].dtype, device=device)}
        # per pack whose mutated members (step counters) all advance by a constant: the device graph also
        # returns the pack of the next call, the members' new values stacked (_Pack.send)
        mutations = gm.meta.get("ember_input_mutations") or []
        new_value = {placeholders[i]: out_leaves[o] for i, o in mutations if isinstance(out_leaves[o], fx.Node)}
        next_packs, mirrors = [], []
        for dtype, members in packs.items():
            news = [new_value.get(m) for m in members]
            if any(v is not None for v in news) and all(v is None or _counter_step(v, m, dtype)
                                                         for v, m in zip(news, members)):
                nxt = dg.call_function(aten.stack.default,
                                       ([denv[v] if v is not None else denv[m] for v, m in zip(news, members)],))
                nxt.meta["val"] = torch.empty((len(members),), dtype=dtype, device=device)
                mirrors.append(len(dev_outs) + len(next_packs))
                next_packs.append(nxt)
            else:
                mirrors.append(None)
    dg.output(tuple(denv[x] for x in dev_outs) + tuple(next_packs))
    dg.eliminate_dead_code()

    _start_build()   # the host part's calls gather with it (send): built while the parts are compiled
    host_gm, dev_gm = fx.GraphModule(gm, hg), fx.GraphModule(gm, dg)
    host_gm.meta["ember_guarded"] = dev_gm.meta["ember_guarded"] = gm.meta.get("ember_guarded", False)
    inputs_dev = [i for i, n in enumerate(placeholders) if n not in host]
    inputs_host = [i for i, n in enumerate(placeholders) if n in host]
    # (input index, output index) pairs renumbered for each part: the host graph writes the step counters in
    # place (the device graph has read their old values from the pack by then)
    # positions in each part (an optimizer step of hundreds of parameters: no list.index per lookup)
    at_dev_in, at_host_in = _positions(inputs_dev), _positions(inputs_host)
    at_dev_out, at_host_out = _positions(dev_outs), _positions(host_outs)
    dev_gm.meta["ember_input_mutations"] = [(at_dev_in[i], at_dev_out[out_leaves[o]]) for i, o in mutations
                                            if out_leaves[o] in at_dev_out and i in at_dev_in]
    host_gm.meta["ember_input_mutations"] = [(at_host_in[i], at_host_out[out_leaves[o]]) for i, o in mutations
                                             if out_leaves[o] in at_host_out and i in at_host_in]
    # device outputs only copied back into inputs (a CUDA graph of the device part need not clone them)
    once = {x for x, k in collections.Counter(dev_outs).items() if k == 1}
    dev_gm.meta["ember_copied_back"] = [(at_dev_in[i], at_dev_out[out_leaves[o]])
                                        for i, o in gm.meta.get("ember_copied_back") or ()
                                        if out_leaves[o] in once and i in at_dev_in]
    at_host_node = _positions(host_inputs)
    at_sent = {n: len(host_outs) + k for k, n in enumerate(sent)}
    at_from_host = {n: len(host_outs) + len(sent) + k for k, n in enumerate(from_host)}
    # the values sent are gathered into a pack as soon as the host part returns: kept from call to call
    host_gm.meta["ember_consumed_outputs"] = frozenset(at_sent.values()) | frozenset(at_from_host.values())
    plan = {
        "host_inputs": inputs_host,
        "device_inputs": inputs_dev,
        # per pack: dtype, and the positions (among the host inputs) of its members
        "packs": [(dtype, [at_host_node[m] for m in members]) for dtype, members in packs.items()],
        # per pack of values the host graph computes for the device: dtype, positions among its outputs
        "sent_packs": [(dtype, [at_sent[m] for m in members]) for dtype, members in sent_packs.items()],
        # per heavy value the device reads: "input", its position among the host inputs / "host", its position
        # among the host graph's outputs; then its dtype, size and strides on the device (_sent_layout)
        "tensors_sent": [(*(("input", at_host_node[n]) if n.op == "placeholder" else ("host", at_from_host[n])),
                          n.meta["val"].dtype, *_sent_layout(n.meta["val"])) for n in tensors_sent],
        # per pack: the device output holding its next values, or None; the device outputs before those
        "next_packs": mirrors, "device_outputs": len(dev_outs),
        "device": device,
        # per output leaf: ("host", k) / ("device", k) / ("const", value)
        "outputs": [("host", at_host_out[x]) if isinstance(x, fx.Node) and x in host else
                    ("device", at_dev_out[x]) if isinstance(x, fx.Node) else ("const", x) for x in out_leaves],
        "out_spec": out_spec,
    }
    return host_gm, dev_gm, plan


# CPU ops computed on the host when the device reads their results: their device versions call libdevice
LINKED_ON_DEVICE = {aten.pow.Tensor_Tensor, aten.pow.Tensor_Scalar, aten.pow.Scalar}
# ... in graphs of more nodes than this. An optimizer step alone fuses its updates into a few kernels, where
# recomputing costs less than the transfer each call; a training step with its backward fuses them into hundreds.
SENT_FROM_HOST_ABOVE = 1000


def _sent_layout(v: torch.Tensor) -> tuple[tuple, tuple]:
    """(size, strides) a CPU tensor is sent to the device in: contiguous (made so on the CPU first)."""
    return tuple(v.shape), torch.empty(v.shape, device="meta").stride()


def _in_order(tensors_sent: list, from_inputs: list, from_host: list) -> list:
    """The tensors sent, in the device graph's order, from the two lists each source's were sent in."""
    a, b = iter(from_inputs), iter(from_host)
    return [next(a) if where == "input" else next(b) for where, *_ in tensors_sent]


def _positions(items: list) -> dict:
    return {x: k for k, x in enumerate(items)}


class _Pack:
    """The values of some same-dtype 0-d CPU tensors in one pinned buffer, sent to the GPU without a wait.

    Two buffers take turns; before one is refilled, the copy that last read it must have finished (an event,
    long done by then in a training loop). No copy at all while the values are those `keep` was told of: the
    device tensor holding them then stands for the pack."""

    def __init__(self, dtype: torch.dtype, positions: list[int], device: torch.device):
        n = len(positions)
        self.positions, self.n, self.size = positions, n, torch.empty((), dtype=dtype).element_size()
        self.buffers = [torch.empty(n, dtype=dtype, pin_memory=True) for _ in range(2)]
        self.events: list[torch.cuda.Event | None] = [None, None]
        self.ptrs = (ctypes.c_int64 * n)()
        self.turn, self.device, self.transfers = 0, device, 0
        self.next: torch.Tensor | None = None        # on the device: the values the CPU tensors should have now
        self.expected = torch.empty(n, dtype=dtype)  # those values, as the host graph wrote them

    def keep(self, next_pack: torch.Tensor) -> None:
        """After the host graph wrote the CPU values: `next_pack` (the device graph's) holds the same."""
        _gather_fn()(self.ptrs, self.n, self.size, self.expected.data_ptr())
        self.next = next_pack

    def send(self, host_args: list[torch.Tensor]) -> torch.Tensor:
        self.ptrs[:] = [host_args[i].data_ptr() for i in self.positions]
        if self.next is not None:
            if _c_functions()[1](self.ptrs, self.n, self.size, self.expected.data_ptr()):
                return self.next
            self.next = None   # changed from outside (a loaded state dict): copied below
        k, self.turn = self.turn, 1 - self.turn
        if self.events[k] is not None:
            self.events[k].synchronize()
        buf = self.buffers[k]
        _gather_fn()(self.ptrs, self.n, self.size, buf.data_ptr())
        out = buf.to(self.device, non_blocking=True)
        self.transfers += 1
        self.events[k] = torch.cuda.Event()
        self.events[k].record()
        return out


def _eager_while_building(host_fn: Callable, host_gm: fx.GraphModule) -> list[Callable]:
    """[host_fn], or, while its C++ build still runs, [a function that runs host_gm's few ATen ops on the CPU and
    puts host_fn in its place once the build is done]: the first call need not wait for g++, which runs beside
    the device part's Triton compile and may end after it. The eager part's outputs are fresh tensors (the
    caller copies the counters back) where the C++ part
    wrote them in place, so the next call copies the pack to the GPU once (_Pack.send), as for a counter set from
    outside."""
    build = getattr(getattr(host_fn, "compiled", None), "build", None)
    cell = [host_fn]
    if build is not None and not build.done():
        def while_building(*args):
            if build.done():
                cell[0] = host_fn
                return host_fn(*args)
            return host_gm(*args)
        cell[0] = while_building
    return cell


def compile_split(gm: fx.GraphModule, example_inputs: list, compile_host: Callable, compile_device: Callable
                  ) -> Callable | str:
    """gm compiled as a host part and a device part (module doc), or why it cannot be split."""
    parts = split(gm)
    if isinstance(parts, str):
        return parts
    host_gm, dev_gm, plan = parts
    host_idx, dev_idx, device = plan["host_inputs"], plan["device_inputs"], plan["device"]
    tensors_sent = plan["tensors_sent"]
    from_host = any(where == "host" for where, *_ in tensors_sent)
    has_host_outputs = any(where == "host" for where, _ in plan["outputs"]) or bool(plan["sent_packs"]) or from_host
    host_fn = compile_host(host_gm, [example_inputs[i] for i in host_idx]) if has_host_outputs else None
    host = _eager_while_building(host_fn, host_gm) if host_fn is not None else None
    dev_examples = [example_inputs[i] for i in dev_idx] + \
        [torch.empty((len(pos),), dtype=dt, device=device) for dt, pos in plan["packs"] + plan["sent_packs"]] + \
        [torch.empty_strided(size, stride, dtype=dt, device=device) for *_, dt, size, stride in tensors_sent]
    dev_fn = compile_device(dev_gm, dev_examples)
    packs = [_Pack(dt, pos, device) for dt, pos in plan["packs"]]
    sent_packs = [_Pack(dt, pos, device) for dt, pos in plan["sent_packs"]]
    mirrored = [(p, at) for p, at in zip(packs, plan["next_packs"]) if at is not None]
    n_dev_out = plan["device_outputs"]
    outputs = plan["outputs"]
    unflatten = fast_unflatten(plan["out_spec"])

    host_of, dev_of = picker(host_idx), picker(dev_idx)
    # the output leaves, picked from (*device outputs, *host outputs, *values sent, *constants) in one C call
    n_dev = sum(where == "device" for where, _ in outputs)
    n_host = sum(where == "host" for where, _ in outputs) + sum(len(pos) for _, pos in plan["sent_packs"]) + \
        sum(where == "host" for where, *_ in tensors_sent)
    consts = tuple(k for where, k in outputs if where == "const")
    at, c = [], 0
    for where, k in outputs:
        at.append(k if where == "device" else n_dev + k if where == "host" else n_dev + n_host + c)
        c += where == "const"
    leaves_of = picker(at)

    def send_tensors(host_args: list, h, where_from: str) -> list:
        # (a pageable CPU tensor is staged by the time `.to` returns: the host may write it again at once)
        return [(host_args[k] if where == "input" else h[k]).contiguous().to(device, non_blocking=True)
                for where, k, *_ in tensors_sent if where == where_from] if tensors_sent else []

    def run(*args):
        host_args = host_of(args)
        if sent_packs or from_host:   # the host graph first: the device reads values it computes (the old
            old = [p.send(host_args) for p in packs]                     # inputs are packed or sent first)
            inputs_sent = send_tensors(host_args, None, "input")
            h = host[0](*host_args)
            d = dev_fn(*dev_of(args), *old, *[p.send(h) for p in sent_packs], *_in_order(
                tensors_sent, inputs_sent, send_tensors(host_args, h, "host")))
        else:
            d = dev_fn(*dev_of(args), *[p.send(host_args) for p in packs], *send_tensors(host_args, None, "input"))
            h = host[0](*host_args) if has_host_outputs else ()
        if mirrored:
            for p, at in mirrored:
                p.keep(d[at])
            d = d[:n_dev_out]
        return unflatten(leaves_of((*d, *h, *consts)))
    return run
