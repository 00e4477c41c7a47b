"""Shipped programs on disk: one portable file of compiled code (ember.save_cache, ember.export).

A file is a header line, the JSON of the environment it was built for (`environment()`: ember, torch, Triton
and Python versions, the C++ target and the CPU's instruction sets, the GPU), then a pickle of its payload. A
load compares the environment before it unpickles anything: any difference is a clear message and the caller
compiles as usual, never code built for another machine.

The payload is pickled by `Saver`, which writes what compiled code refers to as references where the object is
the loading process's own (modules, their globals, importable functions and classes, torch ops), code objects as
marshal data, other functions by value (their code, globals and closure), objects that define `ember_saved()` in
the form it returns, and the built libraries (`Shipped`) once each, as bytes written into the loading machine's
cache directory. A live object of the user's program (an instance of a user class, a module) is refused: a copy
of it would not be the object the program holds.
"""
from __future__ import annotations

import builtins
import copyreg
import enum
import functools
import hashlib
import importlib
import io
import json
import marshal
import os
import pathlib
import pickle
import platform
import sys
import tempfile
import types
from typing import Any, Callable

import torch
import torch.fx

from ember import config
from ember.runtime import cache

MAGIC = b"EMBER-SAVED 1\n"
FORMAT = 1


class CannotSave(Exception):
    """What a saved program would need and cannot be written (a live object, a function with no saved form)."""


def _version(package: str) -> str | None:
    """An installed distribution's version, read without importing it (None when it is not installed)."""
    try:
        from importlib.metadata import version
        return version(package)
    except Exception:
        return None


@functools.lru_cache(maxsize=None)
def _ember_source() -> str:
    """A hash of ember's own source: a file saved by other ember code (its version string unchanged between
    commits) is not loaded, whatever its saved forms would mean to this code."""
    root = pathlib.Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def _cpu_flags() -> list[str]:
    try:
        text = pathlib.Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    line = next((ln for ln in text.splitlines() if ln.startswith(("flags", "Features"))), "")
    # the instruction-set extensions generated code may use (not the machine's bugs or power features)
    return sorted(f for f in line.partition(":")[2].split() if f.startswith(("avx", "sse", "fma", "f16c", "bmi",
                                                                           "amx", "asimd", "sve", "neon")))


def _gpu(query: bool) -> list | None:
    """The GPU compiled code runs on: [name, [major, minor]] of the current device when CUDA is in use
    (initialized, or `query`: asked for, which initializes it)."""
    if torch.cuda.is_available() and (query or torch.cuda.is_initialized()):
        return [torch.cuda.get_device_name(), list(torch.cuda.get_device_capability())]
    return None


def environment(gpu: bool = False) -> dict:
    """What compiled code depends on: a file built where any of these differ is not loaded. The GPU is the one
    in use (`gpu`: the current device's, even before this process used CUDA)."""
    return {"format": FORMAT, "ember": _version("ember"), "ember_source": _ember_source(), "torch": torch.__version__,
            "torch_git": str(torch.version.git_version), "triton": _version("triton"),
            "python": f"{sys.implementation.name} {sys.version_info[0]}.{sys.version_info[1]}",
            "machine": platform.machine(), "cpu_isa": config.CPU_ISA, "cxxflags": cache.cxxflags(),
            # the native target is this CPU's: the instruction sets it has
            "cpu_flags": _cpu_flags() if config.CPU_ISA == "native" else None, "gpu": _gpu(gpu)}


def mismatch(saved: dict, here: dict | None = None) -> list[str]:
    """The environment entries that differ, as `name: saved -> here` (empty: the file fits this process). A
    GPU is compared only when the file was built with one (Triton's binaries are for its name and capability)."""
    here = here or environment(gpu=saved.get("gpu") is not None)
    out = []
    for k in sorted(set(saved) | set(here)):
        a, b = saved.get(k), here.get(k)
        if a == b or k == "gpu" and a is None:
            continue
        if isinstance(a, list) and isinstance(b, list) and all(isinstance(x, str) for x in a + b):
            # (instruction sets, flags: what only one side has)
            out.append(f"{k}: only saved {sorted(set(a) - set(b))}, only here {sorted(set(b) - set(a))}")
        else:
            out.append(f"{k}: {a!r} -> {b!r}")
    return out


# -- saving -------------------------------------------------------------------------------------------------

class Shipped:
    """A built file of the cache directory (a kernel library, an extension) that goes into the saved file."""

    def __init__(self, path: pathlib.Path | str):
        self.path = pathlib.Path(path)


class Bound:
    """Stands in a saved program for an object the loading side supplies (by `name`)."""

    def __init__(self, name: str):
        self.name = name

    def __reduce__(self):
        return (Bound, (self.name,))


def _module_of_globals() -> dict[int, str]:
    return {id(m.__dict__): name for name, m in list(sys.modules.items()) if isinstance(m, types.ModuleType)}


def importable(obj) -> bool:
    """Whether pickle finds `obj` again by its module and qualified name."""
    mod, qual = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not mod or not qual or "<locals>" in qual or mod not in sys.modules:
        return False
    target: Any = sys.modules[mod]
    for part in qual.split("."):
        target = getattr(target, part, None)
        if target is None:
            return False
    return target is obj


def _wrapped_depth(obj) -> int | None:
    """How many `__wrapped__` steps lead from the module attribute of obj's qualified name to obj (a function a
    functools.wraps decorator holds, compared by identity in guards), or None."""
    mod = sys.modules.get(getattr(obj, "__module__", None) or "")
    target: Any = mod
    for part in (getattr(obj, "__qualname__", "") or "<locals>").split("."):
        target = getattr(target, part, None)
    for depth in range(1, 8):
        target = getattr(target, "__wrapped__", None)
        if target is None:
            return None
        if target is obj:
            return depth
    return None


def _unwrapped(module: str, qualname: str, depth: int):
    target: Any = importlib.import_module(module)
    for part in qualname.split("."):
        target = getattr(target, part)
    for _ in range(depth):
        target = target.__wrapped__
    return target


def _op(namespace: str, name: str, overload: str | None):
    packet = getattr(getattr(torch.ops, namespace), name)
    return packet if overload is None else getattr(packet, overload)


def _function(code: bytes, globals_: dict, name: str, defaults, kwdefaults, closure, qualname: str):
    cells = None if closure is None else tuple(types.CellType() if c is _EMPTY_CELL else types.CellType(c)
                                               for c in closure)
    f = types.FunctionType(marshal.loads(code), globals_, name, defaults, cells)
    f.__kwdefaults__, f.__qualname__ = kwdefaults, qualname
    return f


class _EmptyCell:
    def __reduce__(self):
        return "_EMPTY_CELL"


_EMPTY_CELL = _EmptyCell()
# types whose instances are values (a copy is as good as the object): pickled as pickle does
_VALUE_MODULES = ("builtins", "types", "inspect", "torch", "ember", "sympy", "collections", "enum", "functools",
                  "operator", "typing", "dataclasses", "math", "numpy")


class Saver(pickle.Pickler):
    """pickle.Pickler with ember's rules (module docstring). `persistent`: id(obj) -> the reference a loader
    resolves (the caller's own objects: a compiler, its resume functions, its Config)."""

    def __init__(self, file, persistent: dict[int, tuple] | None = None, refused: tuple[type, ...] = (),
                 lazy_graphs: bool = True):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.lazy_graphs = lazy_graphs
        self.persistent = persistent or {}
        self.refused = refused   # types whose objects only a reference may stand for (a caller's compilers)
        self.globals_of = _module_of_globals()
        self.files: dict[str, pathlib.Path] = {}   # name in the cache directory -> file

    def persistent_id(self, obj):
        ref = self.persistent.get(id(obj))
        if ref is not None:
            return ref
        if type(obj) is dict:
            if obj is builtins.__dict__:
                return ("builtins",)
            name = self.globals_of.get(id(obj))
            if name is not None:
                return ("globals", name)
        elif type(obj) is Shipped:
            rel = obj.path.relative_to(cache.cache_dir("cpp").parent).as_posix()
            self.files[rel] = obj.path
            return ("file", rel)
        return None

    def reducer_override(self, obj):
        t = type(obj)
        # (looked up on the type, or in a function's own dict: never through an object's __getattr__)
        if t is types.FunctionType and "ember_saved" in obj.__dict__:
            return obj.ember_saved()
        saved = getattr(t, "ember_saved", None)
        if saved is not None and not isinstance(obj, type):
            return saved(obj)
        if isinstance(obj, self.refused):
            raise CannotSave(f"a {t.__qualname__} it does not own")
        if self.lazy_graphs and isinstance(obj, torch.fx.GraphModule):
            buf = io.BytesIO()
            inner = Saver(buf, self.persistent, self.refused, lazy_graphs=False)
            inner.dump(obj)
            self.files.update(inner.files)
            return (LazyGraphModule, (buf.getvalue(),))
        if t is types.CodeType:
            return (marshal.loads, (marshal.dumps(obj),))
        if t is types.ModuleType:
            return (importlib.import_module, (obj.__name__,))
        if isinstance(obj, torch._ops.OpOverload):
            return (_op, (obj.namespace, obj._schema.name.split("::")[-1], obj._overloadname))
        if isinstance(obj, torch._ops.OpOverloadPacket):
            return (_op, (obj._qualified_op_name.split("::")[0], obj.__name__, None))
        if t is types.BuiltinFunctionType and not isinstance(obj.__self__, types.ModuleType) and \
                obj.__module__ in sys.modules and \
                getattr(sys.modules[obj.__module__], obj.__name__, None) is obj:   # (pybind11's: by their module)
            return (getattr, (sys.modules[obj.__module__], obj.__name__))
        if t is types.FunctionType:
            if importable(obj):
                return NotImplemented
            depth = _wrapped_depth(obj)
            if depth is not None:
                return (_unwrapped, (obj.__module__, obj.__qualname__, depth))
            closure = None if obj.__closure__ is None else tuple(_cell_contents(c) for c in obj.__closure__)
            return (_function, (marshal.dumps(obj.__code__), obj.__globals__, obj.__name__, obj.__defaults__,
                                obj.__kwdefaults__, closure, obj.__qualname__))
        if isinstance(obj, type) and not importable(obj) and obj.__module__ != "builtins":
            raise CannotSave(f"the class {obj.__module__}.{obj.__qualname__}, which another process cannot import "
                             f"(a class defined inside a function): define it at a module's top level")
        if t is types.CellType:
            raise CannotSave("a closure cell of a function another process makes anew")
        if t is types.MethodType or isinstance(obj, type) or t is functools.partial:
            return NotImplemented
        if isinstance(obj, torch.nn.Module) and not isinstance(obj, torch.fx.GraphModule):
            raise CannotSave(f"a live module (a {t.__qualname__} instance)")
        mod = (getattr(t, "__module__", "") or "").split(".")[0]
        if isinstance(obj, (enum.Enum, tuple)) and importable(t):   # (an enum member, a named tuple: values)
            return NotImplemented
        if mod not in _VALUE_MODULES and copyreg.dispatch_table.get(t) is None:
            raise CannotSave(f"a live object of the program (a {t.__module__}.{t.__qualname__} instance)")
        return NotImplemented


class LazyGraphModule:
    """A saved GraphModule, unpickled at its first use: a loaded program runs its graphs' compiled forms, and
    needs their Python forms only for a fallback, a lifted constant or a backward compiled later (fx makes a
    GraphModule again by tracing its code: a large part of a loaded program's first call otherwise)."""

    def __init__(self, data: bytes):
        self._data, self._gm = data, None

    def _module(self) -> torch.fx.GraphModule:
        if self._gm is None:
            self._gm = loads(self._data)
        return self._gm

    def __call__(self, *args, **kwargs):
        return self._module()(*args, **kwargs)

    def __getattr__(self, name: str):
        if name in ("_data", "_gm"):   # (not set yet: a half-built copy)
            raise AttributeError(name)
        return getattr(self._module(), name)

    def __reduce__(self):
        return (LazyGraphModule, (self._data,))


def _cell_contents(cell):
    try:
        return cell.cell_contents
    except ValueError:
        return _EMPTY_CELL


def dumps(obj, persistent: dict[int, tuple] | None = None,
          refused: tuple[type, ...] = ()) -> tuple[bytes, dict[str, pathlib.Path]]:
    """obj pickled by Saver; and the built files it refers to. Raises CannotSave."""
    buf = io.BytesIO()
    saver = Saver(buf, persistent, refused)
    try:
        saver.dump(obj)
    except CannotSave:
        raise
    except (pickle.PicklingError, TypeError, AttributeError, ValueError) as e:
        raise CannotSave(f"{type(e).__name__}: {e}") from e
    return buf.getvalue(), saver.files


# -- loading ------------------------------------------------------------------------------------------------

class Loader(pickle.Unpickler):
    """Unpickles a Saver's data; `persistent(ref)` resolves the caller's own references."""

    def __init__(self, file, persistent: Callable[[tuple], Any] | None = None):
        super().__init__(file)
        self.resolve = persistent

    def persistent_load(self, ref):
        kind = ref[0]
        if kind == "builtins":
            return builtins.__dict__
        if kind == "globals":
            return importlib.import_module(ref[1]).__dict__
        if kind == "file":
            return cache.cache_dir("cpp").parent / ref[1]
        if self.resolve is None:
            raise pickle.UnpicklingError(f"no resolver for {ref!r}")
        return self.resolve(ref)


def loads(data: bytes, persistent: Callable[[tuple], Any] | None = None):
    return Loader(io.BytesIO(data), persistent).load()


# -- the file -----------------------------------------------------------------------------------------------

def write(path: str | os.PathLike, payload: dict, files: dict[str, pathlib.Path]) -> None:
    """The file: header, environment, then the payload with the built files' bytes (written to a temporary
    name and renamed, so a reader never sees half a file)."""
    body = {"payload": payload, "files": {rel: p.read_bytes() for rel, p in files.items()}}
    path = pathlib.Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent if str(path.parent) else ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC)
            f.write(json.dumps(environment()).encode() + b"\n")
            pickle.dump(body, f, protocol=pickle.HIGHEST_PROTOCOL)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)   # (mkstemp's file is private; a saved program is for others to read)
        os.replace(tmp, path)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise


class Mismatch(Exception):
    """The file was built for another environment (the message says what differs)."""


def read(path: str | os.PathLike) -> dict:
    """The payload of a file written by `write`, after its built files are placed in this machine's cache
    directory. Raises Mismatch when it was built for another environment, ValueError when it is no such file."""
    with open(path, "rb") as f:
        if f.readline() != MAGIC:
            raise ValueError(f"{path} is not a file ember.save_cache or ember.export wrote")
        saved_env = json.loads(f.readline())
        diff = mismatch(saved_env)
        if diff:
            raise Mismatch(f"{path} was built for another environment ({'; '.join(diff)})")
        body = pickle.load(f)
    root = cache.cache_dir("cpp").parent
    for rel, data in body["files"].items():
        target = root / rel
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=target.parent)
            with os.fdopen(fd, "wb") as out:
                out.write(data)
            os.replace(tmp, target)
    return body["payload"]
