"""The Triton backend: an ATen graph on CUDA tensors -> lowered, scheduled and printed (ember.codegen.triton)
-> a host program launching the kernels. All kernels of a graph are compiled concurrently on first use (threads,
and worker processes for many kernels); the source module is cached on disk by content hash and Triton caches
its binaries. A graph that also computes on CPU tensors is split (host_scalars)."""
from __future__ import annotations

import concurrent.futures
import functools
import os
import time
from typing import Callable

import sympy
import torch
import torch.utils._pytree as pytree

from ember.backends import cpp_backend, host_scalars, triton_program
from ember.backends.triton_program import KernelLaunch
from ember.codegen import lower, mm_template, schedule, wrapper
from ember.codegen.schedule import FusedGroup, Schedule
from ember.codegen.triton.heuristics import launch_meta
from ember.codegen.triton.kernels import FIXUP_META, generate, inline_locals
from ember.codegen.triton.passes import chunk_wide_groups, overwrite_dying_inputs, \
    registers_for_private_values, split_few_row_groups, split_symbolic_foreach
from ember.codegen.triton.printer import LIBDEVICE_OPS, PRELUDE
from ember.errors import CannotLower
from ember.ir import symbols
from ember.runtime import cuda_launch, triton_launch, triton_workers
from ember.runtime.triton_launch import FAST_LAUNCH, SizedLauncher, load_module
from ember.tools.logs import get_logger

code_log = get_logger("output_code")
fallback_log = get_logger("fallbacks")
SYMBOLIC = True   # compiles symbolic ATen graphs (docs/dynamic.md): size symbols as kernel arguments
STATS = {"graphs": 0, "kernels": 0, "eager_graphs": 0, "compile_s": 0.0}   # for tests and benchmarks

_COMPILE_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=max(8, triton_workers.WORKERS),
                                                      thread_name_prefix="ember-triton")
WORKERS_FROM = 4   # kernels in a graph from which they compile in worker processes (each costs a start-up)


def _precompile(mod, kernels: list, sched: Schedule, device: torch.device) -> list:
    """Compile and load every kernel now, concurrently, instead of one by one at first launch: Triton's passes
    and PTX assembly run outside the GIL, its Python frontend inside it, so a graph of many kernels compiles in
    worker processes (triton_workers) and only loads here. Loaded for ember's launcher (cuda_launch) where it
    fits: Triton's own launcher is a C stub built with gcc for each new argument signature, slow when built
    one by one at first launch. Argument dtypes stand in
    for tensors (Triton's warmup takes them). A kernel is compiled once per source, block sizes and argument
    dtypes: groups printing one source may launch it with other block sizes (a full-mask flat kernel's text
    does not hold its size: one compiled for 256-element blocks, launched on a grid counted in 128s, writes past
    its output). Returns, per entry of `kernels`, (the loaded kernel, its fixup's): cuda_launch.Loaded or
    Triton's compiled kernel, None where it did not load."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return [(None, None)] * len(kernels)
    t0 = time.perf_counter()
    if device.type == "cuda":
        cuda_launch.EXTENSION.get()   # (starts its build, once per machine, while Triton compiles)
    names = {name for _, name, *_ in kernels}
    hints = {str(s): v for s, v in symbols.HINTS.items()}   # a symbolic graph's size symbols: the example's values
    in_workers = mod.__file__ if device.type == "cuda" and len(names) >= WORKERS_FROM else None
    keys, wanted = [], {}
    for _, name, args, cfg, _grid in kernels:
        # (a size argument stands in as the example's value, which the kernel does not specialize on)
        dtypes = [sched.buffers[a].dtype if a not in hints else hints[a] for a in args] + \
            ([torch.int32] if "fixup" in cfg else [])
        keys.append((name, tuple(sorted(launch_meta(cfg).items())), tuple(dtypes)))
        wanted[keys[-1]] = (dtypes, cfg)
    jobs = {}
    # the longest sources first (the slowest to compile): one of them started last would be the pool's tail
    for key in sorted(wanted, key=lambda k: -len(getattr(getattr(mod, k[0]), "src", ""))):
        name, (dtypes, cfg) = key[0], wanted[key]
        jobs[key] = (_COMPILE_POOL.submit(_compile_and_load, getattr(mod, name), dtypes, launch_meta(cfg), device,
                                          in_workers),
                     _COMPILE_POOL.submit(_compile_and_load, getattr(mod, f"{name}_fixup"), dtypes, FIXUP_META,
                                          device, in_workers) if "fixup" in cfg else None)

    def result(job, name: str):
        try:
            kernel = job.result() if job is not None else None
        except Exception as e:  # compiled again (and any error raised) at the first launch
            code_log.debug("precompiling %s failed: %s: %s", name, type(e).__name__, e)
            return None
        return kernel if getattr(kernel, "function", None) is not None else None
    loaded = {key: (result(main, key[0]), result(fixup, f"{key[0]}_fixup")) for key, (main, fixup) in jobs.items()}
    STATS["compile_s"] += time.perf_counter() - t0
    code_log.debug("compiled %d Triton kernels in %.2fs", len(jobs), time.perf_counter() - t0)
    return [loaded[key] for key in keys]


def _compile_and_load(fn, dtypes: list, meta: dict, device: torch.device, module_path: str | None = None):
    """Triton's compiled kernel, loaded: for ember's launcher (cuda_launch.Loaded) where it fits, else Triton's.
    With `module_path`, a worker process compiles it first (triton_workers), and the warmup here reads it from
    Triton's cache."""
    if module_path is not None:
        spec = triton_workers.specialization(fn, dtypes, meta)
        if spec is not None:
            triton_workers.compile_in_worker(module_path, fn.fn.__name__, spec)
    kernel = fn.warmup(*dtypes, grid=(1,), **meta)
    if device.type == "cuda" and hasattr(kernel, "_init_handles"):
        with torch.cuda.device(device):   # the module loads into this device's context, from this thread
            loaded = cuda_launch.load(kernel, len(dtypes), device) if FAST_LAUNCH else None
            if loaded is not None:
                return loaded
            kernel._init_handles()
    return kernel


def compile_schedule(sched: Schedule, fallback: Callable, device: torch.device, check_inputs: bool = True) -> Callable:
    """The host program for a schedule on `device`: `call(list of inputs) -> list of outputs`."""
    source, kernels = generate(sched)
    mod = load_module(source)
    hints = {str(s): v for s, v in symbols.HINTS.items()}   # a symbolic graph's size symbols
    launches = [KernelLaunch(group.name, name, launch_meta(cfg), grid, sum(a in hints for a in args),
                             len(args) + ("fixup" in cfg), (cfg["fixup"], FIXUP_META) if "fixup" in cfg else None)
                for group, name, args, cfg, grid in kernels]
    launch = {group.name: (name, args, grid, "fixup" in cfg) for group, name, args, cfg, grid in kernels}
    globs = triton_program.launchers(mod, launches, device)
    for group, *_ in kernels:   # rows the schedule keeps local but a Triton tile cannot: one buffer each
        for b in inline_locals(group)[1]:
            buf = sched.buffers[b]
            if not all(symbols.is_static(x) for x in (*buf.size, *buf.stride)):
                raise NotImplementedError("a scratch row buffer of a symbolic size")
            globs[b] = torch.empty_strided(tuple(int(x) for x in buf.size), tuple(int(x) for x in buf.stride),
                                           dtype=buf.dtype, device=device)
    for (group, *_), (kernel, fixup) in zip(kernels, _precompile(mod, kernels, sched, device)):
        if kernel is not None:
            globs[f"_launch_{group.name}"].preloaded(kernel)
        if fixup is not None:
            globs[f"_fixup_{group.name}"].preloaded(fixup)

    def kernel_call(group: FusedGroup) -> str:
        if group.name not in launch:
            return "pass  # empty"
        name, args, grid, flagged = launch[group.name]
        if isinstance(globs[f"_launch_{group.name}"], SizedLauncher):   # its number of programs from the sizes
            return f"_launch_{group.name}({grid}, {', '.join(args)})  # {name}"
        if flagged:
            a = ", ".join(args + [f"_flag_{group.name}"])
            return f"_launch_{group.name}({a}); _fixup_{group.name}({a})  # {name}[({grid},)] and its fixup"
        return f"_launch_{group.name}({', '.join(args)})  # {name}[({grid},)]"

    globs["_fallback"] = fallback
    triton_launch.use_native_pointers()
    call = wrapper.python_wrapper(sched, kernel_call, globs, check_inputs)
    call.namespace["_empty"] = functools.partial(torch.empty_strided, device=device)
    call.kernel_source = source
    call.kernels = kernels
    call.launches = launches
    call.sched = sched
    if code_log.isEnabledFor(10):
        code_log.debug("triton kernels (%d):\n%s\nhost program:\n%s", len(kernels), source[len(PRELUDE):],
                       call.source)
    return call


def _device_of(gm: torch.fx.GraphModule, example_inputs: list) -> torch.device:
    """The device a graph's kernels run on: its first input's, or value's, off the CPU (a graph may pass CPU
    tensors through to library calls, its first input one); the CPU only under TRITON_INTERPRET."""
    values = [t for t in example_inputs if isinstance(t, torch.Tensor)] + \
        [v for n in gm.graph.nodes for v in pytree.tree_leaves(n.meta.get("val")) if isinstance(v, torch.Tensor)]
    return next((t.device for t in values if t.device.type not in ("cpu", "meta")),
                next((t.device for t in values), torch.device("cuda")))


def _no_kernel_reads_cpu(low, example_inputs: list) -> None:
    """Raise CannotLower where a generated kernel would read a CPU tensor (an input or constant the graph passes
    through to library calls, which take CPU arguments; a kernel cannot): that graph runs eagerly."""
    cpu = {b.name for b, t in zip(low.inputs, example_inputs) if b is not None and isinstance(t, torch.Tensor)
           and t.device.type == "cpu"} | {k for k, t in low.constants.items() if t.device.type == "cpu"}
    if not cpu:
        return
    for b in low.buffers:
        if isinstance(b, (schedule.Pointwise, schedule.Reduction)):
            idx = [sympy.Symbol(f"c{i}", integer=True) for i in range(len(b.size))]
            body = b.fn(idx) if isinstance(b, schedule.Pointwise) else \
                b.fn(idx, [sympy.Symbol(f"r{i}", integer=True) for i in range(len(b.rsize))])
            read = schedule.reads_of(body) & cpu
            if read:
                raise CannotLower(f"a kernel ({b.name}, from {', '.join(b.origins) or '?'}) would read the CPU "
                                  f"tensor {sorted(read)[0]}")


def compile_aten(gm: torch.fx.GraphModule, example_inputs: list, options: dict | None = None) -> Callable:
    """Compile a functional ATen-level fx graph (node.meta['val'] set) on CUDA tensors into Triton kernels.
    The same contract as ember.backends.cpp_backend.compile_aten."""
    t0 = time.perf_counter()
    host_scalars.fold_constants(gm)   # CPU values made from no input: computed once, the device given a copy
    devices = {v.device.type for n in gm.graph.nodes for v in pytree.tree_leaves(n.meta.get("val"))
               if isinstance(v, torch.Tensor)} | {t.device.type for t in example_inputs if isinstance(t, torch.Tensor)}
    devices.discard("meta")     # shape-only values some graphs carry
    if devices - {"cuda"} and not (os.environ.get("TRITON_INTERPRET") == "1" and devices == {"cpu"}) and \
            not host_scalars.cpu_values_pass_through(gm):
        # e.g. torch.optim's step counters, kept on the CPU unless capturable=True: the CPU values are computed
        # by the C++ backend and reach the kernels in one copy (host_scalars)
        if devices == {"cpu", "cuda"}:
            # under mode="reduce-overhead" the device part is replayed as a CUDA graph (cudagraphs.aot_compilers)
            graphed = (options or {}).get("cudagraphs.device_part")
            device_options = {k: v for k, v in (options or {}).items() if k != "cudagraphs.device_part"}

            def compile_device(g, ex):
                f = compile_aten(g, ex, device_options)
                return graphed(f, g) if graphed is not None else f
            split = host_scalars.compile_split(
                gm, example_inputs, lambda g, ex: cpp_backend.compile_aten(g, ex, options), compile_device)
            if not isinstance(split, str):
                return split
        why = f": {split}" if devices == {"cpu", "cuda"} else ""
        fallback_log.warning("graph runs eagerly (Triton backend): it mixes %s tensors with CUDA ones%s",
                             "/".join(sorted(devices - {"cuda"})), why)
        STATS["eager_graphs"] += 1
        return gm.forward
    symbolic = lower.is_symbolic(gm)
    try:
        with lower.lowering(symbolic):
            call, out_spec = _lower_and_print(gm, example_inputs, options or {}, symbolic)
    except CannotLower as e:
        fallback_log.warning("%s (Triton backend): %s", "symbolic graph runs as its ATen graph (every size)"
                             if symbolic else "graph runs eagerly", e)
        STATS["eager_graphs"] += 1
        return gm.forward
    except NotImplementedError as e:
        fallback_log.warning("graph runs eagerly (Triton backend): %s: %s", type(e).__name__, e)
        STATS["eager_graphs"] += 1
        return gm.forward
    # (any other error, a bug in ember, propagates: ember.tools.failsafe runs the captured graph eagerly)
    code_log.debug("graph %s lowered and printed in %.3fs", type(gm).__name__, time.perf_counter() - t0)
    STATS["graphs"] += 1
    STATS["kernels"] += len({name for _, name, *_ in call.kernels})

    run = triton_program.runner(call, out_spec)
    device = _device_of(gm, example_inputs)
    # (ember.save_cache: the kernels' source and binaries, the host program; loaded with no codegen or compile)
    run.ember_saved = lambda: triton_program.saved_form(call, call.launches, device, out_spec, gm)
    return run


def _lower_and_print(gm: torch.fx.GraphModule, example_inputs: list, options: dict, symbolic: bool):
    """(the host program, the outputs' tree spec) of an ATen graph on CUDA tensors (under LOWERING_LOCK).
    Symbolic graphs take no matmul templates (timed at one size)."""
    low, out_spec, _ = lower.lower(gm, example_inputs, target="gpu")
    mutations = gm.meta.get("ember_input_mutations")
    if os.environ.get("TRITON_INTERPRET") != "1":   # (there every kernel reads CPU tensors)
        _no_kernel_reads_cpu(low, example_inputs)
    sched = split_few_row_groups(schedule.schedule(low, mutations=mutations, across=True))
    schedule.write_in_place(sched, mutations)   # the split may have made more of them safe
    # after it: what it inlines must not be written
    schedule.recompute_scalars(sched, mutations, LIBDEVICE_OPS)
    sched = split_symbolic_foreach(chunk_wide_groups(sched))
    autotune = options.get("max_autotune") and not symbolic
    if not autotune:   # (the matmul templates print their epilogues' stores)
        registers_for_private_values(sched)
        overwrite_dying_inputs(sched)
    device = _device_of(gm, example_inputs)
    if autotune:
        sched = mm_template.fuse_mm_epilogues(sched, device, force=options.get("max_autotune.force"))
    return compile_schedule(sched, lambda args: gm(*args), device, not gm.meta.get("ember_guarded", False)), out_spec
