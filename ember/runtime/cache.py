"""On-disk kernel cache: generated sources are built once per content hash, by any process.

Layout: $EMBER_CACHE_DIR (default ~/.cache/ember)/<backend>/<hash>.<ext>. A build writes to a temporary
name and renames into place, so concurrent processes never load a half-written library.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import os
import pathlib
import subprocess
import tempfile

_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1)),
                                              thread_name_prefix="ember-build")
CXXFLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fwrapv", "-fno-math-errno", "-std=c++17"]


class BuildError(RuntimeError):
    """The system compiler rejected generated code; the message names the source file to look at."""


def cache_dir(backend: str = "cpp") -> pathlib.Path:
    root = pathlib.Path(os.environ.get("EMBER_CACHE_DIR") or pathlib.Path.home() / ".cache" / "ember")
    d = root / backend
    d.mkdir(parents=True, exist_ok=True)
    return d


def source_key(source: str, flags=CXXFLAGS) -> str:
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


def _build(source: str, cpp: pathlib.Path, so: pathlib.Path) -> pathlib.Path:
    """g++ on the file; a large one (densenet121's inference graph: 176K characters, 7 s of g++ on this 2-core
    machine) in parts, each the prelude plus a share of the kernels, compiled to objects side by side and
    linked into one library."""
    cpp.write_text(source)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=so.parent)
    os.close(fd)
    cxx = os.environ.get("CXX", "g++")
    prelude, *kernels = source.split(KERNEL_MARK)
    n = min(os.cpu_count() or 1, len(kernels), len(source) // PART_CHARS)
    try:
        if n < 2:
            _run([cxx, *CXXFLAGS, str(cpp), "-o", tmp, "-lmvec", "-lm"], cpp)
        else:
            shares: list[list[str]] = [[] for _ in range(n)]
            for k in sorted(kernels, key=len, reverse=True):   # longest first, each to the lightest part
                min(shares, key=lambda sh: sum(map(len, sh))).append(k)
            parts = [cpp.with_suffix(f".part{i}.cpp") for i in range(n)]
            objs = [p.with_suffix(".o") for p in parts]
            for p, share in zip(parts, shares):
                p.write_text(KERNEL_MARK.join([prelude, *share]))
            compile_flags = [f for f in CXXFLAGS if f != "-shared"]
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
