"""mode="reduce-overhead": replay compiled graphs through torch.cuda.CUDAGraph.

A CUDA graph replays the kernels it recorded on the same addresses, so everything a recorded graph reads or
writes must stay where it was. That gives three kinds of memory, and the rules below keep them apart:

  static inputs   read in place: `static_input_indices`, or by default nn.Parameters and the inputs found
                  at the same address on the first two calls (module buffers, a reused batch). A different
                  tensor there records the graph again; a default-static input that moves is copied from
                  then on.
  input buffers   every other input gets a buffer made at record time; a call copies its argument in only
                  when the argument is not already that buffer. A saved tensor that already lives in graph
                  memory (a forward's, given back to its backward) is used as the buffer.
  graph memory    intermediates and outputs, allocated during capture from one private pool shared by every
                  graph of a compiled program (forward, backward, each shape), so they can share memory.

Because graphs share the pool, replaying one graph may overwrite the outputs of another. So:
  * outputs handed to the caller are cloned (`clone_outputs=True`, the default): the caller may keep them
    across steps. Outputs the caller copies into its inputs at once (`copied_back`: input mutations, such as
    batch norm's running statistics) are not; where that input is static, the graph records the copy itself.
    With `clone_outputs=False` they are the graph's own memory and are valid only until the next call of any
    graph in the pool -- torch.compile's rule for mode="reduce-overhead".
  * tensors a forward saves for its backward are not copied. Either they come back in a `Saved` holder
    that is evacuated (cloned out of graph memory) before any replay that does not consume it, or
    (`saved_as_aliases`, for ember.autograd's Function, which keeps them with save_for_backward) as plain
    aliases: while one is alive, a replay that could overwrite it runs the compiled code eagerly instead.
    In the usual forward, backward, forward, backward order nothing is evacuated, copied or run eagerly.

Public entry points: `CUDAGraphed` (any callable: flat tensors -> tuple of tensors), `aot_compilers`
(forward/backward compilers for ember.autograd.aot_module) and `graphed_autograd_function` (a compiled
forward and backward pair made into one differentiable callable).
"""
from __future__ import annotations

import dataclasses
import itertools
import weakref
from typing import Callable, Sequence

import torch

from ember.runtime import native_guards
from ember.tools.picker import picker
from ember.tools.logs import get_logger

log = get_logger("graph")


class GraphPool:
    """One private CUDA memory pool, shared by all graphs of one compiled program, and its pending saves."""

    def __init__(self, device: torch.device | int | None = None):
        self.device = torch.device("cuda", torch.cuda.current_device() if device is None else
                                   torch.device(device).index or 0)
        self.handle = torch.cuda.graph_pool_handle()
        self.pending: "weakref.WeakSet[Saved]" = weakref.WeakSet()
        # saved tensors handed out as plain aliases of graph memory (aot_module's Function keeps them with
        # save_for_backward, so they cannot be moved): while one is alive, replays that could overwrite it
        # run eagerly instead
        self.aliases: list[weakref.ref] = []
        # Storages a replay writes: graphs' outputs and input buffers (by storage address, so views count).
        self.graph_storages: set[int] = set()

    def before_replay(self, consuming: "Saved | None" = None, inputs: Sequence = ()) -> bool:
        """Make graph memory safe to overwrite; False when it cannot be (then run eagerly, not replay)."""
        alive = [t for t in (r() for r in self.aliases) if t is not None]
        self.aliases = [weakref.ref(t) for t in alive]
        if alive:
            given = set(map(id, inputs))
            # the usual case, a backward handed its own saved tensors, by identity; else by storage (a view of one)
            if not all(id(t) in given for t in alive):
                read = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
                if any(t.untyped_storage().data_ptr() not in read for t in alive):
                    return False
        for saved in list(self.pending):
            if saved is not consuming:
                saved.evacuate()
        return True

    def owns(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self.graph_storages

    def ember_saved(self) -> tuple:   # (ember.runtime.artifacts: a new pool on the same device, nothing in it)
        return (GraphPool, (self.device.index,))


class Saved:
    """Tensors a graphed forward keeps for its backward; they live in graph memory until taken or evacuated."""

    def __init__(self, tensors: list[torch.Tensor], pool: GraphPool):
        self.tensors = tensors
        self.pool = pool
        pool.pending.add(self)

    def evacuate(self) -> None:
        """Another replay is about to reuse graph memory: move our tensors out of it."""
        self.tensors = [t.clone() if isinstance(t, torch.Tensor) and self.pool.owns(t) else t for t in self.tensors]
        self.pool.pending.discard(self)

    def take(self) -> list[torch.Tensor]:
        self.pool.pending.discard(self)
        return self.tensors


class FreshLike:
    """Makes copies of `tensors` (a replay's outputs, cloned on each replay): the contiguous ones
    as views of one allocation per dtype and device, each view 64-byte aligned for vector loads (as DDP's
    gradient buckets: one allocator call instead of hundreds); the others with empty_like. The views come
    from one C++ call (unflatten_dense_tensors, DDP's) over the sources and padding: Python slices and views of
    hundreds of gradients cost several times more."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.tensors = tensors
        self.loose = []
        by_kind: dict = {}
        for i, t in enumerate(tensors):
            if t.is_contiguous() and t.numel() > 0:
                by_kind.setdefault((t.dtype, t.device), []).append(i)
            else:
                self.loose.append(i)
        # per dtype and device: (dtype, device, total elements, layout: sources and paddings, picker, indices,
        # the layout's flat views, the one-launch copy where there is one)
        self.groups = []
        for (dtype, device), idx in by_kind.items():
            align = max(1, 64 // tensors[idx[0]].element_size())
            layout, at = [], []
            for i in idx:
                at.append(len(layout))
                layout.append(tensors[i])
                if tensors[i].numel() % align:
                    layout.append(torch.empty(align - tensors[i].numel() % align, dtype=dtype, device=device))
            starts = list(itertools.accumulate((t.numel() for t in layout), initial=0))
            gather = _gather_copy([tensors[i] for i in idx], [starts[a] for a in at], device, dtype)
            self.groups.append((dtype, device, starts[-1], layout, picker(at), idx, [t.view(-1) for t in layout],
                                gather))

    def copies(self) -> list[torch.Tensor]:
        """New tensors holding the sources' values now. A group's values are copied into its allocation by one
        Triton launch on CUDA (gather_copy), else one concatenation: _foreach_copy_ of same-dtype tensors is one
        cudaMemcpyAsync each (thousands of them, milliseconds of host time a step, for a training step's
        parameters, state and gradients)."""
        out: list = [None] * len(self.tensors)
        for i in self.loose:
            out[i] = torch.empty_like(self.tensors[i]).copy_(self.tensors[i])
        for dtype, device, total, layout, pick, idx, flat_sources, gather in self.groups:
            flat = torch.empty(total, dtype=dtype, device=device)
            if gather is not None:
                gather.copy(flat)
            else:
                torch.cat(flat_sources, out=flat)
            for i, v in zip(idx, pick(torch._C._nn.unflatten_dense_tensors(flat, layout))):
                out[i] = v
        return out


def _gather_copy(sources: list[torch.Tensor], offsets: list[int], device: torch.device, dtype: torch.dtype):
    """One Triton launch copying the sources (gather_copy), where Triton runs on this device: torch.cat of many
    small tensors is several times slower than their bytes need."""
    if device.type != "cuda" or len(sources) < 2:
        return None
    try:
        from ember.runtime import gather_copy
    except ImportError:
        return None
    return gather_copy.GatherCopy(sources, offsets) if dtype in gather_copy.DTYPES else None


def _signature(inputs: Sequence[torch.Tensor], static: frozenset[int]) -> tuple:
    """What a recording depends on: layout of every input, the address of every static input, and the value of
    every int input (a symbolic graph's sizes: a recording replays the kernels launched for those sizes)."""
    return tuple((tuple(t.shape), t.stride(), t.dtype, t.device, t.data_ptr() if i in static else None)
                 if isinstance(t, torch.Tensor) else (type(t), t) for i, t in enumerate(inputs))


# recordings one CUDAGraphed keeps (one per input signature: a symbolic graph's distinct sizes); past it the least
# recently replayed is dropped, its memory going back to the pool (a recording holds its graph's memory)
MAX_RECORDINGS = 16


@dataclasses.dataclass
class _Recording:
    graph: torch.cuda.CUDAGraph
    buffers: list[torch.Tensor]        # what the graph reads, one per input (static inputs themselves)
    copy_in: list[int]                 # indices of inputs that may need copying into their buffer
    outputs: tuple[torch.Tensor, ...]  # graph memory
    static_ptrs: list[int]             # addresses of the static inputs it was recorded with
    static_idx: list[int]
    layouts: list[tuple]               # (shape, stride, dtype) of the other inputs
    owned: list[bool] = None           # per output: lives in graph memory (a replay rewrites it)
    cloned: list[int] = None           # user outputs cloned on each replay (graph memory the caller may keep)
    passed_through: list = ()          # (output, input): an output that is a static input, written in place

    native: tuple | None = None        # the C++ checks (native_guards) and what they compare, when loaded
    ints: tuple = ()                   # (index, value) of the int inputs (a symbolic graph's sizes)

    def __post_init__(self):
        self.cloned_sources = [self.outputs[i] for i in self.cloned or ()]
        self.fresh = FreshLike(self.cloned_sources)
        self.buffer_ptrs = tuple(self.buffers[i].data_ptr() for i in self.copy_in)

    def with_native_checks(self, inputs: Sequence[torch.Tensor]) -> None:
        """Per-call checks in C++ from now on, where native_guards is loaded and every copied input's metadata
        packs: a training step compares a thousand addresses and hundreds of layouts a replay, slow in
        Python."""
        native = native_guards.checker()
        if native is None:
            return
        specs = [native.spec(inputs[i]) for i in self.copy_in]
        if any(s is None for s in specs):
            return
        self.native = (native, picker(self.static_idx), tuple(self.static_ptrs), picker(self.copy_in),
                       tuple(type(inputs[i]) for i in self.copy_in), b"".join(specs))

    def matches(self, inputs: Sequence[torch.Tensor]) -> bool:
        """The per-call check (cheaper than the full signature: only the static inputs' addresses)."""
        for i, v in self.ints:
            if inputs[i] != v:
                return False
        if self.native is not None:
            native, static, ptrs, copied, types, specs = self.native
            got = native.data_ptrs(static(inputs))
            if got is not None:
                return got == ptrs and native.check(copied(inputs), types, specs)
        return ([inputs[i].data_ptr() for i in self.static_idx] == self.static_ptrs and
                [(x.shape, x.stride(), x.dtype) for x in map(inputs.__getitem__, self.copy_in)] == self.layouts)

    def copy_inputs(self, inputs: Sequence[torch.Tensor]) -> None:
        """Copy each non-static input into its buffer unless it is that buffer already (a saved tensor)."""
        ptrs = None
        if self.native is not None:
            native, _, _, copied, _, _ = self.native
            ptrs = native.data_ptrs(copied(inputs))
        if ptrs is None:
            ptrs = tuple(inputs[i].data_ptr() for i in self.copy_in)
        if ptrs != self.buffer_ptrs:
            for k, (a, b) in enumerate(zip(ptrs, self.buffer_ptrs)):
                if a != b:
                    self.buffers[self.copy_in[k]].copy_(inputs[self.copy_in[k]])


class CUDAGraphed:
    """`fn` (flat CUDA tensors -> tuple of tensors) recorded once per input signature and replayed.

    The first call with a new signature runs `fn` eagerly `warmup` times on a side stream (cuBLAS handles,
    cuDNN algorithm choice, Triton compilation happen there, not inside the capture), records it, then
    replays. `static_input_indices`: inputs read in place (parameters; default: those that are
    nn.Parameters). `num_user_outputs`: when given, the outputs after the first `num_user_outputs` are tensors saved
    for a backward; they are returned uncopied, in one `Saved` holder, as the last element of the result.
    """

    def __init__(self, fn: Callable, static_input_indices: Sequence[int] | None = None, *,
                 pool: GraphPool | None = None, num_user_outputs: int | None = None, clone_outputs: bool = True,
                 warmup: int = 1, saved_as_aliases: bool = False, copied_back: Sequence[tuple[int, int]] = (),
                 mutations: Sequence[tuple[int, int]] = ()):
        self.fn = fn
        # inputs fn writes in place (a step's parameters and optimizer state): the warm-up runs on copies of
        # them, so that recording applies the step once, by its replay
        self.mutated_inputs = frozenset(i for i, _ in mutations)
        # (input, output): outputs the caller copies into its inputs right away (input mutations, e.g. batch
        # norm's running statistics): handed out uncloned, since no replay comes between; where the input is
        # static, the graph itself copies the output into it
        self.copies_back = list(copied_back)
        self.copied_back = frozenset(o for _, o in copied_back)
        # None: found out from the calls: nn.Parameters, and inputs at the same address on the first two calls
        # (module buffers, a reused input); one that later moves is copied from then on
        self.auto = static_input_indices is None
        self.static = None if self.auto else frozenset(static_input_indices)
        self._first_ptrs: list[int] | None = None
        self._demoted: set[int] = set()
        self.saved_as_aliases = saved_as_aliases
        self.replays = self.eager_runs = 0
        self.name = getattr(fn, "__name__", type(fn).__name__)
        self.pool = pool or GraphPool()
        self.num_user_outputs = num_user_outputs
        self.clone_outputs = clone_outputs
        self.warmup = warmup
        self.recordings: dict[tuple, _Recording] = {}   # in order of last use (MAX_RECORDINGS at most)
        self.evicted = 0
        self._last: _Recording | None = None

    def ember_saved(self) -> tuple:
        """The saved form (ember.runtime.artifacts): the compiled callable and how it is replayed, without its
        recordings (a CUDA graph holds this process's addresses). Loaded, it records again at its first calls,
        as a fresh compile does: recording launches the compiled kernels, it compiles nothing."""
        return (_graphed, (self.fn, None if self.auto else sorted(self.static), self.pool, self.num_user_outputs,
                           self.clone_outputs, self.warmup, self.saved_as_aliases, self.copies_back,
                           sorted(self.mutated_inputs), self.name))

    def __call__(self, *inputs: torch.Tensor, consuming: Saved | None = None) -> tuple:
        rec = self._last
        if self.static is None:
            if self._first_ptrs is None:      # first call: run eagerly, note where the inputs live
                self._first_ptrs = [t.data_ptr() if isinstance(t, torch.Tensor) else None for t in inputs]
                return self._eager(inputs)
            self.static = frozenset(i for i, t in enumerate(inputs) if isinstance(t, torch.nn.Parameter) or
                                    (isinstance(t, torch.Tensor) and t.data_ptr() == self._first_ptrs[i]))
        if rec is None or not rec.matches(inputs):
            if self.auto:   # a promoted input that moved: copy it from now on
                moved = {i for i in self.static if not isinstance(inputs[i], torch.nn.Parameter) and
                         rec is not None and inputs[i].data_ptr() != rec.buffers[i].data_ptr()}
                if moved:
                    self._demoted |= moved
                    self.static = self.static - moved
            key = _signature(inputs, self.static)
            rec = self.recordings.pop(key, None)
            if rec is None:
                if len(self.recordings) >= MAX_RECORDINGS:
                    self.recordings.pop(next(iter(self.recordings)))   # the least recently used
                    if not self.evicted:
                        log.warning("cudagraphs: %s reached %d recordings (one per input size): the least "
                                    "recently used are dropped and recorded again when their sizes return",
                                    self.name, MAX_RECORDINGS)
                    self.evicted += 1
                rec = self._record(inputs)
            self.recordings[key] = rec   # (last in the dict: the most recently used)
            self._last = rec
        if not self.pool.before_replay(consuming, inputs):
            self.eager_runs += 1
            if self.eager_runs == 1:
                log.warning("cudagraphs: %s ran eagerly: saved tensors of another graph in its memory pool are "
                            "still alive (%s)", self.name, [tuple(r().shape) for r in self.pool.aliases][:6])
            return self._eager(inputs)
        self.replays += 1
        rec.copy_inputs(inputs)
        rec.graph.replay()
        n_user = len(rec.outputs) if self.num_user_outputs is None else self.num_user_outputs
        user = rec.outputs[:n_user]
        if self.clone_outputs and rec.cloned or rec.passed_through:
            user = list(user)
            if self.clone_outputs:
                for i, t in zip(rec.cloned, rec.fresh.copies()):
                    user[i] = t
            for o, i in rec.passed_through:
                user[o] = inputs[i]
            user = tuple(user)
        if self.num_user_outputs is None:
            return user
        if self.saved_as_aliases:
            # only saved tensors in graph memory need watching; inputs saved as they are (parameters, the batch)
            # are the caller's memory, which no replay writes
            saved = tuple(o.detach() if owned else o for o, owned in zip(rec.outputs[n_user:], rec.owned[n_user:]))
            self.pool.aliases += [weakref.ref(t) for t, owned in zip(saved, rec.owned[n_user:]) if owned]
            return user + saved
        return user + (Saved(list(rec.outputs[n_user:]), self.pool),)

    def _eager(self, inputs) -> tuple:
        """fn run as it is (fresh memory): the first call, and calls that must not overwrite graph memory."""
        outs = tuple(self.fn(*inputs))
        if self.num_user_outputs is None or self.saved_as_aliases:
            return outs
        return outs[:self.num_user_outputs] + (Saved(list(outs[self.num_user_outputs:]), self.pool),)

    def _record(self, inputs: Sequence[torch.Tensor]) -> _Recording:
        for i, t in enumerate(inputs):
            if not (isinstance(t, torch.Tensor) and t.is_cuda or type(t) is int):
                where = f" on {t.device}" if isinstance(t, torch.Tensor) else ""
                raise TypeError(f"mode='reduce-overhead' (CUDA graphs) needs CUDA tensor inputs; input {i} is "
                                f"a {type(t).__name__}{where}. Move it to the GPU or compile without this mode.")
        buffers, copy_in = [], []
        for i, t in enumerate(inputs):
            if type(t) is int:   # a size: part of the signature, recorded as it is
                buffers.append(t)
                continue
            if i in self.static or self.pool.owns(t):
                # read in place: parameters, or saved graph memory. A new alias, so that the recording does not
                # keep the caller's tensor object alive (the pool watches saved tensors by their lifetime)
                buffers.append(t.detach())
            else:
                buffers.append(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t))
                self.pool.graph_storages.add(buffers[-1].untyped_storage().data_ptr())
            if i not in self.static:
                copy_in.append(i)
        log.debug("cudagraphs: recording %s for input shapes %s", getattr(self.fn, "__name__", self.fn),
                  [tuple(t.shape) if isinstance(t, torch.Tensor) else t for t in inputs])
        # Warm-up and capture on a side stream, as torch.cuda.graph requires. Eager warm-up allocates outside
        # the pool and capture runs nothing, so neither touches pending saved tensors.
        stream = torch.cuda.Stream(device=self.pool.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            warm = [b.clone() if i in self.mutated_inputs else b for i, b in enumerate(buffers)]
            for _ in range(self.warmup):
                self.fn(*warm)
            del warm
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()

        def where(t):
            return (t.data_ptr(), t.shape, t.stride(), t.dtype)
        with torch.cuda.graph(graph, pool=self.pool.handle, stream=stream):
            outputs = tuple(self.fn(*buffers))
            # copies back into static inputs (parameters, module buffers, optimizer state: fixed addresses) are
            # recorded after the kernels, so a replay leaves no copies for the host to launch. Those outputs are
            # then the inputs themselves (passed through below).
            into = {o: i for i, o in self.copies_back if i in self.static and isinstance(outputs[o], torch.Tensor)
                    and where(outputs[o])[1:] == where(buffers[i])[1:] and where(outputs[o]) != where(buffers[i])}
            if into:
                torch._foreach_copy_([buffers[i] for i in into.values()], [outputs[o] for o in into])
                outputs = tuple(buffers[into[o]] if o in into else t for o, t in enumerate(outputs))
        static_storages = {inputs[i].untyped_storage().data_ptr() for i in self.static}
        for o in outputs:   # outputs that alias a static input are the caller's memory, not graph memory
            if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in static_storages:
                self.pool.graph_storages.add(o.untyped_storage().data_ptr())
        static_idx = sorted(self.static)
        owned = [isinstance(o, torch.Tensor) and self.pool.owns(o) for o in outputs]
        n_user = len(outputs) if self.num_user_outputs is None else self.num_user_outputs
        # outputs that are a static input written in place (a step's parameters and state): the caller's tensor
        static_at = {where(buffers[i]): i for i in static_idx}
        passed_through = [(o, static_at[where(outputs[o])]) for o in range(n_user)
                          if isinstance(outputs[o], torch.Tensor) and where(outputs[o]) in static_at]
        through = {o for o, _ in passed_through}
        cloned = [i for i in range(n_user) if isinstance(outputs[i], torch.Tensor) and i not in self.copied_back
                  and i not in through]
        rec = _Recording(graph, buffers, copy_in, outputs, [inputs[i].data_ptr() for i in static_idx], static_idx,
                         [(inputs[i].shape, inputs[i].stride(), inputs[i].dtype) for i in copy_in], owned, cloned,
                         passed_through)
        rec.ints = tuple((i, t) for i, t in enumerate(inputs) if type(t) is int)
        rec.with_native_checks(inputs)
        return rec


def _graphed(fn: Callable, static: list | None, pool: GraphPool, num_user_outputs: int | None, clone_outputs: bool,
             warmup: int, saved_as_aliases: bool, copied_back: list, mutated: list, name: str) -> CUDAGraphed:
    """A CUDAGraphed as its ember_saved wrote it, recorded at none of its signatures yet."""
    g = CUDAGraphed(fn, static, pool=pool, num_user_outputs=num_user_outputs, clone_outputs=clone_outputs,
                    warmup=warmup, saved_as_aliases=saved_as_aliases, copied_back=copied_back,
                    mutations=[(i, None) for i in mutated])
    g.name = name
    return g


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


def aot_compilers(compile_graph: Callable) -> tuple[Callable, Callable]:
    """(fw_compiler, bw_compiler) for ember.autograd.aot_module under mode="reduce-overhead": each graph that
    `compile_graph(gm, example_inputs)` compiles is replayed as a CUDA graph, all in one pool.

    The forward's saved tensors go to the backward uncopied (aliases of graph memory): aot_module records how
    many of a training forward's outputs are the user's in gm.meta["num_user_outputs"]. A graph without it (an
    inference graph) has only user outputs, all cloned.
    While a forward's saved tensors are alive (its backward has not run), graphs that could overwrite them
    run eagerly instead of replaying.
    """
    pool = GraphPool()
    numbers = itertools.count()

    def fw_compiler(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        n_user = gm.meta.get("num_user_outputs")
        name = f"forward graph {next(numbers)}"
        if _reads_cpu_tensors(example_inputs):
            return host_scalars_graphed(gm, example_inputs, name, n_user is not None)
        f = compile_graph(gm, example_inputs)
        fw = CUDAGraphed(lambda *a: tuple(f(*a)), pool=pool, num_user_outputs=n_user, saved_as_aliases=True,
                         copied_back=gm.meta.get("ember_copied_back", ()),
                         mutations=gm.meta.get("ember_input_mutations", ()))
        fw.name = name
        return fw

    def bw_compiler(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        if _reads_cpu_tensors(example_inputs):
            return host_scalars_graphed(gm, example_inputs, "backward graph", False)
        f = compile_graph(gm, example_inputs)
        bw = CUDAGraphed(lambda *a: tuple(f(*a)), pool=pool)
        bw.name = "backward graph"
        return bw

    def host_scalars_graphed(gm: torch.fx.GraphModule, example_inputs: list, name: str, saves: bool) -> Callable:
        """A graph reading CPU tensors (torch.optim's step counters: ember.codegen.host_scalars) replays its
        device part; the host part runs around the replay. A training forward (its saved tensors) does not."""
        if saves:
            log.info("cudagraphs: %s reads CPU tensors and saves tensors for its backward: no CUDA graph", name)
            return compile_graph(gm, example_inputs)

        def device_part(f: Callable, dev_gm: torch.fx.GraphModule) -> Callable:
            g = CUDAGraphed(lambda *a: tuple(f(*a)), pool=pool,
                            mutations=dev_gm.meta.get("ember_input_mutations", ()),
                            copied_back=dev_gm.meta.get("ember_copied_back", ()))
            g.name = f"{name} (device part)"
            return g
        return compile_graph(gm, example_inputs, {"cudagraphs.device_part": device_part})

    return fw_compiler, bw_compiler


def _reads_cpu_tensors(example_inputs: list) -> bool:
    return any(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in example_inputs)

