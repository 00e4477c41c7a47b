"""Generated Triton modules imported from the on-disk cache (with libdevice for Triton's interpreter), and
Launcher, which launches one compiled kernel with a fixed grid without Triton's per-call binder."""
from __future__ import annotations

import hashlib
import importlib.util
import math
import os
import sys
import types

import torch

from ember.runtime import cuda_launch, native_guards

# Launcher's own launch path (off in Triton's interpreter, whose kernels have no compiled launcher); read on import
FAST_LAUNCH = os.environ.get("TRITON_INTERPRET") != "1"
_data_ptr = torch.Tensor.data_ptr


class _InterpretedLibdevice:
    """libdevice for TRITON_INTERPRET=1 (kernels run on the CPU with numpy, so the printer is tested without a
    GPU): Triton's interpreter patches triton.language but not libdevice's externs."""
    NUMPY = {"log10": "log10", "tan": "tan", "asin": "arcsin", "acos": "arccos", "atan": "arctan",
             "sinh": "sinh", "cosh": "cosh", "tanh": "tanh", "asinh": "arcsinh", "acosh": "arccosh",
             "atanh": "arctanh", "log1p": "log1p", "expm1": "expm1", "nearbyint": "rint", "rint": "rint",
             "trunc": "trunc", "signbit": "signbit", "atan2": "arctan2", "copysign": "copysign", "hypot": "hypot",
             "pow": "power", "fmod": "fmod", "nextafter": "nextafter"}

    def __getattr__(self, name):
        import numpy as np
        import triton.language as tl
        from triton.runtime.interpreter import TensorHandle
        if name == "rsqrt":
            f = lambda x: (1 / np.sqrt(x)).astype(x.dtype)  # noqa: E731
        elif name == "fma":   # the product exact in float64, as a fused multiply-add's (_sincos's reduction;
            # libdevice's own fma flushes denormals, eager's kernels do not)
            f = lambda a, b, c: a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)  # noqa: E731
        elif name in ("erfc", "lgamma"):
            fn = math.erfc if name == "erfc" else math.lgamma
            f = lambda x: np.vectorize(fn, otypes=[x.dtype])(x)  # noqa: E731
        else:
            f = getattr(np, self.NUMPY[name])

        def call(*args):
            first = next(a for a in args if isinstance(a, tl.tensor))
            data = [a.handle.data if isinstance(a, tl.tensor) else np.asarray(a, first.handle.data.dtype)
                    for a in args]
            out = np.asarray(f(*data))
            if out.dtype == np.bool_:
                out = out.astype(np.int32)
                return tl.tensor(TensorHandle(out, tl.int32), first.type.with_element_ty(tl.int32)
                                 if first.type.is_block() else tl.int32)
            return tl.tensor(TensorHandle(out.astype(first.handle.data.dtype), first.handle.dtype), first.type)
        return call


def cache_dir() -> str:
    """The directory of generated Triton modules (and autotuning choices): $EMBER_CACHE_DIR/triton."""
    root = os.environ.get("EMBER_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "ember")
    d = os.path.join(root, "triton")
    os.makedirs(d, exist_ok=True)
    return d


def load_module(source: str) -> types.ModuleType:
    """Import generated source from the on-disk cache (Triton needs a real file to read kernels' source)."""
    key = hashlib.sha256(source.encode()).hexdigest()[:24]
    name = f"ember_triton_{key}"
    if name in sys.modules:
        return sys.modules[name]
    path = os.path.join(cache_dir(), f"{key}.py")
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(source)
        os.replace(tmp, path)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if os.environ.get("TRITON_INTERPRET") == "1":
        mod.libdevice = _InterpretedLibdevice()
        mod._rsqrt = mod.libdevice.rsqrt    # (the interpreter runs no inline PTX)
        mod._fma = mod.libdevice.fma
    sys.modules[name] = mod
    return mod


class Launcher:
    """Launches one compiled kernel with a fixed grid, skipping Triton's per-call binder.

    `kernel[grid](...)` re-derives the argument specialization and looks up the compiled kernel on every call,
    and a graph launches hundreds of kernels: that would be most of a step's host time. The first launch goes
    through Triton and keeps the CompiledKernel; later ones call its launcher directly, at less than half the
    cost. Triton specialized the pointers on 16-byte alignment, so a call whose pointers are not all aligned
    (a view at an odd offset) goes through Triton again.

    Pointers go to the launcher as integers, computed once for the alignment test: given a tensor, Triton's C
    launcher calls its data_ptr() and then asks the driver whether that address is device memory
    (cuPointerGetAttribute), a cost per argument. A launcher that refuses integers gets the tensors (`raw`
    False, found at the first call)."""

    def __init__(self, fn, grid: int, meta: dict, device: torch.device):
        self.fn, self.grid, self.meta = fn, grid, meta
        names = list(fn.arg_names)
        self.constexprs = tuple(meta[n] for n in names if n in meta)   # kernel parameters after the pointers
        self.device_index = device.index if device.index is not None or not FAST_LAUNCH else torch.cuda.current_device()
        self.kernel = None
        self.aligned_only = True
        self.raw: bool | None = None    # whether the launcher takes integer pointers (None: not tried yet)
        self.native = None   # ember's launcher and its first arguments (cuda_launch), when it loaded the kernel
        self.compiled = None   # Triton's compiled kernel this launches (a saved program ships its binary)

    def preloaded(self, kernel) -> None:
        """Launch `kernel` (compiled by warmup with every pointer 16-byte aligned) from the first call on."""
        self.compiled = kernel.compiled if isinstance(kernel, cuda_launch.Loaded) else kernel
        if isinstance(kernel, cuda_launch.Loaded):
            self.native = (kernel.launch, (kernel.function, self.grid, kernel.threads, kernel.shared, kernel.nulls,
                                           kernel.device))
        elif not (FAST_LAUNCH and hasattr(kernel, "packed_metadata")):
            return
        self.kernel, self.aligned_only = kernel, True

    def __call__(self, *args):
        k = self.kernel
        if k is not None:
            if self.native is not None:
                ptrs = _aligned_ptrs(args)
                if ptrs is not None:
                    launch, head = self.native
                    launch(*head, _raw_stream(self.device_index), *ptrs)
                    return
            ptrs = list(map(_data_ptr, args))
            if self.native is None and (not self.aligned_only or not any(p % 16 for p in ptrs)):
                try:
                    k.run(self.grid, 1, 1, _raw_stream(self.device_index), k.function, k.packed_metadata, None,
                          None, None, *(ptrs if self.raw is not False else args), *self.constexprs)
                except (TypeError, ValueError):
                    if self.raw is not None:
                        raise
                    self.raw = False    # this launcher takes tensors only: this call and the next ones
                    return self(*args)
                if self.raw is None:
                    self.raw = True
                return
        kernel = self.fn[(self.grid,)](*args, **self.meta)   # (Triton's binder: a pointer not 16-byte aligned)
        if FAST_LAUNCH and self.kernel is None and hasattr(kernel, "packed_metadata"):
            self.kernel = kernel
            self.aligned_only = not any(a.data_ptr() % 16 for a in args)


class SizedLauncher:
    """Launches a kernel of a symbolic graph (docs/dynamic.md): its last `n_sizes` arguments are size symbols
    (int64, which the kernel tells Triton not to specialize: one compiled kernel serves every size), and the
    number of programs comes with each call (the host program computes it from the sizes). The kernel compiled
    ahead (`preloaded`, for ember's launcher) takes every call whose pointers are 16-byte aligned; any other call,
    or every call without it, goes through Triton's binder."""

    def __init__(self, fn, meta: dict, device: torch.device, n_sizes: int):
        self.fn, self.meta, self.n = fn, meta, n_sizes
        self.device_index = device.index if device.index is not None or not FAST_LAUNCH else torch.cuda.current_device()
        self.native = None   # (launch, function, threads, shared, nulls, device) of cuda_launch.Loaded
        self.compiled = None   # Triton's compiled kernel this launches (a saved program ships its binary)

    def preloaded(self, kernel) -> None:
        self.compiled = kernel.compiled if isinstance(kernel, cuda_launch.Loaded) else kernel
        if isinstance(kernel, cuda_launch.Loaded) and FAST_LAUNCH:
            self.native = (kernel.launch, kernel.function, kernel.threads, kernel.shared, kernel.nulls, kernel.device)

    def __call__(self, grid: int, *args):
        if grid <= 0:
            return
        native = self.native
        if native is not None:
            ptrs = _aligned_ptrs(args[:len(args) - self.n])
            if ptrs is not None:
                launch, function, threads, shared, nulls, device = native
                launch(function, grid, threads, shared, nulls, device, _raw_stream(self.device_index), *ptrs,
                       *args[len(args) - self.n:])
                return
        self.fn[(grid,)](*args, **self.meta)


def _aligned_ptrs(args: tuple) -> tuple | None:
    """The arguments' addresses, or None when one is not 16-byte aligned. Replaced by native_guards'
    aligned_data_ptrs once that is loaded (use_native_pointers): one C++ call in place of a data_ptr() call
    and a test per argument, a large share of a small kernel's launch."""
    ptrs = tuple(map(_data_ptr, args))
    return None if any(p % 16 for p in ptrs) else ptrs


def use_native_pointers() -> None:
    """Launchers test alignment with native_guards' aligned_data_ptrs from now on, where the extension loaded."""
    global _aligned_ptrs
    native = native_guards.checker()
    if native is not None and hasattr(native, "aligned_data_ptrs"):
        _aligned_ptrs = native.aligned_data_ptrs


def _raw_stream(index: int) -> int:
    """The current CUDA stream of device `index`, as the integer a launcher takes."""
    return torch.cuda.current_stream(index).cuda_stream


if hasattr(torch._C, "_cuda_getCurrentRawStream"):  # what Triton itself calls: the same value, faster
    _raw_stream = torch._C._cuda_getCurrentRawStream  # noqa: F811

