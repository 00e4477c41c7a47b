"""ember: a just-in-time compiler for PyTorch programs.  `model = ember.compile(model)`."""
import os

from ember.api import compile, disable, export
from ember.backends import list_backends, register_backend
from ember.errors import BackendCompilerFailed, EmberError, GraphBreakError
from ember.frontend.dynamic_dims import mark_dynamic, mark_static, maybe_mark_dynamic
# imported here, not inside a function: importing the submodule ember.explain binds the package's `explain`
# attribute to the module, which would hide a function of that name after its first call
from ember.explain import explain
from ember.tools.minify import minify


def reset() -> None:
    """Forget every captured graph and guard (like torch._dynamo.reset()), and what ember.load_cache read."""
    from ember.frontend import saved
    from ember.frontend.convert import reset_caches
    reset_caches()
    saved.clear()


def save_cache(path: str | os.PathLike, strict: bool = False) -> dict:
    """Write everything this process compiled (guards, graphs, resume functions, kernels, host programs) to one
    file that `ember.load_cache` reads in another process, on a machine of the same environment (ember, torch,
    Triton and Python versions, C++ target and CPU instruction sets, GPU). What cannot be saved (a graph that
    calls an opaque Python function, an entry holding a live object) is left out with a warning naming its
    file:line, or raises with strict=True. Returns counts: functions, entries, left_out."""
    from ember.frontend import saved
    return saved.save(path, strict)


def load_cache(path: str | os.PathLike) -> bool:
    """Read a file `ember.save_cache` wrote: each compiled function's first call then runs the saved code when
    its guards admit the call, with no capture and no code generation. A file built for another environment
    is not loaded (a warning says what differs; functions compile as usual): returns False."""
    from ember.frontend import saved
    return saved.load(path)


def load_exported(path: str | os.PathLike):
    """The program `ember.export(...).save(path)` wrote: a callable that runs the exported compiled code, with
    its saved parameters, on inputs its constraints admit. Raises when the file was built for another
    environment (ember.runtime.artifacts.Mismatch says what differs)."""
    from ember.frontend import exported
    return exported.load(path)


__all__ = ["compile", "disable", "reset", "save_cache", "load_cache", "export", "load_exported", "explain",
           "list_backends", "register_backend", "mark_dynamic", "mark_static", "maybe_mark_dynamic", "minify",
           "BackendCompilerFailed", "EmberError", "GraphBreakError"]
