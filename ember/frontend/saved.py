"""ember.save_cache / ember.load_cache: every compiled function's entries in one file, loaded with no capture.

An entry is saved as its Python source (guards, graph call, side effects, resume calls), its guards' texts and
the constants its source names, among them the compiled graph in the saved form its backend gives it
(ember.runtime.artifacts: a C++ graph as its ATen graph, host program and built library; a Triton graph as its
kernels' source, host program and each kernel's binary; a CUDA graph without its recordings). Entries are filed
under their function's code: the module and qualified name of the code object and a hash of its bytecode,
constants and names (not its file's path or line numbers: the same source installed elsewhere loads), the
compiler's kind (shared by closures, a generator's steps) and the compile's Config (backend, mode, options,
dynamic, fullgraph). A resume function's entries go with the function it resumes, under the resume's key
(offset, stack, live names), and its code is made again from the original's on load.

load_cache only reads the file: a compiler asks for saved entries at its first miss (FrameCompiler.restore), so
a saved entry is checked by its guards like any other and a call none admits is captured as usual.
"""
from __future__ import annotations

import hashlib
import os
import sys
import types
import warnings
from typing import Any

from ember.frontend.convert import FrameCompiler, base_namespace, make_entry_function, _code_where
from ember.frontend.guards import CHECKER_FUNCTIONS
from ember.runtime import artifacts, cache, native_guards
from ember.tools.logs import get_logger

log = get_logger("saved")
# what load_cache read and no compiler took yet: compiler key -> saved records of its code
_PENDING: dict[tuple, list[dict]] = {}
STATS = {"restored_entries": 0}


def code_key(fc: FrameCompiler) -> tuple:
    """(module, qualified name, hash of the code): the same function in another process, wherever installed."""
    h = hashlib.sha256()

    def feed(code: types.CodeType) -> None:
        h.update(code.co_code)
        h.update(repr((code.co_qualname, code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars,
                       code.co_argcount, code.co_kwonlyargcount, code.co_flags)).encode())
        for c in code.co_consts:
            if isinstance(c, types.CodeType):
                feed(c)
            else:
                h.update(repr(c).encode())

    feed(fc.code)
    return (fc.fn.__globals__.get("__name__"), fc.code.co_qualname, h.hexdigest()[:20])


def compiler_key(fc: FrameCompiler) -> tuple:
    cfg = fc.cfg
    options = repr(sorted((cfg.options or {}).items()))
    return (code_key(fc), fc.shared, fc.steps, cfg.backend_name, cfg.mode, options, cfg.dynamic, cfg.fullgraph)


_BASE = set(base_namespace(None)) | set(CHECKER_FUNCTIONS) | {"__builtins__", "___entry"}


def _entry_state(entry) -> dict:
    ns = entry.fn.__globals__
    return {"source": entry.source, "guards": entry.guards, "description": entry.description,
            "namespace": {k: v for k, v in ns.items() if k not in _BASE}}


def _references(fc: FrameCompiler) -> dict[int, tuple]:
    """The compiler's own objects an entry names, as references its loader resolves (_Restorer)."""
    refs = {id(fc.cfg): ("cfg",)}
    for key, r in fc.resumes.items():
        refs[id(r)] = ("resume", key)
        if isinstance(r, FrameCompiler):
            refs[id(r.fn)] = ("resume_fn", key)
    refs[id(fc.fn)] = ("fn",)
    if fc.fn.__closure__ is not None:   # (the loading process's function has its own cells, guarded alike)
        refs[id(fc.fn.__closure__)] = ("closure",)
    return refs


def _user_where(fc: FrameCompiler, entry) -> str:
    """The user's file:line of an entry: its function's, or for a compiled module (ember.api's one function
    that calls every module) the forward of the module's class its guards name."""
    if fc.fn.__module__ == "ember.api":
        for v in entry.fn.__globals__.values():
            forward = getattr(v, "forward", None) if isinstance(v, type) else None
            if hasattr(forward, "__code__"):
                return f"{v.__qualname__}.forward ({_code_where(forward.__code__)})"
    return f"{fc.name} ({_code_where(fc.code)})"


def _save_entries(fc: FrameCompiler, refs: dict, files: dict, refused: list) -> list[bytes]:
    out = []
    for e in fc.entries:
        try:
            data, used = artifacts.dumps(_entry_state(e), refs, (FrameCompiler,))
        except artifacts.CannotSave as err:
            refused.append(f"{_user_where(fc, e)}: {err}")
            continue
        files.update(used)
        out.append(data)
    return out


def save(path: str | os.PathLike, strict: bool = False) -> dict:
    """Write every entry this process compiled to `path`; what cannot be saved is left out, each named with
    its function's file:line in one warning (strict=True: raised as an error, nothing written). Returns the
    counts saved."""
    records, files, refused = [], {}, []
    for fc in list(FrameCompiler._all):
        if fc.origin is not None or not fc.entries:
            continue   # (a resume function's entries are saved with the function it resumes)
        refs = _references(fc)
        entries = _save_entries(fc, refs, files, refused)
        resumes = {key: _save_entries(r, refs, files, refused) for key, r in fc.resumes.items()
                   if isinstance(r, FrameCompiler) and r.entries}
        if entries:
            # (with the sizes its captures saw: a new size after the load goes symbolic as it would have here)
            records.append({"key": compiler_key(fc), "name": fc.name, "entries": entries, "resumes": resumes,
                            "frame_state": dict(fc.frame_state)})
    if refused:
        msg = "ember.save_cache: left out (they compile again when loaded):\n  " + "\n  ".join(refused)
        if strict:
            raise artifacts.CannotSave(msg)
        warnings.warn(msg, stacklevel=3)
    launch = sys.modules.get("ember.runtime.cuda_launch")
    for ext in (native_guards.EXTENSION, getattr(launch, "EXTENSION", None)):   # ember's C extensions, when built
        if ext is not None and ext.module is not None:
            p = ext.path()
            files[p.relative_to(cache.cache_dir("cpp").parent).as_posix()] = p
    artifacts.write(path, {"records": records}, files)
    n = sum(len(r["entries"]) + sum(map(len, r["resumes"].values())) for r in records)
    return {"functions": len(records), "entries": n, "left_out": len(refused)}


def load(path: str | os.PathLike) -> bool:
    """Read a file save() wrote; its entries are installed at their compilers' first miss. False (logged, and
    warned) when the file was built for another environment: the program then compiles as usual."""
    try:
        payload = artifacts.read(path)
    except artifacts.Mismatch as e:
        warnings.warn(f"ember.load_cache: {e}; nothing loaded, functions compile as usual", stacklevel=3)
        return False
    for rec in payload["records"]:
        _PENDING.setdefault(rec["key"], []).append(rec)
    FrameCompiler.restore = restore
    return True


def clear() -> None:
    _PENDING.clear()


class _Restorer:
    """Resolves an entry's references (`_references`) against the compiler it is installed in."""

    def __init__(self, fc: FrameCompiler, rec: dict):
        self.fc, self.rec = fc, rec

    def __call__(self, ref: tuple) -> Any:
        kind = ref[0]
        if kind == "cfg":
            return self.fc.cfg
        if kind == "fn":
            return self.fc.fn
        if kind == "closure":
            return self.fc.fn.__closure__
        r = self.fc.resume_compiler(*ref[1])
        if isinstance(r, FrameCompiler) and not r.restore_asked:
            r.restore_asked = True   # (its saved entries now, before a call could capture it)
            _install(r, self.rec["resumes"].get(ref[1], ()), self)
        return r.fn if kind == "resume_fn" else r


def _install(fc: FrameCompiler, saved: list[bytes], resolve: _Restorer) -> int:
    n = 0
    for data in saved:
        try:
            state = artifacts.loads(data, resolve)
            ns = {**base_namespace(fc.cfg), **state["namespace"]}
            if any(name in state["source"] for name in CHECKER_FUNCTIONS if name != "___dict_get"):
                checker = native_guards.checker(wait=True)
                if checker is None:
                    raise RuntimeError("its guards need the C++ guard checker, which is not available here")
                ns.update({name: getattr(checker, f) for name, f in CHECKER_FUNCTIONS.items()})
            entry = make_entry_function(fc, state["source"], ns, state["guards"], state["description"])
        except Exception as e:   # (a class no longer importable, a renamed attribute: that entry compiles again)
            log.warning("ember.load_cache: an entry of %s (%s) was not restored: %s: %s", fc.name,
                        _code_where(fc.code), type(e).__name__, e)
            continue
        entry.saved = True
        fc.entries.append(entry)
        n += 1
    STATS["restored_entries"] += n
    return n


def restore(fc: FrameCompiler) -> bool:
    """FrameCompiler.restore: install the saved entries of fc's code and Config, if any."""
    if fc.origin is not None or not _PENDING:
        return False
    recs = _PENDING.get(compiler_key(fc))
    if not recs:
        return False
    for rec in recs:
        fc.frame_state.update(rec["frame_state"])
    return sum(_install(fc, rec["entries"], _Restorer(fc, rec)) for rec in recs) > 0


