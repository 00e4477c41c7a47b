"""The host program of a compiled graph: generated Python that checks inputs, allocates buffers (reusing
dead ones of the same layout), runs kernels and extern calls in schedule order and returns the outputs.

Backend-neutral: a backend supplies `kernel_call(group) -> str`, the Python statement that runs a group
(C++: a ctypes call on data pointers; Triton: a kernel launch).

`persistent=True` (the C++ backend) keeps the buffers that never leave a call (not graph outputs, nothing a
kept ATen op could return a view of) from one call to the next, and matmul externs write into theirs
(`aten.addmm.out`...): on CPU each fresh multi-megabyte tensor is fresh pages from the kernel, and the page
faults of first touching them are a large share of a call.
A call that finds the set in use (another thread inside the same graph) allocates a private one.
"""
from __future__ import annotations

import math
import threading
import types
from typing import Callable

import sympy
import torch
import torch.utils._pytree as pytree

from ember import config
from ember.ir import ExternBuffer, TensorArg, symbols
from ember.codegen.schedule import FusedGroup, Schedule, lifetimes
from ember.runtime import native_guards
from ember.runtime.artifacts import Bound


def fast_unflatten(spec: pytree.TreeSpec) -> Callable[[list], object]:
    """`lambda leaves: tree_unflatten(leaves, spec)`, without pytree's walk for a flat list or tuple of leaves
    (most graphs' outputs; the walk costs on every call)."""
    if spec.type in (list, tuple):
        kids = spec.children() if hasattr(spec, "children") else spec.children_specs
        if all(k.is_leaf() for k in kids):
            return list if spec.type is list else tuple
    return lambda leaves: pytree.tree_unflatten(leaves, spec)


_data_ptr = torch.Tensor.data_ptr


def _overlapping(size, stride) -> bool:
    """Whether a layout has elements sharing memory (an expanded dim: stride 0 over more than one element)."""
    # (symbolic sizes at the example's values: an expanded dim's stride is 0 at every size)
    dims = sorted((abs(symbols.hint(st)), symbols.hint(n)) for n, st in zip(size, stride) if symbols.hint(n) > 1)
    reach = 0   # one past the furthest offset the dims before reach
    for st, n in dims:
        if st <= reach:
            return True
        reach += (n - 1) * st
    return False


def _restride(t: torch.Tensor, stride) -> torch.Tensor:
    out = torch.empty_strided(t.shape, stride, dtype=t.dtype, device=t.device)
    out.copy_(t)
    return out


class _LoggedFallback:
    """The graph run as it is, for a call the compiled code was not built for; the first such call of each
    graph is logged with the input that differed (EMBER_LOGS=fallbacks)."""

    def __init__(self, fallback: Callable, inputs: list, check_inputs: bool):
        self.fallback, self.inputs, self.check_inputs, self.calls = fallback, inputs, check_inputs, 0

    def ember_saved(self) -> tuple:
        """Saved (ember.runtime.artifacts) with the inputs' layouts only, and the fallback its loader supplies."""
        layouts = [None if b is None else types.SimpleNamespace(name=b.name, size=b.size, stride=b.stride,
                                                                 dtype=b.dtype) for b in self.inputs]
        return (_LoggedFallback, (Bound("_fallback"), layouts, self.check_inputs))

    def __call__(self, args: list):
        self.calls += 1
        if self.calls == 1:
            from ember.tools.logs import get_logger
            get_logger("fallbacks").warning("a compiled graph ran eagerly for a call: %s", self.why(args))
        return self.fallback(args)

    def why(self, args: list) -> str:
        for i, (b, a) in enumerate(zip(self.inputs, args)):
            if b is None:   # a size
                continue
            want = (symbols.ints(b.size), symbols.ints(b.stride), b.dtype)
            if not isinstance(a, torch.Tensor):
                return f"input {i} ({b.name}) is a {type(a).__name__}, compiled for a tensor"
            got = (tuple(a.shape), a.stride(), a.dtype)
            if self.check_inputs and not _matches(got, want):
                return f"input {i} ({b.name}) is (shape, stride, dtype) {got}, compiled for {want}"
        return "an input written in place shares memory with another input"


def _matches(got: tuple, want: tuple) -> bool:
    """Whether (shape, stride, dtype) matches a compiled layout, whose symbolic sizes match any value."""
    return got[2] == want[2] and all(len(g) == len(w) and all(not isinstance(y, int) or x == y for x, y in zip(g, w))
                                     for g, w in zip(got[:2], want[:2]))


class _Overlap:
    """`overlap(args)`: whether the memory of an input in `written` overlaps another input's. The inputs' layouts
    are fixed (checked or guarded), so each one's byte range follows from its address; the addresses of the
    last call that passed are remembered (an optimizer passes the same tensors every step): only pairs with an
    input whose address changed since are checked again (a fresh step-counter pack each call: a few pairs, not
    all written inputs against all inputs).

    A symbolic graph's extents are Python over its size symbols (`extents` holds strings for those, `sizes` the
    symbols' names): the host program passes the call's sizes, `overlap(args, sizes)`, and the extents are
    computed again only when they differ from the last call's (a loop of one size pays a tuple compare)."""

    def __init__(self, written: tuple, extents: list, sizes: tuple = ()):
        self.written, self.extents, self.sizes = written, extents, sizes
        self.is_written = [False] * len(extents)
        for i in written:
            self.is_written[i] = True
        self.extents_at = eval(f"lambda {', '.join(sizes)}: [{', '.join(map(str, extents))}]") if sizes else None
        # (the sizes, the extents at them, the addresses of the last call that passed): one object, replaced whole
        self.state = ((), extents, None)

    def ember_saved(self) -> tuple:   # (ember.runtime.artifacts: without the last call's addresses)
        return (_Overlap, (self.written, self.extents, self.sizes))

    def __call__(self, args: list, sizes: tuple = ()) -> bool:
        native = native_guards.EXTENSION.module   # once loaded (an Adam step over densenet121 passes 1,456 tensors)
        ptrs = native.data_ptrs(tuple(args)) if native is not None else None
        if ptrs is None:
            ptrs = tuple(map(_data_ptr, args))   # (map over the C method: faster than a comprehension)
        seen, ext, last = self.state
        if sizes != seen:   # other sizes: other extents, every pair checked again
            ext, last = self.extents_at(*sizes), None
        elif ptrs == last:
            return False
        changed = self.written if last is None else [k for k, (a, b) in enumerate(zip(ptrs, last)) if a != b]
        if len(changed) * len(self.written) > 8 * len(ptrs):
            # many moved (an optimizer's fresh gradients every step: hundreds x thousands of pairs): one sweep over
            # all inputs by address instead
            if self._sweep_overlaps(ptrs, ext):
                return True
            self.state = (sizes, ext, ptrs)
            return False
        for i in changed:
            lo, hi = ptrs[i], ptrs[i] + ext[i]
            if lo >= hi:
                continue
            if self.is_written[i]:     # against every other input
                if any(j != i and e and p < hi and lo < p + e for j, (p, e) in enumerate(zip(ptrs, ext))):
                    return True
            elif any(j != i and ext[j] and ptrs[j] < hi and lo < ptrs[j] + ext[j] for j in self.written):
                return True
        self.state = (sizes, ext, ptrs)
        return False

    def _sweep_overlaps(self, ptrs: list, ext: list) -> bool:
        """Whether some input in `written` overlaps another input: in address order, an input overlaps one
        before it iff it starts below the highest end seen so far (of any input if it is written, else of the
        written ones)."""
        end_any = end_written = -1
        for lo, i in sorted((p, i) for i, p in enumerate(ptrs) if ext[i]):
            if lo < (end_any if self.is_written[i] else end_written):
                return True
            hi = lo + ext[i]
            end_any = max(end_any, hi)
            if self.is_written[i]:
                end_written = max(end_written, hi)
        return False


def buffer_layout(b) -> tuple:
    """(size, stride, dtype) of a buffer: what a dead buffer must match to be reused (symbolic sizes: equal at
    every size)."""
    return symbols.ints(b.size), symbols.ints(b.stride), b.dtype


def tuple_code(xs) -> str:
    """Python for a tuple of sizes: a static one as its repr (as it always printed), symbolic ones over the symbols'
    names (the host program's locals)."""
    xs = symbols.ints(xs)
    if all(isinstance(x, int) for x in xs):
        return repr(xs)
    return "(" + ", ".join(symbols.python_code(x) for x in xs) + ("," if len(xs) == 1 else "") + ")"


def _extent(b):
    """Bytes between the first and one past the last element of an input buffer: an int, or a symbolic graph's
    size expression (symbolic sizes are at least 2 and strides never negative, docs/dynamic.md)."""
    size, stride = symbols.ints(b.size), symbols.ints(b.stride)
    if any(n == 0 for n in size):
        return 0
    e = (sum((n - 1) * (abs(st) if isinstance(st, int) else st) for n, st in zip(size, stride)) + 1) * b.dtype.itemsize
    return e if isinstance(e, int) else symbols.ints([e])[0]


# extern ops that write into a given buffer through their `out=` overload (one output, no views)
OUT_VARIANTS = {torch.ops.aten.mm.default: torch.ops.aten.mm.out, torch.ops.aten.addmm.default: torch.ops.aten.addmm.out,
                torch.ops.aten.bmm.default: torch.ops.aten.bmm.out,
                torch.ops.aten.baddbmm.default: torch.ops.aten.baddbmm.out}


def _mkldnn(name: str, overload: str):
    """torch.ops.mkldnn.<name>.<overload>, or None where this torch lacks it."""
    try:
        return getattr(getattr(torch.ops.mkldnn, name), overload)
    except (AttributeError, RuntimeError):
        return None


# a convolution with a residual add post-op, and its form that accumulates into the residual's memory: oneDNN's
# sum post-op writes into the buffer the convolution's result would be added from, where the binary post-op
# reads it and writes a freshly allocated result (the in-place form is the faster, also than eager's
# convolution + add_ + relu_)
CONV_ADD = _mkldnn("_convolution_pointwise", "binary")
CONV_ADD_INPLACE = _mkldnn("_convolution_pointwise_", "binary")


# ATen ops a host program calls through their torch.* binding instead of the OpOverload: the binding's argument
# parser is unboxed and cheaper per call than `OpOverload.__call__` (a model calls dozens of convolutions a
# step). The schemas are the same
# (`torch.convolution` is `aten::convolution`), so positional arguments and keywords carry over; `.out`
# overloads take `out=` in the binding too.
_BOUND_NAMES = ("convolution", "mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention",
                "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                "_scaled_dot_product_flash_attention_for_cpu")
BOUND_OPS = {getattr(getattr(torch.ops.aten, n), o): getattr(torch._C._VariableFunctions, n)
             for n in _BOUND_NAMES if hasattr(torch.ops.aten, n) and hasattr(torch._C._VariableFunctions, n)
             for o in ("default", "out") if o in getattr(torch.ops.aten, n).overloads()}


class Wrapper:
    def __init__(self, sched: Schedule):
        self.sched = sched
        self.lines: list[str] = []
        self.globals: dict = {"torch": torch, "_empty": torch.empty_strided, "_restride": _restride}

    def const(self, v) -> str:
        if v is None or isinstance(v, (bool, str)) or (isinstance(v, int)) or \
                (isinstance(v, float) and math.isfinite(v)):
            return repr(v)
        if isinstance(v, sympy.Basic) and v.is_integer:   # a size computed from the symbols
            return symbols.python_code(v)
        name = f"_c{len(self.globals)}"
        self.globals[name] = v
        return name

    def tensor(self, a: TensorArg) -> str:
        buf = self.sched.buffers[a.buffer]
        if not symbols.HINTS:   # a static graph
            same = tuple(a.size) == tuple(int(s) for s in buf.size) and \
                tuple(a.stride) == tuple(int(s) for s in buf.stride) and a.offset == int(buf.offset)
        else:
            same = len(a.size) == len(buf.size) and all(symbols.same(x, y) for x, y in zip(
                (*a.size, *a.stride, a.offset), (*buf.size, *buf.stride, buf.offset)))
        if same:
            return a.buffer
        return f"{a.buffer}.as_strided({tuple_code(a.size)}, {tuple_code(a.stride)}, {a.buffer}.storage_offset() + " \
            f"{symbols.python_code(a.offset)})"

    def arg(self, a) -> str:
        if isinstance(a, TensorArg):
            return self.tensor(a)
        if isinstance(a, (list, tuple)):
            inner = ", ".join(self.arg(x) for x in a)
            return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
        return self.const(a)


CONV_RESULTS = {t for t in (torch.ops.aten.convolution.default, _mkldnn("_convolution_pointwise", "default"), CONV_ADD)
                if t is not None}


def _residual_donor(w: "Wrapper", it, j: int, o, last: dict, pinned: set, ours: set, conv_results: set):
    """The buffer a convolution-with-residual-add call (CONV_ADD) may accumulate into, or None: the residual is a
    whole buffer of the result's layout that this call reads last, made in this call (a kernel's buffer or a
    convolution's fresh result: no input, no view of another), read by no other argument, and the result is
    no graph output (it may take a buffer kept across calls)."""
    if not config.ACCUMULATE_RESIDUALS or CONV_ADD is None or CONV_ADD_INPLACE is None or it.target is not CONV_ADD or it.fallback or it.kwargs \
            or o is None or o.name != it.name or o.name in pinned or len(it.outputs) != 1:
        return None
    a = it.args[1]
    if not isinstance(a, TensorArg) or w.tensor(a) != a.buffer:
        return None
    r = a.buffer
    if last.get(r) != j or r in pinned or not (r in ours or r in conv_results):
        return None
    if buffer_layout(w.sched.buffers[r]) != buffer_layout(o):
        return None
    if any(isinstance(x, TensorArg) and x.buffer == r for k, x in enumerate(it.args) if k != 1):
        return None
    return r


def python_wrapper(sched: Schedule, kernel_call: Callable[[FusedGroup], str], extra_globals: dict,
                   check_inputs: bool = True, persistent: bool = False,
                   consumed_outputs: frozenset = frozenset()) -> Callable:
    """Build `call(args) -> outputs`; returns the function (its source is `call.source`). check_inputs=False:
    the caller guarantees the inputs' types, shapes, strides and dtypes (the frontend's guards did check them).
    persistent: buffers private to a call are kept for the next call (see the module docstring), and so are
    the outputs at `consumed_outputs` (indices), which the caller reads before it calls again (host_scalars:
    the values it sends to the device, a training step's ~1,100 scalars allocated on every call)."""
    w = Wrapper(sched)
    w.globals.update(extra_globals)
    w.globals["_Tensor"] = torch.Tensor  # an input that is None (an unused gradient) runs the graph eagerly
    low = sched.lowered
    w.globals.update(low.constants)  # tensors the graph holds (get_attr): bound by name
    L = w.lines
    L.append("def call(args):")
    names = [b.name if b is not None else str(low.symbols[i]) for i, b in enumerate(low.inputs)]
    if names:
        L.append(f"    {', '.join(names)}, = args")
    L += [f"    {line}" for line in _derived_sizes(low)]
    # An input with the compiled shape and dtype but other strides is copied into the compiled layout: a
    # backward's saved tensor may come out of the compiled forward dense where the trace saw a view, and
    # running eagerly on every call would be the price otherwise. Not for inputs written in place or returned.
    kept_layout = set(sched.inplace.values()) | {o.buffer for o in low.outputs if isinstance(o, TensorArg)}
    tensors = [b for b in low.inputs if b is not None]
    restrided = [b for b in tensors if b.name not in kept_layout] if check_inputs else []
    checks = [f"not isinstance({b.name}, _Tensor) or {b.name}.shape != {tuple_code(b.size)} or "
              f"{b.name}.dtype != {w.const(b.dtype)}" +
              (f" or {b.name}.stride() != {tuple_code(b.stride)}" if b.name in kept_layout else "")
              for b in tensors] if check_inputs else []
    if sched.inplace:
        # an input written in place must not share memory with another input (then the kernels would read
        # values already overwritten): such a call runs the functional graph, whose results are copied back
        # (a symbolic graph's: of its tensor inputs, at the call's sizes)
        tensor_names = [b.name for b in tensors]
        written = sorted({tensor_names.index(d) for d in sched.inplace.values()})
        extents = [_extent(b) for b in tensors]
        sizes = sorted({str(x) for e in extents for x in symbols.free_symbols(e)})
        w.globals["_overlap"] = _Overlap(tuple(written), [e if isinstance(e, int) else symbols.python_code(e)
                                                          for e in extents], tuple(sizes))
        checks.append("_overlap(args)" if len(tensors) == len(low.inputs) else
                      f"_overlap(({', '.join(tensor_names)},), ({', '.join(sizes)}{',' if sizes else ''}))")
    if checks:
        w.globals["_fallback"] = _LoggedFallback(w.globals["_fallback"], low.inputs, check_inputs)
        L.append(f"    if {' or '.join(checks)}:")
        L.append("        return _fallback(args)")
    for b in restrided:
        stride = tuple_code(b.stride)
        if _overlapping(b.size, b.stride):
            # compiled for an expanded input (elements sharing memory): a tensor of another layout cannot be
            # copied into that one, and its values need not repeat as the compiled code assumes
            L.append(f"    if {b.name}.stride() != {stride}: return _fallback(args)")
        else:
            L.append(f"    if {b.name}.stride() != {stride}: {b.name} = _restride({b.name}, {stride})")

    last, pinned = lifetimes(sched)
    kept_outputs: set = set()
    if persistent and consumed_outputs:
        # whole buffers only the caller's gather reads: not also returned, nor seen by an ATen op (a view of it)
        outs = [(i in consumed_outputs and o.offset == 0, o.buffer) for i, o in enumerate(low.outputs)
                if isinstance(o, TensorArg)]
        seen_by_aten = set().union(*(it.inputs for it in sched.items if isinstance(it, ExternBuffer)))
        kept_outputs = {b for ok, b in outs if ok} - {b for ok, b in outs if not ok} - seen_by_aten
    free: dict = {}
    ours: set = set()
    library: set = set()  # results that library calls allocated
    conv_results: set = set()  # of those, fresh tensors of convolutions (no views)
    slots: list = []  # persistent: (size, stride, dtype) of each kept buffer, allocated by _new_slots()
    body: list[str] = []

    def alloc(b, indent="    "):
        key = buffer_layout(b)
        # pinned buffers may be (views of) what the call returns
        keep = persistent and (b.name not in pinned or b.name in kept_outputs)
        if free.get((key, keep)):
            body.append(f"{indent}{b.name} = {free[(key, keep)].pop()}  # reuses a dead buffer")
        elif keep:
            body.append(f"{indent}{b.name} = _S[{len(slots)}]")
            slots.append(key)
        else:
            body.append(f"{indent}{b.name} = _empty({tuple_code(key[0])}, {tuple_code(key[1])}, dtype={w.const(b.dtype)})")
        ours.add(b.name)

    for j, it in enumerate(sched.items):
        if isinstance(it, FusedGroup):
            released = []
            for m in it.members:
                if m.local:
                    continue
                b = m.buf
                if b.name in sched.takes_over:  # stored over an input read here for the last time: its memory
                    r = m.dest                  # passes to the result (freed or reused when the result dies)
                    body.append(f"    {b.name} = {r}  # overwrites {r}")
                    if r in library:
                        released.append(r)
                    for owner in (ours, library, conv_results):
                        if r in owner:
                            owner.discard(r)
                            owner.add(b.name)
                    continue
                if m.dest:  # written in place into a graph input (schedule._write_in_place)
                    body.append(f"    {b.name} = {m.dest}  # updated in place")
                    continue
                alloc(b)
            if not symbols.is_static(it.numel) or it.numel > 0:
                body.append(f"    {kernel_call(it)}")
            if released:   # the name would keep the memory from the allocator after the result dies
                body.append(f"    del {', '.join(released)}")
        else:
            args = ", ".join([w.arg(a) for a in it.args] + [f"{k}={w.arg(v)}" for k, v in it.kwargs.items()])
            o = it.outputs[0] if len(it.outputs) == 1 else None
            donor = _residual_donor(w, it, j, o, last, pinned, ours, conv_results)
            if donor is not None:
                # the result overwrites the residual (dead after this call) in place: the name takes over its
                # memory, freed or kept as the residual's would have been
                swapped = ", ".join([w.arg(it.args[1]), w.arg(it.args[0])] + [w.arg(a) for a in it.args[2:]])
                body.append(f"    {o.name} = {w.const(CONV_ADD_INPLACE)}({swapped})  # accumulates into {donor}")
                if donor in library:
                    body.append(f"    del {donor}")  # its memory lives on as the result's
                for owner in (ours, library):
                    if donor in owner:
                        owner.discard(donor)
                        owner.add(o.name)
                conv_results.add(o.name)
            elif persistent and it.target in OUT_VARIANTS and not it.fallback and o is not None \
                    and o.name == it.name and o.name not in pinned:
                alloc(o)  # the library call writes into a kept buffer
                out_op = OUT_VARIANTS[it.target]
                body.append(f"    {w.const(BOUND_OPS.get(out_op, out_op))}({args}, out={o.name})")
            else:
                body.append(f"    {it.name} = {w.const(BOUND_OPS.get(it.target, it.target))}({args})")
                for i, o in enumerate(it.outputs):
                    if o is None:
                        continue
                    if o.name != it.name:
                        body.append(f"    {o.name} = {it.name}[{i}]")
                    body.append(f"    if {o.name} is not None and {o.name}.stride() != {tuple_code(o.stride)}: "
                                f"{o.name} = _restride({o.name}, {tuple_code(o.stride)})")
                    library.add(o.name)
                    if it.target in CONV_RESULTS and len(it.outputs) == 1:
                        conv_results.add(o.name)
                if len(it.outputs) > 1 and all(o is None or o.name != it.name for o in it.outputs):
                    body.append(f"    del {it.name}")  # the result tuple would keep every output alive
        dead = []
        for r, lj in last.items():
            if lj == j and r in ours and r not in pinned:
                free.setdefault((buffer_layout(sched.buffers[r]), persistent), []).append(r)
            elif lj == j and r in library and r not in pinned:
                dead.append(r)
        if dead:
            # a library result (a convolution's output) is freed after its last reader, so the allocator hands
            # its memory to the next result: held to the end of the call, all of them would be fresh pages from
            # the kernel on every call
            body.append(f"    del {', '.join(dead)}")
    outs = [w.arg(o) if isinstance(o, TensorArg) else w.const(o) for o in low.outputs]
    body.append(f"    return [{', '.join(outs)}]")
    sizes = sorted({str(x) for key in slots for x in (*key[0], *key[1]) if not isinstance(x, int)
                    for x in symbols.free_symbols(x)})
    if slots and sizes:
        # symbolic sizes: the kept set serves the sizes of the call that made it; a call of other sizes makes a new
        # one (kept in its place)
        make = ["def _new_slots(" + ", ".join(sizes) + "):", "    return ["] + \
            [f"        _empty({tuple_code(size)}, {tuple_code(stride)}, dtype={w.const(dtype)})," for size, stride, dtype in slots] + \
            ["    ]"]
        L[:0] = make   # (defined by the program's own source: a saved program defines it again when loaded)
        key = "(" + ", ".join(sizes) + ",)"
        w.globals.update(_slots=[None, None], _lock=threading.Lock())
        L += ["    _mine = _lock.acquire(False)",
              "    try:",
              f"        _k = {key}",
              "        if _mine and _slots[0] == _k:",
              "            _S = _slots[1]",
              "        else:",
              f"            _S = _new_slots({', '.join(sizes)})",
              "            if _mine:",
              "                _slots[:] = [_k, _S]"]
        L += ["    " + line for line in body]
        L += ["    finally:", "        if _mine:", "            _lock.release()"]
    elif slots:
        # one set of kept buffers, used by one call at a time (the C++ kernels release the GIL); a call that
        # finds it taken gets a private set
        w.globals.update(_slots=[], _lock=threading.Lock(), _new_slots=lambda: [
            torch.empty_strided(size, stride, dtype=dtype) for size, stride, dtype in slots])
        L += ["    _mine = _lock.acquire(False)",
              "    try:",
              "        _S = _slots if _mine else _new_slots()",
              "        if not _S:",
              "            _S.extend(_new_slots())"]
        L += ["    " + line for line in body]
        L += ["    finally:", "        if _mine:", "            _lock.release()"]
    else:
        L += body
    src = "\n".join(L) + "\n"
    ns = dict(w.globals)
    exec(compile(src, "<ember wrapper>", "exec"), ns)
    call = ns["call"]
    call.source = src
    call.namespace = ns
    return call


# names the host program's loader binds anew (kernels, error flag, fallback) or that hold one call's state
_BOUND = ("__builtins__", "call", "_errp", "_check_err")


def saved_namespace(call: Callable, kernels: list) -> dict:
    """What `restored_wrapper` needs besides the program's source and what its loader binds: the constants
    and helpers of `call.namespace`, the kept buffers empty, a fresh lock."""
    skip = set(_BOUND) | {k[0] for k in kernels}
    out = {}
    for k, v in call.namespace.items():
        if k in skip or k == "_fallback" and not isinstance(v, _LoggedFallback):
            continue
        if k == "_slots":   # (symbolic: [sizes, buffers]; static: the buffers)
            v = [None, None] if len(v) == 2 and not isinstance(v[0], torch.Tensor) else []
        elif k == "_lock":
            v = Bound("_lock")
        elif isinstance(v, types.FunctionType) and v.__code__.co_filename == "<ember wrapper>":
            continue   # (defined by the source)
        out[k] = v
    return out


def restored_wrapper(program: str, namespace: dict, bound: dict) -> Callable:
    """The host program `python_wrapper` made, from its saved source and `saved_namespace`, with the loader's
    kernels, error flag and fallback (`bound`)."""
    ns = {**bound, **namespace}
    for k, v in ns.items():
        if isinstance(v, Bound) and v.name == "_lock":
            ns[k] = threading.Lock()
        elif isinstance(v, _LoggedFallback) and isinstance(v.fallback, Bound):
            v.fallback = bound[v.fallback.name]
    exec(compile(program, "<ember wrapper>", "exec"), ns)
    call = ns["call"]
    call.source, call.namespace = program, ns
    return call


def _derived_sizes(low) -> list[str]:
    """Python binding each size symbol the code uses but no input passes (docs/dynamic.md passes every free symbol;
    a graph may also take a symbol only in a tensor's size) to that tensor's size."""
    given = {str(v) for v in low.symbols.values()}
    out = []
    for b in low.inputs:
        if b is None:
            continue
        for d, n in enumerate(b.size):
            if not isinstance(n, int) and getattr(n, "is_Symbol", False) and str(n) not in given:
                out.append(f"{n} = {b.name}.shape[{d}]")
                given.add(str(n))
    return out
