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


def _build(source: str, cpp: pathlib.Path, so: pathlib.Path) -> pathlib.Path:
    cpp.write_text(source)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=so.parent)
    os.close(fd)
    cmd = [os.environ.get("CXX", "g++"), *CXXFLAGS, str(cpp), "-o", tmp, "-lmvec", "-lm"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        os.unlink(tmp)
        raise BuildError(f"ember: the C++ compiler failed on generated code {cpp}\n"
                         f"command: {' '.join(cmd)}\n{r.stderr[-4000:]}\n"
                         f"(this is an ember bug; ember.compile(..., options={{'fallback': 'eager'}}) runs "
                         f"such graphs eagerly instead)")
    os.replace(tmp, so)
    return so
