"""mode="reduce-overhead": replay compiled graphs through torch.cuda.CUDAGraph.

A CUDA graph replays the kernels it recorded on the same addresses, so everything a recorded graph reads or
writes must stay where it was. That gives three kinds of memory, and the rules below keep them apart:

  static inputs   parameters and buffers (`static_input_indices`): read in place; if the caller passes a
                  different tensor there (a replaced parameter), the graph is recorded again for it.
  input buffers   every other input gets a buffer made at record time; a call copies its argument in only
                  when the argument is not already that buffer (a forward's saved tensor given back to the
                  backward is). A saved tensor that already lives in graph memory is used as the buffer.
  graph memory    intermediates and outputs, allocated during capture from one private pool shared by every
                  graph of a compiled program (forward, backward, each shape), so they can share memory.

Because graphs share the pool, replaying one graph may overwrite the outputs of another. So:
  * outputs handed to the caller are cloned (`clone_outputs=True`, the default): the caller may keep them
    across steps. With `clone_outputs=False` they are the graph's own memory and are valid only until the
    next call of any graph in the pool -- torch.compile's rule for mode="reduce-overhead".
  * tensors a forward saves for its backward (`num_saved`) are not copied: they come back in a `Saved`
    holder that stays "pending" until the backward takes it. Before any replay, every pending holder that
    the replay does not consume is evacuated (its tensors cloned out of graph memory). In the usual
    forward, backward, forward, backward order nothing is evacuated and nothing is copied.

Public entry points: `CUDAGraphed` (any callable: flat tensors -> tuple of tensors) and
`graphed_autograd_function` (a compiled forward and backward pair made into one differentiable callable).
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import Callable, Sequence

import torch

from ember.tools.logs import get_logger

log = get_logger("graph")


class GraphPool:
    """One private CUDA memory pool, shared by all graphs of one compiled program, and its pending saves."""

    def __init__(self, device: torch.device | int | None = None):
        self.device = torch.device("cuda", torch.cuda.current_device() if device is None else
                                   torch.device(device).index or 0)
        self.handle = torch.cuda.graph_pool_handle()
        self.pending: "weakref.WeakSet[Saved]" = weakref.WeakSet()
        # Storages a replay writes: graphs' outputs and input buffers (by storage address, so views count).
        self.graph_storages: set[int] = set()

    def before_replay(self, consuming: "Saved | None" = None) -> None:
        for saved in list(self.pending):
            if saved is not consuming:
                saved.evacuate()

    def owns(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self.graph_storages


class Saved:
    """Tensors a graphed forward keeps for its backward; they live in graph memory until taken or evacuated."""

    def __init__(self, tensors: list[torch.Tensor], pool: GraphPool):
        self.tensors = tensors
        self.pool = pool
        pool.pending.add(self)

    def evacuate(self) -> None:
        """Another replay is about to reuse graph memory: move our tensors out of it."""
        self.tensors = [t.clone() if self.pool.owns(t) else t for t in self.tensors]
        self.pool.pending.discard(self)

    def take(self) -> list[torch.Tensor]:
        self.pool.pending.discard(self)
        return self.tensors


def _signature(inputs: Sequence[torch.Tensor], static: frozenset[int]) -> tuple:
    """What a recording depends on: layout of every input, and the address of every static input."""
    return tuple((tuple(t.shape), t.stride(), t.dtype, t.device, t.data_ptr() if i in static else None)
                 for i, t in enumerate(inputs))


@dataclasses.dataclass
class _Recording:
    graph: torch.cuda.CUDAGraph
    buffers: list[torch.Tensor]        # what the graph reads, one per input (static inputs themselves)
    copy_in: list[int]                 # indices of inputs that may need copying into their buffer
    outputs: tuple[torch.Tensor, ...]  # graph memory
    static_ptrs: list[int]             # addresses of the static inputs it was recorded with
    static_idx: list[int]
    layouts: list[tuple]               # (shape, stride, dtype) of the other inputs

    def matches(self, inputs: Sequence[torch.Tensor]) -> bool:
        """The per-call check (the full signature costs ~0.35 us a tensor; this ~0.06 for parameters)."""
        return ([inputs[i].data_ptr() for i in self.static_idx] == self.static_ptrs and
                [(x.shape, x.stride(), x.dtype) for x in map(inputs.__getitem__, self.copy_in)] == self.layouts)


class CUDAGraphed:
    """`fn` (flat CUDA tensors -> tuple of tensors) recorded once per input signature and replayed.

    The first call with a new signature runs `fn` eagerly `warmup` times on a side stream (cuBLAS handles,
    cuDNN algorithm choice, Triton compilation happen there, not inside the capture), records it, then
    replays. `num_user_outputs`: when given, the outputs after the first `num_user_outputs` are tensors saved
    for a backward; they are returned uncopied, in one `Saved` holder, as the last element of the result.
    """

    def __init__(self, fn: Callable, static_input_indices: Sequence[int] = (), *, pool: GraphPool | None = None,
                 num_user_outputs: int | None = None, clone_outputs: bool = True, warmup: int = 1):
        self.fn = fn
        self.static = frozenset(static_input_indices)
        self.pool = pool or GraphPool()
        self.num_user_outputs = num_user_outputs
        self.clone_outputs = clone_outputs
        self.warmup = warmup
        self.recordings: dict[tuple, _Recording] = {}
        self._last: _Recording | None = None

    def __call__(self, *inputs: torch.Tensor, consuming: Saved | None = None) -> tuple:
        rec = self._last
        if rec is None or not rec.matches(inputs):
            key = _signature(inputs, self.static)
            rec = self.recordings.get(key)
            if rec is None:
                rec = self.recordings[key] = self._record(inputs)
            self._last = rec
        self.pool.before_replay(consuming)
        for i in rec.copy_in:
            buf, x = rec.buffers[i], inputs[i]
            if buf.data_ptr() != x.data_ptr():
                buf.copy_(x)
        rec.graph.replay()
        n_user = len(rec.outputs) if self.num_user_outputs is None else self.num_user_outputs
        user = tuple(o.clone() if self.clone_outputs else o for o in rec.outputs[:n_user])
        if self.num_user_outputs is None:
            return user
        return user + (Saved(list(rec.outputs[n_user:]), self.pool),)

    def _record(self, inputs: Sequence[torch.Tensor]) -> _Recording:
        for i, t in enumerate(inputs):
            if not (isinstance(t, torch.Tensor) and t.is_cuda):
                where = f" on {t.device}" if isinstance(t, torch.Tensor) else ""
                raise TypeError(f"mode='reduce-overhead' (CUDA graphs) needs CUDA tensor inputs; input {i} is "
                                f"a {type(t).__name__}{where}. Move it to the GPU or compile without this mode.")
        buffers, copy_in = [], []
        for i, t in enumerate(inputs):
            if i in self.static or self.pool.owns(t):
                buffers.append(t)                 # read in place: parameters, or saved graph memory
            else:
                buffers.append(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t))
                self.pool.graph_storages.add(buffers[-1].untyped_storage().data_ptr())
            if i not in self.static:
                copy_in.append(i)
        log.debug("cudagraphs: recording %s for input shapes %s", getattr(self.fn, "__name__", self.fn),
                  [tuple(t.shape) for t in inputs])
        # Warm-up and capture on a side stream, as torch.cuda.graph requires. Eager warm-up allocates outside
        # the pool and capture runs nothing, so neither touches pending saved tensors.
        stream = torch.cuda.Stream(device=self.pool.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(self.warmup):
                self.fn(*buffers)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool.handle, stream=stream):
            outputs = tuple(self.fn(*buffers))
        static_storages = {inputs[i].untyped_storage().data_ptr() for i in self.static}
        for o in outputs:   # outputs that alias a static input are the caller's memory, not graph memory
            if o.untyped_storage().data_ptr() not in static_storages:
                self.pool.graph_storages.add(o.untyped_storage().data_ptr())
        static_idx = sorted(self.static)
        return _Recording(graph, buffers, copy_in, outputs, [inputs[i].data_ptr() for i in static_idx], static_idx,
                          [(inputs[i].shape, inputs[i].stride(), inputs[i].dtype) for i in copy_in])


def graphed_autograd_function(forward: Callable, backward: Callable, *, num_user_outputs: int,
                              static_input_indices: Sequence[int] = (),
                              inference: Callable | None = None) -> Callable:
    """A differentiable callable from a compiled forward/backward pair, both replayed as CUDA graphs.

    forward(*inputs) -> (*user_outputs, *saved); backward(*saved, *grad_outputs) -> one gradient per input
    (None where an input needs none; the same positions on every call). `inference(*inputs) -> user_outputs`
    (optional) is used when grad is off. This is what ember.autograd's Function should do under
    mode="reduce-overhead"; the saved tensors stay in graph memory from forward to backward (module doc).
    """
    pool = GraphPool()
    fw = CUDAGraphed(forward, static_input_indices, pool=pool, num_user_outputs=num_user_outputs)
    inf = CUDAGraphed(inference, static_input_indices, pool=pool) if inference is not None else None
    grad_is_none: list[bool] = []          # which inputs get no gradient, learnt on the first backward

    def backward_tensors_only(*args):
        grads = tuple(backward(*args))
        if not grad_is_none:
            grad_is_none.extend(g is None for g in grads)
        return tuple(g for g in grads if g is not None)

    bw: list[CUDAGraphed] = []             # made on the first backward, when the saved tensors are known

    def graphed_backward(saved: Saved, tensors: list[torch.Tensor]) -> CUDAGraphed:
        if not bw:
            # Saved tensors that are static inputs of the forward (parameters) stay static in the backward.
            static_ptrs = {p for r in fw.recordings.values() for p in r.static_ptrs}
            bw.append(CUDAGraphed(backward_tensors_only, pool=pool,
                                  static_input_indices=[i for i, t in enumerate(tensors)
                                                        if t.data_ptr() in static_ptrs]))
        return bw[0]

    class Graphed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            *outs, saved = fw(*inputs)
            ctx.saved = saved           # not save_for_backward: evacuation replaces the tensors
            ctx.out_meta = [(o.shape, o.dtype, o.device) for o in outs]
            return tuple(outs)

        @staticmethod
        def backward(ctx, *grads):
            saved: Saved = ctx.saved
            # Unused outputs get zero grads so one recording serves every call.
            grads = [torch.zeros(s, dtype=d, device=dev) if g is None else g
                     for g, (s, d, dev) in zip(grads, ctx.out_meta)]
            tensors = saved.take()
            got = iter(graphed_backward(saved, tensors)(*tensors, *grads, consuming=saved))
            return tuple(None if none else next(got) for none in grad_is_none)

    def call(*inputs: torch.Tensor) -> tuple:
        if inf is not None and not torch.is_grad_enabled():
            return inf(*inputs)
        return Graphed.apply(*inputs)

    return call
