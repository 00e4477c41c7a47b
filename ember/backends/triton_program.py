"""A compiled Triton graph at run time: its kernels' module, their launchers, its host program; and its saved form.

triton_backend.compile_schedule makes one from a schedule it printed; a saved program (ember.load_cache,
ember.export) makes one from `saved_form`'s record without the code generator and without a Triton compile: the
kernels' module is imported from its saved source (defining a @triton.jit function compiles nothing), and each
kernel's binary comes from the file as Triton's own cache entry (`TritonBinary`: the metadata, IRs and cubin
Triton wrote for it), put back into Triton's cache directory and loaded for ember's launcher (cuda_launch)
straight from it. A kernel that launcher does not fit (or a call with a misaligned pointer) goes through Triton's
launch path, which finds the same entry in its cache: a cache hit, not a compile. Under Triton's interpreter
there are no binaries: the sources and the host program alone.
"""
from __future__ import annotations

import contextlib
import dataclasses
import pathlib
from typing import Callable

import torch

from ember.codegen import wrapper
from ember.runtime import cuda_launch, triton_launch
from ember.runtime.triton_launch import Launcher, SizedLauncher, load_module
from ember.tools.logs import get_logger

log = get_logger("saved")
STATS = {"restored_graphs": 0, "restored_kernels": 0}   # for tests and benchmarks


@dataclasses.dataclass(frozen=True)
class KernelLaunch:
    """How the host program launches one fused group's kernel (its launcher is `_launch_<group>`)."""
    group: str
    kernel: str                # the @triton.jit function's name in the module
    meta: dict                 # its constexprs and launch options (block sizes, warps)
    grid: int | str            # programs: a number, or (a symbolic graph) the host program computes it
    n_sizes: int               # size arguments after the pointers (a symbolic graph's)
    n_params: int              # kernel parameters: pointers, sizes, a flagged pair's flag
    fixup: tuple | None = None   # a flagged pair's fixup kernel: (grid, meta); its flag is `_flag_<group>`


def launchers(mod, launches: list[KernelLaunch], device: torch.device) -> dict:
    """The launcher of every kernel (and a flagged pair's flag and fixup), by the names the host program calls."""
    out = {}
    for k in launches:
        fn = getattr(mod, k.kernel)
        if k.n_sizes or isinstance(k.grid, str):   # sizes as arguments, the number of programs from the host
            out[f"_launch_{k.group}"] = SizedLauncher(fn, k.meta, device, k.n_sizes)
        else:
            out[f"_launch_{k.group}"] = Launcher(fn, k.grid, k.meta, device)
        if k.fixup is not None:   # its flag and counter, zero between calls
            out[f"_flag_{k.group}"] = torch.zeros(2, dtype=torch.int32, device=device)
            out[f"_fixup_{k.group}"] = Launcher(getattr(mod, f"{k.kernel}_fixup"), *k.fixup, device)
    return out


class TritonBinary:
    """One compiled kernel as Triton's cache holds it: its key (`hash`) and the files of its cache entry
    (metadata JSON, IRs, cubin), by name."""

    def __init__(self, key: str, files: dict[str, bytes]):
        self.key, self.files = key, files

    @staticmethod
    def of(launcher) -> "TritonBinary | None":
        """The binary a launcher launches, read from Triton's cache entry; None if it has none (not compiled
        yet, or compiled by Triton's interpreter)."""
        compiled = getattr(launcher, "compiled", None) or getattr(launcher, "kernel", None)
        if isinstance(compiled, TritonBinary):
            return compiled
        group = getattr(compiled, "metadata_group", None)
        if not group or getattr(compiled, "hash", None) is None:
            return None
        try:
            files = {name: pathlib.Path(path).read_bytes() for name, path in group.items()}
        except OSError:   # (the cache entry is gone: that kernel compiles again after a load)
            return None
        return TritonBinary(compiled.hash, files)

    def load(self):
        """Triton's compiled kernel, from its cache entry put back into this machine's Triton cache (where an
        entry of that key is missing)."""
        from triton.compiler import CompiledKernel
        from triton.runtime.cache import get_cache_manager
        manager = get_cache_manager(self.key)
        group = {name: manager.get_file(name) or manager.put(data, name, binary=True)
                 for name, data in self.files.items()}
        manager.put_group(next(name for name in group if name.endswith(".json")), group)
        return CompiledKernel(None, group, self.key)

    def __reduce__(self):
        return (TritonBinary, (self.key, self.files))


def saved_form(call: Callable, launches: list[KernelLaunch], device: torch.device, out_spec, gm) -> tuple:
    """What `restored_graph` makes the compiled graph again from: the kernels' source, the host program's source
    and namespace (wrapper.saved_namespace, without the launchers), the launches, each kernel's binary, the
    device, the outputs' tree spec and the ATen graph (the fallback of calls the program was not built for)."""
    ns = call.namespace
    binaries = {k.group: (TritonBinary.of(ns[f"_launch_{k.group}"]), TritonBinary.of(ns.get(f"_fixup_{k.group}")))
                for k in launches}
    bound = [(name,) for name in ns if name.startswith(("_launch_", "_fixup_", "_flag_"))]
    return (restored_graph, (call.kernel_source, call.source, wrapper.saved_namespace(call, bound), launches,
                             binaries, device, out_spec, gm))


def runner(call: Callable, out_spec) -> Callable:
    """`run(*inputs)`: the host program on a call's inputs, its outputs in the graph's structure."""
    unflatten = wrapper.fast_unflatten(out_spec)

    def run(*args):
        return unflatten(call(list(args)))
    run.compiled = call
    return run


def restored_graph(kernel_source: str, program: str, namespace: dict, launches: list[KernelLaunch],
                   binaries: dict, device: torch.device, out_spec, gm) -> Callable:
    """The compiled graph `saved_form` describes: the kernels' module imported, each kernel loaded from its
    binary, the host program run from its source. A kernel without a binary (or one ember's launcher does not
    fit) launches through Triton, which compiles it, or finds it in its cache, at its first call."""
    mod = load_module(kernel_source)
    bound = launchers(mod, launches, device)
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        for k in launches:
            main, fixup = binaries.get(k.group, (None, None))
            for name, binary, n in ((f"_launch_{k.group}", main, k.n_params), (f"_fixup_{k.group}", fixup, k.n_params)):
                if binary is None or name not in bound:
                    continue
                loaded = cuda_launch.load(binary.load(), n, device) if triton_launch.FAST_LAUNCH else None
                if loaded is not None:
                    bound[name].preloaded(loaded)
                bound[name].compiled = binary   # (saved again as it came)
                STATS["restored_kernels"] += 1
    bound["_fallback"] = lambda args: gm(*args)
    triton_launch.use_native_pointers()
    call = wrapper.restored_wrapper(program, namespace, bound)
    call.kernel_source, call.launches = kernel_source, launches
    STATS["restored_graphs"] += 1
    run = runner(call, out_spec)
    run.ember_saved = lambda: (restored_graph, (kernel_source, program, namespace, launches, binaries, device,
                                                out_spec, gm))
    return run

