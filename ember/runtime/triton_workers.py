"""Triton kernels compiled in worker processes.

Triton turns a kernel's Python AST into MLIR in Python, holding the GIL, so threads run that part of one kernel at
a time: in a training step of hundreds of kernels that is most of the cold compile. Workers are processes
running this file (they import Triton, not torch or ember). Each compiles a kernel into Triton's on-disk cache, and
the parent's own compile of it (`fn.warmup`) is then a cache hit: it reads the binary.

What to compile comes from Triton's `jit_cache_hook`. The parent calls `fn.warmup` with the hook set. The hook
receives the kernel's specialization serialized (argument types, constants, alignment attributes, options,
target: what Triton's `preload` takes) and returns True, so the parent compiles nothing. A worker rebuilds the
same source object and compiles it for that target, so the cache key is the parent's.

Anything a worker cannot do (a dead worker, an error, a Triton without the hook) returns False, and the parent
compiles the kernel itself.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time

WORKERS = max(1, min(16, os.cpu_count() or 1))
STATS = {"sent": 0, "compiled": 0, "worker_s": 0.0}   # kernels sent to and compiled by workers, their seconds
SLOWEST: list[tuple[float, str, str]] = []   # (seconds, kernel, module path) of the slowest compiles (benchmarks)
_log = logging.getLogger("ember.output_code")   # (stdlib only: a worker imports no ember)


# ---- the parent's side ---------------------------------------------------------------------------------------

_hook_lock = threading.Lock()
_stats_lock = threading.Lock()


def specialization(fn, args: list, meta: dict) -> str | None:
    """The serialized specialization `fn.warmup(*args, **meta)` would compile, compiling nothing; None when
    Triton has no hook for it or already holds the kernel in this process."""
    try:
        from triton import knobs
    except ImportError:
        return None
    found = []
    caller = threading.get_ident()

    def hook(**kw):
        if threading.get_ident() != caller:   # another thread's compile (not ours to skip)
            return None
        data = (kw.get("compile") or {}).get("specialization_data")
        if data is None:
            return None
        found.append(data)
        return True

    with _hook_lock:
        previous = knobs.runtime.jit_cache_hook
        knobs.runtime.jit_cache_hook = hook
        try:
            fn.warmup(*args, grid=(1,), **meta)
        finally:
            knobs.runtime.jit_cache_hook = previous
    if not found:
        return None
    data = json.loads(found[0])
    if "target" not in data:   # (Triton 3.6 serializes no target: the one the parent compiles for)
        from triton.runtime import driver
        data["target"] = driver.active.get_current_target().__dict__
    return json.dumps(data)


class _Worker:
    def __init__(self):
        # -P: the script's folder (ember/runtime) stays off sys.path, so its modules cannot shadow Triton's imports
        self.proc = subprocess.Popen([sys.executable, "-P", "-u", __file__], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def compile(self, path: str, name: str, spec: str) -> str:
        env = {k: v for k, v in os.environ.items() if k.startswith("TRITON_")}
        self.proc.stdin.write(json.dumps({"path": path, "name": name, "spec": spec, "env": env}) + "\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline()
        if not reply:
            raise RuntimeError(f"Triton worker exited ({self.proc.poll()})")
        reply = json.loads(reply)
        with _stats_lock:   # (threads reply concurrently)
            STATS["worker_s"] += reply["s"]
            SLOWEST.append((reply["s"], name, path))
            SLOWEST.sort(reverse=True)
            del SLOWEST[8:]
        return reply["error"]


_idle: queue.SimpleQueue = queue.SimpleQueue()
_started = 0
_start_lock = threading.Lock()


def _take() -> _Worker:
    global _started
    try:
        return _idle.get_nowait()
    except queue.Empty:
        pass
    with _start_lock:
        if _started < WORKERS:
            w = _Worker()
            _started += 1
            return w
    return _idle.get()


def compile_in_worker(path: str, name: str, spec: str) -> bool:
    """Compile kernel `name` of the module at `path` into Triton's cache in a worker process (blocks; threads
    call it concurrently, one worker each). False when the worker could not."""
    with _stats_lock:
        STATS["sent"] += 1
    try:
        w = _take()
    except OSError:
        return False
    try:
        error = w.compile(path, name, spec)
    except (OSError, ValueError, RuntimeError):
        w.proc.kill()   # its replacement starts at the next _take
        global _started
        with _start_lock:
            _started -= 1
        return False
    _idle.put(w)
    if error:
        _log.debug("a Triton worker could not compile %s (compiled here instead): %s", name, error)
        return False
    with _stats_lock:
        STATS["compiled"] += 1
    return True


# ---- the worker's side ---------------------------------------------------------------------------------------

def _tuples(v):
    return tuple(_tuples(x) for x in v) if isinstance(v, list) else v


def _compile_here(path: str, name: str, spec: str, modules: dict) -> None:
    import importlib.util

    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    if path not in modules:
        s = importlib.util.spec_from_file_location(f"ember_triton_worker_{len(modules)}", path)
        mod = importlib.util.module_from_spec(s)
        s.loader.exec_module(mod)
        modules[path] = mod
    fn = getattr(modules[path], name)
    d = json.loads(spec)

    def constant(v):   # as serialized by Triton's serialize_specialization_data
        if isinstance(v, dict):
            if "constexpr" in v:
                return tl.constexpr(_tuples(v["constexpr"]))
            raise ValueError(f"constant {v} is not one a worker rebuilds")
        if isinstance(v, str) and tl.dtype.is_dtype(v):
            return tl.dtype(v)
        return _tuples(v)

    constexprs = {tuple(k): constant(v) for k, v in zip(d["constant_keys"], d["constant_vals"])}
    attrs = {tuple(k): v for k, v in zip(d["attrs_keys"], d["attrs_vals"])}
    signature = {k: _tuples(v) for k, v in d["signature"].items()}
    options = {k: _tuples(v) for k, v in d["options"].items()}
    compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget(**d["target"]), options=options)


def _serve() -> None:
    modules: dict = {}
    for line in sys.stdin:
        req = json.loads(line)
        for k in [k for k in os.environ if k.startswith("TRITON_") and k not in req["env"]]:
            del os.environ[k]
        os.environ.update(req["env"])
        t0 = time.perf_counter()
        try:
            _compile_here(req["path"], req["name"], req["spec"], modules)
            error = ""
        except Exception as e:  # the parent compiles it itself, and reports any error then
            error = f"{type(e).__name__}: {e}" or "error"
        sys.stdout.write(json.dumps({"error": error, "s": time.perf_counter() - t0}) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    _serve()
