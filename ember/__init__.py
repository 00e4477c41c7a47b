"""ember: a just-in-time compiler for PyTorch programs.  `model = ember.compile(model)`."""
from ember.api import compile, disable
from ember.backends import list_backends, register_backend
from ember.errors import BackendCompilerFailed, EmberError, GraphBreakError
from ember.frontend.dynamic_dims import mark_dynamic, mark_static, maybe_mark_dynamic
# imported here, not inside a function: importing the submodule ember.explain binds the package's `explain`
# attribute to the module, which would hide a function of that name after its first call
from ember.explain import explain
from ember.tools.minify import minify


def reset() -> None:
    """Forget every captured graph and guard (like torch._dynamo.reset())."""
    from ember.frontend.convert import reset_caches
    reset_caches()


__all__ = ["compile", "disable", "reset", "explain", "list_backends", "register_backend", "mark_dynamic", "mark_static",
           "maybe_mark_dynamic", "minify",
           "BackendCompilerFailed", "EmberError", "GraphBreakError"]
