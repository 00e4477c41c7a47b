"""ember: a just-in-time compiler for PyTorch programs.  `model = ember.compile(model)`."""
from ember.api import compile, disable
from ember.backends import list_backends, register_backend
from ember.errors import BackendCompilerFailed, EmberError, GraphBreakError


def reset() -> None:
    """Forget every captured graph and guard (like torch._dynamo.reset())."""
    from ember.frontend import reset_caches
    reset_caches()


def explain(fn):
    """ember.explain(fn)(*args) -> an object with graphs, breaks and guards; print() it for a summary."""
    from ember.explain import explain as explain_fn
    return explain_fn(fn)


__all__ = ["compile", "disable", "reset", "explain", "list_backends", "register_backend",
           "BackendCompilerFailed", "EmberError", "GraphBreakError"]
