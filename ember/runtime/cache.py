"""On-disk kernel cache: generated sources are built once per content hash, by any process.

Layout: $EMBER_CACHE_DIR (default ~/.cache/ember)/<backend>/<hash>.<ext>. A build writes to a temporary
name and renames into place, so concurrent processes never load a half-written library.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import importlib.machinery
import importlib.util
import os
import pathlib
import subprocess
import sys
import tempfile
import threading
import types
from typing import Callable

from ember import config

_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1)),
                                              thread_name_prefix="ember-build")
# (not -fno-trapping-math: file-wide it slows convolution models' kernels on AVX-512 and AVX2; the kernels whose
# selects need it to vectorize carry it themselves, cpp.EMBER_NO_TRAPS)
CXXFLAGS = ["-O3", "-fopenmp", "-fPIC", "-shared", "-fwrapv", "-fno-math-errno", "-std=c++17"]
# config.CPU_ISA -> the compiler's target flags: the machine's own, or a named x86 target, so a machine with AVX-512
# can build and run (and the test suite check) the code an AVX2-only machine gets; "portable" leaves the
# compiler's default target (any x86-64, or another architecture)
ISA_FLAGS = {"native": ["-march=native"], "avx512": ["-march=skylake-avx512"], "avx2": ["-march=haswell"],
             "portable": []}


def cxxflags(shared: bool = True) -> list[str]:
    """The flags of a build for config.CPU_ISA (shared=False: a compile to an object or precompiled header)."""
    if config.CPU_ISA not in ISA_FLAGS:
        raise ValueError(f"EMBER_CPU_ISA={config.CPU_ISA!r}: expected one of {', '.join(ISA_FLAGS)}")
    return [f for f in CXXFLAGS if shared or f != "-shared"] + ISA_FLAGS[config.CPU_ISA]


class BuildError(RuntimeError):
    """The system compiler rejected generated code; the message names the source file to look at."""


def cache_dir(backend: str = "cpp") -> pathlib.Path:
    root = pathlib.Path(os.environ.get("EMBER_CACHE_DIR") or pathlib.Path.home() / ".cache" / "ember")
    d = root / backend
    d.mkdir(parents=True, exist_ok=True)
    return d


def source_key(source: str, flags: list[str] | None = None) -> str:
    flags = cxxflags() if flags is None else flags
    return hashlib.sha256((" ".join(flags) + "\n" + source).encode()).hexdigest()[:24]


def build_cpp(source: str) -> concurrent.futures.Future:
    """Future of the path of a shared library built from `source` (cached on disk by content hash)."""
    key = source_key(source)
    d = cache_dir("cpp")
    so, cpp = d / f"{key}.so", d / f"{key}.cpp"
    if so.exists():
        done = concurrent.futures.Future()
        done.set_result(so)
        return done
    return _POOL.submit(_build, source, cpp, so)


KERNEL_MARK = "\n\n// ember: next kernel\n"   # between the prelude and each kernel of a generated file
PART_CHARS = 40_000   # a file at least twice this long is compiled in parts, one process per core
# preludes that many generated files begin with (cpp.PRELUDE): precompiled (a g++ precompiled header) once
# per cache directory and flags, when a second file with one is built, then included by the later files.
# Parsing <cmath> and <algorithm> is most of a small graph's g++ time.
SHARED_PRELUDES: set[str] = set()
_PCH_SEEN: set[str] = set()   # shared preludes a file of this process began with
_PCH: dict[str, concurrent.futures.Future] = {}   # prelude -> its latest header build
_PCH_LOCK = threading.Lock()


def _precompiled(prelude: str) -> pathlib.Path | None:
    """The header holding a shared prelude in today's cache directory, its precompiled form beside it. None for
    another prelude, for a process's first file with it (a program of one graph pays for no precompiling beside
    its build), while it builds (started by a later file: files built meanwhile keep the prelude inline) and
    where it could not be built."""
    if prelude not in SHARED_PRELUDES:
        return None
    header = _pch_header(prelude)
    if _pch_exists(header):
        return header
    with _PCH_LOCK:
        if prelude not in _PCH_SEEN:
            _PCH_SEEN.add(prelude)
        elif prelude not in _PCH or (_PCH[prelude].done() and _PCH[prelude].exception() is None):
            # (a build done but no header here: the cache directory changed, a test's)
            _PCH[prelude] = _POOL.submit(_build_pch, prelude, header)
    return None


def _pch_header(prelude: str) -> pathlib.Path:
    return cache_dir("cpp") / f"prelude_{source_key(prelude, cxxflags(shared=False))}.h"


def _pch_exists(header: pathlib.Path) -> bool:
    return header.exists() and header.with_name(header.name + ".gch").exists()


def _build_pch(prelude: str, header: pathlib.Path) -> pathlib.Path:
    d, gch = header.parent, header.with_name(header.name + ".gch")
    fd, tmp = tempfile.mkstemp(suffix=".h", dir=d)
    os.close(fd)
    tmp_h, tmp_gch = pathlib.Path(tmp), pathlib.Path(tmp + ".gch")
    try:
        tmp_h.write_text(prelude)
        _run([os.environ.get("CXX", "g++"), *cxxflags(shared=False), "-x", "c++-header", str(tmp_h), "-o", str(tmp_gch)], tmp_h)
        os.replace(tmp_h, header)   # the header first: a .gch found beside no header is never looked for
        os.replace(tmp_gch, gch)
    finally:
        tmp_h.unlink(missing_ok=True)
        tmp_gch.unlink(missing_ok=True)
    return header


def _build(source: str, cpp: pathlib.Path, so: pathlib.Path) -> pathlib.Path:
    """g++ on the file; a large one (a CNN's inference graph: g++ is single-threaded) in parts, each the prelude
    plus a share of the kernels, compiled to objects side by side and linked into one library."""
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=so.parent)
    os.close(fd)
    # this build's own copy of the source: threads building one graph at once (each missing the cache) would write
    # the shared .cpp while another's g++ reads it, and a library short of kernels could win the rename
    final_cpp, cpp = cpp, pathlib.Path(tmp).with_suffix(".cpp")
    cpp.write_text(source)
    cxx = os.environ.get("CXX", "g++")
    prelude, *kernels = source.split(KERNEL_MARK)
    header = _precompiled(prelude) if kernels else None
    if header is not None:   # (the kept copy includes it too: the header lies beside it)
        prelude = f'#include "{header}"'
        cpp.write_text(KERNEL_MARK.join([prelude, *kernels]))
    n = min(os.cpu_count() or 1, len(kernels), len(source) // PART_CHARS)
    try:
        if n < 2:
            _run([cxx, *cxxflags(), str(cpp), "-o", tmp, "-lmvec", "-lm"], cpp)
        else:
            shares: list[list[str]] = [[] for _ in range(n)]
            for k in sorted(kernels, key=len, reverse=True):   # longest first, each to the lightest part
                min(shares, key=lambda sh: sum(map(len, sh))).append(k)
            parts = [pathlib.Path(tmp).with_suffix(f".part{i}.cpp") for i in range(n)]   # (this build's own)
            objs = [p.with_suffix(".o") for p in parts]
            for p, share in zip(parts, shares):
                p.write_text(KERNEL_MARK.join([prelude, *share]))
            compile_flags = cxxflags(shared=False)
            errs = [p.with_suffix(".err") for p in parts]   # files, not pipes: a process never blocks on a full one
            running = []
            for p, o, e in zip(parts, objs, errs):
                with open(e, "w") as err:
                    running.append(subprocess.Popen([cxx, *compile_flags, "-c", str(p), "-o", str(o)], stderr=err))
            for proc, p, e in zip(running, parts, errs):
                _check(proc.args, proc.wait(), e.read_text(), p)
            _run([cxx, "-shared", "-fopenmp", *map(str, objs), "-o", tmp, "-lmvec", "-lm"], cpp)
            for f in parts + objs + errs:
                f.unlink(missing_ok=True)
    except BaseException:
        os.unlink(tmp)
        raise
    os.replace(cpp, final_cpp)   # (kept beside the library, for reading)
    os.replace(tmp, so)
    return so


def _run(cmd: list, cpp: pathlib.Path) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    _check(cmd, r.returncode, r.stderr, cpp)


def _check(cmd: list, returncode: int, stderr: str, cpp: pathlib.Path) -> None:
    if returncode != 0:
        raise BuildError(f"ember: the C++ compiler failed on generated code {cpp}\n"
                         f"command: {' '.join(map(str, cmd))}\n{stderr[-4000:]}\n"
                         f"(this is an ember bug; ember.compile(..., options={{'fallback': 'eager'}}) runs "
                         f"such graphs eagerly instead)")


class Extension:
    """A CPython extension module of ember's own (C/C++ source in ember, not generated per graph), built once per
    source, flags and Python in the background (this module's pool), cached on disk under $EMBER_CACHE_DIR/<kind>,
    loaded once. `get()` is None while it builds, and for good if it cannot be built (no compiler, headers that
    do not fit) or the environment variable `off` is "0": its callers then keep their Python path, as correct."""

    def __init__(self, kind: str, name: str, source: str, flags: Callable[[], list], off: str, what: str,
                 topic: str, init: Callable[[types.ModuleType], None] = lambda mod: None):
        self.kind, self.name, self.source, self.flags, self.off, self.what = kind, name, source, flags, off, what
        self.topic = topic   # the ember log topic of the warning when it cannot be had
        self.init = init
        self.module: types.ModuleType | None = None
        self.failed = False
        self.future: concurrent.futures.Future | None = None
        self._lock, self._load_lock = threading.Lock(), threading.Lock()

    def path(self) -> pathlib.Path:
        import torch
        key = hashlib.sha256("\n".join([self.source, *self.flags(), torch.__version__, str(torch.version.git_version),
                                        sys.version]).encode()).hexdigest()[:24]
        return cache_dir(self.kind) / f"{key}{importlib.machinery.EXTENSION_SUFFIXES[0]}"

    def _build(self, so: pathlib.Path) -> pathlib.Path:
        # private file names, renamed into place: processes building at once (pytest -n 2 on a fresh cache)
        # neither compile a half-written source nor load a half-written library
        fd, src = tempfile.mkstemp(suffix=".cpp", dir=so.parent)
        os.write(fd, self.source.encode())
        os.close(fd)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=so.parent)
        os.close(fd)
        try:
            r = subprocess.run([os.environ.get("CXX", "g++"), src, "-o", tmp, *self.flags()], capture_output=True,
                               text=True)
            if r.returncode != 0:
                raise RuntimeError(f"g++ failed on {src}:\n{r.stderr[-2000:]}")
        except BaseException:
            os.unlink(tmp)
            raise
        os.replace(src, so.with_suffix(".cpp"))
        os.replace(tmp, so)
        return so

    def _done(self, fut: concurrent.futures.Future) -> None:
        """Load the built library (once; called by the build's thread when it ends, or by a waiting caller)."""
        with self._load_lock:
            if self.module is not None or self.failed:
                return
            try:
                spec = importlib.util.spec_from_file_location(self.name, fut.result())
                mod = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(mod)
                self.init(mod)
                self.module = mod
            except Exception as e:
                from ember.tools.logs import get_logger
                get_logger(self.topic).warning("ember: %s could not be built or loaded; %s=0 skips the build: %s",
                                              self.what, self.off, e)
                self.failed = True

    def get(self, wait: bool = False) -> types.ModuleType | None:
        """The loaded module, or None while it builds (the first call starts the build) or when it cannot be
        had. `wait`: block until the build has ended."""
        if os.environ.get(self.off, "1") == "0":
            return None
        if self.module is not None or self.failed:
            return self.module
        with self._lock:
            if self.future is None:
                try:
                    so = self.path()
                    if so.exists():
                        self.future = concurrent.futures.Future()
                        self.future.set_result(so)
                    else:
                        self.future = _POOL.submit(self._build, so)
                except Exception as e:
                    self.future = concurrent.futures.Future()
                    self.future.set_exception(e)
                self.future.add_done_callback(self._done)
        if wait or self.future.done():
            self._done(self.future)
        return self.module
