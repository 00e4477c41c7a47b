"""Triton compiles in worker processes: the parent's threads share one GIL.

Triton's front end (Python AST -> MLIR) and parts of its passes hold the GIL, so a pool of threads in the
compiling process spreads a graph's kernels poorly: resnet50's 25 kernels took 6.9 s on one thread and 3.1 s
on eight (H100 machine, 16 cores, 2026-11-25, bench/gpu_compile_pool.py). A worker process compiles a kernel
into Triton's on-disk cache (binary and C launcher); the parent's own compile of it is then a cache hit, so
what the parent runs, and every key Triton computes, stays exactly what it would be without workers.

Workers are started when the first CUDA graph is compiled (`Workers.warm`), so their start-up (importing
Triton, not torch) overlaps the parent's lowering and scheduling. They never touch the GPU: the device, stream
and target queries Triton makes are answered with the parent's values. A job that fails in a
worker (or a worker that dies) costs nothing but time: the parent then compiles that kernel itself.

    python ember/codegen/compile_worker.py <backend> <arch> <warp_size>    # one worker; jobs on stdin
(run as a file, not as part of the ember package: a worker imports Triton only)
"""
from __future__ import annotations

import atexit
import concurrent.futures
import json
import os
import queue
import subprocess
import sys
import threading


class Workers:
    """A fixed number of worker processes, each fed by one thread of the parent."""

    def __init__(self, count: int, target: tuple):
        self.count, self.target = count, target
        self.jobs: queue.Queue = queue.Queue()
        self.threads: list[threading.Thread] = []
        self.procs: list[subprocess.Popen] = []

    def warm(self) -> None:
        """Start the workers (once): from here on they import torch and Triton in the background."""
        if self.threads:
            return
        for _ in range(self.count):
            t = threading.Thread(target=self._serve, daemon=True, name="ember-compile-worker")
            t.start()
            self.threads.append(t)

    def compile(self, path: str, kernel: str, dtypes: list, meta: dict) -> concurrent.futures.Future:
        """Compile `kernel` of the module at `path` for these argument dtypes and constexprs into Triton's
        cache. The future's result is None once done; it raises if the worker failed."""
        self.warm()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self.jobs.put((json.dumps({"path": path, "kernel": kernel, "dtypes": [str(d).split(".")[-1] for d in dtypes],
                                   "meta": meta}), fut))
        return fut

    def _start(self) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), *map(str, self.target)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                text=True, bufsize=1)
        self.procs.append(proc)
        return proc

    def _serve(self) -> None:
        proc = None
        while True:
            job, fut = self.jobs.get()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                if proc is None or proc.poll() is not None:
                    proc = self._start()
                proc.stdin.write(job + "\n")
                proc.stdin.flush()
                answer = proc.stdout.readline()
                if answer.strip() != "ok":
                    raise RuntimeError(f"Triton compile worker: {answer.strip() or 'exited'}")
                fut.set_result(None)
            except Exception as e:   # the parent compiles this kernel itself
                fut.set_exception(e)

    def close(self) -> None:
        for p in self.procs:
            try:
                p.stdin.close()
                p.wait(timeout=2)
            except Exception:
                p.kill()


_WORKERS: Workers | None = None


def workers(device) -> Workers | None:
    """The process's workers for compiling kernels for `device` (a CUDA device), or None where workers would
    not help: EMBER_COMPILE_WORKERS=0, fewer than 4 CPUs, or Triton's interpreter."""
    global _WORKERS
    count = int(os.environ.get("EMBER_COMPILE_WORKERS", str(min(8, (os.cpu_count() or 1) // 2))))
    if count < 2 or os.environ.get("TRITON_INTERPRET") == "1" or device.type != "cuda":
        return None
    if _WORKERS is None:
        from triton.runtime.driver import driver
        t = driver.active.get_current_target()
        _WORKERS = Workers(count, (t.backend, t.arch, t.warp_size))
        atexit.register(_WORKERS.close)
    return _WORKERS


class _Dtype:
    """A torch dtype as Triton's warmup reads one (its class name, module and str), so a worker needs no torch."""

    def __init__(self, name: str):
        self.name = name

    def __str__(self) -> str:
        return f"torch.{self.name}"


_Dtype.__name__ = "dtype"
_Dtype.__module__ = "torch"


class _Device:
    """What Triton asks of its driver while compiling: the parent's device and target, and the launcher class
    (built here too: Triton caches it), without a CUDA context or torch (importing torch takes a worker
    seconds; Triton's own driver lookup imports it)."""

    def __init__(self, target):
        self.target = target
        if target.backend == "cuda":
            try:
                from triton.backends.nvidia.driver import CudaLauncher
                self.launcher_cls = CudaLauncher
            except Exception:
                pass

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self):
        return self.target


def _serve_jobs(backend: str, arch: str, warp_size: str) -> None:
    """A worker's loop: compile each job on stdin, answer one line on stdout ("ok" or the error)."""
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)   # whatever Triton prints goes to stderr, not into the answers
    import importlib.util

    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    device = _Device(GPUTarget(backend, int(arch) if arch.isdigit() else arch, int(warp_size)))
    driver.set_active(device)
    modules = {}
    for line in sys.stdin:
        try:
            job = json.loads(line)
            path = job["path"]
            if path not in modules:   # under the parent's module name: Triton keys nothing on it, but alike
                name = "ember_triton_" + os.path.basename(path)[:-3]
                spec = importlib.util.spec_from_file_location(name, path)
                mod = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(mod)
                modules[path] = mod
            fn = getattr(modules[path], job["kernel"])
            kernel = fn.warmup(*map(_Dtype, job["dtypes"]), grid=(1,), **job["meta"])
            if hasattr(device, "launcher_cls"):
                try:   # the C launcher stub (a gcc build, cached by Triton) that the parent's load would build
                    device.launcher_cls(kernel.src, kernel.metadata)
                except Exception:
                    pass
            answers.write("ok\n")
        except Exception as e:
            answers.write(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}\n")


if __name__ == "__main__":
    del sys.path[0]   # this file's folder, where ember's own triton.py would shadow Triton
    _serve_jobs(*sys.argv[1:4])
